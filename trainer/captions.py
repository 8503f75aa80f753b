"""Caption options (Train's shuffle_tags, keep_tokens, tag_dropout, caption_dropout): captions as comma-separated
tags, varied per draw. Text embeddings are encoded once, before training (the text encoder leaves the device), so
the variation is encoded ahead: each image gets `variants` seeded variants of its caption (tags shuffled after the
first keep_tokens, each of the others dropped at tag_dropout), plus its dropped caption (the trigger word alone, or
empty), and each draw of the image during training picks one (trainer/cache.py Batches, from the run's generator:
a seed gives the same draws, and a resume goes on with them). Cost: up to `variants` + 1 text encodings per image
instead of 1, and their embeddings in RAM (the report says how many and how much). The trigger word always stays,
first, and is never dropped."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CaptionOptions:
    shuffle_tags: bool = False
    keep_tokens: int = 0  # the first N tags (after the trigger word) stay in place and are never dropped
    tag_dropout: float = 0.0  # each other tag is left out of a variant at this rate
    caption_dropout: float = 0.0  # a draw uses the dropped caption (trigger word alone, or empty) at this rate
    variants: int = 4  # caption variants per image, encoded before training (with shuffle or tag dropout)

    @property
    def varies_tags(self) -> bool:
        return self.shuffle_tags or self.tag_dropout > 0

    @property
    def on(self) -> bool:
        return self.varies_tags or self.caption_dropout > 0


def split_trigger(caption: str, trigger: str) -> tuple[str, str]:
    """(trigger, the rest): the dataset puts the trigger word first ("trigger, caption")."""
    if trigger and (caption == trigger or caption.startswith(trigger + ",")):
        return trigger, caption[len(trigger):].lstrip(",").strip()
    return "", caption


def caption_variant(caption: str, trigger: str, options: CaptionOptions, generator: torch.Generator) -> str:
    """One variant: the trigger word, the first keep_tokens tags as they are, then the other tags shuffled and/or
    each dropped at tag_dropout."""
    head, rest = split_trigger(caption, trigger)
    tags = [tag.strip() for tag in rest.split(",") if tag.strip()]
    kept, free = tags[:options.keep_tokens], tags[options.keep_tokens:]
    if options.shuffle_tags and len(free) > 1:
        free = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]
    if options.tag_dropout and free:
        keep = (torch.rand(len(free), generator=generator) >= options.tag_dropout).tolist()
        free = [tag for tag, stays in zip(free, keep) if stays]
    return ", ".join(([head] if head else []) + kept + free)


def caption_variants(caption: str, trigger: str, options: CaptionOptions, seed: int, index: int) -> list[str]:
    """The variants of image `index`'s caption, seeded by the run's seed and the image (the same for a resume);
    just the caption when tags do not vary."""
    if not options.varies_tags:
        return [caption]
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return [caption_variant(caption, trigger, options, generator) for _ in range(options.variants)]


def dropped_caption(trigger: str) -> str:
    return trigger
