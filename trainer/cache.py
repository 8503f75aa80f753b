"""Samples -> cache: every image is VAE-encoded and every caption text-encoded at most once, before training,
so the encoders can leave the device while the diffusion model trains. Held as CPU tensors; with a
LatentTextStore, encodings from earlier runs (same process, or its folder) are reused instead of recomputed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from .cache_store import LatentTextStore, image_key, text_key
from .captions import CaptionOptions, caption_variants, dropped_caption
from .dataset import CONTROL_FOLDER, CONTROL_SUFFIX, Dataset, UnusableImage, load_image, load_mask
from .errors import LeanLoRAError


@dataclass(frozen=True)
class CachedSample:
    latent: torch.Tensor            # [1, C, h, w], the model's own latent space (already process_in'd)
    cond: dict[str, torch.Tensor]   # conditioning kwargs of the diffusion model, each with batch dim 1
    name: str = ""                  # the image's file name, for the report (e.g. which images validation holds out)
    # With caption options (captions.py): the conditioning of each caption variant, and of the dropped caption;
    # Batches picks one per draw. `cond` stays the caption as written (validation and memory probes use it).
    variants: tuple[dict[str, torch.Tensor], ...] = ()
    dropped: dict[str, torch.Tensor] | None = None
    # With masked_loss: [1, 1, h, w] at the latent's size, 0..1 (ones where the image has no mask)
    mask: torch.Tensor | None = None


MASK_KEY = "leanlora_loss_mask"  # collate's entry for the batch's masks; the session takes it out of the conditioning


ImageEncoder = Callable[[torch.Tensor], torch.Tensor]              # [1, H, W, 3] 0..1 -> [1, C, h, w]
TextEncoder = Callable[[str, int, int], dict[str, torch.Tensor]]   # (caption, width, height) -> cond kwargs

# An edit pair's control latents in a sample's conditioning: CONTROL_KEY + "0", "1", ... in order (each [1, C, ...],
# the model's latent space); the model's family hands them to the model as its sampling conditioning does
CONTROL_KEY = "control_latent."


class ControlEncoder(Protocol):
    """How an edit model takes a pair's control images (ModelAdapter.control_encoder; ComfyUI's: bridge/edit_pairs.py).
    The control is framed as its target (the same center crop of the same aspect) at `control_size`, what the model's
    own conditioning node resizes it to, and encoded as that node encodes it."""
    name: str                  # the edit model, for the report ("Qwen-Image-Edit 2509/2511")
    preprocess: str            # the control's resize rule: part of its latent's cache key
    text_sees_controls: bool   # the text encoder reads the control images too (Qwen-Image-Edit's vision-language)
    max_controls: int

    def control_size(self, width: int, height: int) -> tuple[int, int]: ...
    def encode_control(self, pixels: torch.Tensor) -> torch.Tensor: ...  # [1, H, W, 3] -> the latent the model gets
    def encode_text(self, caption: str, width: int, height: int,
                    controls: list[torch.Tensor]) -> dict[str, torch.Tensor]: ...


def control_encoder_for(adapter, dataset: Dataset) -> ControlEncoder | None:
    """The adapter's encoder of the dataset's control images (None for a folder of plain images). The adapter refuses
    what its model cannot train (an edit model given plain images, a plain model given pairs); one that knows no
    control images refuses a folder of pairs here, naming both layouts."""
    make = getattr(adapter, "control_encoder", None)
    encoder = make(dataset) if make is not None else None
    if dataset.pairs and encoder is None:
        raise LeanLoRAError(pairs_refusal(adapter.describe(), dataset))
    if encoder is not None:
        most = max(len(sample.controls) for sample in dataset.samples)
        if most > encoder.max_controls:
            raise LeanLoRAError(f"{encoder.name} takes at most {encoder.max_controls} control image"
                                f"{'s' if encoder.max_controls > 1 else ''} per target, and {dataset.folder} has "
                                f"targets with {most}; keep {encoder.max_controls} per target")
    return encoder


def pairs_refusal(model: str, dataset: Dataset) -> str:
    return (f"{dataset.folder} is a folder of edit pairs ({len(dataset.samples)} targets with control images), and "
            f"this model takes no control image: {model}. Connect an edit model (Qwen-Image-Edit 2509/2511 or "
            "FLUX.1 Kontext) to train an edit LoRA, or train on the targets alone: move the control images (the "
            f"<name>{CONTROL_SUFFIX}.* files and the {CONTROL_FOLDER}/ folder) out of the folder")


# What load_image does to an image's bytes besides the target size; part of every latent key, so a change to
# load_image's resize/crop must change this string (old latents then miss instead of being reused).
PREPROCESS = "scale-to-cover center-crop lanczos v2 (16-bit grey scaled, alpha on white)"


@dataclass
class CacheStats:
    image_hits: int = 0
    image_misses: int = 0
    text_hits: int = 0
    text_misses: int = 0
    caption_line: str = ""  # with caption options: the variants encoded and their RAM
    mask_line: str = ""  # with masked_loss: how many images have a mask, from where
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason): unusable when cached
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"cache: latents {self.image_hits} hits, {self.image_misses} encoded; "
                 f"text {self.text_hits} hits, {self.text_misses} encoded"]
        lines += [f"  {line}" for line in (self.caption_line, self.mask_line) if line]
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


def _check_finite(encoded: dict[str, torch.Tensor], part: str, doing: str) -> None:
    """An encoder's NaN/inf output would make every step's loss NaN, blamed on the learning rate as a divergence:
    named here, before training, as the part of the checkpoint that gave it."""
    bad = [key for key, tensor in encoded.items() if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise LeanLoRAError(f"the checkpoint's {part} gave NaN/inf values {doing} ({', '.join(bad)}): that part "
                            "of the checkpoint is damaged or overflows in fp16; nothing was trained. Load a working "
                            f"{part.split(' ')[0]} separately, or pick another checkpoint")


def _check_masks_leave_pixels(cached: list[CachedSample], stats: CacheStats) -> None:
    """A mask that excludes every pixel makes its image's loss 0: that image teaches nothing (a note names it), and
    when every mask does, the run would save an untrained LoRA after a loss of 0.0000: refused before training."""
    empty = [sample.name for sample in cached if sample.mask is not None and not bool(sample.mask.any())]
    if cached and len(empty) == len(cached):
        raise LeanLoRAError(f"masked_loss: the loss mask of every image excludes every pixel ({', '.join(empty[:5])}"
                            + (f" and {len(empty) - 5} more" if len(empty) > 5 else "") + "), so nothing could be "
                            "learned; nothing was trained. Paint the <image>_mask.png files white (or leave the alpha "
                            "opaque) where the loss should count, or set masked_loss off")
    if empty:
        stats.notes.append(f"WARNING: the loss masks of {len(empty)} images exclude every pixel, so they teach "
                           f"nothing: {', '.join(empty[:5])}" + (f" and {len(empty) - 5} more" if len(empty) > 5 else ""))


def build_cache(dataset: Dataset, encode_image: ImageEncoder, encode_text: TextEncoder,
                on_item: Callable[[int, int], None] = lambda done, total: None,
                store: LatentTextStore | None = None, image_encoder_id: str = "", text_encoder_id: str = "",
                stats: CacheStats | None = None, preprocess: str = PREPROCESS,
                captions: CaptionOptions = CaptionOptions(), seed: int = 0,
                masked_loss: bool = False,
                tokenize: Callable[[str], dict[str, torch.Tensor]] | None = None,
                controls: ControlEncoder | None = None) -> list[CachedSample]:
    """Encodes what the store does not hold yet (without a store: everything) and counts into `stats`. A hit
    skips decoding the image as well as the encoder, so a fully cached dataset never loads the VAE or CLIP.
    An image that has become unusable since the scan (deleted, truncated, undecodable, replaced by a link that
    leads out of the dataset's confinement) is skipped and listed in `stats`; only when none is left is that an
    error. `captions`: caption variants to encode as well (captions.py), seeded by `seed`. `masked_loss`: each
    sample gets its loss mask (dataset.load_mask) at the latent's size, area-averaged as the VAE downsamples.
    `tokenize` (a trained text encoder's, text_encoder.py): each caption's conditioning also holds its tokens (never
    stored: tokenizing is cheap, and the store's entries stay those of the encoder's output).
    `controls` (an edit model's, for a dataset of pairs): each control image is framed as its target, resized as the
    model's node resizes it and encoded once (keyed by its bytes and that rule, like the targets), into the sample's
    conditioning as CONTROL_KEY<i>; where the text encoder reads the controls too, a caption's key holds them."""
    if dataset.pairs and controls is None:
        raise LeanLoRAError(pairs_refusal("(a model without control images)", dataset))
    mask_sources: dict[str, int] = {}
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
        _check_finite(latent, "VAE", f"encoding {sample.path.name}")
        stats.image_hits += hit
        stats.image_misses += not hit
        control_latents, control_id, control_pixels = {}, "", None
        if controls is not None:
            try:
                control_latents, control_id, control_pixels = _controls(sample, width, height, controls, store,
                                                                        image_encoder_id, preprocess, stats)
            except UnusableImage as unusable:
                stats.skipped.append((sample.path.name, f"its control image {unusable.path.name}: {unusable.reason}"))
                on_item(index + 1, total)
                continue
        sees_controls = controls is not None and controls.text_sees_controls

        def encode_caption(caption: str) -> dict[str, torch.Tensor]:
            if not sees_controls:
                return encode_text(caption, width, height)
            return controls.encode_text(caption, width, height, control_pixels())

        def text(caption: str) -> dict[str, torch.Tensor]:
            text_id = (caption, width, height, control_id if sees_controls else "")
            hit = text_id in run_texts
            if not hit:
                keyed = f"{caption}\0controls {control_id}" if sees_controls else caption
                run_texts[text_id], hit = _fetch(
                    store, lambda: text_key(keyed, width, height, text_encoder_id),
                    lambda: {k: v.detach().to("cpu") for k, v in encode_caption(caption).items()})
                _check_finite(run_texts[text_id], "text encoder (CLIP)", f"encoding the caption {caption[:60]!r}")
                if tokenize is not None:
                    run_texts[text_id] = {**run_texts[text_id], **tokenize(caption)}
            stats.text_hits += hit
            stats.text_misses += not hit
            return run_texts[text_id]
        variants, dropped = (), None
        if captions.varies_tags:
            variants = tuple(text(variant) for variant in
                             caption_variants(sample.caption, dataset.trigger_word, captions, seed, index))
        if captions.caption_dropout:
            dropped = text(dropped_caption(dataset.trigger_word))
        mask = None
        if masked_loss:
            try:
                pixels, where = load_mask(sample.path, (width, height))
            except UnusableImage as unusable:
                stats.skipped.append((sample.path.name, unusable.reason))
                on_item(index + 1, total)
                continue
            size = tuple(latent["latent"].shape[-2:])
            mask = torch.ones(1, 1, *size) if pixels is None else \
                torch.nn.functional.interpolate(pixels[None, None], size=size, mode="area")
            mask_sources[where or "none"] = mask_sources.get(where or "none", 0) + 1
        if control_latents:  # every caption variant goes with the pair's controls
            variants = tuple({**cond, **control_latents} for cond in variants)
            dropped = {**dropped, **control_latents} if dropped is not None else None
        cached.append(CachedSample(latent["latent"], {**text(sample.caption), **control_latents}, sample.path.name,
                                   variants, dropped, mask))
        on_item(index + 1, total)
    if controls is not None and cached:
        sizes = sorted({tuple(value.shape[-2:]) for sample in cached for key, value in sample.cond.items()
                        if key.startswith(CONTROL_KEY)})
        stats.notes.append(f"edit pairs for {controls.name}: each control image framed as its target, resized as "
                           f"{controls.preprocess} (latents " + ", ".join(f"{w}x{h}" for h, w in sizes)
                           + "), given to the model as reference latents"
                           + ("; the instruction encoded with the control images" if controls.text_sees_controls
                              else ""))
    if store is not None and store.disk_problem:
        stats.notes.append(store.disk_problem)
    if masked_loss:
        _check_masks_leave_pixels(cached, stats)
        count = lambda where: mask_sources.get(where, 0)  # noqa: E731
        stats.mask_line = (f"masked loss: {count('mask file')} images masked by <image>_mask.png, "
                           f"{count('alpha channel')} by their alpha channel, {count('none')} without a mask (every "
                           "pixel counts)")
    if captions.on:
        texts = {id(cond): cond for sample in cached for cond in (sample.cond, *sample.variants, sample.dropped)
                 if cond is not None}
        nbytes = sum(t.numel() * t.element_size() for cond in texts.values() for t in cond.values())
        varied = f"{captions.variants} variants per image" if captions.varies_tags else "as written"
        stats.caption_line = (f"captions: {varied}"
                              + (" + the dropped caption" if captions.caption_dropout else "")
                              + f", {len(texts)} distinct texts encoded before training, {nbytes / 2 ** 20:.1f} MiB "
                              "of text embeddings in RAM")
    if not cached:
        details = "; ".join(f"{name}: {reason}" for name, reason in stats.skipped[:5])
        raise LeanLoRAError(f"no image of {dataset.folder} could be used when caching ({details}); fix or replace "
                            "the files and run again")
    return cached


def _controls(sample, width: int, height: int, encoder: ControlEncoder, store: LatentTextStore | None,
              image_encoder_id: str, preprocess: str, stats: CacheStats):
    """({CONTROL_KEY<i>: latent}, the controls' identity for the caption's key, a function giving their pixels) of
    one pair. A latent is keyed by the control's bytes, the framing, the model's resize rule and the VAE; the pixels
    are decoded only when something misses."""
    size = encoder.control_size(width, height)
    rule = f"control {encoder.preprocess} from {preprocess} {size[0]}x{size[1]} (target {width}x{height})"
    loaded: list[torch.Tensor] = []

    def pixels() -> list[torch.Tensor]:
        if not loaded:
            loaded.extend(load_image(path, size)[None] for path in sample.controls)
        return loaded
    latents, keys = {}, []
    for i, path in enumerate(sample.controls):
        keys.append(_image_key(path, rule, image_encoder_id))
        entry, hit = _fetch(store, lambda: keys[-1],
                            lambda: {"latent": encoder.encode_control(pixels()[i]).detach().to("cpu", torch.float32)})
        _check_finite(entry, "VAE", f"encoding the control image {path.name}")
        stats.image_hits += hit
        stats.image_misses += not hit
        latents[f"{CONTROL_KEY}{i}"] = entry["latent"]
    return latents, " ".join(keys), pixels


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
    if samples[0].mask is not None:
        cond[MASK_KEY] = torch.cat([s.mask for s in samples])
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
                 sequence_keys: tuple[str, ...] = (), caption_dropout: float = 0.0):
        self.cache, self.batch_size, self.generator, self.sequence_keys = cache, batch_size, generator, sequence_keys
        self.shapes = [stack_shape(sample) for sample in cache]
        self.caption_dropout = caption_dropout
        # caption options: each draw picks a caption variant (or the dropped caption) of its image
        self.varied = caption_dropout > 0 or any(sample.variants for sample in cache)
        self.choices: list[list[int]] = []  # per batch of `order`: each image's caption, VARIANT / DROPPED / WRITTEN
        self.epoch = torch.arange(len(cache)).repeat_interleave(repeats)  # repeats is bounded by Dataset (MAX_REPEATS)
        self.order: list[list[int]] = []  # this epoch's batches, as indices into the cache
        self.position = 0  # batches of this epoch already handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.position >= len(self.order):
            self._shuffle_epoch()
        chunk = self.order[self.position]
        choices = self.choices[self.position] if self.varied else [WRITTEN] * len(chunk)
        self.position += 1
        return collate([self._with_caption(self.cache[i], choice) for i, choice in zip(chunk, choices)],
                       self.sequence_keys)

    @staticmethod
    def _with_caption(sample: CachedSample, choice: int) -> CachedSample:
        if choice == WRITTEN:
            return sample
        return replace(sample, cond=sample.dropped if choice == DROPPED else sample.variants[choice])

    def _shuffle_epoch(self) -> None:
        groups: dict[tuple, list[tuple[int, int]]] = {}
        indices = self.epoch[torch.randperm(len(self.epoch), generator=self.generator)].tolist()
        choices = [WRITTEN] * len(indices)
        if self.varied:  # drawn only with caption options: other runs draw exactly what they always did
            dropped = (torch.rand(len(indices), generator=self.generator) < self.caption_dropout).tolist()
            picks = torch.randint(0, 2 ** 31, (len(indices),), generator=self.generator).tolist()
            variants = [len(self.cache[i].variants) for i in indices]
            choices = [DROPPED if drop else pick % count if count else WRITTEN
                       for drop, pick, count in zip(dropped, picks, variants)]
        for index, choice in zip(indices, choices):
            # grouped by the chosen caption's shapes: a variant may encode to another length than the caption
            shape = self.shapes[index] if choice == WRITTEN else \
                stack_shape(self._with_caption(self.cache[index], choice))
            groups.setdefault(shape, []).append((index, choice))
        size = self.batch_size
        chunks = [ids[start:start + size] for ids in groups.values() for start in range(0, len(ids), size)]
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=self.generator).tolist()]
        self.order = [[index for index, _ in chunk] for chunk in chunks]
        self.choices = [[choice for _, choice in chunk] for chunk in chunks]
        self.position = 0

    def state_dict(self) -> dict:
        # `order` is replaced each epoch, never changed in place: sharing it is a snapshot
        state = {"order": self.order, "position": self.position, "batch_size": self.batch_size}
        return {**state, "captions": self.choices} if self.varied else state

    def load_state_dict(self, state: dict) -> None:
        """The order of an interrupted run; with another batch size its epoch is reshuffled at the next batch (as
        it is when caption options were turned on or off in between)."""
        choices = state.get("captions")
        same_captions = (choices is not None) == self.varied and \
            (choices is None or self._valid(state["order"], choices))
        if state["batch_size"] == self.batch_size and same_captions and \
                all(0 <= i < len(self.cache) for c in state["order"] for i in c):
            self.order, self.position = [list(c) for c in state["order"]], int(state["position"])
            self.choices = [list(c) for c in choices] if choices is not None else []
        else:
            self.order, self.position, self.choices = [], 0, []

    def _valid(self, order, choices) -> bool:
        """Each recorded caption choice names a variant the image has (or the dropped caption, where on)."""
        try:
            return len(order) == len(choices) and all(
                len(c) == len(o) and all((x == DROPPED and self.cache[i].dropped is not None) or x == WRITTEN
                                         or 0 <= x < len(self.cache[i].variants) for i, x in zip(o, c))
                for o, c in zip(order, choices))
        except (TypeError, IndexError):
            return False


WRITTEN, DROPPED = -1, -2  # Batches' caption choices besides a variant's index: the caption as written, dropped


def batches(cache: list[CachedSample], batch_size: int, repeats: int, generator: torch.Generator,
            sequence_keys: tuple[str, ...] = (), caption_dropout: float = 0.0) -> Batches:
    return Batches(cache, batch_size, repeats, generator, sequence_keys, caption_dropout)
