"""Host RAM planned like VRAM (issue 44 item 5; trainer/memory/host_ram.py): Memory Settings' `ram` limit, the
host RAM estimate of a plan against the job's measured resident peak, auto-fit leaving out what the limit cannot
hold, a plan over it refused before step 1, and the limit from the widget or a config file through to the report.
CPU only: a simulated card (trainer/device/card.py) stands for the GPU where the plan needs one."""
from __future__ import annotations

import gc

import pytest
import torch

from leanlora import cli, config, library
from test_pure_torch_training import EAGER, TinyAdapter, train
from trainer.errors import LeanLoRAError
from trainer.device.card import GIB, SimulatedCard
from trainer.memory.host_ram import HostRamPlan
from trainer.settings import AutoFit, BaseWeights, LatentCache, MemorySettings, RamLimit
from helpers import node_module

MIB = 2 ** 20


class BallastAdapter(TinyAdapter):
    """TinyAdapter whose training copy also holds `ballast` bytes of frozen fp32 weights of its own (a copy made
    for training, as a model the host application does not share would be), so host RAM is measurable."""

    def __init__(self, ballast: int):
        super().__init__()
        self.ballast = ballast

    def training_unet(self):
        unet = super().training_unet()
        side = 2048
        layers = max(1, self.ballast // (side * side * 4))
        torch.manual_seed(1)
        unet.ballast = torch.nn.ModuleList(torch.nn.Linear(side, side, bias=False) for _ in range(layers))
        return unet.requires_grad_(False)


def test_the_host_ram_estimate_of_a_run_is_its_measured_resident_peak_within_the_stated_tolerance(tmp_path):
    """A CPU run whose training copy holds 256 MiB of weights of its own: the estimate (the copy, the latent cache,
    the LoRA and optimizer state a CPU run keeps in RAM) against how far the job's resident set rose. Tolerance:
    the measured rise is within 5% of the estimate, + 32 MiB above it for what PyTorch's CPU kernels, autograd and
    the allocator take beside the counted tensors (measured: 255.8 MiB risen for 256.0 estimated)."""
    gc.collect()
    outcome, _ = train(tmp_path / "data", tmp_path / "loras", BallastAdapter(256 * MIB), EAGER, steps=3)
    estimated, grown = outcome.run.host_ram.total, outcome.run.host_ram_grown
    assert outcome.run.host_ram.training_copy >= 256 * MIB
    assert grown is not None and 0.95 * estimated <= grown <= 1.05 * estimated + 32 * MIB, \
        f"estimated {estimated / MIB:.0f} MiB, the job's resident set rose {grown / MIB:.0f} MiB"
    assert f"host RAM estimate (GiB): training copy's own tensors {outcome.run.host_ram.training_copy / GIB:.2f}" \
        in outcome.report
    assert f"host RAM of this job: peak {outcome.run.host_ram_peak / GIB:.2f} GiB resident, {grown / GIB:.2f} GiB " \
           f"above its start; estimated {estimated / GIB:.2f} GiB" in outcome.report


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    import tiny_dit_assets
    return tiny_dit_assets.build_family(tmp_path_factory.mktemp("ram_flux"), "flux_dev")


def test_streamed_fp8_copies_of_a_comfyui_model_are_the_host_bytes_streaming_keeps(tiny_flux):
    """FLUX.1's tiny model as ComfyUI loads it (not fp8): the estimate of fp8 weights streamed at 40% is the host
    bytes the converted, streamed layers hold once the rest is placed on the (simulated) card, none of it ComfyUI's
    own memory; the copy's own tensors before placement are none (it shares ComfyUI's), and an fp8 file's streamed
    weights are ComfyUI's pages: no copy."""
    import tiny_dit_assets
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.step.frozen_weights import place_on_device
    memory = MemorySettings("bf16", True, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.4)
    adapter = ComfyAdapter(*tiny_dit_assets.load_family(tiny_flux, "flux_dev", {}))
    unet = adapter.training_unet()
    with SimulatedCard(gib=1.0, context_gib=0.0).installed():
        estimate = HostRamPlan(adapter, unet, [], RamLimit()).estimate(memory)
        assert estimate.training_copy == 0 and estimate.streamed > 0
        adapter.set_compute_dtype(unet, torch.bfloat16)
        adapter.store_weights_fp8(unet)
        adapter.stream_weights_from_cpu(unet, memory.stream_share)
        place_on_device(unet, torch.device("cpu"))
        comfy = adapter.shared_host_storages()
        streamed = sum(t.numel() * t.element_size() for layer in unet.modules()
                       if getattr(layer, "leanlora_streamed", False)
                       for t in (layer.weight, getattr(layer, "bias", None))
                       if t is not None and t.untyped_storage().data_ptr() not in comfy)
        fp8_file = ComfyAdapter(*tiny_dit_assets.load_family(tiny_flux, "flux_dev", {"dtype": torch.float8_e4m3fn}))
        assert HostRamPlan(fp8_file, fp8_file.training_unet(), [], RamLimit()).estimate(memory).streamed == 0
    assert streamed == estimate.streamed


def test_weights_a_rung_parks_go_back_to_comfyuis_own_pages_not_to_host_copies(tiny_flux):
    """An fp8 file (FLUX.1's tiny model loaded as fp8_e4m3fn) streamed at 40% and placed; then a rung that streams
    80% parks every placed weight (park_frozen_on_cpu) and places the rest again, and the run's end takes the placed
    ones home (move_to_host). Each time the weights that were ComfyUI's go back to ComfyUI's own storages, same
    values: the copy's own host bytes stay what they were after the first placement (before: every parked weight
    became a copy, and the layers streamed from the second rung on stayed copies: Qwen-Image at 8 GiB ~2 GiB), and
    the streamed layers hold what the estimate counts for an fp8 file's, nothing. A weight whose device data
    changed after placement (here cast) comes back as a copy of what it holds now."""
    import tiny_dit_assets
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.step.frozen_weights import move_to_host, park_frozen_on_cpu, place_on_device
    adapter = ComfyAdapter(*tiny_dit_assets.load_family(tiny_flux, "flux_dev", {"dtype": torch.float8_e4m3fn}))
    unet = adapter.training_unet()
    comfy = adapter.shared_host_storages()
    frozen = [t for t in [*unet.parameters(), *unet.buffers()] if not t.requires_grad]
    with SimulatedCard(gib=1.0, context_gib=0.0).installed() as card:
        def own_host_bytes(tensors) -> int:  # host storages of the copy that are not ComfyUI's, each once
            own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                   if not card.holds(t) and t.untyped_storage().data_ptr() not in comfy}
            return sum(own.values())

        def streamed(module) -> list[torch.Tensor]:
            return [t for layer in module.modules() if getattr(layer, "leanlora_streamed", False)
                    for t in (layer.weight, getattr(layer, "bias", None)) if t is not None]
        adapter.set_compute_dtype(unet, torch.bfloat16)
        adapter.store_weights_fp8(unet)
        adapter.stream_weights_from_cpu(unet, 0.4)
        place_on_device(unet, torch.device("cpu"))
        placed = [t for t in frozen if card.holds(t)]
        values = [t.detach().clone() for t in placed]
        own_placed = own_host_bytes(frozen)
        assert placed and own_host_bytes(streamed(unet)) == 0

        park_frozen_on_cpu(unet)
        assert own_host_bytes(frozen) == own_placed, "parking made host copies of ComfyUI's weights"
        assert all(torch.equal(t, v) for t, v in zip(placed, values))
        memory = MemorySettings("bf16", True, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.8)
        adapter.stream_weights_from_cpu(unet, memory.stream_share)
        place_on_device(unet, torch.device("cpu"))
        more = streamed(unet)
        assert len(more) > len([t for t in placed if not card.holds(t)])
        assert own_host_bytes(more) == HostRamPlan(adapter, unet, [], RamLimit()).estimate(memory).streamed == 0

        still = [t for t in frozen if card.holds(t)]
        changed = still[0]
        changed.data = card.place(changed.data.to(torch.bfloat16))  # a cast on the device after placement
        move_to_host(unet)
        assert not any(card.holds(t) for t in frozen)
        assert own_host_bytes(frozen) == own_placed + changed.numel() * changed.element_size()
        assert changed.dtype == torch.bfloat16 and changed.untyped_storage().data_ptr() not in comfy
    assert all(torch.equal(t, v) for t, v in zip(placed, values) if t is not changed)


def _comfy_linear(rows: int, columns: int, dtype: torch.dtype) -> torch.nn.Module:
    import comfy.ops
    torch.manual_seed(0)
    layer = comfy.ops.disable_weight_init.Linear(columns, rows, bias=False, dtype=dtype)
    layer.weight.data.normal_(0, 0.02)
    return torch.nn.Sequential(layer).requires_grad_(False)


def test_fp8_conversion_converts_chunk_by_chunk_to_the_whole_weights_numbers():
    """store_weights_fp8 converts FP8_CONVERSION_CHUNK elements at a time: the fp8 values (bit for bit) and the scale
    are those of the whole weight's `(w.float() / (absmax / 448)).to(fp8)`, for bf16 and fp32 weights over several
    chunks, and an fp32 weight (whose .float() is itself) is left as it was."""
    from bridge.cast_weights import store_weights_fp8
    from trainer.step.frozen_weights import FP8_CONVERSION_CHUNK, FP8_SCALE_VALUE
    for dtype in (torch.bfloat16, torch.float32):
        module = _comfy_linear(2 * FP8_CONVERSION_CHUNK // 2049 + 7, 2049, dtype)  # two chunks and a part
        layer = module[0]
        original = layer.weight.detach().clone()
        scale = original.abs().max().item() / torch.finfo(torch.float8_e4m3fn).max
        whole = (original.float() / scale).to(torch.float8_e4m3fn)
        before = layer.weight
        store_weights_fp8(module)
        assert layer.weight.numel() > 2 * FP8_CONVERSION_CHUNK
        assert getattr(layer, FP8_SCALE_VALUE) == float(torch.tensor(scale, dtype=torch.float32))  # its fp32 buffer's
        assert torch.equal(layer.weight.view(torch.uint8), whole.view(torch.uint8)), dtype
        assert torch.equal(before, original), dtype


def _peak_rss_reset() -> bool:
    """Resets this process's peak resident set (VmHWM) to its resident set now (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def test_the_fp8_conversion_of_a_large_layer_takes_the_host_ram_the_estimate_counts():
    """A bf16 8192x8192 layer (64M elements, FLUX.1's largest has 66M) converted to fp8: the process's peak resident
    set rises by the fp8 copy and one chunk's fp32 temporary (what host_ram's estimate counts for the conversion),
    within 16 MiB for the allocator, where converting it whole held two fp32 temporaries of it (512 MiB)."""
    from bridge.cast_weights import store_weights_fp8
    from trainer.memory.host_ram import FP8_CONVERSION_TEMPORARY
    from trainer.step.frozen_weights import FP8_CONVERSION_CHUNK
    store_weights_fp8(_comfy_linear(4096, 2048, torch.bfloat16))  # once before: threads and allocator arenas exist
    module = _comfy_linear(8192, 8192, torch.bfloat16)
    gc.collect()
    if not _peak_rss_reset():
        pytest.skip("this system cannot reset the peak resident set (/proc/self/clear_refs)")
    start = _status_bytes("VmRSS")
    store_weights_fp8(module)
    risen = _status_bytes("VmHWM") - start
    elements = module[0].weight.numel()
    counted = elements + FP8_CONVERSION_TEMPORARY * min(elements, FP8_CONVERSION_CHUNK)
    assert risen <= counted + 16 * MIB, f"peak rose {risen / MIB:.0f} MiB, counted {counted / MIB:.0f} MiB"
    assert counted < 2 * 4 * elements // 4


def test_fp8_copies_lie_on_pages_of_their_own_so_streaming_page_locks_them_in_place():
    """A bf16 file's weights converted to fp8 in a training thread of a process that has freed a 30 MiB tensor
    (glibc then puts tensors up to 32 MiB side by side in its heaps): every fp8 copy of PIN_IN_PLACE_MIN bytes or more
    starts on a page and shares no page with another, so pin_in_place can register each where it lies (the driver
    refuses a range whose page another registered tensor holds; a pinned copy, rounded up to a power of two, was made
    instead). Plain torch.empty tensors of the same sizes share pages there in a fresh process. Placed on
    the GPU, a copy's host memory goes back to the system at once: freeing them lowers the resident set by their
    bytes."""
    import threading
    from bridge.cast_weights import store_weights_fp8
    from trainer.device.card import PIN_IN_PLACE_MIN
    page = 4096
    sizes = [(3072, 3072), (1536, 3072), (3072, 3072), (9216, 3072 // 2), (512, 1024)]  # 9, 4.5, 9, 13.5, 0.5 MiB

    def shared_pages(tensors) -> int:
        spans = sorted((t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors)
        return sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if (end - 1) // page >= start // page)
    found = {}

    def convert():
        freed = torch.empty(30 * MIB, dtype=torch.uint8)
        del freed  # raises glibc's mmap threshold: tensors up to 30 MiB now come from its heaps
        found["plain"] = shared_pages([torch.empty(r * c, dtype=torch.uint8) for r, c in sizes])
        module = torch.nn.Sequential(*(_comfy_linear(r, c, torch.bfloat16)[0] for r, c in sizes)).requires_grad_(False)
        store_weights_fp8(module)
        found["module"] = module
    worker = threading.Thread(target=convert)
    worker.start()
    worker.join()
    weights = [layer.weight for layer in found.pop("module")]
    large = [w for w in weights if w.numel() >= PIN_IN_PLACE_MIN]
    # the premise (plain tensors of these sizes share pages there) holds in a fresh process but depends on what the
    # heap went through before (in the whole suite it sometimes does not): the fp8 copies must not share either way
    assert len(large) == 4 and all(w.dtype == torch.float8_e4m3fn and w.data_ptr() % page == 0 for w in large)
    assert shared_pages(large) == 0, f"fp8 copies share pages (plain tensors of these sizes shared {found['plain']})"
    held = sum(w.numel() for w in large)
    before = _status_bytes("VmRSS")
    del weights, large
    gc.collect()
    assert before - _status_bytes("VmRSS") >= 0.9 * held


def _plan(ram: RamLimit) -> HostRamPlan:
    adapter = BallastAdapter(0)
    return HostRamPlan(adapter, adapter.training_unet(), [], ram)


def test_a_ram_limit_without_room_for_the_offload_buffers_makes_auto_fit_stream_instead():
    """At the ladder's activation-offload rung (fp8 weights, AdamW8bit, every block recomputed) on a card: with
    room in host RAM for what one forward pass offloads, offload is the next rung; without it, the rung after
    (streaming from CPU) with offload left off, and the report says why."""
    memory = MemorySettings("bf16", True, optimizer="AdamW8bit", base_weights=BaseWeights.FP8)
    offloaded = 512 * MIB
    with SimulatedCard(gib=1.0, context_gib=0.0).installed():
        roomy = _plan(RamLimit(4))
        taken, _ = roomy.next_rung_within(memory, offloaded)
        assert taken.activation_offload and taken.base_weights is BaseWeights.FP8 and not roomy.lines
        tight = _plan(RamLimit(0.25))
        instead, description = tight.next_rung_within(memory, offloaded)
        assert not instead.activation_offload and instead.base_weights is BaseWeights.FP8_STREAMED
        assert description.startswith("frozen base weights streamed from CPU memory")
        assert tight.lines == ["auto-fit: activation offload left out: with it the run would take 0.50 GiB of host "
                               "RAM, over the 0.25 GiB limit (ram 0.25 GiB)"]
        # the walk goes on from there: offload stays out, streaming grows
        further, _ = tight.next_rung_within(instead)
        assert not further.activation_offload and further.stream_share > instead.stream_share


def _settings(card: AutoFit | None, ram: RamLimit) -> MemorySettings:
    return MemorySettings("no", False, 1, 1, latent_cache=LatentCache.OFF, fast_path="off", ram=ram,
                          **({"auto_fit": card} if card else {}))


def test_a_plan_auto_fit_cannot_fit_in_the_ram_limit_is_refused_before_step_1_naming_the_numbers(tmp_path):
    """Auto-fit on a (simulated) card with a `ram` limit below what the training copy alone holds: refused before
    any step, naming the RAM needed, the limit and what to change; no LoRA is written."""
    card = SimulatedCard(gib=1.0, context_gib=0.0)
    memory = _settings(AutoFit(card_gib=1.0), RamLimit(0.01))
    with card.installed(), pytest.raises(LeanLoRAError) as refused:
        train(tmp_path / "data", tmp_path / "loras", BallastAdapter(32 * MIB), memory, steps=2)
    message = str(refused.value)
    assert message.startswith("host RAM: this run needs about 0.03 GiB of host RAM (training copy's own tensors "
                              "0.03 GiB"), message
    assert "the limit is 0.01 GiB (ram 0.01 GiB), and no plan auto-fit can choose needs less. Before step 1, " \
           "nothing trained" in message
    assert "close other programs or unload other models to free RAM, or raise `ram`" in message
    assert not list((tmp_path / "loras").glob("*.safetensors"))
    refused.value.__cause__ = refused.value.__context__ = refused.value.__traceback__ = None
    del refused
    gc.collect()
    assert card.allocated() == 0


def test_settings_given_as_they_are_run_as_set_over_the_ram_limit_with_a_warning(tmp_path):
    outcome, events = train(tmp_path / "data", tmp_path / "loras", BallastAdapter(32 * MIB),
                            _settings(None, RamLimit(0.01)), steps=2)
    assert not outcome.partial and len(outcome.losses) == 2 and outcome.lora_path.is_file()
    assert outcome.run.host_ram.total > outcome.run.host_ram_limit == int(0.01 * GIB)
    warning = next(line for line in outcome.report.split("\n") if line.startswith("WARNING: host RAM"))
    assert "the settings run as set (card manual)" in warning
    assert any(event["kind"] == "phase" and event["text"] == warning for event in events)


class PackAdapter(TinyAdapter):
    """TinyAdapter for the node's own trainer: its enums are the pack's (imported under the tests' package name)."""

    def __init__(self, pack_objective):
        super().__init__()
        self.timestep_sampling = pack_objective.TimestepSampling.UNIFORM

    def set_attention(self, backend, compiled=False):
        assert backend.value == "auto"
        return None


def test_the_ram_widget_reaches_the_run_and_the_report(tmp_path):
    node = node_module("settings").LeanLoRAMemorySettings
    spec = node.INPUT_TYPES()["optional"]["ram"]
    assert spec[0][0] == "auto (free RAM)" and spec[1]["default"] == "auto (free RAM)" and "16 GiB" in spec[0]
    memory, = node().execute(card="manual", mixed_precision="no", gradient_checkpointing=False, latent_cache="off",
                             fast_path="off", ram="16 GiB")
    assert memory.ram.gib == 16 and "host RAM limit 16 GiB" in memory.describe()
    auto, = node().execute(card="manual")
    assert auto.ram.gib is None  # the default: the machine's free RAM
    # the node's own trainer (the pack under the tests' name) runs with the node's output
    import importlib
    import tiny_assets
    from helpers import PACK
    from trainer.dataset import scan_folder
    pack = lambda name: importlib.import_module(f"{PACK}.trainer.{name}")  # noqa: E731
    dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "data", n=2), 64)
    outcome = pack("train_lora").train_lora(
        PackAdapter(pack("objective")), dataset, memory, pack("settings").LoraSettings(rank=4, alpha=4.0),
        pack("settings").TrainSettings(steps=1, learning_rate=1e-3, seed=0, output_name="ram"), tmp_path / "loras",
        lambda **event: None, lambda: False)
    assert outcome.run.requested.ram.gib == 16 and outcome.run.host_ram_limit == 16 * GIB
    assert "; limit: ram 16 GiB" in outcome.report and ", limit 16.00 GiB" in outcome.report


def test_the_auto_limit_is_the_free_ram_beside_what_the_run_holds():
    plan = _plan(RamLimit())
    assert plan.limit.limit is None or plan.limit.limit >= plan.copy.own + plan.latent_cache
    assert plan.limit.source.startswith("ram auto")


def test_the_ram_key_of_a_config_file_reaches_memory_settings():
    """Headless runs (leanlora/config.py): `ram` is Memory Settings' widget, given as its label or a number of
    GiB; a size the widget does not list is refused naming the key."""
    for given in ("24 GiB", 24, 24.0):
        values = config.complete(config.parse({"ram": given, "card": "manual"}))
        memory, = library.pack("nodes.settings").LeanLoRAMemorySettings().execute(**cli.node_inputs(values)["memory"])
        assert memory.ram.gib == 24, given
    assert config.complete(config.parse({}))["ram"] == "auto (free RAM)"
    with pytest.raises(library.ConfigError, match=r"^ram: Value not in list: '25 GiB' not in"):
        config.complete(config.parse({"ram": 25}))
