"""The denoising objective, written against ComfyUI's `model_sampling` interface so the checkpoint decides
eps / v-prediction / flow matching: noise comes from the model's own schedule and the target is whatever raw model
output would make the model's own `calculate_denoised` return the clean latent."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import LeanLoRAError

# (model input, timestep, conditioning kwargs) -> raw model output
Predict = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class TimestepSampling(Enum):
    """How a step picks its noise levels among the model's own (`model_sampling.sigmas`, ascending; a flow model's
    carry its shift already). The family chooses (ModelFamily.timestep_sampling) unless the run does
    (TrainSettings.timestep_sampling). The values are kohya's `ss_timestep_sampling` words in KOHYA_SAMPLING."""
    UNIFORM = "uniform"            # every level equally often: DDPM training, kohya's default for SD
    LOGIT_NORMAL = "logit-normal"  # sigmoid(N(0, 1)) of the way up the schedule: SD3's and kohya's "sigmoid" for
    #                                flow models, fewer steps at the nearly clean and nearly pure-noise ends
    SHIFTED_SIGMOID = "shifted-sigmoid"  # kohya's "shift": the logit-normal position t moved to t*s / (1 + (s-1)*t),
    #                                      towards the noisy end for s > 1 (on top of a flow schedule's own shift)


KOHYA_SAMPLING = {TimestepSampling.UNIFORM: "uniform", TimestepSampling.LOGIT_NORMAL: "sigmoid",
                  TimestepSampling.SHIFTED_SIGMOID: "shift"}
DEFAULT_SHIFT = 3.0  # kohya's discrete_flow_shift default


def _shifted(position: torch.Tensor, shift: float) -> torch.Tensor:
    return position * shift / (1 + (shift - 1) * position)


def sample_sigmas(model_sampling, batch: int, generator: torch.Generator,
                  sampling: TimestepSampling = TimestepSampling.UNIFORM, shift: float = DEFAULT_SHIFT,
                  resolution_shift: float = 1.0) -> torch.Tensor:
    """`resolution_shift` (the family's, for this latent size; 1: none) moves every mode's position along the table
    the same way as SHIFTED_SIGMOID's shift: on a flow schedule shifting by s is mu += log(s) in
    exp(mu) / (exp(mu) + 1/t - 1), so the table's shift becomes the one the model samples this size with."""
    sigmas = getattr(model_sampling, "sigmas", None)
    if sigmas is None:
        raise LeanLoRAError(f"this model's noise schedule ({type(model_sampling).__name__}) has no table of noise "
                            "levels (model_sampling.sigmas) to train with")
    last = len(sigmas) - 1
    if sampling is not TimestepSampling.UNIFORM:
        position = torch.sigmoid(torch.randn(batch, generator=generator))
        if sampling is TimestepSampling.SHIFTED_SIGMOID:
            position = _shifted(position, shift)
        index = (_shifted(position, resolution_shift) * last).round().long()
    else:
        index = torch.randint(0, len(sigmas), (batch,), generator=generator)
        if resolution_shift != 1.0:  # the same draws; only their place on the table moves
            index = (_shifted((index + 1) / len(sigmas), resolution_shift) * len(sigmas) - 1).round().long()
    return sigmas.cpu()[index.clamp(0, last)]


def output_target(model_sampling, sigma: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """calculate_denoised(sigma, out, noisy) is affine in `out` (denoised = a - b * out), so the output that
    denoises to `clean` is (a - clean) / b: eps for EPS models, v for V_PREDICTION models, noise - clean for flow
    (CONST) models."""
    a = model_sampling.calculate_denoised(sigma, torch.zeros_like(noisy), noisy)
    b = a - model_sampling.calculate_denoised(sigma, torch.ones_like(noisy), noisy)
    return (a - clean) / b


def pyramid_noise(noise: torch.Tensor, generator: torch.Generator, iterations: int, discount: float) -> torch.Tensor:
    """kohya's pyramid_noise_like (multires noise): noise upsampled (bilinear) from ever coarser random grids, each
    level r^i times smaller for a random r in [2, 4) and weighted discount^i, added until a grid is 1 pixel wide,
    then the whole scaled back to unit standard deviation. Its coarse, low-frequency part lets the LoRA move an
    image's overall brightness and colour, as noise offset does. kohya's r comes from Python's random; here from
    the run's generator, so a seed (and a resume) draws the same."""
    if noise.dim() != 4:
        raise LeanLoRAError(f"multires_noise_iterations: this model's latents have {noise.dim()} dimensions (batch, "
                            "channels, height, width expected): set multires_noise_iterations to 0")
    batch, channels, height, width = noise.shape
    noise = noise.clone()
    for i in range(iterations):
        r = float(torch.rand((), generator=generator)) * 2 + 2
        h, w = max(1, int(height / r ** i)), max(1, int(width / r ** i))
        coarse = torch.randn(batch, channels, h, w, generator=generator)
        noise += F.interpolate(coarse, size=(height, width), mode="bilinear") * discount ** i
        if h == 1 or w == 1:
            break
    return noise / noise.std()


def draw_noise(model_sampling, shape: torch.Size, generator: torch.Generator,
               sampling: TimestepSampling = TimestepSampling.UNIFORM, noise_offset: float = 0.0,
               shift: float = DEFAULT_SHIFT, multires_iterations: int = 0, multires_discount: float = 0.3,
               resolution_shift: float = 1.0) -> dict[str, torch.Tensor]:
    """Noise, noise levels and the model's timesteps for one batch, on the CPU: drawn from the CPU generator so
    a seed gives the same run on any device, and computed from a CPU `model_sampling` so no step waits for the
    GPU (a replayed CUDA graph gets them as plain inputs).
    noise_offset (kohya's): noise += offset * N(0, 1) per image and channel, drawn after the noise levels, and only
    when on, so a run without it draws exactly what it always did and one with it the same noise levels.
    multires_iterations > 0 (kohya's multires noise): pyramid_noise on top, after the offset as kohya orders them."""
    noise = torch.randn(shape, generator=generator)
    sigma = sample_sigmas(model_sampling, shape[0], generator, sampling, shift, resolution_shift)
    if noise_offset:
        noise = noise + noise_offset * torch.randn((*shape[:2], *[1] * (len(shape) - 2)), generator=generator)
    if multires_iterations:
        noise = pyramid_noise(noise, generator, multires_iterations, multires_discount)
    return {"noise": noise, "sigma": sigma, "timestep": model_sampling.timestep(sigma).float()}


class LossKind(Enum):
    """How the output is scored against the target; the values are kohya's `ss_loss_type` words."""
    MSE = "l2"
    HUBER = "huber"          # torch's Huber: squared below huber_c, then linear with slope huber_c
    SMOOTH_L1 = "smooth_l1"  # torch's smooth L1 with beta = huber_c: Huber divided by huber_c


@dataclass(frozen=True)
class LossFunction:
    """The training loss of an output against its target at noise levels `sigma`. The default is plain MSE, computed
    as it always was (one F.mse_loss over the batch: bit for bit today's). min_snr_gamma > 0 (kohya's min-SNR-γ)
    weights each image's mean loss by min(SNR, γ) / SNR for eps-prediction and min(SNR, γ) / (SNR + 1) for
    v-prediction, with SNR = 1 / sigma² (ComfyUI's discrete schedules: sigma² = (1 - ᾱ) / ᾱ, so SNR = ᾱ / (1 - ᾱ)
    as kohya's all_snr); it has no meaning for flow matching, where LossFunction.of refuses it."""
    kind: LossKind = LossKind.MSE
    huber_c: float = 0.1  # kohya's default; the Huber delta and smooth-L1 beta (a constant huber_schedule)
    min_snr_gamma: float = 0.0  # 0: off
    v_prediction: bool = False

    @classmethod
    def of(cls, kind: LossKind, huber_c: float, min_snr_gamma: float, prediction: str) -> "LossFunction":
        """The loss for a model of `prediction` (FamilyIdentity.prediction: epsilon, v or flow)."""
        if min_snr_gamma and prediction not in ("epsilon", "v"):
            raise LeanLoRAError(f"min_snr_gamma: got {min_snr_gamma:g}, but this model is trained by {prediction} "
                                "matching, not eps- or v-prediction: min-SNR weighting is defined on a DDPM schedule's "
                                "signal-to-noise ratio and does not apply (kohya offers it for SD models only). Set "
                                "min_snr_gamma to 0, and choose the timestep_sampling instead")
        return cls(kind, huber_c, min_snr_gamma, prediction == "v")

    def __call__(self, output: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (masked_loss; [B, 1, h, w], 0..1): each image's loss is its mask-weighted mean, so only the masked
        part counts and a small mask is not diluted by the pixels outside it (an all-black mask scores 0)."""
        score = {LossKind.MSE: F.mse_loss,
                 LossKind.HUBER: lambda o, t, **kw: F.huber_loss(o, t, delta=self.huber_c, **kw),
                 LossKind.SMOOTH_L1: lambda o, t, **kw: F.smooth_l1_loss(o, t, beta=self.huber_c, **kw)}[self.kind]
        if not self.min_snr_gamma and mask is None:
            return score(output, target)
        dims = tuple(range(1, output.dim()))
        if mask is None:
            per_image = score(output, target, reduction="none").mean(dim=dims)
        else:
            weights = mask.to(output.dtype).expand_as(output)
            per_image = (score(output, target, reduction="none") * weights).sum(dim=dims) \
                / weights.sum(dim=dims).clamp_min(1e-8)
        if not self.min_snr_gamma:
            return per_image.mean()
        return (per_image * min_snr_weights(sigma, self.min_snr_gamma, self.v_prediction)).mean()


PLAIN_MSE = LossFunction()


def min_snr_weights(sigma: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    """kohya's apply_snr_weight per image, from ComfyUI's sigmas: SNR = 1 / sigma² (device work only)."""
    snr = sigma.float().pow(-2)
    return snr.clamp(max=gamma) / (snr + 1 if v_prediction else snr)


def denoising_loss(model_sampling, predict: Predict, clean: torch.Tensor, cond: dict[str, torch.Tensor],
                   noise: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor,
                   loss: LossFunction = PLAIN_MSE, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Everything after the random draws: only device work, no host synchronisation (capturable)."""
    noisy = model_sampling.noise_scaling(sigma, noise, clean)
    with torch.no_grad():
        target = output_target(model_sampling, sigma, noisy, clean).float()
    output = predict(model_sampling.calculate_input(sigma, noisy), timestep, cond)
    return loss(output.float(), target, sigma) if mask is None else loss(output.float(), target, sigma, mask)
