"""The denoising objective, written against ComfyUI's `model_sampling` interface so the checkpoint decides
eps / v-prediction / flow matching: noise comes from the model's own schedule and the target is whatever raw model
output would make the model's own `calculate_denoised` return the clean latent."""
from __future__ import annotations

from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import LeanLoRAError

# (model input, timestep, conditioning kwargs) -> raw model output
Predict = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class TimestepSampling(Enum):
    """How a step picks its noise levels among the model's own (`model_sampling.sigmas`, ascending; a flow model's
    carry its shift already). The family chooses (ModelFamily.timestep_sampling)."""
    UNIFORM = "uniform"            # every level equally often: DDPM training, kohya's default for SD
    LOGIT_NORMAL = "logit-normal"  # sigmoid(N(0, 1)) of the way up the schedule: SD3's and kohya's "sigmoid" for
    #                                flow models, fewer steps at the nearly clean and nearly pure-noise ends


def sample_sigmas(model_sampling, batch: int, generator: torch.Generator,
                  sampling: TimestepSampling = TimestepSampling.UNIFORM) -> torch.Tensor:
    sigmas = getattr(model_sampling, "sigmas", None)
    if sigmas is None:
        raise LeanLoRAError(f"this model's noise schedule ({type(model_sampling).__name__}) has no table of noise "
                            "levels (model_sampling.sigmas) to train with")
    if sampling is TimestepSampling.LOGIT_NORMAL:
        position = torch.sigmoid(torch.randn(batch, generator=generator))
        index = (position * (len(sigmas) - 1)).round().long()
    else:
        index = torch.randint(0, len(sigmas), (batch,), generator=generator)
    return sigmas.cpu()[index]


def output_target(model_sampling, sigma: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """calculate_denoised(sigma, out, noisy) is affine in `out` (denoised = a - b * out), so the output that
    denoises to `clean` is (a - clean) / b: eps for EPS models, v for V_PREDICTION models, noise - clean for flow
    (CONST) models."""
    a = model_sampling.calculate_denoised(sigma, torch.zeros_like(noisy), noisy)
    b = a - model_sampling.calculate_denoised(sigma, torch.ones_like(noisy), noisy)
    return (a - clean) / b


def draw_noise(model_sampling, shape: torch.Size, generator: torch.Generator,
               sampling: TimestepSampling = TimestepSampling.UNIFORM) -> dict[str, torch.Tensor]:
    """Noise, noise levels and the model's timesteps for one batch, on the CPU: drawn from the CPU generator so
    a seed gives the same run on any device, and computed from a CPU `model_sampling` so no step waits for the
    GPU (a replayed CUDA graph gets them as plain inputs)."""
    noise = torch.randn(shape, generator=generator)
    sigma = sample_sigmas(model_sampling, shape[0], generator, sampling)
    return {"noise": noise, "sigma": sigma, "timestep": model_sampling.timestep(sigma).float()}


def denoising_loss(model_sampling, predict: Predict, clean: torch.Tensor, cond: dict[str, torch.Tensor],
                   noise: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """Everything after the random draws: only device work, no host synchronisation (capturable)."""
    noisy = model_sampling.noise_scaling(sigma, noise, clean)
    with torch.no_grad():
        target = output_target(model_sampling, sigma, noisy, clean).float()
    output = predict(model_sampling.calculate_input(sigma, noisy), timestep, cond)
    return F.mse_loss(output.float(), target)
