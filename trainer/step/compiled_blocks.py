"""torch.compile of the training copy's repeated blocks (the `compile` memory setting), with the fallbacks that
keep a run going where compiling fails here."""
from __future__ import annotations

import contextlib
import time

import torch

from ..device.allocator import compiled_kernels_blocked
from ..errors import is_compile_error, is_out_of_memory, one_line
from .probe_steps import ProbeSteps

# Inductor settings for the compiled blocks. Combo kernels launch a graph's small independent kernels (a layer's
# fp8 upcasts, its LoRA weights' casts) as one: H200, SDXL 1024² batch 1, each cold in its own process, lean with
# compile went from 0.1203 to 0.1124 s/step and fast from 0.0728 to 0.0704, compile time unchanged (campaign 10).
INDUCTOR_OPTIONS = {"combo_kernels": True}


class CompiledBlocks:
    """torch.compile of the training copy's repeated blocks, each on its own, the way diffusers compiles repeated
    blocks: blocks of the same structure and shapes share one compiled graph (SDXL's 140 attention modules
    compile as a handful). Compiling the whole model traces every block into one graph instead (on SDXL it had
    not finished after 9 minutes on an H200 machine). Gradient checkpointing wraps them from outside. Where
    dynamo/inductor cannot compile here (no C++ compiler or Triton, an unsupported op, ...), every block falls
    back to its eager forward and `notes` says why; a compile error surfaces before any compiled kernel runs, so
    the same call simply runs eagerly."""

    RECOMPILE_LIMIT = 64  # compiled variants per block type: SDXL's compiled ResBlocks come in 8 shapes (13 in all)

    def __init__(self, units: list[torch.nn.Module], inductor_settings: dict | None = None):
        import torch._dynamo.config as dynamo_config
        # dynamo's default (8) would leave the rest of the shapes eager without a word in the report
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, self.RECOMPILE_LIMIT)
        self.units = units
        self.failed: str | None = None
        self.notes: list[str] = []
        self.graphs_at_start: int | None = None  # compiled graphs in this process when step 1 began
        self.paused = False  # blocks run their eager forward meanwhile (see uncompiled)
        # emptied if compiling with them fails (drop_options)
        self.options = inductor_options(INDUCTOR_OPTIONS if inductor_settings is None else inductor_settings)
        for unit in units:
            unit.forward = self._guarded(unit.forward)

    def _guarded(self, eager):
        compiled = {}  # inductor options -> this block's compiled forward

        def forward(*args, **kwargs):
            if self.failed or self.paused or compiled_kernels_blocked():
                return eager(*args, **kwargs)
            options = tuple(sorted(self.options.items()))
            if options not in compiled:
                # Static shapes: blocks share one code object, so dynamo's automatic dynamic shapes would make the
                # sizes symbolic after the second block shape (slower kernels for every later shape) without saving
                # a compile (parameter shapes stay specialized). Each new batch shape (another aspect bucket, a
                # bucket's smaller remainder) costs one compile, once per process; compile_before_first_step compiles the run's.
                compiled[options] = torch.compile(eager, dynamic=False, options=dict(options))
            try:
                return compiled[options](*args, **kwargs)
            except Exception as error:
                if not is_compile_error(error):
                    raise
                dropped = self.drop_options()
                if dropped:  # a newer inductor feature can fail where plain compiling works: try that first
                    result = forward(*args, **kwargs)
                    self.note_dropped(dropped, error)
                    return result
                self.fall_back(error)
                return eager(*args, **kwargs)
        forward.leanlora_compiled = True
        return forward

    @contextlib.contextmanager
    def uncompiled(self):
        """Blocks run eagerly inside: for steps whose shapes would each cost a compile (auto-fit's probes)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def training_starts(self) -> None:
        self.graphs_at_start = compiled_graph_count()

    def report(self) -> list[str]:
        """The notes, and how many graphs dynamo compiled in this process after step 1 began: mostly batch shapes
        the compile step had not seen (another image size, a smaller last batch) or settings changed by OOM
        recovery, each a pause in training."""
        more = compiled_graph_count() - self.graphs_at_start if self.graphs_at_start is not None else 0
        if more <= 0 or self.failed:
            return self.notes
        return self.notes + [f"torch.compile: {more} more graph{'s' if more > 1 else ''} compiled after step 1 "
                             "began (a batch shape the compile step had not seen, such as another image size or "
                             "a smaller last batch, or settings changed by OOM recovery); training paused while "
                             "they compiled"]

    def drop_options(self) -> dict:
        """After a compile error: from now on the blocks compile without the extra inductor options. Returns the
        options dropped; none means the error was plain compiling's own (the caller falls back to eager)."""
        dropped, self.options = self.options, {}
        return dropped

    def note_dropped(self, dropped: dict, error: BaseException) -> None:
        """Once compiling again without `dropped` worked (if it failed too, fall_back's note says why)."""
        if not self.failed:
            self.notes.append(f"torch.compile: compiled without inductor's {', '.join(dropped)}, which failed here "
                              f"({one_line(error)})")

    def fall_back(self, error: BaseException) -> None:
        """From now on every block runs its eager forward (through the same wrapper: checkpointing may have
        wrapped it since, and must stay)."""
        self.failed = one_line(error)
        self.notes.append(f"torch.compile failed here ({self.failed}); the model runs eagerly")


def inductor_options(wanted: dict) -> dict:
    """The options of `wanted` this torch's inductor knows: an older one without a setting compiles without it,
    where torch.compile would refuse the unknown name and leave the whole model eager."""
    import torch._inductor.config as inductor_config
    known = inductor_config.get_config_copy()
    return {name: value for name, value in wanted.items() if name in known}


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def inductor_cache_counts() -> tuple[int, int]:
    """Graphs inductor loaded from its on-disk cache, and graphs it built, in this process so far."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


def compile_blocks(units: list[torch.nn.Module], inductor_settings: dict | None = None) -> CompiledBlocks:
    """Installs compiled forwards on `units` (modules of the private training copy, not yet checkpointed), compiled
    with `inductor_settings` (default: INDUCTOR_OPTIONS)."""
    return CompiledBlocks(list(units), inductor_settings)


def compile_before_first_step(compiled: CompiledBlocks | None, steps: ProbeSteps) -> tuple[list[str], int | None]:
    """With compile on (`compiled`, None or failed: nothing to do): compiles before step 1 with one forward+backward
    on the largest bucket's batch (gradients discarded), so compile time is reported on its own and a compiler
    failing in backward is caught here. Returns the report's lines and the batch size compiled (None: none was)."""
    if compiled is None or compiled.failed:
        return [], None
    started, batch, cached = time.perf_counter(), steps.run_batch_size(), inductor_cache_counts()
    retried = None  # (inductor options dropped, the error compiling with them), once compiled without them
    while not compiled.failed:
        try:
            # Compiled graphs are specialized to shapes: compile the batch the run steps with (a batch of one
            # would be compiled, then thrown away at step 1 by a second full compile).
            steps.throwaway_step(steps.largest_batch(batch))
            break
        except Exception as error:
            if is_out_of_memory(error):
                steps.free_failed_step(error)
                return ["torch.compile: the compile step ran out of memory; compiling happens at step 1 (the "
                        "memory estimate probes uncompiled steps)"], None
            if not is_compile_error(error):
                raise
            dropped = compiled.drop_options()  # backward compiles here: forward's retry cannot see it
            if not dropped:
                compiled.fall_back(error)
            retried = (dropped, error)
    if compiled.failed:
        return [], None
    if retried:
        compiled.note_dropped(*retried)
    hits, misses = (now - before for now, before in zip(inductor_cache_counts(), cached))
    caching = (f" ({misses} graphs built, {hits} loaded from inductor's disk cache in {inductor_cache_dir()}; "
               "later runs load what was built, after a restart too)") if hits + misses else ""
    return [f"torch.compile: the diffusion model's {len(compiled.units)} blocks compiled in "
            f"{time.perf_counter() - started:.1f} s{caching}"], batch
