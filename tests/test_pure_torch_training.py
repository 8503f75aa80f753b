"""train_lora end to end on a tiny pure-torch model through the ModelAdapter contract (trainer/model.py),
with no ComfyUI anywhere: eager training, recovery from an out-of-memory step, and Cancel (the trainer's own stop
and the host's cancel error raised inside a step). This file imports no ComfyUI, and the last test checks that
such a run loads none."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.dataset import scan_folder
from trainer.step.frozen_weights import cast_frozen_weights
from trainer.model import FamilyIdentity, ModelAdapter
from trainer.objective import TimestepSampling
from trainer.report import Recovery
from trainer.settings import Attention, FastPath, LatentCache, LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora

REPO = Path(__file__).resolve().parents[1]
LATENT_CHANNELS, CONTEXT_DIM, WIDTH = 4, 8, 16


class HostInterrupt(Exception):
    """What a host raises inside a step when its user presses Cancel (ComfyUI: InterruptProcessingException)."""


class EpsSchedule(torch.nn.Module):
    """A discrete DDPM noise schedule with eps prediction, in the terms of ComfyUI's model_sampling."""

    def __init__(self, steps: int = 100):
        super().__init__()
        betas = torch.linspace(1e-4, 2e-2, steps)
        alphas = torch.cumprod(1 - betas, 0)
        self.register_buffer("sigmas", ((1 - alphas) / alphas) ** 0.5)

    def timestep(self, sigma):
        return (sigma[:, None] - self.sigmas[None]).abs().argmin(1).view(sigma.shape)

    @staticmethod
    def _per_sample(sigma, like):
        return sigma.view(sigma.shape[:1] + (1,) * (like.ndim - 1))

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        return latent_image + noise * self._per_sample(sigma, noise)

    def calculate_input(self, sigma, noisy):
        return noisy / (self._per_sample(sigma, noisy) ** 2 + 1) ** 0.5

    def calculate_denoised(self, sigma, model_output, model_input):
        return model_input - model_output * self._per_sample(sigma, model_output)


class Attention2d(torch.nn.Module):
    """Cross-attention of latent pixels over the caption context, named as LoRA's "attention" targets expect."""

    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.to_k, self.to_v = (torch.nn.Linear(CONTEXT_DIM, WIDTH, bias=False) for _ in range(2))
        self.to_out = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))

    def forward(self, tokens, context):
        q, k, v = self.to_q(tokens), self.to_k(context), self.to_v(context)
        return tokens + self.to_out(torch.nn.functional.scaled_dot_product_attention(q, k, v))


class TinyDenoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Conv2d(LATENT_CHANNELS, WIDTH, 1)
        self.time = torch.nn.Embedding(100, WIDTH)
        self.blocks = torch.nn.ModuleList(Attention2d() for _ in range(2))
        self.proj_out = torch.nn.Conv2d(WIDTH, LATENT_CHANNELS, 1)
        self.on_forward = lambda: None  # the tests' fault injection

    def forward(self, x, timestep, context):
        self.on_forward()
        h = self.proj_in(x) + self.time(timestep.long())[:, :, None, None]
        b, c, height, width = h.shape
        tokens = h.flatten(2).transpose(1, 2)
        for block in self.blocks:
            tokens = block(tokens, context)
        return self.proj_out(tokens.transpose(1, 2).reshape(b, c, height, width))


class TinyAdapter:
    """The ModelAdapter of a pure-torch model: a fixed linear "VAE", a hashed-word "text encoder", TinyDenoiser."""

    device = torch.device("cpu")
    cancel_errors = (HostInterrupt,)
    sequence_conditioning = ("context",)
    timestep_sampling = TimestepSampling.UNIFORM
    graph_blocker = None

    def __init__(self):
        torch.manual_seed(0)
        self.model_sampling = EpsSchedule()
        self.base = TinyDenoiser()
        self.to_latent = torch.randn(3, LATENT_CHANNELS) * 0.5
        self.on_forward = lambda: None

    def describe(self) -> str:
        return "TinyDenoiser (pure torch)"

    def encode_image(self, pixels):
        pooled = torch.nn.functional.avg_pool2d(pixels.permute(0, 3, 1, 2), 8)  # [1, 3, H/8, W/8]
        return torch.einsum("bchw,cl->blhw", pooled, self.to_latent)

    def encode_text(self, caption, width, height):
        words = caption.split() or [""]
        rows = [torch.Generator().manual_seed(int(hashlib.sha256(w.encode()).hexdigest()[:8], 16)) for w in words]
        return {"context": torch.stack([torch.randn(CONTEXT_DIM, generator=g) for g in rows])[None]}

    def image_encoder_id(self) -> str:
        return "tiny-vae"

    def text_encoder_id(self) -> str:
        return "tiny-text"

    def release_encoders(self) -> None:
        pass  # nothing to unload: the encoders hold no device memory

    def training_unet(self):
        unet = TinyDenoiser()
        unet.load_state_dict(self.base.state_dict())
        unet.on_forward = lambda: self.on_forward()
        return unet.requires_grad_(False)

    def set_attention(self, backend, compiled=False):
        assert backend is Attention.AUTO
        return None

    def set_compute_dtype(self, unet, dtype):
        cast_frozen_weights(unet, dtype)

    def set_conv_layout(self, unet, device, compute_dtype):
        return None

    def checkpoint_blocks(self, unet, depth=None, latent_size=None):
        return list(unet.blocks)

    def prepare_compile_units(self, unet):
        return list(unet.blocks)

    # no layer casts per call, so nothing can be stored as fp8 or streamed: every frozen weight stays as it is
    def store_weights_fp8(self, unet) -> int:
        return 0

    def group_upcasts(self, unet) -> None:
        pass

    def stream_weights_from_cpu(self, unet, share=1.0) -> int:
        return 0

    def projected_weight_bytes(self, unet, compute_dtype, base_weights, stream_share=1.0) -> int:
        size = torch.empty((), dtype=compute_dtype).element_size()
        return sum(t.numel() * size for t in [*unet.parameters(), *unet.buffers()]
                   if t.is_floating_point() and not t.requires_grad)

    def reserved_vram(self) -> int:
        return 0

    def predict(self, unet, x, timestep, cond):
        return unet(x, timestep, cond["context"])

    def resolution_shift(self, latent_size) -> float:
        return 1.0

    def free(self, unet) -> None:
        unet.to("cpu")

    def identity(self) -> FamilyIdentity:
        return FamilyIdentity("TinyDenoiser", "tiny_denoiser", "tiny-denoiser", "pure torch")

    def lora_targets(self, unet, targets):
        return ("to_q", "to_k", "to_v", "to_out.0")

    def kohya_module_names(self):
        return None

    def diffusers_module_names(self):
        return None


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a typing.Protocol asks for."""
    return {name for name in dir(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def test_the_tiny_adapter_is_a_whole_model_adapter():
    members = protocol_members(ModelAdapter)
    assert {"cancel_errors", "predict", "store_weights_fp8", "sequence_conditioning"} <= members
    assert not members - set(dir(TinyAdapter()))


EAGER = MemorySettings("no", False, 1, 1, latent_cache=LatentCache.OFF, fast_path=FastPath.OFF)


def train(folder: Path, out: Path, adapter: TinyAdapter | None = None, memory: MemorySettings = EAGER,
          steps: int = 6, stop_after_steps: int | None = None):
    """One run on a 4-image dataset (tiny_assets writes it); returns the outcome and the progress events.
    stop_after_steps: the run's should_stop turns True once that many steps were reported (the node's Cancel)."""
    import tiny_assets
    dataset = scan_folder(tiny_assets.build_tiny_dataset(folder, n=4), 64)
    events = []
    reported = lambda: sum(event["kind"] == "step" for event in events)  # noqa: E731
    outcome = train_lora(adapter or TinyAdapter(), dataset, memory, LoraSettings(rank=4, alpha=4.0),
                         TrainSettings(steps=steps, learning_rate=1e-3, seed=0, output_name="tiny"), out,
                         lambda **event: events.append(event),
                         lambda: stop_after_steps is not None and reported() >= stop_after_steps)
    return outcome, events


def test_eager_training_saves_a_kohya_lora_of_every_step(tmp_path):
    outcome, events = train(tmp_path / "data", tmp_path / "loras")
    assert not outcome.partial and len(outcome.losses) == 6 and outcome.recoveries == []
    assert outcome.lora_path == tmp_path / "loras" / "tiny.safetensors"
    saved = load_file(outcome.lora_path)
    # rank 4 down/up and alpha for q, k, v and out of both blocks: the LoRA trained what the settings name
    assert len(saved) == 2 * 4 * 3 and all(torch.isfinite(t).all() for t in saved.values())
    assert all(key.startswith("lora_unet_blocks_") for key in saved)
    # the typed report: settings kept, the estimate's exact static terms (on the CPU nothing is probed)
    assert outcome.run.used == EAGER and outcome.run.steps_done == 6 and outcome.run.estimate.total is None
    lora_weights = sum(t.numel() for key, t in saved.items() if key.endswith(("lora_down.weight", "lora_up.weight")))
    assert outcome.run.estimate.lora_parameters == 4 * lora_weights  # fp32 while training
    assert any(t.abs().sum() > 0 for key, t in saved.items() if "lora_up" in key)  # trained away from zero init
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]


def test_an_out_of_memory_step_moves_down_the_ladder_and_training_goes_on(tmp_path):
    adapter = TinyAdapter()
    calls = {"n": 0}

    def third_forward_runs_out():
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    adapter.on_forward = third_forward_runs_out
    memory = MemorySettings("no", False, 2, 1, latent_cache=LatentCache.OFF, fast_path=FastPath.OFF)
    outcome, events = train(tmp_path / "data", tmp_path / "loras", adapter, memory)
    # batches of 2: steps 1 and 2 ran, step 3's forward failed and was repeated as 2 micro-batches of 1
    assert outcome.run.recoveries == [Recovery(3, "batch 2 -> 1 with gradient accumulation 2 (effective batch stays 2)")]
    assert outcome.run.requested == memory and outcome.run.steps_done == 6
    assert (outcome.run.used.batch_size, outcome.run.used.gradient_accumulation) == (1, 2)
    assert outcome.recoveries == [f"step 3: out of memory -> {outcome.run.recoveries[0].rung}"]
    assert not outcome.partial and len(outcome.losses) == 6 and outcome.lora_path.exists()
    assert calls["n"] == 2 + 1 + 4 * 2  # 2 steps, the failed forward, 4 steps of 2 micro-batches
    assert any(e["kind"] == "phase" and "recovered (out of memory)" in e["text"] for e in events)


def _assert_partial_after(outcome, steps: int):
    assert outcome.partial and len(outcome.losses) == steps
    assert outcome.run.cancelled and outcome.run.steps_done == steps and outcome.run.used == EAGER
    assert outcome.lora_path.name == f"tiny_partial_step{steps}.safetensors"
    assert all(torch.isfinite(t).all() for t in load_file(outcome.lora_path).values())
    assert f"CANCELLED after step {steps}: partial LoRA (what was learned so far) saved" in outcome.report


def test_cancel_keeps_what_was_learned(tmp_path):
    outcome, _ = train(tmp_path / "data", tmp_path / "loras", steps=50, stop_after_steps=3)
    _assert_partial_after(outcome, 3)


def test_the_hosts_cancel_error_inside_a_step_keeps_what_was_learned(tmp_path):
    adapter, calls = TinyAdapter(), {"n": 0}

    def host_cancels_in_the_fourth_forward():
        calls["n"] += 1
        if calls["n"] == 4:
            raise HostInterrupt("processing interrupted")
    adapter.on_forward = host_cancels_in_the_fourth_forward
    outcome, _ = train(tmp_path / "data", tmp_path / "loras", adapter, steps=50)
    _assert_partial_after(outcome, 3)


def test_a_run_loads_no_comfyui(tmp_path):
    """In a fresh process where ComfyUI cannot even be imported, a run trains and saves, and no ComfyUI module
    was loaded (pytest's own process may hold ComfyUI from other test files)."""
    comfyui = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "nodes", "latent_preview")
    code = (f"import sys\nsys.path[:0] = {[str(REPO), str(REPO / 'tests'), str(REPO / 'scripts')]!r}\n"
            f"for name in {comfyui!r}: sys.modules[name] = None  # any import of them fails\n"
            "from pathlib import Path\nimport test_pure_torch_training as t\n"
            f"outcome, _ = t.train(Path({str(tmp_path)!r}) / 'data', Path({str(tmp_path)!r}) / 'loras', steps=2)\n"
            "assert outcome.lora_path.exists() and len(outcome.losses) == 2\n"
            f"loaded = [m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in {comfyui!r}]\n"
            "assert not loaded, loaded\nprint('trained without ComfyUI')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "trained without ComfyUI" in result.stdout, result.stderr[-3000:]


def test_a_cuda_graph_too_big_for_the_card_takes_a_rung_instead_of_eager_steps(tmp_path, monkeypatch):
    """Under auto-fit a first graph whose pool does not fit the card (micro_steps.GraphDoesNotFit, raised after
    the eager warm-up measured it) is recovered like an out-of-memory step: the next rung, the step repeated, the
    report naming why. At the bottom of the ladder the run goes on with eager steps instead of failing."""
    from trainer.memory import fit, host_ram
    from trainer.step.micro_steps import GraphDoesNotFit
    too_big = "the graph's own memory pool (~5.10 GiB) does not fit the 11.02 GiB limit"

    def first_forward_has_no_room_for_its_graph(adapter):
        calls = {"n": 0}

        def on_forward():
            calls["n"] += 1
            if calls["n"] == 1:
                raise GraphDoesNotFit(too_big)
        adapter.on_forward = on_forward
        return adapter

    memory = MemorySettings("no", False, 2, 1, latent_cache=LatentCache.OFF, fast_path=FastPath.OFF)
    outcome, events = train(tmp_path / "data", tmp_path / "loras", first_forward_has_no_room_for_its_graph(
        TinyAdapter()), memory)
    rung = "batch 2 -> 1 with gradient accumulation 2 (effective batch stays 2)"
    assert outcome.run.recoveries == [Recovery(1, rung, "the CUDA graph would not fit the card")]
    assert outcome.recoveries == [f"step 1: the CUDA graph would not fit the card -> {rung}"]
    assert outcome.run.steps_done == 6 and not outcome.partial and outcome.lora_path.exists()
    assert any(e["kind"] == "phase" and e["text"] == f"recovered (the CUDA graph would not fit the card): {rung}"
               for e in events)

    monkeypatch.setattr(fit, "next_rung", lambda memory, device: None)  # nothing left to trade
    monkeypatch.setattr(host_ram, "next_rung", lambda memory, device: None)  # the walk within the ram limit too
    outcome, _ = train(tmp_path / "data2", tmp_path / "loras2", first_forward_has_no_room_for_its_graph(
        TinyAdapter()), memory)
    assert outcome.run.steps_done == 6 and not outcome.partial and outcome.lora_path.exists()
    assert outcome.recoveries == ["step 1: the CUDA graph would not fit the card -> steps run eagerly (nothing left "
                                  "on the memory ladder to make room for the CUDA graph)"]
    assert f"fast path: CUDA graphs off: {too_big}, and no memory setting is left to trade for it; steps run " \
           "eagerly" in outcome.report


def test_the_final_samples_and_what_follows_train_find_the_training_state_released(tmp_path, monkeypatch):
    """The whole job fits the card: the final LoRA's samples (and the KSampler after Train) render after the
    optimizer state, the LoRA gradients and the training copy were let go, not beside them. The session refers
    to itself through its bound step functions, so release must not wait for the garbage collector (disabled
    here); the training copy goes at the next collection (it is moved off the device before that)."""
    import gc
    import weakref
    import tiny_assets
    from trainer import session as session_module
    held, alive_at_final_sample = {}, []

    class Tracked(TinyAdapter):
        def training_unet(self):
            unet = super().training_unet()
            held["unet"] = weakref.ref(unet)
            return unet

    real_build = session_module.build_optimizer

    def tracked_build(*args, **kwargs):
        optimizer, note = real_build(*args, **kwargs)
        held["optimizer"] = weakref.ref(optimizer)
        held["gradients"] = [weakref.ref(p) for p in args[1]]  # the LoRA parameters: their .grad must be gone
        return optimizer, note

    def on_sample(step, state_dict, _pace):
        if step == 4:  # the final LoRA's samples
            alive_at_final_sample.append(held["optimizer"]() is not None)
            alive_at_final_sample.append(any(ref() is not None and ref().grad is not None
                                             for ref in held["gradients"]))
        return []

    monkeypatch.setattr(session_module, "build_optimizer", tracked_build)
    dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "data", n=4), 64)
    gc.collect()
    gc.disable()
    try:
        outcome = train_lora(Tracked(), dataset, EAGER, LoraSettings(rank=4, alpha=4.0),
                             TrainSettings(steps=4, learning_rate=1e-3, seed=0, output_name="tiny"),
                             tmp_path / "loras", lambda **event: None, lambda: False, sample_every=2,
                             on_sample=on_sample)
    finally:
        gc.enable()
    assert alive_at_final_sample == [False, False], "optimizer / gradients still held at the final samples"
    gc.collect()
    assert held["unet"]() is None, "something still refers to the training copy"
    assert outcome.lora_path.exists() and all(t.device.type == "cpu" for t in outcome.lora_state_dict.values())
