import contextlib
import logging
import os
import time
from pathlib import Path

import comfy.model_management
import comfy.utils
import folder_paths

from ..trainer.cache_store import LatentTextStore
from ..trainer.errors import LeanLoRAError, TrainingCancelled
from ..trainer.files import check_writable, sanitize_name
from ..trainer.settings import LR_SCHEDULES, THIS_GPU, LatentCache, SampleSettings, TrainSettings
from ..trainer.training_state import STATE_SUFFIX, find_latest_state
from .common import CATEGORY, pil_to_image
from .jobs import JOBS, Job
from .labels import RESUME_LATEST, RESUME_OFF, choices, values_of
from .settings import ADVANCED
from .workers import Workers, cancel_between_steps
from .monitor import LATEST_TRAINING
from .plot import loss_chart

PREVIEW_EVERY_S = 2.0
LOG_EVERY_STEPS = 10
FALLBACK_FOLDER = "leanlora_unsaved_loras"  # inside ComfyUI's output folder, where the loras folder fails at save
SAMPLES_FOLDER = "leanlora_samples"  # inside ComfyUI's output folder: <output_name>/step<N>_<i>.png
SAMPLE_PREVIEW_PIXELS = 1024  # the preview's longest side at most (ComfyUI's own max_size would also enlarge)
SAMPLE_PREVIEW_HOLD_S = 10.0  # a step's samples stay on the node this long before the loss chart comes back
VRAM_EVERY_S = 1.0  # the live panel's VRAM readout: the device as the driver sees it, at most this often
_partial_runs = 0  # runs that ended with a partial LoRA: IS_CHANGED then makes a re-queue train again
# bridge/ and trainer.train_lora import peft (and through it bitsandbytes, which prints on a CPU): both load when
# a training starts, not when ComfyUI loads the pack (tests/test_imports.py).


def _send(event: str, data: dict) -> None:
    try:
        from server import PromptServer
        server = PromptServer.instance
        # with the run (prompt) it belongs to: the browser panel keeps its state by run, not by node id
        server.send_sync(event, {**data, "prompt_id": getattr(server, "last_prompt_id", None)}, server.client_id)
    except Exception:  # no server (CLI/tests): progress events are optional
        pass


def progress_line(event: dict) -> str:
    """step 120/500, loss 0.1043, 0.162 s/step, 1:01 left (with Prodigy: ..., loss 0.1043, Prodigy d 0.000312, ...)"""
    from ..trainer.train_lora import format_duration
    line = f"step {event['step']}/{event['total']}, loss {event['loss']:.4f}"
    if event.get("d") is not None:  # Prodigy's estimated step size
        line += f", Prodigy d {event['d']:.3g}"
    if event.get("s_per_step"):
        line += f", {event['s_per_step']:.3f} s/step, {format_duration(event['eta_s'])} left"
    return line


def device_vram(device) -> dict | None:
    """{used_gib, total_gib} of the training device as the driver sees it (every process); {"device": "cpu"} on
    the CPU (the panel says "no GPU"); None on other devices."""
    try:
        import torch
        if device is not None and torch.device(device).type == "cpu":
            return {"device": "cpu"}
        if device is None or torch.device(device).type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return {"used_gib": (total - free) / 2 ** 30, "total_gib": total / 2 ** 30}
    except Exception:  # a readout only: never a reason to stop
        return None


def output_reference(path: str) -> dict | None:
    """A file in ComfyUI's output folder as /view's query ({filename, subfolder, type}); None elsewhere."""
    try:
        relative = Path(path).resolve().relative_to(Path(folder_paths.get_output_directory()).resolve())
    except ValueError:
        return None
    subfolder = "" if relative.parent == Path(".") else relative.parent.as_posix()
    return {"filename": relative.name, "subfolder": subfolder, "type": "output"}


def wait_for(job: Job, total: int, node_id: str | None = None, device=None):
    """Runs in ComfyUI's worker thread: forwards progress (to the browser panel, web/leanlora.js, with the node's
    id and the device's VRAM) and loss previews, turns Cancel into job.cancel()."""
    progress = comfy.utils.ProgressBar(total)
    losses, last_preview, last_step, last_vram = [], 0.0, 0, 0.0
    validation = []  # (step of this run, held-out loss)
    try:
        while True:
            finished = job.done.wait(0.1)
            for event in job.drain():
                message = {**event, "node": node_id}
                if event["kind"] == "step" and time.monotonic() - last_vram > VRAM_EVERY_S:
                    message["vram"], last_vram = device_vram(device), time.monotonic()
                if event["kind"] == "sample":  # as ComfyUI's /view serves them to the panel's gallery
                    message["images"] = [output_reference(path) for path in event["paths"]]
                _send("leanlora.progress", message)
                if event["kind"] == "phase":
                    logging.info("LeanLoRA: %s", event["text"])
                if event["kind"] == "saved":
                    logging.info("LeanLoRA: step %d saved as %s", event["step"], event["path"])
                if event["kind"] == "sample":
                    logging.info("LeanLoRA: samples at step %d: %s", event["step"], ", ".join(event["paths"]))
                    # shown on the node as its preview (held a while before the loss chart returns)
                    progress.update_absolute(last_step, total, ("PNG", sample_strip(event["paths"]), None))
                    last_preview = time.monotonic() + SAMPLE_PREVIEW_HOLD_S
                if event["kind"] == "validation":
                    logging.info("LeanLoRA: step %d validation loss %.4f", event["step"], event["loss"])
                    validation.append((event["step"] - event.get("first_step", 0), event["loss"]))
                if event["kind"] == "step":
                    losses.append(event["loss"])
                    last_step = event["step"]
                    line = progress_line(event)
                    if event["step"] == 1 or event["step"] % LOG_EVERY_STEPS == 0:
                        logging.info("LeanLoRA %s", line)
                    preview = None
                    if time.monotonic() - last_preview > PREVIEW_EVERY_S or event["step"] == total:
                        # the chart as the node's preview, for frontends without web/leanlora.js (which draws its
                        # own panel and hides it); the step line is on that panel, not drawn under the node
                        preview, last_preview = ("PNG", loss_chart(losses, validation=validation), 512), time.monotonic()
                    progress.update_absolute(event["step"], total, preview)  # raises if Cancel was pressed
            if finished:
                break
            if comfy.model_management.processing_interrupted():
                job.cancel()
    except comfy.model_management.InterruptProcessingException:
        # Cancel seen by the progress bar before this loop saw it: the job saves what it learned, and the node
        # reports that partial LoRA like any Cancel (execute), instead of ending without a word
        job.cancel()
        job.done.wait()
        if job.result is None:
            raise
    except BaseException:
        job.cancel()  # the job saves what it learned before it ends
        job.done.wait()
        raise
    if isinstance(job.error, TrainingCancelled):  # cancelled before anything was learned
        logging.info("LeanLoRA: %s", job.error)
        raise comfy.model_management.InterruptProcessingException()
    if job.error is not None:
        raise job.error
    return job.result


def sample_strip(paths: list[str]):
    """One step's sample images side by side, for the node's preview."""
    from PIL import Image
    images = [Image.open(path).convert("RGB") for path in paths]
    strip = Image.new("RGB", (sum(image.width for image in images), max(image.height for image in images)))
    x = 0
    for image in images:
        strip.paste(image, (x, 0))
        x += image.width
    strip.thumbnail((SAMPLE_PREVIEW_PIXELS, SAMPLE_PREVIEW_PIXELS))  # only ever made smaller
    return strip


def sample_settings(prompts, every_n_steps, size, steps, cfg, seed, output_name) -> tuple[SampleSettings, Path]:
    """Train's sample_* inputs, checked (with their folder) before anything runs; their size and steps against
    the model family's limits come once the MODEL's family is known (SampleSettings.check_within)."""
    settings = SampleSettings.from_text(prompts, every_steps=every_n_steps, size=size, steps=steps, cfg=cfg, seed=seed)
    folder = Path(folder_paths.get_output_directory()) / SAMPLES_FOLDER / sanitize_name(output_name)
    if settings.on:  # the run's own folder (<name>, else <name>_2, ...) is made at its first sample
        check_writable(folder.parent, 0, "samples folder")
    return settings, folder


def _lora_folders() -> list[Path]:
    return [Path(folder) for folder in folder_paths.get_folder_paths("loras")]


def training_states() -> list[str]:
    """The training states in the loras folders, as names relative to their folder (newest first)."""
    found = []
    for folder in _lora_folders():
        if folder.is_dir():
            found += [(p.stat().st_mtime, p.relative_to(folder).as_posix()) for p in folder.rglob(f"*{STATE_SUFFIX}")]
    return [name for _, name in sorted(found, reverse=True)]


def resolve_resume(choice: str, output_name: str) -> Path | None:
    """Train's resume input as a state file, checked before anything runs."""
    if choice in (None, "", RESUME_OFF):
        return None
    if choice == RESUME_LATEST:
        latest = find_latest_state(_lora_folders(), sanitize_name(output_name))
        if latest is None:
            raise LeanLoRAError(f"resume: no training state for output_name {sanitize_name(output_name)!r} in "
                                f"{', '.join(map(str, _lora_folders()))}: a run writes one when it is cancelled or "
                                "stopped, and at every save with save_every_n_steps above 0. Set resume to 'off' "
                                "to start from scratch")
        return latest
    for folder in _lora_folders():
        path = folder / choice
        try:
            if not (path.is_file() and Path(os.path.normpath(path)).is_relative_to(folder)):  # absolute, '..'
                continue
        except OSError:  # a name no file system holds (too long): not there
            continue
        if path.resolve().is_relative_to(folder.resolve()):
            return path
        raise LeanLoRAError(f"resume: the training state {choice!r} in {folder} is a link leading out of the loras "
                            f"folder (to {path.resolve()}), which LeanLoRA does not read states through: copy the "
                            "state file itself into the loras folder, or pick another one")
    raise LeanLoRAError(f"resume: the training state {choice!r:.200} is not in the loras folder any more: pick another "
                        "one (refresh the page to update the list) or 'latest state of this output name'")


def latent_store(choice: LatentCache) -> LatentTextStore | None:
    if choice is LatentCache.OFF:
        return None
    if choice is LatentCache.RAM_AND_DISK:  # a folder that cannot be written is reported and skipped by train_lora
        return LatentTextStore(Path(folder_paths.models_dir) / "leanlora_cache")
    return LatentTextStore()


def saved_as(path: Path, loras_dir: Path) -> str:
    """The saved file as a user finds it: models/loras/<file> inside ComfyUI's loras folder, else its full path
    (another loras folder from extra_model_paths, or the fallback folder in output/)."""
    try:
        return f"models/loras/{path.relative_to(loras_dir).as_posix()}" \
            if loras_dir.resolve() == (Path(folder_paths.models_dir) / "loras").resolve() else str(path)
    except ValueError:
        return str(path)


class LeanLoRATrain:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The checkpoint's MODEL (SD1.5 or SDXL). It is not modified."}),
                "clip": ("CLIP", {"tooltip": "Encodes the captions once, before training."}),
                "vae": ("VAE", {"tooltip": "Encodes the images into latents once, before training."}),
                "dataset": ("DATASET", {"tooltip": "From LeanLoRA Dataset."}),
                "memory": ("MEMORY", {"tooltip": "From LeanLoRA Memory Settings."}),
                "lora_config": ("LORA_CONFIG", {"tooltip": "From LeanLoRA LoRA Config."}),
                "steps": ("INT", {"default": 500, "min": 1, "max": 1000000, "tooltip":
                    "Optimizer steps. Each step sees batch_size x gradient_accumulation images."}),
                # The frontend rounds a FLOAT to the decimals of its step (1e-5 turned 5e-6 into 1e-05): a step
                # of 1e-7 keeps 7 decimals, enough for every rate down to the minimum.
                "learning_rate": ("FLOAT", {"default": 1e-4, "min": 1e-7, "max": 10.0, "step": 1e-7, "round": False,
                    "tooltip": "Peak learning rate for the LoRA weights; 1e-4 is a safe start for AdamW (Lion: 3-10x "
                               "lower; Prodigy: 1.0, a multiplier of the step it finds). Type values such as 5e-6 "
                               "directly."}),
                "lr_schedule": (list(LR_SCHEDULES), {"default": "constant", "tooltip":
                    "How the learning rate changes over the steps (diffusers' schedules): constant, cosine decay "
                    "to 0, linear decay to 0, cosine with restarts, polynomial."}),
                "warmup_steps": ("INT", {"default": 0, "min": 0, "max": 100000, "tooltip":
                    "Steps over which the learning rate ramps up from 0 before the schedule starts."}),
                # No "control after generate" widget (the frontend adds one set to randomize to every INT named
                # seed): a re-queue must not silently train again and write my_lora_2, my_lora_3, ...
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFF, "control_after_generate": False,
                                 **ADVANCED, "tooltip":
                    "Seeds LoRA init, shuffling, noise and timesteps: the same seed gives the same run. Change it by "
                    "hand to train again with other random draws."}),
                "output_name": ("STRING", {"default": "my_lora", "tooltip":
                    "File name in ComfyUI's loras folder. An existing file is never overwritten (_2, _3 ... is "
                    "added); a cancelled run is saved as <name>_partial_step<N>."}),
            },
            "optional": {
                "save_every_n_steps": ("INT", {"default": 0, "min": 0, "max": 1000000, "tooltip":
                    "0: only the final file. N: also <name>_step<N>.safetensors every N steps, each a complete LoRA "
                    "with a training state beside it (<name>_step<N>.leanlora-state) to resume from."}),
                "keep_last_saves": ("INT", {"default": 0, "min": 0, "max": 10000, **ADVANCED, "tooltip":
                    "Of this run's step files (and their states), keep the last K; 0 keeps all."}),
                "resume": ([RESUME_OFF, RESUME_LATEST, *training_states()], {"default": RESUME_OFF, "tooltip":
                    "Go on exactly where a run stopped (cancelled, out of memory, crashed, or finished with steps "
                    "raised): weights, optimizer, schedule, RNG and data order. 'latest state of this output "
                    "name' picks the state with the most steps. Needs the same dataset and LoRA shape; memory "
                    "settings may differ (the report says what changed)."}),
                "sample_prompts": ("STRING", {"multiline": True, "default": "", "tooltip":
                    "Sample images while training: one prompt per line (the dataset's trigger word may appear). "
                    "Empty: no samples. Rendered with the LoRA at its current weights on the input MODEL (a "
                    "patched clone: the MODEL itself is not changed), saved to output/leanlora_samples/<output_name>/"
                    "step<N>_<i>.png and shown on this node."}),
                "sample_every_n_steps": ("INT", {"default": 0, "min": 0, "max": 1000000, "tooltip":
                    "0: off. N: render the sample prompts every N steps and after the last step. Sampling needs "
                    "the base model, CLIP and VAE on the GPU beside the training copy and is not in the memory "
                    "estimate or auto-fit; ComfyUI loads them partially where they do not fit (slower). On small "
                    "cards keep it off or rare; a sample that fails (out of memory) is reported and training goes on."}),
                "sample_size": ("INT", {"default": 512, "min": 64, "max": 4096, "step": 64, "tooltip":
                    "Width and height of the samples (512 for SD1.5, 1024 for SDXL)."}),
                "sample_steps": ("INT", {"default": 20, "min": 1, "max": 1000, **ADVANCED, "tooltip":
                    "Sampler steps per image (euler, normal schedule)."}),
                "sample_cfg": ("FLOAT", {"default": 7.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                                         **ADVANCED, "tooltip": "Guidance scale (cfg) of the samples; the negative prompt is empty."}),
                # fixed, like the training seed: the same noise at every step shows what the LoRA learned between
                "sample_seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF,
                                        "control_after_generate": False, **ADVANCED, "tooltip":
                    "Noise seed of the samples, the same at every step so the images are comparable."}),
                "validation_fraction": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.9, "step": 0.01, **ADVANCED,
                                                  "tooltip":
                    "0: off. Else this share of the images (at least 1) is held out of training and its loss, with "
                    "noise and timesteps fixed per image, is measured every validation_every_n_steps and drawn "
                    "in green beside the training loss: a rising curve means the LoRA is overfitting."}),
                "validation_every_n_steps": ("INT", {"default": 50, "min": 0, "max": 1000000, **ADVANCED, "tooltip":
                    "How often the validation loss is measured (and at the end); 0: at the end only."}),
                # Timesteps and loss: last, so that saved workflows' widget values keep their positions; advanced
                # (right-click > Show Advanced). The defaults train exactly as before these inputs existed.
                "noise_offset": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "round": False,
                                           **ADVANCED, "tooltip":
                    "0: off. kohya's noise offset: a random per-channel constant of this size is added to the noise, "
                    "so the LoRA can learn darker darks and brighter brights. 0.05-0.1 is usual."}),
                "min_snr_gamma": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.5, **ADVANCED,
                                            "tooltip":
                    "0: off. Min-SNR-γ loss weighting (kohya's): the nearly clean timesteps count less; 5 is usual. "
                    "For eps- and v-prediction models (SD1.x/SD2.x/SDXL); flow models (Flux, Z-Image, Qwen-Image) "
                    "refuse it."}),
                "timestep_sampling": (choices("timestep_sampling"), {"default": "family default", **ADVANCED,
                                                                     "tooltip":
                    "How noise levels are drawn: the model family's default (uniform for SD, logit-normal for flow "
                    "models), uniform, logit-normal (more steps in the middle), or shifted sigmoid (logit-normal "
                    "moved towards the noisy end by timestep_shift). Validation keeps the family default."}),
                "timestep_shift": ("FLOAT", {"default": 3.0, "min": 0.1, "max": 100.0, "step": 0.1, **ADVANCED,
                                             "tooltip":
                    "The shift of 'shifted sigmoid' (kohya's discrete_flow_shift, 3 by default; 1 is no shift)."}),
                "loss": (choices("loss"), {"default": "MSE", **ADVANCED, "tooltip":
                    "MSE (the usual), Huber or smooth L1 (torch's: quadratic for errors below huber_c, linear above, "
                    "so outliers pull less). Validation loss is always MSE."}),
                "huber_c": ("FLOAT", {"default": 0.1, "min": 0.001, "max": 100.0, "step": 0.001, **ADVANCED,
                                      "tooltip": "Huber's delta and smooth L1's beta (constant over the run); 0.1 is "
                                                 "kohya's."}),
                # Issue 35's other options, after the timesteps and loss (same reason: saved positions), advanced
                "ema_decay": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.9999, "step": 0.0001, "round": False,
                                        **ADVANCED, "tooltip":
                    "0: off. Keep an exponential moving average of the LoRA weights with this decay (0.999 is "
                    "usual) and save it as the LoRA file; samples and validation use it too. One more fp32 copy of "
                    "the LoRA in VRAM. Not with AdamWScheduleFree (it averages by itself)."}),
                "shuffle_tags": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "Shuffle each caption's comma-separated tags (after the first keep_tokens). The trigger word "
                    "stays first. Captions are encoded before training: caption_variants shuffles per image."}),
                "keep_tokens": ("INT", {"default": 0, "min": 0, "max": 255, **ADVANCED, "tooltip":
                    "The first N tags after the trigger word stay in place and are never dropped (kohya's "
                    "keep_tokens). Needs shuffle_tags or tag_dropout."}),
                "tag_dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.95, "step": 0.01, **ADVANCED,
                                          "tooltip":
                    "0: off. Leave each tag (not the trigger word, not the kept ones) out of a caption variant at "
                    "this rate; 0.05-0.1 is usual."}),
                "caption_dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.95, "step": 0.01, **ADVANCED,
                                              "tooltip":
                    "0: off. Train this share of the steps with the caption dropped (only the trigger word, or "
                    "empty without one), so the LoRA also works from short prompts; 0.05-0.1 is usual."}),
                "caption_variants": ("INT", {"default": 4, "min": 1, "max": 64, **ADVANCED, "tooltip":
                    "With shuffle_tags or tag_dropout: caption variants per image, encoded once before training "
                    "(each one text encoding and its embedding in RAM); each step draws one of them."}),
                "multires_noise_iterations": ("INT", {"default": 0, "min": 0, "max": 20, **ADVANCED, "tooltip":
                    "0: off. kohya's multires (pyramid) noise: coarser noise levels added on top, so the LoRA can "
                    "change overall brightness and colour; 6-10 is usual."}),
                "multires_noise_discount": ("FLOAT", {"default": 0.3, "min": 0.01, "max": 1.0, "step": 0.01,
                                                      **ADVANCED, "tooltip":
                    "Weight factor of each coarser level of multires noise (0.3 is kohya's; 0.1 is gentler)."}),
                "masked_loss": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "Train only where each image's mask is white: <image>_mask.png beside the image (greyscale), "
                    "else its alpha channel; images without one count every pixel. The loss is averaged over "
                    "the mask."}),
            },
            # the queued prompt: Memory Settings' gpus gives it to the worker processes as a config (nodes/workers.py)
            "hidden": {"unique_id": "UNIQUE_ID", "prompt": "PROMPT"},
        }

    RETURN_TYPES = ("MODEL", "CLIP", "LORA_MODEL", "STRING", "IMAGE", "STRING")
    RETURN_NAMES = ("model", "clip", "lora", "lora_name", "loss_plot", "report")
    OUTPUT_TOOLTIPS = ("The input MODEL with the trained LoRA applied (strength 1).",
                       "The input CLIP; with LoRA Config's text_encoder_lr set, with the trained text-encoder LoRA "
                       "applied (strength 1).",
                       "The LoRA weights, usable by ComfyUI's Load LoRA Model node and LeanLoRA Apply LoRA.",
                       "The saved file's name in the loras folder (pick it in Load LoRA in later runs).",
                       "Loss per step (raw and smoothed); the validation loss in green when validation_fraction is on.",
                       "What was trained, how long it took, peak VRAM and host RAM, and where the file is.")
    FUNCTION = "execute"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True  # it writes a LoRA file: a graph with Train and no Save/Preview node still runs
    DESCRIPTION = "Trains a LoRA on the connected checkpoint and saves it into ComfyUI's loras folder."

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return _partial_runs  # equal inputs are served from ComfyUI's cache, unless the last run was cancelled

    def execute(self, model, clip, vae, dataset, memory, lora_config, steps, learning_rate, lr_schedule, warmup_steps,
                seed, output_name, save_every_n_steps=0, keep_last_saves=0, resume=RESUME_OFF, sample_prompts="",
                sample_every_n_steps=0, sample_size=512, sample_steps=20, sample_cfg=7.0, sample_seed=0,
                validation_fraction=0.0, validation_every_n_steps=50, noise_offset=0.0, min_snr_gamma=0.0,
                timestep_sampling="family default", timestep_shift=3.0, loss="MSE", huber_c=0.1, ema_decay=0.0,
                shuffle_tags=False, keep_tokens=0, tag_dropout=0.0, caption_dropout=0.0, caption_variants=4,
                multires_noise_iterations=0, multires_noise_discount=0.3, masked_loss=False, unique_id=None,
                prompt=None):
        global _partial_runs
        from ..bridge.comfy_adapter import ComfyAdapter, apply_lora
        from ..bridge.samples import SampleRenderer
        from ..trainer.train_lora import train_lora
        settings = TrainSettings(steps, learning_rate, seed, output_name, lr_schedule, warmup_steps,
                                 save_every_n_steps, keep_last_saves, resolve_resume(resume, output_name),
                                 validation_fraction=validation_fraction, validation_every_steps=validation_every_n_steps,
                                 noise_offset=noise_offset, min_snr_gamma=min_snr_gamma, timestep_shift=timestep_shift,
                                 huber_c=huber_c, ema_decay=ema_decay, shuffle_tags=shuffle_tags,
                                 keep_tokens=keep_tokens, tag_dropout=tag_dropout, caption_dropout=caption_dropout,
                                 caption_variants=caption_variants, multires_noise_iterations=multires_noise_iterations,
                                 multires_noise_discount=multires_noise_discount, masked_loss=masked_loss,
                                 **values_of({"timestep_sampling": timestep_sampling, "loss": loss}))
        samples, samples_folder = sample_settings(sample_prompts, sample_every_n_steps, sample_size, sample_steps,
                                                  sample_cfg, sample_seed, output_name)
        adapter = ComfyAdapter(model, clip, vae)  # a model no family knows fails here, before any work
        samples.check_within(adapter.family.sample_limits)
        # a new run on the panel: its total, and the prompts its sample images belong to
        _send("leanlora.progress", {"kind": "start", "node": unique_id, "total": steps, "output_name": output_name,
                                    "prompts": list(samples.prompts) if samples.on else []})
        # several GPUs: the worker processes start loading now; this job joins them as rank 0 once they have
        workers = Workers.for_run(getattr(memory, "gpus", THIS_GPU), prompt, unique_id)
        # several processes: a Cancel stops every rank before a step (agreed), never inside rank 0's samples
        renderer = SampleRenderer(model, clip, vae, samples, samples_folder,
                                  JOBS.cancelled if workers is None else lambda: False,
                                  dataset) if samples.on else None
        loras_dir = Path(folder_paths.get_folder_paths("loras")[0])
        fallback_dir = Path(folder_paths.get_output_directory()) / FALLBACK_FOLDER
        store = latent_store(memory.latent_cache)
        job = None
        try:
            with cancel_between_steps() if workers is not None else contextlib.nullcontext():
                job = JOBS.start(lambda job: train_lora(
                    adapter, dataset, memory, lora_config, settings, loras_dir, job.emit, lambda: job.cancelled,
                    store, fallback_dir, LATEST_TRAINING, samples.every_steps, renderer,
                    launcher_env=workers.join(lambda: job.cancelled) if workers is not None else None))
                if workers is not None:
                    workers.watch(job)
                outcome = wait_for(job, steps, unique_id, adapter.device)
        except BaseException as error:
            failure = workers.failed(error) if workers is not None else None
            if failure is not None:  # a worker died: the error says which and how (its log), not rank 0's echo
                raise LeanLoRAError(failure) from error
            raise
        finally:
            if workers is not None:
                workers.finish(job)
        logging.info("LeanLoRA:\n%s", outcome.report)
        if outcome.save_note:
            logging.warning("LeanLoRA: %s", outcome.save_note)
        saved = outcome.lora_path
        lora_name = saved.relative_to(loras_dir).as_posix() if saved.is_relative_to(loras_dir) else str(saved)
        result = (*apply_lora(model, clip, outcome.lora_state_dict, 1.0, 1.0), outcome.lora_state_dict, lora_name,
                  pil_to_image(loss_chart(outcome.losses, validation=outcome.validation_losses)), outcome.report)
        shown = saved_as(saved, loras_dir)
        if outcome.partial:
            # Cancel pressed: this node ends with the partial LoRA (its name in the node's output, the history and
            # on the node), then the rest of the graph stops like any interrupted graph. The flag is set again
            # because ComfyUI's ops in the training thread may have consumed it.
            _partial_runs += 1
            message = f"stopped; partial saved to {shown}; set resume to continue"
            logging.warning("LeanLoRA: %s", message)
            _send("leanlora.partial_saved", {"node": unique_id, "lora_name": lora_name, "path": str(saved),
                                             "shown": shown, "steps": len(outcome.losses), "text": message})
            comfy.model_management.interrupt_current_processing(True)
        else:
            message = f"Saved to {shown}"
            _send("leanlora.saved", {"node": unique_id, "lora_name": lora_name, "path": str(saved), "shown": shown,
                                     "steps": len(outcome.losses), "text": message})
        return {"ui": {"text": [outcome.report]}, "result": result}
