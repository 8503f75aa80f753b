"""Samples -> cache: every image is VAE-encoded and every caption text-encoded at most once, before training,
so the encoders can leave the device while the diffusion model trains. Held as CPU tensors; with a
LatentTextStore, encodings from earlier runs (same process, or its folder) are reused instead of recomputed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from .cache_store import LatentTextStore, image_key, text_key
from .dataset import Dataset, UnusableImage, load_image
from .errors import LeanLoRAError


@dataclass(frozen=True)
class CachedSample:
    latent: torch.Tensor            # [1, C, h, w], the model's own latent space (already process_in'd)
    cond: dict[str, torch.Tensor]   # conditioning kwargs of the diffusion model, each with batch dim 1
    name: str = ""                  # the image's file name, for the report (e.g. which images validation holds out)


ImageEncoder = Callable[[torch.Tensor], torch.Tensor]              # [1, H, W, 3] 0..1 -> [1, C, h, w]
TextEncoder = Callable[[str, int, int], dict[str, torch.Tensor]]   # (caption, width, height) -> cond kwargs


# What load_image does to an image's bytes besides the target size; part of every latent key, so a change to
# load_image's resize/crop must change this string (old latents then miss instead of being reused).
PREPROCESS = "scale-to-cover center-crop lanczos v2 (16-bit grey scaled, alpha on white)"


@dataclass
class CacheStats:
    image_hits: int = 0
    image_misses: int = 0
    text_hits: int = 0
    text_misses: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason): unusable when cached
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"cache: latents {self.image_hits} hits, {self.image_misses} encoded; "
                 f"text {self.text_hits} hits, {self.text_misses} encoded"]
        lines += [f"  skipped {name} while caching: {reason}" for name, reason in self.skipped]
        return "\n".join(lines + [f"  {note}" for note in self.notes])


def _image_key(path: Path, preprocess: str, encoder_id: str) -> str:
    try:
        return image_key(path, preprocess, encoder_id)
    except FileNotFoundError as error:
        raise UnusableImage(path, "no longer exists (deleted or moved after the folder was scanned)") from error
    except OSError as error:
        raise UnusableImage(path, f"cannot be read ({error.strerror or error})") from error


def _fetch(store: LatentTextStore | None, make_key: Callable[[], str],
           encode: Callable[[], dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], bool]:
    """(entry, hit): the store's entry, else a fresh encoding, which is put into the store."""
    key = make_key() if store is not None else None
    entry = store.get(key) if key is not None else None
    if entry is not None:
        return entry, True
    entry = encode()
    if key is not None:
        store.put(key, entry)
    return entry, False


def build_cache(dataset: Dataset, encode_image: ImageEncoder, encode_text: TextEncoder,
                on_item: Callable[[int, int], None] = lambda done, total: None,
                store: LatentTextStore | None = None, image_encoder_id: str = "", text_encoder_id: str = "",
                stats: CacheStats | None = None, preprocess: str = PREPROCESS) -> list[CachedSample]:
    """Encodes what the store does not hold yet (without a store: everything) and counts into `stats`. A hit
    skips decoding the image as well as the encoder, so a fully cached dataset never loads the VAE or CLIP.
    An image that has become unusable since the scan (deleted, truncated, undecodable, replaced by a link that
    leads out of the dataset's confinement) is skipped and listed in `stats`; only when none is left is that an
    error."""
    stats = stats if stats is not None else CacheStats()
    run_texts: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}  # a repeated caption is encoded once
    cached = []
    total = len(dataset.samples)
    for index, sample in enumerate(dataset.samples):
        width, height = dataset.target_size(sample)
        if dataset.confinement is not None and dataset.confinement.leads_out(sample.path):  # made a link since the scan
            stats.skipped.append((sample.path.name, dataset.confinement.link_reason))
            on_item(index + 1, total)
            continue
        try:
            latent, hit = _fetch(
                store, lambda: _image_key(sample.path, f"{preprocess} {width}x{height}", image_encoder_id),
                lambda: {"latent": encode_image(load_image(sample.path, (width, height))[None]).detach().to("cpu", torch.float32)})
        except UnusableImage as unusable:
            stats.skipped.append((sample.path.name, unusable.reason))
            on_item(index + 1, total)
            continue
        stats.image_hits += hit
        stats.image_misses += not hit

        text_id = (sample.caption, width, height)
        hit = text_id in run_texts
        if not hit:
            run_texts[text_id], hit = _fetch(
                store, lambda: text_key(sample.caption, width, height, text_encoder_id),
                lambda: {k: v.detach().to("cpu") for k, v in encode_text(sample.caption, width, height).items()})
        stats.text_hits += hit
        stats.text_misses += not hit
        cached.append(CachedSample(latent["latent"], run_texts[text_id], sample.path.name))
        on_item(index + 1, total)
    if store is not None and store.disk_problem:
        stats.notes.append(store.disk_problem)
    if not cached:
        details = "; ".join(f"{name}: {reason}" for name, reason in stats.skipped[:5])
        raise LeanLoRAError(f"no image of {dataset.folder} could be used when caching ({details}); fix or replace "
                            "the files and run again")
    return cached


def _match_token_length(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Captions over 75 tokens encode to longer cross-attention contexts (77 x k). Like ComfyUI's
    CONDCrossAttn.concat, repeat each to the least common multiple so the contexts can be stacked: attention
    over a context repeated m times equals attention over it once (which entries are such sequences, the model
    adapter says: ModelAdapter.sequence_conditioning). batches() never mixes lengths (the least
    common multiple of 77 x 7 and 77 x 8 is 56 x 77); this is for callers that do."""
    lengths = {t.shape[1] for t in tensors}
    if len(lengths) == 1:
        return tensors
    target = math.lcm(*lengths)
    return [t.repeat(1, target // t.shape[1], *([1] * (t.dim() - 2))) for t in tensors]


def collate(samples: list[CachedSample],
            sequence_keys: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    latents = torch.cat([s.latent for s in samples])
    cond = {}
    for key in samples[0].cond:
        parts = [s.cond[key] for s in samples]
        if key in sequence_keys:
            parts = _match_token_length(parts)
        cond[key] = torch.cat(parts)
    return latents, cond


def stack_shape(sample: CachedSample) -> tuple:
    """Samples of one stack shape batch as they are: same latent size (aspect-ratio bucket) and same
    conditioning shapes (a caption over 75 tokens has a longer context)."""
    return tuple(sample.latent.shape), tuple((key, tuple(value.shape)) for key, value in sorted(sample.cond.items()))


class Batches:
    """Endless batches. Each epoch is every sample `repeats` times, shuffled, then grouped by stack shape
    (aspect-ratio bucket and caption length) so no batch is ever padded or repeated; batch order is shuffled
    across groups. A group's remainder becomes a smaller batch instead of being dropped or padded.
    The epoch's order and the position in it are state (`state_dict`), so a resumed run continues mid-epoch with
    the batches the interrupted one would have drawn."""

    def __init__(self, cache: list[CachedSample], batch_size: int, repeats: int, generator: torch.Generator,
                 sequence_keys: tuple[str, ...] = ()):
        self.cache, self.batch_size, self.generator, self.sequence_keys = cache, batch_size, generator, sequence_keys
        self.shapes = [stack_shape(sample) for sample in cache]
        self.epoch = torch.arange(len(cache)).repeat_interleave(repeats)  # repeats is bounded by Dataset (MAX_REPEATS)
        self.order: list[list[int]] = []  # this epoch's batches, as indices into the cache
        self.position = 0  # batches of this epoch already handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.position >= len(self.order):
            self._shuffle_epoch()
        chunk = self.order[self.position]
        self.position += 1
        return collate([self.cache[i] for i in chunk], self.sequence_keys)

    def _shuffle_epoch(self) -> None:
        groups: dict[tuple, list[int]] = {}
        for index in self.epoch[torch.randperm(len(self.epoch), generator=self.generator)].tolist():
            groups.setdefault(self.shapes[index], []).append(index)
        size = self.batch_size
        chunks = [ids[start:start + size] for ids in groups.values() for start in range(0, len(ids), size)]
        self.order = [chunks[i] for i in torch.randperm(len(chunks), generator=self.generator).tolist()]
        self.position = 0

    def state_dict(self) -> dict:
        # `order` is replaced each epoch, never changed in place: sharing it is a snapshot
        return {"order": self.order, "position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """The order of an interrupted run; with another batch size its epoch is reshuffled at the next batch."""
        if state["batch_size"] == self.batch_size and all(0 <= i < len(self.cache) for c in state["order"] for i in c):
            self.order, self.position = [list(c) for c in state["order"]], int(state["position"])
        else:
            self.order, self.position = [], 0


def batches(cache: list[CachedSample], batch_size: int, repeats: int, generator: torch.Generator,
            sequence_keys: tuple[str, ...] = ()) -> Batches:
    return Batches(cache, batch_size, repeats, generator, sequence_keys)
