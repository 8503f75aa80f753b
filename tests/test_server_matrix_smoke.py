"""The GPU server matrix (bench/server_matrix.py) end to end on the CPU, before any device time is spent: a real
ComfyUI with this pack, tiny SD1.5 files in both forms, train + KSampler, Cancel then a new queue, the base image
pixel-identical after training, ComfyUI's own trainer as the peer rows queue it; plus the card-emulation launcher's ordering and the SDXL file layouts (shapes
only, on the meta device); and the DiT matrix's newer families (Qwen-Image, Chroma, Wan): prompts, plans, full-size
files (meta device: detection, sizes), tiny files through the stock loaders, one live CPU smoke server (Wan)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_launcher_caps_after_comfyuis_allocator_choice_and_before_main_goes_on(tmp_path):
    """The hook fires once cuda_malloc (ComfyUI's allocator choice) has run and torch is imported, never imports
    torch before cuda_malloc itself, and passes ComfyUI's arguments through unchanged."""
    (tmp_path / "cuda_malloc.py").write_text("import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'backend:cudaMallocAsync'\n")
    (tmp_path / "main.py").write_text(textwrap.dedent("""\
        import sys
        print("torch before cuda_malloc:", "torch" in sys.modules, file=sys.stderr, flush=True)
        import cuda_malloc
        import torch
        print("main goes on; argv", sys.argv[1:], file=sys.stderr, flush=True)
        """))
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "comfy_launcher.py"), "--card-gib", "4", "--listen",
                           "127.0.0.1", "--reserve-vram", "136"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith(("torch before", "[launcher]", "main goes"))]
    assert lines[0] == "torch before cuda_malloc: False"
    assert lines[1].startswith("[launcher]") and "4 GiB" in lines[1] and "'backend:cudaMallocAsync'" in lines[1]
    assert lines[2] == "main goes on; argv ['--listen', '127.0.0.1', '--reserve-vram', '136']"


def test_sdxl_files_have_the_layouts_comfyuis_loaders_read():
    """Full-size SDXL on the meta device (no memory): the split UNet and the checkpoint detect as SDXL, the split
    text encoders as CLIP-L / CLIP-G, and the checkpoint's text encoder and VAE keys map back through ComfyUI's
    own loading conversion to exactly the split files' keys."""
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models

    from bench import full_size_assets as assets

    parts = assets.model_state_dicts("sdxl", device="meta")
    assert type(comfy.model_detection.model_config_from_unet(parts["unet"], "")) is comfy.supported_models.SDXL
    assert comfy.sd.detect_te_model(parts["clip_l"]) == comfy.sd.TEModel.CLIP_L
    assert comfy.sd.detect_te_model(parts["clip_g"]) == comfy.sd.TEModel.CLIP_G
    assert "text_projection.weight" in parts["clip_g"]

    checkpoint = assets.checkpoint_state_dict("sdxl", parts)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(checkpoint)
    assert prefix == "model.diffusion_model."
    config = comfy.model_detection.model_config_from_unet(checkpoint, prefix)
    assert type(config) is comfy.supported_models.SDXL
    loaded_clip = set(config.process_clip_state_dict(dict(checkpoint)))
    expected = {f"clip_l.transformer.{k}" for k in parts["clip_l"] if k != "text_projection.weight"} | \
               {f"clip_g.transformer.{k}" for k in parts["clip_g"]}
    assert loaded_clip - expected == {"clip_l.transformer.text_model.embeddings.position_ids"}
    assert expected <= loaded_clip
    vae = {k.removeprefix("first_stage_model.") for k in checkpoint if k.startswith("first_stage_model.")}
    assert vae == set(parts["vae"])
    assert {k.removeprefix(prefix) for k in checkpoint if k.startswith(prefix)} == set(parts["unet"])


def test_peer_rows_take_the_nodes_defaults_and_name_what_this_comfyui_lacks():
    """ComfyUI's TrainLoraNode differs by version (0.3.75 has no offloading): a row asking for an input the node
    lacks, or a ComfyUI without the node, is that row's error instead of a silently different peer."""
    from bench.server_matrix import PEER_TRAIN_INPUTS, peer_inputs_for
    node = {"input": {"required": {name: ["INT", {"default": 0}] for name in PEER_TRAIN_INPUTS} |
                      {"steps": ["INT", {"default": 16}], "model": ["MODEL"], "checkpoint_depth": ["INT", {"default": 1}]}},
            "output": ["MODEL", "LORA_MODEL", "LOSS_MAP"]}
    inputs, missing = peer_inputs_for({"gradient_checkpointing": True}, {"TrainLoraNode": node})
    assert missing == ["gradient_checkpointing"]
    assert inputs["rank"] == 16 and inputs["checkpoint_depth"] == 1 and "steps" not in inputs and "model" not in inputs
    assert peer_inputs_for({}, {}) == ({}, ["TrainLoraNode"])
    assert peer_inputs_for({}, {"TrainLoraNode": {**node, "output": ["MODEL"]}})[1] == ["LORA_MODEL output"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    done = subprocess.run([sys.executable, "-m", "bench.server_matrix", "--plan", "smoke", "--tiny", "--out", str(out),
                           "--budget-s", "300"], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), done.stdout, out


def test_smoke_trains_samples_cancels_and_requeues_in_one_live_server(smoke):
    result, stdout, out = smoke
    rows = {row["job"]: row for row in result["rows"]}
    assert list(rows) == ["sample_base_before", "train_balanced", "cancel_fast", "after_cancel_checkpoint",
                          "peer_builtin"]
    assert all(row["passed"] and row["server_alive_after"] for row in rows.values()), \
        [(r["job"], r["status"], r.get("error")) for r in rows.values()]

    trained = rows["train_balanced"]
    assert trained["status"] == "ok" and trained["steps_done"] == 3
    assert "trained 3/3 steps" in trained["report"]
    assert trained["s_per_step"] > 0 and trained["steady_steps"] == 2  # step 1 (its own burst on the CPU) left out
    assert trained["base_identical"] is True  # the base MODEL's image after training = before
    assert trained["nvml"].startswith("NVML not used") and trained.get("nvml_peak_gib") is None
    assert trained["wall_s"] > 0 and trained["first_step_after_s"] > 0

    cancelled = rows["cancel_fast"]
    assert cancelled["status"] == "cancelled" and cancelled["steps_done"] < 2000
    assert cancelled["cancel"]["partial_loras"] and cancelled["cancel"]["latency_s"] is not None
    after = rows["after_cancel_checkpoint"]
    assert after["status"] == "ok" and after["form"] == "checkpoint" and "trained 2/2 steps" in after["report"]

    # ComfyUI's own TrainLoraNode, queued in the same server as the GPU rows queue it: timed from its progress
    # events (steps 10 -> 12), our Train node's common choices in its inputs, its LoRA saved
    peer = rows["peer_builtin"]
    assert peer["status"] == "ok" and peer["steps_done"] == 12 and peer["steady_steps"] == 2 and peer["s_per_step"] > 0
    assert {k: peer["settings"][k] for k in ("rank", "batch_size", "learning_rate", "optimizer")} == \
        {"rank": 16, "batch_size": 1, "learning_rate": 1e-4, "optimizer": "AdamW"}
    assert "steps" not in peer["settings"] and "progress events" in peer["s_per_step_source"]
    assert list((out / "servers" / "smoke_sd15_cpu" / "output" / "loras").glob("matrix_smoke_sd15_cpu_4_peer_builtin_*.safetensors"))

    assert result["summary"]["failed"] == 0 and result["summary"]["servers_lost"] == 0
    table = (out / "table.md").read_text()
    assert "| smoke_sd15_cpu | train_balanced | sd15/split |" in table and table in stdout + "\n"
    assert (out / "servers" / "smoke_sd15_cpu" / "comfyui.log").read_text().count("Prompt executed") >= 3


# --- the DiT families (bench/dit_matrix.py, bench/dit_assets.py) ---------------------------------------------------

DIT_LOADERS = {"z_image": ("CLIPLoader", "lumina2"), "flux_dev": ("DualCLIPLoader", "flux"),
               "qwen_image": ("CLIPLoader", "qwen_image"), "chroma": ("CLIPLoader", "chroma"), "wan": ("CLIPLoader", "wan")}
# (cfg, sampler, latent node) as scripts/family_templates.py's shipped templates sample
DIT_SAMPLING = {"z_image": (1.0, "euler", "EmptySD3LatentImage"), "flux_dev": (1.0, "euler", "EmptySD3LatentImage"),
                "qwen_image": (2.5, "euler", "EmptySD3LatentImage"), "chroma": (4.0, "euler", "EmptySD3LatentImage"),
                "wan": (6.0, "uni_pc", "EmptyHunyuanLatentVideo")}


@pytest.mark.parametrize("family", sorted(DIT_LOADERS))
def test_dit_prompt_has_the_familys_stock_loaders_and_its_templates_sampling(family):
    from bench import dit_assets, dit_matrix
    from bench.server_matrix import Job, settings

    assets = {family: {"loaders": dit_assets.names(family), "dataset": "/data", "resolution": 1024}}
    prompt = dit_matrix.build_prompt(Job("fast", settings("fast")), family, "split", assets, {}, "t", 2)
    clip_node, clip_type = DIT_LOADERS[family]
    assert prompt["clip"] == {"class_type": clip_node, "inputs": dit_assets.names(family)[clip_node]}
    assert prompt["clip"]["inputs"]["type"] == clip_type
    assert prompt["unet"]["inputs"]["weight_dtype"] == "default" and prompt["vae"]["class_type"] == "VAELoader"
    cfg, sampler, latent = DIT_SAMPLING[family]
    ksampler = prompt["ksampler_trained"]["inputs"]
    assert (ksampler["cfg"], ksampler["sampler_name"], ksampler["scheduler"]) == (cfg, sampler, "simple")
    assert ksampler["model"] == ["train", 0] and prompt["neg_trained"]["inputs"]["text"] == ""  # the empty negative
    node = prompt["latent_trained"]
    assert node["class_type"] == latent and node["inputs"]["width"] == node["inputs"]["height"] == 1024
    if family == "wan":
        assert node["inputs"]["length"] == 1  # one frame: the LoRA's images


def test_dit_plans_cover_the_newer_families_with_the_issues_cards():
    from bench import dit_matrix
    cards = {name: [s.card_gib for s in dit_matrix.PLANS[name]()] for name in ("qwen_image", "chroma", "wan")}
    assert cards == {"qwen_image": [None, 24, 12, 8], "chroma": [None, 24, 8], "wan": [None, 24, 8]}
    for name in ("qwen_image", "chroma", "wan"):
        assert all(s.model == name and s.jobs[0].steps == 110 for s in dit_matrix.PLANS[name]())
    assert [s.model for s in dit_matrix.PLANS["smoke_families"]()] == ["qwen_image", "chroma", "wan"]


def test_dit_full_size_files_fit_the_gpu_machine():
    """The full-size configs as ComfyUI 0.3.75 detects the real files, on the meta device: sizes and that each
    family's files fit the GPU machine's disk and RAM (bench.dit_assets.estimate)."""
    from bench import dit_assets
    est = {f: dit_assets.estimate(f) for f in ("qwen_image", "chroma", "wan")}
    files = {f: e["files_gib"] for f, e in est.items()}
    assert 18.5 < files["qwen_image"]["leanlora_random_qwen_image_fp8_e4m3fn.safetensors"] < 19.5  # 20.4 B, fp8
    assert 16.3 < files["chroma"]["leanlora_random_chroma_bf16.safetensors"] < 16.8  # 8.9 B, bf16
    assert 13 < files["wan"]["leanlora_random_wan2.1_t2v_14B_fp8_e4m3fn.safetensors"] < 14  # 14 B, fp8 blocks
    assert all(e["fits"] for e in est.values()), est


def test_dit_tiny_files_of_the_newer_families_load_through_the_stock_loaders(tmp_path):
    """bench.dit_assets --tiny (the writer the GPU run uses, narrow configs): the files load with what UNETLoader /
    CLIPLoader / VAELoader call, encode, denoise once and decode, finite (scripts/tiny_dit_assets.verify_family)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_dit_assets
    from bench import dit_assets
    from safetensors import safe_open
    models = tmp_path / "models"
    for family in ("qwen_image", "chroma", "wan"):
        loaders = dit_assets.build_family(family, models, tiny=True, device="cpu")
        report = tiny_dit_assets.verify_family(tmp_path, family, loaders)
        assert report["finite"] and report["diffusion_model"] == {
            "qwen_image": "QwenImageTransformer2DModel", "chroma": "Chroma", "wan": "WanModel"}[family]
    with safe_open(str(models / "text_encoders" / dit_assets.names("qwen_image")["CLIPLoader"]["clip_name"]), "pt") as f:
        keys = set(f.keys())
        assert "scaled_fp8" in keys and "model.layers.0.mlp.up_proj.scale_weight" in keys
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == __import__("torch").float8_e4m3fn
    with safe_open(str(models / "text_encoders" / dit_assets.names("wan")["CLIPLoader"]["clip_name"]), "pt") as f:
        assert "spiece_model" in set(f.keys()) and "scaled_fp8" in set(f.keys())


def test_dit_smoke_wan_trains_and_samples_in_a_live_server(tmp_path):
    """bench.dit_matrix's CPU smoke plan for one newer family (Wan: uni_pc on a one-frame video latent), end to end."""
    out = tmp_path / "dit"
    done = subprocess.run([sys.executable, "-m", "bench.dit_matrix", "--plan", "smoke_wan", "--tiny", "--out", str(out),
                           "--budget-s", "200"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["server"], r["status"], r["steps_done"]) for r in rows] == [("smoke_wan_cpu", "ok", 3)]
    assert "Prompt executed" in (out / "servers" / "smoke_wan_cpu" / "comfyui.log").read_text()


def test_dit_full_size_files_are_detected_as_comfyui_detects_the_real_ones():
    """The full-size key sets and shapes (meta tensors in the files' dtypes): ComfyUI 0.3.75's detection gives
    exactly the configs bench.dit_assets builds (the rest are the constructors' defaults) and the text-encoder
    options the real fp8 files get (scaled fp8 for Qwen2.5-VL-7B and umt5-xxl)."""
    import torch
    import comfy.model_detection as md
    import comfy.sd
    from bench import dit_assets as da

    def meta_sd(kind):
        module, dtype_of, skip, extra, _loaded = da._RECIPES[kind]
        root = module(False)
        sd = {k: torch.empty(shape, dtype=dtype, device="meta")
              for k, _m, _p, shape, dtype in da._entries(root, dtype_of, skip)}
        return {**sd, **(extra(root, dtype_of, skip) if extra else {})}

    for kind, full, model_config in [("qwen_image", da.QWEN_IMAGE_FULL, "QwenImage"), ("chroma", da.CHROMA_FULL, "Chroma"),
                                     ("wan", da.WAN21_T2V_14B, "WAN21_T2V")]:
        sd = meta_sd(kind)
        detected = md.detect_unet_config(sd, "")
        assert type(md.model_config_from_unet_config(detected, sd)).__name__ == model_config
        for key, value in detected.items():
            if key in full:
                assert (list(value) if isinstance(value, tuple) else value) == \
                    (list(full[key]) if isinstance(full[key], tuple) else full[key]), (kind, key)
    sd = meta_sd("qwen25_7b_fp8")
    assert comfy.sd.detect_te_model(sd) == comfy.sd.TEModel.QWEN25_7B
    assert comfy.sd.llama_detect([sd]) == {"dtype_llama": torch.bfloat16, "llama_scaled_fp8": torch.float8_e4m3fn}
    sd = meta_sd("umt5_xxl_fp8")
    assert comfy.sd.detect_te_model(sd) == comfy.sd.TEModel.T5_XXL
    assert comfy.sd.t5xxl_detect([sd]) == {"dtype_t5": torch.float16, "t5xxl_scaled_fp8": torch.float8_e4m3fn}
