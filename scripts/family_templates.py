"""The per-family templates in example_workflows/ (leanlora_<family>_train_then_generate.json): the files a user of
that family loads with ComfyUI's own loader nodes -> the LeanLoRA nodes -> Train -> a sampler with the trained LoRA in
the same graph, laid out without overlaps, with notes beside the two things to pick (the model files, the image
folder). Written from one API-format graph per family by workflow_convert.api_to_ui, so a node's widget order
always matches the server's:

    python scripts/family_templates.py --object-info http://127.0.0.1:8188    # or a saved object_info.json

tests/test_families.py checks the shipped files are what this writes, and runs each on the tiny models. The edit
templates (leanlora_<name>_train_then_edit.json, EDITS) train on a folder of pairs and edit an image with the LoRA."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from workflow_convert import api_to_ui, load_object_info

REPO = Path(__file__).resolve().parents[1]
TRIGGER = "lnlr"

# family: (title, loaders as the family's own ComfyUI templates use them, Train/sampler settings, file notes)
FAMILIES = {
    "z_image": {
        "title": "Z-Image",
        "loaders": {"UNETLoader": {"unet_name": "z_image_turbo_bf16.safetensors", "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "qwen_3_4b.safetensors", "type": "lumina2"},
                    "VAELoader": {"vae_name": "ae.safetensors"}},
        "sampler": {"steps": 8, "cfg": 1.0},
        "files": "models/diffusion_models: z_image_turbo_bf16.safetensors; models/text_encoders: "
                 "qwen_3_4b.safetensors (CLIPLoader type lumina2); models/vae: ae.safetensors",
    },
    "flux_dev": {
        "title": "FLUX.1-dev",
        "loaders": {"UNETLoader": {"unet_name": "flux1-dev.safetensors", "weight_dtype": "fp8_e4m3fn"},
                    "DualCLIPLoader": {"clip_name1": "clip_l.safetensors",
                                       "clip_name2": "t5xxl_fp8_e4m3fn.safetensors", "type": "flux"},
                    "VAELoader": {"vae_name": "ae.safetensors"}},
        "sampler": {"steps": 20, "cfg": 1.0},
        "files": "models/diffusion_models: flux1-dev.safetensors (or an fp8 file; weight_dtype fp8 keeps it at "
                 "12 GB); models/text_encoders: clip_l.safetensors + t5xxl_fp8_e4m3fn.safetensors (DualCLIPLoader "
                 "type flux); models/vae: ae.safetensors",
    },
    "chroma": {
        "title": "Chroma",
        "loaders": {"UNETLoader": {"unet_name": "Chroma1-HD.safetensors", "weight_dtype": "fp8_e4m3fn"},
                    "CLIPLoader": {"clip_name": "t5xxl_fp8_e4m3fn.safetensors", "type": "chroma"},
                    "VAELoader": {"vae_name": "ae.safetensors"}},
        "sampler": {"steps": 26, "cfg": 4.0},
        "files": "models/diffusion_models: Chroma1-HD.safetensors (weight_dtype fp8 keeps it at 9 GB); "
                 "models/text_encoders: t5xxl_fp8_e4m3fn.safetensors (CLIPLoader type chroma); models/vae: "
                 "ae.safetensors",
    },
    "wan": {
        "title": "Wan 2.1",
        "loaders": {"UNETLoader": {"unet_name": "wan2.1_t2v_14B_fp8_e4m3fn.safetensors", "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"},
                    "VAELoader": {"vae_name": "wan_2.1_vae.safetensors"}},
        # ComfyUI's Wan text-to-video template's sampler; one frame: the LoRA's images
        "sampler": {"steps": 30, "cfg": 6.0, "sampler_name": "uni_pc"},
        "latent": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"length": 1}},
        "files": "models/diffusion_models: wan2.1_t2v_14B_fp8_e4m3fn.safetensors (or the 1.3B, or one of Wan 2.2 "
                 "A14B's two experts: the LoRA trains on the one loaded); models/text_encoders: "
                 "umt5_xxl_fp8_e4m3fn_scaled.safetensors (CLIPLoader type wan); models/vae: wan_2.1_vae.safetensors",
    },
    "qwen_image": {
        "title": "Qwen-Image",
        "loaders": {"UNETLoader": {"unet_name": "qwen_image_fp8_e4m3fn.safetensors", "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image"},
                    "VAELoader": {"vae_name": "qwen_image_vae.safetensors"}},
        "sampler": {"steps": 20, "cfg": 2.5},
        "files": "models/diffusion_models: qwen_image_fp8_e4m3fn.safetensors; models/text_encoders: "
                 "qwen_2.5_vl_7b_fp8_scaled.safetensors (CLIPLoader type qwen_image); models/vae: "
                 "qwen_image_vae.safetensors",
    },
    "flux2_klein": {  # ComfyUI 0.33 only: written from a 0.33 server's object_info (--family flux2_klein)
        "title": "FLUX.2 klein", "comfyui": "0.33",
        "loaders": {"UNETLoader": {"unet_name": "flux-2-klein-base-4b.safetensors", "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "qwen_3_4b.safetensors", "type": "flux2"},
                    "VAELoader": {"vae_name": "flux2-vae.safetensors"}},
        # ComfyUI's FLUX.2 klein 4B (base) text-to-image template: 20 euler steps at cfg 5, its empty latent
        "sampler": {"steps": 20, "cfg": 5.0},
        "latent": {"class_type": "EmptyFlux2LatentImage", "inputs": {}},
        "files": "models/diffusion_models: flux-2-klein-base-4b.safetensors (the base model trains; or klein 9B "
                 "base with qwen_3_8b, or FLUX.2 dev with its Mistral file); models/text_encoders: "
                 "qwen_3_4b.safetensors (CLIPLoader type flux2); models/vae: flux2-vae.safetensors",
    },
    "anima": {  # ComfyUI 0.33 and later
        "title": "Anima", "comfyui": "0.33",
        "loaders": {"UNETLoader": {"unet_name": "anima-base-v1.0.safetensors", "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "qwen_3_06b_base.safetensors", "type": "stable_diffusion"},
                    "VAELoader": {"vae_name": "qwen_image_vae.safetensors"}},
        # Anima's model card: 30-50 steps, CFG 4-5, er_sde; its ComfyUI workflows sample an EmptyLatentImage
        "sampler": {"steps": 30, "cfg": 4.0, "sampler_name": "er_sde"},
        "latent": {"class_type": "EmptyLatentImage"},
        "files": "models/diffusion_models: anima-base-v1.0.safetensors; models/text_encoders: "
                 "qwen_3_06b_base.safetensors (CLIPLoader type stable_diffusion); models/vae: "
                 "qwen_image_vae.safetensors (needs ComfyUI 0.33 or later)",
    },
    "krea2": {  # ComfyUI 0.33 and later
        "title": "Krea 2", "comfyui": "0.33",
        # an unquantized file: ComfyUI's own templates load krea2_turbo_fp8_scaled / _int8_convrot, quantized layers
        # LeanLoRA cannot train yet (the family refuses them, naming this); fp8 weight_dtype keeps it at about 12 GB
        "loaders": {"UNETLoader": {"unet_name": "krea2_turbo_bf16.safetensors", "weight_dtype": "fp8_e4m3fn"},
                    "CLIPLoader": {"clip_name": "qwen3vl_4b_fp8_scaled.safetensors", "type": "krea2"},
                    "VAELoader": {"vae_name": "qwen_image_vae.safetensors"}},
        # ComfyUI's Krea-2 text-to-image template (Krea-2 Turbo, distilled): 8 steps at cfg 1 on an EmptyLatentImage
        "sampler": {"steps": 8, "cfg": 1.0},
        "latent": {"class_type": "EmptyLatentImage"},
        "files": "models/diffusion_models: an unquantized (bf16) Krea 2 file, not the fp8-scaled or int8 ones "
                 "ComfyUI's Krea 2 templates use (LeanLoRA cannot train quantized layers yet; weight_dtype fp8 keeps "
                 "it at about 12 GB); models/text_encoders: qwen3vl_4b_fp8_scaled.safetensors (CLIPLoader type "
                 "krea2); models/vae: qwen_image_vae.safetensors (needs ComfyUI 0.33 or later)",
    },
    "hunyuan_image": {
        "title": "HunyuanImage 2.1", "comfyui": "0.33",
        "loaders": {"UNETLoader": {"unet_name": "hunyuanimage2.1_bf16.safetensors", "weight_dtype": "fp8_e4m3fn"},
                    "DualCLIPLoader": {"clip_name1": "qwen_2.5_vl_7b.safetensors",
                                       "clip_name2": "byt5_small_glyphxl_fp16.safetensors", "type": "hunyuan_image"},
                    "VAELoader": {"vae_name": "hunyuan_image_2.1_vae_fp16.safetensors"}},
        # Tencent's settings for the base model (50 steps, guidance 3.5; ComfyUI applies its shift 5) at its native
        # 2048x2048, on ComfyUI's EmptyHunyuanImageLatent (64 channels, 1/32 of the image)
        "sampler": {"steps": 50, "cfg": 3.5},
        "latent": {"class_type": "EmptyHunyuanImageLatent", "inputs": {"width": 2048, "height": 2048}},
        "files": "models/diffusion_models: hunyuanimage2.1_bf16.safetensors (weight_dtype fp8 keeps it at 17 GB; "
                 "not the refiner or the distilled model); models/text_encoders: qwen_2.5_vl_7b.safetensors + "
                 "byt5_small_glyphxl_fp16.safetensors (DualCLIPLoader type hunyuan_image); models/vae: "
                 "hunyuan_image_2.1_vae_fp16.safetensors",
    },
}


def template_path(family: str) -> Path:
    return REPO / "example_workflows" / f"leanlora_{family}_train_then_generate.json"


# after a file name in a loader: the frontend (1.49.6) flags a model file name that is not installed as a missing
# model when the template opens; a value that does not end in .safetensors is not checked, and still names the file
PICK = " (pick yours)"


def placeholders(inputs: dict) -> dict:
    """A loader's inputs with each file name as the template shows it: the name, then PICK."""
    return {name: f"{value}{PICK}" if str(value).endswith(".safetensors") else value for name, value in inputs.items()}


def family_prompt(family: str) -> dict:
    """The API-format graph of a family's template (node ids as the test's overrides name them)."""
    spec = FAMILIES[family]
    clip_loader = "DualCLIPLoader" if "DualCLIPLoader" in spec["loaders"] else "CLIPLoader"
    prompt_text = f"{TRIGGER}, a photo"
    latent = spec.get("latent", {"class_type": "EmptySD3LatentImage"})  # a video model: its latent of one frame
    return {
        "1": {"class_type": "UNETLoader", "inputs": placeholders(spec["loaders"]["UNETLoader"])},
        "2": {"class_type": clip_loader, "inputs": placeholders(spec["loaders"][clip_loader])},
        "3": {"class_type": "VAELoader", "inputs": placeholders(spec["loaders"]["VAELoader"])},
        "4": {"class_type": "LeanLoRADataset", "inputs": {"folder": "my_photos", "resolution": 1024, "repeats": 1,
                                                         "trigger_word": TRIGGER}},
        "5": {"class_type": "LeanLoRAMemorySettings", "inputs": {"card": "auto (this GPU)"}},
        "6": {"class_type": "LeanLoRALoraConfig", "inputs": {"rank": 16, "alpha": 16.0}},
        "7": {"class_type": "LeanLoRATrain",
              "inputs": {"steps": 1000, "learning_rate": 1e-4, "output_name": f"my_{family}_lora",
                         "model": ["1", 0], "clip": ["2", 0], "vae": ["3", 0], "dataset": ["4", 0],
                         "memory": ["5", 0], "lora_config": ["6", 0]}},
        "8": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt_text, "clip": ["7", 1]}},
        "9": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["7", 1]}},
        "10": {"class_type": latent["class_type"],
               "inputs": {"width": 1024, "height": 1024, **latent.get("inputs", {}), "batch_size": 1}},
        "11": {"class_type": "KSampler", "inputs": {"seed": 42, "sampler_name": "euler", **spec["sampler"],
                                                    "scheduler": "simple", "denoise": 1.0, "model": ["7", 0],
                                                    "positive": ["8", 0], "negative": ["9", 0],
                                                    "latent_image": ["10", 0]}},
        "12": {"class_type": "VAEDecode", "inputs": {"samples": ["11", 0], "vae": ["3", 0]}},
        "13": {"class_type": "SaveImage", "inputs": {"filename_prefix": f"leanlora_{family}", "images": ["12", 0]}},
        "14": {"class_type": "PreviewAny", "inputs": {"source": ["7", 5]}},
        "15": {"class_type": "PreviewImage", "inputs": {"images": ["7", 4]}},
    }


# columns: loaders | LeanLoRA inputs | Train | sampling | outputs
LAYOUT = {"1": (20, 220), "2": (20, 400), "3": (20, 610), "4": (400, 40), "5": (400, 430), "6": (400, 1120),
          "7": (780, 40), "8": (1160, 40), "9": (1160, 250), "10": (1160, 460), "11": (1540, 40), "12": (1540, 420),
          "13": (1920, 40), "14": (780, 1200), "15": (780, 1480)}  # 14, 15: below Train (all widgets) and its panel


def start_note(headline: str, files: str, steps: str) -> dict:
    """A template's "Start here" note, above its loaders: what it does, the files to pick (step 1), then `steps`."""
    return {"pos": (20, -250), "size": (740, 230), "title": "Start here",
            "text": f"{headline}\n1) Pick your model files in the three loaders (left): {files}.\n{steps}"}


def family_template(family: str, object_info: dict) -> dict:
    spec = FAMILIES[family]
    notes = [
        start_note(f"LeanLoRA: train a {spec['title']} LoRA inside ComfyUI, then sample with it.", spec["files"],
                   "2) Put your images (and optional <image>.txt captions) in ComfyUI/input/<a folder> and pick that "
                   "folder in LeanLoRA Dataset's list (press R if it is not listed yet; 'type a folder path…' takes "
                   "an absolute path): the node shows the image and caption counts.\n"
                   "3) Queue: Memory Settings' card (auto) plans for your GPU; the LoRA is saved to models/loras and "
                   "used by the sampler on the right in the same run."),
        {"pos": (1160, 680), "size": (340, 140),
         "text": f"The trigger word ({TRIGGER}) is added to every caption; keep it in your prompts. The sampler "
                 f"uses the family's usual settings ({spec['sampler'].get('sampler_name', 'euler')}, simple "
                 "schedule)."},
    ]
    titles = {"4": "LeanLoRA Dataset (your image folder)", "1": f"Load Diffusion Model ({spec['title']})"}
    return api_to_ui(family_prompt(family), object_info, LAYOUT, titles, notes)


# edit templates (leanlora_<name>_train_then_edit.json): a family's template trained on a folder of before/after pairs,
# then an edit of the user's image with the LoRA, through the edit model's own ComfyUI node (docs/FAMILIES.md)
EDITS = {
    "qwen_image_edit": {
        "title": "Qwen-Image-Edit", "family": "qwen_image", "encoder": "TextEncodeQwenImageEditPlus",
        "loaders": {"UNETLoader": {"unet_name": "qwen_image_edit_2509_fp8_e4m3fn.safetensors",
                                   "weight_dtype": "default"},
                    "CLIPLoader": {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image"},
                    "VAELoader": {"vae_name": "qwen_image_vae.safetensors"}},
        "sampler": {"steps": 20, "cfg": 2.5},  # ComfyUI's Qwen-Image-Edit template
        "files": "models/diffusion_models: qwen_image_edit_2509_fp8_e4m3fn.safetensors (or 2511); "
                 "models/text_encoders: qwen_2.5_vl_7b_fp8_scaled.safetensors (CLIPLoader type qwen_image); "
                 "models/vae: qwen_image_vae.safetensors",
    },
}


def edit_template_path(name: str) -> Path:
    return REPO / "example_workflows" / f"leanlora_{name}_train_then_edit.json"


def edit_prompt(name: str) -> dict:
    """The API-format graph of an edit template: the family's, with its edit model's files, a folder of pairs, and
    the sampler's conditioning and latent from the image to edit (LoadImage, scaled to 1 megapixel, as ComfyUI's
    template does) through the edit model's node, the negative too."""
    spec = EDITS[name]
    prompt = family_prompt(spec["family"])
    for node_id, loader in (("1", "UNETLoader"), ("2", prompt["2"]["class_type"]), ("3", "VAELoader")):
        prompt[node_id]["inputs"] = placeholders(spec["loaders"][loader])
    prompt["4"]["inputs"]["folder"] = "my_pairs"
    prompt["7"]["inputs"]["output_name"] = f"my_{name}_lora"
    edit = {"clip": ["7", 1], "vae": ["3", 0], "image1": ["17", 0]}
    prompt["8"] = {"class_type": spec["encoder"], "inputs": {"prompt": f"{TRIGGER}, your instruction", **edit}}
    prompt["9"] = {"class_type": spec["encoder"], "inputs": {"prompt": "", **edit}}
    prompt["10"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["17", 0], "vae": ["3", 0]}}
    prompt["11"]["inputs"].update(spec["sampler"])
    prompt["13"]["inputs"]["filename_prefix"] = f"leanlora_{name}"
    prompt["16"] = {"class_type": "LoadImage", "inputs": {"image": "example.png"}}
    prompt["17"] = {"class_type": "ImageScaleToTotalPixels",
                    "inputs": {"upscale_method": "lanczos", "megapixels": 1.0, "image": ["16", 0]}}
    return prompt


# the family layout with the edit's nodes: the two encoders taller (five inputs), the image to edit below them
EDIT_LAYOUT = {**LAYOUT, "9": (1160, 370), "16": (1160, 700), "17": (1160, 1160), "10": (1540, 420),
               "12": (1540, 560)}


def edit_template(name: str, object_info: dict) -> dict:
    spec = EDITS[name]
    notes = [
        start_note(f"LeanLoRA: train a {spec['title']} LoRA from before/after pairs inside ComfyUI, then edit with it.",
                   spec["files"],
                   "2) Put your pairs in ComfyUI/input/<a folder>: each after-image <name>.png with its before-image "
                   "<name>_control.png and the instruction in <name>.txt; pick that folder in LeanLoRA Dataset's list "
                   "(press R if it is not listed yet; 'type a folder path…' takes an absolute path).\n"
                   "3) Load the image to edit (Load Image, right), write the instruction, Queue: the LoRA is saved to "
                   "models/loras and edits your image in the same run."),
        {"pos": (1540, 700), "size": (340, 160),
         "text": f"The trigger word ({TRIGGER}) is added to every instruction; keep it in yours. Both encoders are "
                 f"ComfyUI's {spec['encoder']}, as the LoRA trained; samples during training edit the first pair's "
                 "before-image."},
    ]
    titles = {"4": "LeanLoRA Dataset (your folder of pairs)", "1": f"Load Diffusion Model ({spec['title']})",
              "16": "Load Image (the image to edit)"}
    return api_to_ui(edit_prompt(name), object_info, EDIT_LAYOUT, titles, notes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--object-info", required=True, help="server URL or a saved object_info.json")
    parser.add_argument("--family", action="append", choices=list(FAMILIES),
                        help="write only this family's template (repeatable); a family marked for a newer ComfyUI "
                             "(FAMILIES' 'comfyui') is written only when named, from that version's object_info")
    args = parser.parse_args(argv)
    info = load_object_info(args.object_info)
    for family in args.family or [name for name, spec in FAMILIES.items() if "comfyui" not in spec]:
        path = template_path(family)
        path.write_text(json.dumps(family_template(family, info), indent=1) + "\n")
        print(path)
    for name in EDITS if not args.family else ():
        path = edit_template_path(name)
        path.write_text(json.dumps(edit_template(name, info), indent=1) + "\n")
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
