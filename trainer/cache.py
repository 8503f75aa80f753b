"""Samples -> cache: every image is VAE-encoded and every caption text-encoded exactly once, before training,
so the encoders can leave the device while the diffusion model trains. Held in RAM (CPU tensors)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .dataset import Dataset, load_image


@dataclass(frozen=True)
class CachedSample:
    latent: torch.Tensor            # [1, C, h, w], the model's own latent space (already process_in'd)
    cond: dict[str, torch.Tensor]   # conditioning kwargs of the diffusion model, each with batch dim 1


ImageEncoder = Callable[[torch.Tensor], torch.Tensor]              # [1, H, W, 3] 0..1 -> [1, C, h, w]
TextEncoder = Callable[[str, int, int], dict[str, torch.Tensor]]   # (caption, width, height) -> cond kwargs


def build_cache(dataset: Dataset, encode_image: ImageEncoder, encode_text: TextEncoder,
                on_item: Callable[[int, int], None] = lambda done, total: None) -> list[CachedSample]:
    text_cache: dict[str, dict[str, torch.Tensor]] = {}
    cached = []
    total = len(dataset.samples)
    for index, sample in enumerate(dataset.samples):
        pixels = load_image(sample.path, dataset.resolution)[None]
        latent = encode_image(pixels).detach().to("cpu", torch.float32)
        if sample.caption not in text_cache:
            cond = encode_text(sample.caption, pixels.shape[2], pixels.shape[1])
            text_cache[sample.caption] = {k: v.detach().to("cpu") for k, v in cond.items()}
        cached.append(CachedSample(latent, text_cache[sample.caption]))
        on_item(index + 1, total)
    return cached


def _match_token_length(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Captions over 75 tokens encode to longer cross-attention contexts (77 x k). Like ComfyUI's
    CONDCrossAttn.concat, repeat each to the least common multiple so a batch can be stacked."""
    lengths = {t.shape[1] for t in tensors}
    if len(lengths) == 1:
        return tensors
    target = math.lcm(*lengths)
    return [t.repeat(1, target // t.shape[1], *([1] * (t.dim() - 2))) for t in tensors]


def collate(samples: list[CachedSample]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    latents = torch.cat([s.latent for s in samples])
    cond = {}
    for key in samples[0].cond:
        parts = [s.cond[key] for s in samples]
        if key == "c_crossattn":
            parts = _match_token_length(parts)
        cond[key] = torch.cat(parts)
    return latents, cond


def batches(cache: list[CachedSample], batch_size: int, repeats: int,
            generator: torch.Generator) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Endless batches: each epoch is every sample `repeats` times, shuffled; a batch never spans epochs
    unless the epoch is smaller than the batch (then samples repeat within it)."""
    epoch = [i for i in range(len(cache)) for _ in range(repeats)]
    while True:
        order = [epoch[i] for i in torch.randperm(len(epoch), generator=generator).tolist()]
        while len(order) < batch_size:
            order += order
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([cache[i] for i in order[start:start + batch_size]])
