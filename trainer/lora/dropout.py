"""LoRA dropout that CUDA graphs and recomputed blocks can replay: the mask is a hash of the micro-step's seed,
the layer and the element (StepSeededDropout), shared by every adapter type."""
from __future__ import annotations

import torch

ADAPTER = "leanlora"  # peft's adapter name for plain LoRA


class DropoutSeed:
    """The current micro-step's LoRA dropout: its seed, a device tensor the step writes in place (`feed`: inside a
    CUDA graph the copy is recorded, so every replay reads its own step's seed), and the step's keep mask for every
    layer, hashed once per micro-step from that seed. Layer `salt` reads the window of that one mask starting at
    its own offset (`keep`), so each layer's dropout is one masked multiply instead of a hash of its whole input
    (an SDXL step hashed ~1.1 G input elements, 4–5 int64 passes each: +0.13 s per step on an H200).

    Element i of layer `salt` is kept iff hash(seed, offset(salt) + i) clears p, whether read from the shared mask
    or hashed on the spot (an input larger than the mask inside a capture, where it cannot grow), so a mask never
    depends on which path made it or on the inputs seen before. The windows of different layers are shifted views
    of one random sequence: every element still has its own independent draw per layer (distinct offsets)."""

    OFFSETS = 2 ** 20  # distinct window starts: layers sharing an input (q, k, v) never share a mask
    GROWTH = 2 ** 20   # the mask grows in steps of this many elements

    def __init__(self, p: float):
        self.p = p
        self.value: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # earlier masks a recorded CUDA graph still fills and reads

    def feed(self, seed: torch.Tensor) -> None:
        if self.value is None or self.value.device != seed.device:
            self.value = seed.detach().clone()  # the first step is an eager one (probe or warm-up), never a capture
        else:
            self.value.copy_(seed)
        if self._mask is not None and self._mask.device == seed.device:
            torch.ge(self._hashed_bits(0, self._mask.numel()), self._threshold, out=self._mask)

    def keep(self, salt: int, count: int, device: torch.device) -> torch.Tensor:
        """Layer `salt`'s keep mask for an input of `count` elements (bool, flat)."""
        start = salt * 7919 % self.OFFSETS  # odd multiplier: distinct for every salt below OFFSETS
        end = start + count
        if self._mask is None or self._mask.device != device or self._mask.numel() < end:
            if _capturing(device):  # a capture may neither free a mask earlier graphs use nor own one eager steps use
                return self._hashed_bits(start, count) >= self._threshold
            self._grow(-(-end // self.GROWTH) * self.GROWTH, device)
        return self._mask[start:end]

    @property
    def _threshold(self) -> int:
        return round(self.p * 2 ** 32)

    def _grow(self, size: int, device: torch.device) -> None:
        if self._mask is not None:
            self._retired.append(self._mask)
        self.value = self.value.to(device)
        self._mask = self._hashed_bits(0, size) >= self._threshold

    def _hashed_bits(self, start: int, count: int) -> torch.Tensor:
        """32 pseudo-random bits (0 .. 2^32 - 1, int64) for elements start .. start + count - 1 of this step's
        sequence: an integer mix of (seed, index) in plain tensor ops, in place (two int64 tensors of `count` at a
        time). Every multiplier is < 2^31 and every operand < 2^32, so no product leaves int64."""
        mask = 0xFFFFFFFF
        bits = torch.arange(start, start + count, device=self.value.device, dtype=torch.int64)
        bits.mul_(0x2545F491).add_(self.value * 0x1B873593).bitwise_and_(mask)
        for multiplier, shift in ((0x7FEB352D, 15), (0x5BD1E995, 13), (0x68E31DA5, 16)):
            bits.bitwise_xor_(bits >> 16).mul_(multiplier).bitwise_and_(mask)
            bits.bitwise_xor_(bits >> shift)
        return bits


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StepSeededDropout(torch.nn.Module):
    """LoRA dropout whose mask is a hash of (the micro-step's seed, this layer, the element) instead of draws from
    a random generator. A checkpointed block's recompute then makes the forward's mask again without saving and
    restoring the generator's state, which a CUDA graph cannot capture: runs with LoRA dropout keep their graphs.
    The seed comes from the run's own generator (TrainingSession.inputs), so a seed gives the same run and a resume
    continues it exactly. Before any step has fed a seed (a layer called on its own) it draws like nn.Dropout."""

    def __init__(self, salt: int, seed: DropoutSeed):
        super().__init__()
        self.salt, self.seed = salt, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.seed.p  # the one p the masks are made with
        if not self.training or p == 0:
            return x
        if self.seed.value is None:
            return torch.nn.functional.dropout(x, p, training=True)
        keep = self.seed.keep(self.salt, x.numel(), x.device).view(x.shape)
        return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)

    def extra_repr(self) -> str:
        return f"p={self.seed.p}, salt={self.salt}"


def seed_lora_dropout(module: torch.nn.Module) -> DropoutSeed | None:
    """Where a step feeds its LoRA dropout seed; None if `module`'s LoRA has no dropout."""
    return getattr(module, "leanlora_dropout_seed", None)


def step_seeded_peft_dropout(module: torch.nn.Module) -> None:
    """Replaces peft's nn.Dropout in every LoRA layer with a StepSeededDropout sharing one DropoutSeed."""
    seed: DropoutSeed | None = None
    replaced = 0
    for layer in module.modules():
        dropouts = getattr(layer, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict) or ADAPTER not in dropouts:
            continue
        dropout = dropouts[ADAPTER]
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            seed = seed or DropoutSeed(dropout.p)  # one LoraConfig: every layer's p is the same
            dropouts[ADAPTER] = StepSeededDropout(replaced, seed)
            replaced += 1
    if replaced:
        module.leanlora_dropout_seed = seed


def step_seeded_dropouts(p: float, count: int) -> list[torch.nn.Module]:
    """`count` dropouts for the layers of a type LeanLoRA builds itself: StepSeededDropouts sharing one DropoutSeed,
    or Identity when p is 0 (no seed, so such runs draw nothing)."""
    if p == 0:
        return [torch.nn.Identity() for _ in range(count)]
    seed = DropoutSeed(p)
    return [StepSeededDropout(salt, seed) for salt in range(count)]
