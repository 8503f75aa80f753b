"""bench/gpu_matrix.py's plan on the CPU: the groups fit one device command by their estimates, the priority
groups hold issue 41's rows, and the LoRA-loading check's prompt (the live CPU run: python -m bench.gpu_matrix
--group smoke --tiny). What the rows measure is CUDA-only (bench/gpu_matrix.sh on the GPU machine)."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# conftest has the repo on sys.path already, after ComfyUI's folder: putting it first would make ComfyUI's own
# `import nodes` find this pack's nodes/ package for the rest of the session
from bench import gpu_matrix, server_matrix as sm  # noqa: E402


def test_every_group_fits_one_device_command_and_the_priority_rows_come_first():
    for name in gpu_matrix.PRIORITY:
        if name == "cuda_tests":
            continue
        servers = gpu_matrix.GROUPS[name]()
        limit = gpu_matrix.GROUP_LIMIT_S + (40 if len(servers) == 1 else 0)  # a lone server: its own group
        assert gpu_matrix.estimate(servers, assets=False) <= gpu_matrix.GROUP_LIMIT_S - 60, name
        assert gpu_matrix.estimate(servers) <= limit, name
    first = [(s.model, s.card_gib) for g in ("qwen_a", "qwen_b", "wan_a") for s in gpu_matrix.GROUPS[g]()]
    assert first == [("qwen_image", c) for c in (None, 24, 12, 8, 6)] + [("wan", c) for c in (24, 12, 8)]
    assert gpu_matrix.PRIORITY.index("cuda_tests") == 3
    speed = [s for g in gpu_matrix.PRIORITY if g.endswith(tuple("1234")) and "agreement" not in g
             for s in gpu_matrix.GROUPS[g]()]
    assert all(j.steps >= 110 for s in speed for j in s.jobs if j.kind == "train")
    adapters = {j.lora_config.get("type") for g in ("sdxl_adapters_1", "sdxl_adapters_2")
                for s in gpu_matrix.GROUPS[g]() for j in s.jobs if s.card_gib == 8 and j.kind == "train"}
    assert adapters == set(gpu_matrix.ADAPTERS)


def test_the_lora_loading_check_loads_the_trained_file_and_the_base_through_the_same_loader():
    spec = gpu_matrix.row("sdxl", 6, checks=True)
    assert [j.kind for j in spec.jobs] == ["sample", "train", "lora_load"] and spec.base_identity
    assets = {"sdxl": {"unet": "u", "vae": "v", "clip": ["l", "g"], "dataset": "d", "resolution": 1024}}
    prompt = sm.build_prompt(spec.jobs[2], "sdxl", "split", assets, {}, "tag", 2)
    loads = {n["inputs"]["strength_model"]: n["inputs"] for n in prompt.values()
             if n["class_type"] == "LoraLoaderModelOnly"}
    assert set(loads) == {0.0, 1.0} and {v["lora_name"] for v in loads.values()} == {"gm_sdxl_6.safetensors"}
    assert prompt["ksampler_base"]["inputs"]["model"] == ["load_base", 0] and "train" not in prompt
