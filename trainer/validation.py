"""Validation loss: a held-out share of the cached images, each with noise and timesteps drawn once, so that every
evaluation measures the same thing and the curve shows what the LoRA learned, not the luck of the draws.

Nothing here touches the training's random streams: the split and the draws come from generators of their own
(seeded from the run's seed), and an evaluation is a forward pass without gradients (TrainingSession.forward_loss)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .cache import CachedSample
from .errors import LeanLoRAError
from .objective import TimestepSampling, draw_noise

DRAWS_PER_IMAGE = 4  # (noise, timestep) pairs per held-out image: a steadier mean than one, at 4 forwards an image
# Offsets that give the split and the draws generators of their own: the training's is seeded with the seed itself
SPLIT_STREAM, DRAW_STREAM = 0x5EED_0001, 0x5EED_0002


def held_out_count(fraction: float, images: int) -> int:
    """How many of `images` a validation fraction holds out: at least one, and at least one left to train on
    (else a LeanLoRAError naming validation_fraction)."""
    if fraction <= 0:
        return 0
    count = max(1, round(fraction * images))
    if images - count < 1:
        raise LeanLoRAError(f"validation_fraction: {fraction:g} of {images} usable image{'s' if images > 1 else ''} "
                            f"holds out {count} and leaves none to train on: add images, lower "
                            "validation_fraction, or set it to 0 (off)")
    return count


def split_validation(cache: list[CachedSample], fraction: float, seed: int
                     ) -> tuple[list[CachedSample], list[int]]:
    """(the images left to train on, in their cache order; the cache indices held out, ascending), chosen from the
    seed by a generator of their own."""
    count = held_out_count(fraction, len(cache))
    if not count:
        return cache, []
    chosen = torch.randperm(len(cache), generator=torch.Generator().manual_seed(seed + SPLIT_STREAM))[:count]
    held = sorted(chosen.tolist())
    kept = set(range(len(cache))) - set(held)
    return [sample for index, sample in enumerate(cache) if index in kept], held


def split_fingerprint(images: int, held_out: list[int]) -> str:
    """Which of `images` cached images were held out: a state resumes only with the same split."""
    return hashlib.sha256(f"{images}:{held_out}".encode()).hexdigest()[:16]


@dataclass
class ValidationSet:
    """The held-out images with their fixed draws, and the losses measured on them so far."""
    samples: list[CachedSample]
    every: int  # evaluate every N steps (0: at the end only)
    draws: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)  # per image: draw_noise's dicts
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss)

    @classmethod
    def build(cls, samples: list[CachedSample], every: int, model_sampling, seed: int,
              draws_per_image: int = DRAWS_PER_IMAGE,
              sampling: TimestepSampling = TimestepSampling.UNIFORM) -> "ValidationSet":
        # The family's timestep sampling, no noise offset, and TrainingSession.forward_loss scores them with plain
        # MSE: the run's timestep and loss knobs stay out, so validation numbers compare between runs with other knobs
        generator = torch.Generator().manual_seed(seed + DRAW_STREAM)
        draws = [[draw_noise(model_sampling, sample.latent.shape, generator, sampling) for _ in range(draws_per_image)]
                 for sample in samples]
        return cls(samples, every, draws)

    def batches(self):
        """(sample, draw) per forward: batch 1, each image with each of its draws."""
        for sample, draws in zip(self.samples, self.draws):
            for draw in draws:
                yield sample, draw

    def evaluate(self, forward_loss, step: int) -> float:
        """The mean loss over every image and draw at the current weights, recorded at `step`.
        forward_loss(inputs) -> scalar loss tensor (TrainingSession.forward_loss)."""
        total, count = 0.0, 0
        for sample, draw in self.batches():
            inputs = {"clean": sample.latent, **draw, **{f"cond.{k}": v for k, v in sample.cond.items()}}
            total += float(forward_loss(inputs))
            count += 1
        value = total / count
        self.losses.append((step, value))
        return value

    def describe(self, images: int) -> str:
        return (f"validation: {len(self.samples)} of {images} images held out, {len(self.draws[0])} fixed noise and "
                f"timestep draws each, evaluated "
                + (f"every {self.every} steps and at the end" if self.every else "at the end"))

    def summary(self) -> str | None:
        if not self.losses:
            return None
        (first_step, first), (last_step, last) = self.losses[0], self.losses[-1]
        return (f"validation loss: first {first:.4f} (step {first_step}), last {last:.4f} (step {last_step}), "
                f"{len(self.losses)} evaluations")
