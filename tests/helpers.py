"""Small torch modules shaped like ComfyUI's UNet (input_blocks.N.attn1.to_q ...), so LoRA targets and kohya keys
are realistic in unit tests."""
import threading
from pathlib import Path

import torch

from leanlora.library import import_as_package

REPO = Path(__file__).resolve().parents[1]
PACK = "leanlora_nodes_under_test"


def node_module(name: str):
    """nodes/<name>.py imported as a pack submodule (its relative imports work) without running nodes/__init__.py,
    which imports every node (and ComfyUI with the Train node): under a name of the tests' own."""
    return import_as_package(PACK, REPO, f"nodes.{name}")


# The modules the SD-UNet family puts LoRA on per target preset (bridge/families/sd_unet.LORA_TARGETS), which the
# tiny nets here are named like. A copy, so trainer-only tests import no ComfyUI; test_families.py checks they agree.
SD_TARGETS = {
    "attention": ("to_q", "to_k", "to_v", "to_out.0"),
    "attention+feed-forward": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
}


def sd_targets(settings) -> tuple[str, ...]:
    """What inject_lora gets for `settings` on a model named like ComfyUI's UNet."""
    return SD_TARGETS[settings.targets.value]


class Attention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Dropout(0.0))

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        return self.to_out(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)


class TinyNet(torch.nn.Module):
    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.input_blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"attn1": Attention(dim)}) for _ in range(depth))

    def forward(self, x):
        for block in self.input_blocks:
            x = x + block["attn1"](x)
        return x


def regression_problem(seed: int = 0):
    """A TinyNet with LoRA learning another TinyNet's outputs: (net, LoRA params, endless batches, (x, y))."""
    from trainer.lora import inject_lora
    from trainer.settings import LoraSettings
    torch.manual_seed(seed)
    net = TinyNet()
    params = inject_lora(net, LoraSettings(rank=4, alpha=4.0), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4.0)))
    target = TinyNet()
    x = torch.randn(64, 5, 16)
    with torch.no_grad():
        y = target(x)

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            idx = torch.randint(0, 64, (8,), generator=g)
            yield x[idx], y[idx]
    return net, params, data(), (x, y)


def in_a_training_thread(work):
    """Runs `work` in a fresh thread (normal mode, like the training job) and returns its result or raises its
    error."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def optimizer_state_tensor_bytes(optimizer) -> int:
    """Bytes of an optimizer's state tensors, each storage once, 0-dim step counters and RMS scalars left out (as
    trainer.optimizers.optimizer_state_bytes counts them)."""
    import torch
    sizes = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                sizes[value.untyped_storage().data_ptr()] = value.numel() * value.element_size()
    return sum(sizes.values())


def loop_events(**hooks):
    """A loop.LoopEvents with the given methods and settings (on_step=seen.append, sync_every=5, ...)."""
    from trainer.loop import LoopEvents
    events = LoopEvents()
    events.__dict__.update(hooks)
    return events
