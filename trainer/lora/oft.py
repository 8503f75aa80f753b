"""OFT (Qiu et al. 2023, LyCORIS' `algo=diag-oft`): each layer's weight rotated, W' = R W, R block-diagonal and
orthogonal, each block the Cayley transform of a skew-symmetric matrix: Q = B - B^T, R_k = (I + Q_k)(I - Q_k)^-1.
Keys `oft_blocks` (block count, block size, block size) and `alpha`, as LyCORIS writes them and ComfyUI's
comfy/weight_adapter/oft.py reads them; its loader computes W'_k = R_k^T W_k on the k-th block of output rows.

`rank` is LyCORIS' `lora_dim` for OFT, the block size: each layer's output width is split by LyCORIS'
factorisation (the one LoKr uses) into blocks of `rank` rows where rank divides the width and rank^2 does not
exceed it; else into blocks of a divisor of the width at most rank and at most its square root (a 320-wide layer
at rank 24 gets blocks of 16, a 3072-wide one at rank 64 blocks of 48), as LyCORIS does. The file holds the
shapes, which is all ComfyUI reads. Blocks of 1 (rank 1, or a prime width) cannot rotate: refused.

`alpha` is OFT's constraint (COFT), as ComfyUI applies it: Q is scaled down to Frobenius norm alpha (over all
blocks of the layer) when larger. (LyCORIS trains with alpha times the width but stores alpha; LeanLoRA trains
with what ComfyUI applies.) LyCORIS' optional `rescale` is not trained.

The layer never rotates the weight: R W x = R (W x), so it rotates the base layer's output, block by block
(`base_layer(x)` less its bias; the base layer computes as it always does, fp8 or streamed). That costs an
(out x block size) product per token and keeps the base output for the blocks' gradient, like LoRA keeps its
input; a rotated weight would cost a full out x in copy of every layer plus a weight-sized gradient product."""
from __future__ import annotations

import torch

from ..errors import LeanLoRAError
from ..settings import AdapterKind, LoraSettings
from .base import AdapterLinear, AdapterType, _in_compute_dtype, adapter_layers, check_shape, wrap_targets
from .lokr import factorization

EPS = 1e-8  # added to the norm of Q before the constraint, as LyCORIS and ComfyUI do


class OftLinear(AdapterLinear):
    """`base_layer(x) + (R^T - I) (W x)` per block of outputs: what ComfyUI's loader makes of the exported
    blocks, W' = W + (R^T - I) W. The step-seeded dropout, if any, drops elements of W x on that second path."""

    def __init__(self, base_layer: torch.nn.Linear, dropout: torch.nn.Module, rank: int, alpha: float):
        super().__init__(base_layer, dropout)
        block_size, block_num = factorization(self.out_features, rank)
        if block_size == 1:  # Q = B - B^T of a 1 x 1 block is zero: such a layer would never learn
            raise LeanLoRAError(f"LoRA Config's rank {rank}: OFT splits each layer's output width into blocks of at "
                                f"most rank rows (the block size), and a layer {self.out_features} wide gets blocks "
                                "of 1, which cannot rotate: set rank to 2 or more (4-32 is usual for OFT)")
        self.constraint = float(alpha)
        # zero blocks: Q = 0, R = I, so the layer starts as the base layer (LyCORIS' and ComfyUI's initialisation)
        self.oft_blocks = torch.nn.Parameter(
            torch.zeros(block_num, block_size, block_size, device=base_layer.weight.device))

    def rotation_less_identity(self) -> torch.Tensor:
        """R_k - I for every block (fp32), the constraint as ComfyUI applies it: `if |Q| > alpha: Q *= alpha / |Q|`
        as a clamp, so the step holds no data-dependent branch (a CUDA graph or compiled step keeps it)."""
        blocks = self.oft_blocks.float()
        q = blocks - blocks.transpose(1, 2)
        q = q * (self.constraint / (torch.linalg.vector_norm(q) + EPS)).clamp(max=1.0)
        eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
        # (I + Q)(I - Q)^-1 = (I - Q)^-1 (I + Q) (they commute): one solve; I - Q is never singular (Q skew), so
        # the `_ex` form skips the info check, a host sync
        rotation = torch.linalg.solve_ex(eye - q, eye + q)[0]
        return rotation - eye

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        turn = _in_compute_dtype(self.rotation_less_identity(), out)
        bias = _computed_bias(self.base_layer, out)
        if isinstance(self.lora_dropout, torch.nn.Identity):
            # (R^T - I)(out - b) as rot(out) - rot(b): autograd keeps `out` (which the next layer keeps too)
            # instead of a second activation-sized tensor
            delta = self._rotate(out, turn)
            return out + (delta if bias is None else delta - self._rotate(bias, turn))
        return out + self._rotate(self.lora_dropout(out if bias is None else out - bias), turn)

    def _rotate(self, rows: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
        """y_k -> (R_k - I)^T y_k for each block k of the last axis (ComfyUI's einsum `k n m, k n ... -> k m ...`
        on the weight, moved to the output)."""
        blocks = rows.unflatten(-1, turn.shape[:2])
        return torch.einsum("...kn,knm->...km", blocks, turn).flatten(-2)


def _computed_bias(base: torch.nn.Linear, out: torch.Tensor) -> torch.Tensor | None:
    """The bias as the base layer's forward adds it (a streamed one from CPU RAM, ComfyUI's `bias_function`s
    applied), in the output's dtype. Frozen: no gradient."""
    bias = getattr(base, "bias", None)
    if bias is None:
        return None
    with torch.no_grad():
        bias = bias.to(out.device, out.dtype, non_blocking=True)
        for function in getattr(base, "bias_function", ()) or ():
            bias = function(bias)
        return bias


class Oft(AdapterType):
    kind, label = AdapterKind.OFT, "OFT"
    prefixes = ("oft_",)
    file_parts = required_parts = key_parts = ("oft_blocks",)
    network_module = "lycoris.kohya"

    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        wrap_targets(module, settings, target_modules, self.label,
                     lambda layer, dropout: OftLinear(layer, dropout, settings.rank, settings.alpha))

    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return adapter_layers(module, OftLinear)

    def export(self, layer: OftLinear, settings: LoraSettings) -> dict[str, torch.Tensor]:
        return {"oft_blocks": layer.oft_blocks, "alpha": torch.tensor(float(settings.alpha))}

    def load(self, layer: OftLinear, parts: dict[str, torch.Tensor], where: str) -> None:
        blocks = parts["oft_blocks"]
        if blocks.dim() == 4:
            raise LeanLoRAError(f"{where} is a BOFT file (butterfly OFT, 4-dimensional oft_blocks), which LeanLoRA "
                                "does not train; pick an OFT (diag-oft) file or train a new one")
        check_shape(where, "oft_blocks", blocks, tuple(layer.oft_blocks.shape),
                    "It was made for another model or rank (OFT's block size): set LoRA Config's rank as the file "
                    "was trained (its ss_network_dim says it) or pick another file")
        if "alpha" in parts:  # the constraint changes what the blocks compute: the file's must be the settings'
            alpha = float(parts["alpha"])
            if abs(alpha - layer.constraint) > 1e-3 * max(abs(alpha), abs(layer.constraint)):
                raise LeanLoRAError(f"{where} has alpha {alpha:g} (OFT's constraint); LoRA Config says alpha "
                                    f"{layer.constraint:g}: set alpha to {alpha:g} or pick another file")
        layer.oft_blocks.copy_(blocks.float())

    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return None  # several ranks split a width alike (LyCORIS' factorisation): the blocks' shapes decide (load)

    def network_args(self, settings: LoraSettings) -> dict[str, str]:
        # LyCORIS' words; `constraint` is what ComfyUI applies (the file's alpha), not LyCORIS' alpha x width
        return {"algo": "diag-oft", "constraint": str(settings.alpha), "rescaled": "False"}


OFT = Oft()
