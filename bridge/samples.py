"""Sample images while training: the user's MODEL patched with the LoRA at its current weights (a clone, as
ComfyUI's LoraLoader patches), the prompts encoded by the CLIP input, ComfyUI's own sampling (KSampler's path with
the family's sampler and schedule, e.g. euler/normal for SD, euler/simple for the flow DiTs; a fixed seed) and the
VAE's decode. Trained on a folder of edit pairs, each prompt is an instruction applied to the first pair's control
images, its CONDITIONING built as the edit model's ComfyUI node builds it (bridge/edit_pairs.py: Qwen-Image-Edit's
TextEncodeQwenImageEditPlus, FLUX.1 Kontext's ReferenceLatent), the negative too (the empty instruction).

It runs in the training thread between optimizer steps. ComfyUI's model management runs in inference mode (see
ComfyAdapter.encode_image), the training's random streams are left as they were (ComfyUI seeds torch's global
generator for its noise), and everything sampling loaded is unloaded afterwards, as the encoders are released
before training: the training copy finds the memory as it left it."""
from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

import comfy.model_management
import comfy.sample

from .comfy_adapter import ComfyAdapter, apply_lora
from .edit_pairs import sample_edit
from .families import family_for
from .trainer_api import SampleSettings, StepPace, new_folder, write_atomic


class SampleRenderer:
    """`renderer(step, lora_state_dict)` renders one image per prompt and writes `step<N>_<i>.png` (i from 0, in
    prompt order) into this run's own folder; returns the paths. The folder is `folder`, or `folder_2`, `_3`, ...
    where an earlier run has one (created at the first image: a run never overwrites another run's samples).
    The prompts are encoded once, at the first call (with text-encoder keys in the state dict, text_encoder_lr: at
    every call, through that LoRA on a clone of the CLIP). `should_stop()` (Cancel) is asked after every sampler step,
    before each image and decode, and before each block of the diffusion model and the VAE: one sampler step or decode
    at a large size takes minutes on a CPU, and Cancel stops it within one block."""

    def __init__(self, model, clip, vae, settings: SampleSettings, folder: Path,
                 should_stop: Callable[[], bool] = lambda: False, dataset=None):
        """`dataset`: the training's; a folder of edit pairs makes each sample an edit of its first control."""
        self.model, self.clip, self.vae, self.settings = model, clip, vae, settings
        self.requested, self.folder = Path(folder), None  # self.folder: this run's, once claimed
        self.should_stop = should_stop
        pairs = dataset is not None and dataset.pairs
        self.edit = sample_edit(ComfyAdapter(model, clip, vae), dataset, settings.size) if pairs else None
        defaults = (self.edit.family if self.edit else family_for(model.model)).sample_defaults
        self.sampler, self.scheduler = defaults.sampler, defaults.scheduler
        self._conds = None  # (positive per prompt, the empty negative), ComfyUI's conditioning lists

    def __call__(self, step: int, lora_state_dict: dict[str, torch.Tensor], pace: StepPace | None = None) -> list[Path]:
        """`pace`: the training step's, which bounds a sampler step (StepPace): a sample estimated past it is not
        started, and one measured past it (on the second step: the first includes loading the model) stops there;
        either raises a TimeoutError saying how long the sample would take."""
        self._allowed, self._step_times = (pace.sampler_step_allowed if pace else None), []
        if pace is not None:
            settings = self.settings
            latent_side = settings.size // self.vae.spacial_compression_encode()  # as training's latents count
            estimate = pace.sampler_step_estimate(latent_side ** 2, 1 if settings.cfg == 1 else 2)
            if estimate > self._allowed:
                raise TimeoutError(self._too_slow(estimate, f"estimated from the training step's {pace.seconds:.2f} s"))
        device = comfy.model_management.get_torch_device()
        devices = [device] if device.type == "cuda" else []  # the CUDA generator sampling may draw from
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            try:
                images = self._render(lora_state_dict)
            finally:  # also after an out-of-memory part-way: nothing of sampling stays loaded beside training
                comfy.model_management.unload_all_models()
                comfy.model_management.soft_empty_cache()
        if self.folder is None:
            self.folder = new_folder(self.requested)
        return [self._write(image, step, index) for index, image in enumerate(images)]

    def _stop_if_cancelled(self, *_) -> None:
        """Between blocks, sampler steps and images: Cancel, from the job or the queue."""
        if self.should_stop() or comfy.model_management.processing_interrupted():
            raise comfy.model_management.InterruptProcessingException()

    def _after_sampler_step(self, *_) -> None:
        """ComfyUI's sampler callback: Cancel, and the time bound, judged on the second step (the first includes
        loading the model)."""
        self._stop_if_cancelled()
        self._step_times.append(time.perf_counter())
        if self._allowed is None or len(self._step_times) != 3:
            return
        seconds = self._step_times[2] - self._step_times[1]
        if seconds > self._allowed:
            raise TimeoutError(self._too_slow(seconds, "measured"))

    def _too_slow(self, seconds: float, how: str) -> str:
        settings = self.settings
        total = seconds * settings.steps * len(settings.prompts)
        return (f"one sampler step at {settings.size} px takes about {seconds:.1f} s ({how}), so {settings.steps} steps x "
                f"{len(settings.prompts)} images would take about {total / 60:.1f} min, past the bound of "
                f"{self._allowed:.2f} s a sampler step: lower sample_size or sample_steps")

    def _render(self, lora_state_dict: dict[str, torch.Tensor]) -> list[np.ndarray]:
        settings = self.settings
        if any(key.startswith("lora_te") for key in lora_state_dict):  # text_encoder_lr: the prompts through its LoRA
            _, clip = apply_lora(None, self.clip, lora_state_dict, 0.0, 1.0)
            positives, negative = self._encode(clip)
        else:
            if self._conds is None:
                self._conds = self._encode(self.clip)
            positives, negative = self._conds
        patched, _ = apply_lora(self.model, None, lora_state_dict, 1.0, 0.0)
        with _checked_between_blocks((self.model.model, self.vae.first_stage_model), self._stop_if_cancelled):
            return self._sample(patched, positives, negative)

    def _encode(self, clip) -> tuple[list, list]:
        """(the CONDITIONING of each prompt, the empty prompt's): with the edit's control images for pairs."""
        if self.edit is not None:
            encode = lambda text: self.edit.conditioning(text, clip)  # noqa: E731
        else:
            encode = lambda text: clip.encode_from_tokens_scheduled(clip.tokenize(text))  # noqa: E731
        return [encode(prompt) for prompt in self.settings.prompts], encode("")

    def _sample(self, patched, positives, negative) -> list[np.ndarray]:
        settings = self.settings
        latent_size = settings.size // self.vae.spacial_compression_encode()  # 8 pixels a position; FLUX.2's VAE 16
        images = []
        for positive in positives:
            self._stop_if_cancelled()
            self._step_times.append(time.perf_counter())  # the sampler's start: its first step is timed from here
            latent = comfy.sample.fix_empty_latent_channels(patched, torch.zeros(1, 4, latent_size, latent_size))
            noise = comfy.sample.prepare_noise(latent, settings.seed)
            samples = comfy.sample.sample(patched, noise, settings.steps, settings.cfg, self.sampler, self.scheduler,
                                          positive, negative, latent, disable_pbar=True, seed=settings.seed,
                                          callback=self._after_sampler_step)
            self._stop_if_cancelled()
            decoded = self.vae.decode(samples)
            if decoded.dim() == 5:  # a video VAE's frames (Qwen-Image's Wan VAE): one frame here, as VAEDecode does
                decoded = decoded.reshape(-1, *decoded.shape[-3:])
            images.append((decoded[0].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy())
        return images

    def _write(self, pixels: np.ndarray, step: int, index: int) -> Path:
        settings = self.settings
        info = PngInfo()  # what made the image, as text any viewer shows
        info.add_text("parameters", f"{settings.prompts[index]}\nLeanLoRA sample at training step {step}; sampler "
                                    f"{self.sampler} {self.scheduler}, steps {settings.steps}, cfg {settings.cfg:g}, seed "
                                    f"{settings.seed}, size {settings.size}x{settings.size}" + (
                                        f"; an edit of {', '.join(p.name for p in self.edit.paths)}"
                                        if self.edit else ""))
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", pnginfo=info, compress_level=4)
        path = self.folder / f"step{step}_{index}.png"
        return write_atomic(path, lambda tmp: Path(tmp).write_bytes(buffer.getvalue()))


@contextlib.contextmanager
def _checked_between_blocks(models, check: Callable[[], None]):
    """`check` before every block (each child of a ModuleList or Sequential) of `models` while inside, so an interrupt
    raised by it stops a forward part-way. The hooks are the user's modules' for this block only: removed after."""
    handles = [block.register_forward_pre_hook(lambda *_: check())
               for model in models for module in model.modules()
               if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) for block in module.children()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
