"""CPU dry run of the kohya FLUX.1 peer (bench/kohya_peer.py --family flux --dry-run): everything that can be
checked without the GPU, in kohya's own code (the sd-scripts tree given with --kohya) with the child's shims.

    python -m bench.kohya_peer --family flux --kohya SD_SCRIPTS_DIR --work DIR --dry-run

1. files: our writer's formats, small enough for this machine: a full-width FLUX.1-dev with 1 double and 1 single
   block (kohya's loader counts blocks from the keys; its widths are fixed), the full CLIP-L and ae, the 1024² set;
2. kohya's parser on the exact argument list the peer passes (8 GiB card), then its own argument checks;
3. the tokenizer cache: kohya's FluxTokenizeStrategy from --tokenizer_cache_dir, offline, on the set's captions;
4. the dataset: kohya's DreamBooth blueprint over the folder, then the trainer's assert_extra_args;
5. loaders: load_flow_model on the small file (then fp8, as --fp8_base does) and the full key set / shapes of our
   full-size file against kohya's Flux (meta); load_clip_l (shimmed) on the CLIP-L file, then a forward for the
   pooled output; load_t5xxl (shimmed) on our full T5 layout as meta tensors, then kohya's fp8 preparation;
   load_ae on the ae file, then an encode; block swap of 28 blocks on a full-size Flux (meta);
6. networks.lora_flux on the small model: the LoRA modules kohya would train.
Each check prints one line; the exit code is the number that failed. The T5 (4.9 GB) and full FLUX.1-dev (24 GB)
are not loaded here: this machine has neither the memory nor the time; their layouts are checked as meta tensors.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch

from bench import kohya_peer


class Checks:
    def __init__(self):
        self.failed = 0

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        self.failed += not ok
        print(f"[dry-run] {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def run(self, name: str, fn):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - each check reports its own failure and the run goes on
            self(name, False, f"{type(error).__name__}: {str(error)[:600]}")
            traceback.print_exc(limit=4)
            return None


def write_files(folder: Path) -> dict:
    """Our writer's files, small: FLUX.1-dev at full width with one block of each kind, CLIP-L, the ae, the set."""
    from bench import dit_assets
    from bench.full_size_assets import build_dataset
    sys.path.insert(0, str(kohya_peer.REPO / "scripts"))
    import tiny_dit_assets
    models = folder / "models"
    flux = models / "diffusion_models" / "flux1_dev_1_double_1_single_bf16.safetensors"
    clip = models / "text_encoders" / dit_assets.names("flux_dev")["DualCLIPLoader"]["clip_name1"]
    ae = models / "vae" / dit_assets.names("flux_dev")["VAELoader"]["vae_name"]
    cpu = torch.device("cpu")
    if not flux.exists():
        config = {k: v for k, v in dict(dit_assets.FLUX_DEV_FULL, depth=1, depth_single_blocks=1).items()
                  if k != "image_model"}

        def build(comfy, ops):
            import comfy.ldm.flux.model
            return comfy.ldm.flux.model.Flux(image_model="flux", dtype=torch.bfloat16, device="meta", operations=ops,
                                             **config)
        dit_assets.write_random(flux, dit_assets._meta(build), dit_assets._all(torch.bfloat16), cpu)
    if not clip.exists():
        dit_assets.write_random(clip, dit_assets.clip_l_module(False), dit_assets._all(torch.float16), cpu)
    if not ae.exists():
        tiny_dit_assets.build_flux_ae(ae)
    dataset = build_dataset(folder / "data", 1024, 6)
    return {"pretrained_model_name_or_path": str(flux), "clip_l": str(clip), "t5xxl": "(meta: not written)",
            "ae": str(ae), "dataset": str(dataset)}


def meta_state_dict(kind: str) -> dict:
    """Our full-size file's keys, shapes and dtypes for a dit_assets file kind, as meta tensors."""
    from bench import dit_assets
    module, dtype_of, skip, _extra, _loaded = dit_assets._RECIPES[kind]
    return {key: torch.empty(shape, dtype=dtype, device="meta")
            for key, _m, _p, shape, dtype in dit_assets._entries(module(False), dtype_of, skip)}


def main(args) -> int:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COMFYUI_PATH=str(args.comfyui.resolve()))
    check = Checks()
    work = args.work / "dry_run"
    started = time.perf_counter()
    files = write_files(work)
    check("files", True, f"written in {time.perf_counter() - started:.0f} s: " + ", ".join(
        f"{Path(v).name} {Path(v).stat().st_size / 2 ** 20:.0f} MiB" for k, v in files.items()
        if k not in ("t5xxl", "dataset")))
    tokenizers = kohya_peer.tokenizer_cache(work / "tokenizers", args.comfyui.resolve(), "flux")
    data_dir = kohya_peer.kohya_dataset(Path(files["dataset"]), work / "kohya_data_flux")

    # 2. the argument list, through kohya's parser
    os.chdir(args.kohya)
    kohya_peer.install_shims("flux")
    import flux_train_network
    from library import flux_models, flux_utils, strategy_base, train_util
    card = 8
    kohya_args = {"--pretrained_model_name_or_path": files["pretrained_model_name_or_path"],
                  "--clip_l": files["clip_l"], "--t5xxl": str(work / "t5xxl_not_written.safetensors"),
                  "--ae": files["ae"], "--train_data_dir": str(data_dir), "--tokenizer_cache_dir": str(tokenizers),
                  "--blocks_to_swap": kohya_peer.flux_blocks_to_swap(card), "--output_dir": str(work / "out"),
                  "--output_name": "dry_run", "--max_train_steps": 60}
    argv = kohya_peer.recipe("flux", kohya_args)
    print("[dry-run] argv: " + " ".join(argv), flush=True)
    parser = flux_train_network.setup_parser()
    parsed = parser.parse_args(argv)
    train_util.verify_command_line_training_args(parsed)
    parsed = train_util.read_config_from_file(parsed, parser)
    train_util.verify_training_args(parsed)
    train_util.prepare_dataset_args(parsed, True)
    check("kohya's parser", parsed.blocks_to_swap == 28 and parsed.fp8_base and parsed.network_train_unet_only
          and parsed.cache_latents and parsed.cache_text_encoder_outputs and parsed.gradient_checkpointing
          and parsed.mixed_precision == "bf16" and parsed.optimizer_type == "AdamW8bit" and parsed.sdpa
          and parsed.network_module == "networks.lora_flux" and parsed.network_dim == 16
          and parsed.timestep_sampling == "flux_shift" and parsed.model_prediction_type == "raw"
          and parsed.guidance_scale == 1.0 and parsed.resolution == (1024, 1024) and parsed.model_type == "flux",
          f"blocks_to_swap {parsed.blocks_to_swap}, fp8_base {parsed.fp8_base}, resolution {parsed.resolution}, "
          f"optimizer {parsed.optimizer_type}, model_type {parsed.model_type}")

    # 3. tokenizers, offline
    trainer = flux_train_network.FluxNetworkTrainer()
    tokenize = check.run("tokenizers", lambda: trainer.get_tokenize_strategy(parsed))
    captions = [p.read_text().strip() for p in sorted(Path(files["dataset"]).glob("*.txt"))]
    if tokenize is not None:
        l_tokens, t5_tokens, t5_mask = tokenize.tokenize(captions)
        check("tokenizers", l_tokens.shape == (6, 77) and t5_tokens.shape == (6, 512) and trainer.is_schnell is False
              and int(t5_mask[0].sum()) > 3 and int(l_tokens[0, 0]) == 49406,
              f"CLIP {type(tokenize.clip_l).__name__} {tuple(l_tokens.shape)}, T5 {type(tokenize.t5xxl).__name__} "
              f"{tuple(t5_tokens.shape)} ('{captions[0]}': {int(t5_mask[0].sum())} T5 tokens), dev (not schnell)")
        strategy_base.TokenizeStrategy.set_strategy(tokenize)

    # 4. the dataset, as kohya's train() builds it
    def dataset():
        from library import config_util
        strategy_base.LatentsCachingStrategy.set_strategy(trainer.get_latents_caching_strategy(parsed))
        generator = config_util.BlueprintGenerator(config_util.ConfigSanitizer(True, True, parsed.masked_loss, True))
        subsets = config_util.generate_dreambooth_subsets_config_by_subdirs(parsed.train_data_dir, parsed.reg_data_dir)
        blueprint = generator.generate({"datasets": [{"subsets": subsets}]}, parsed)
        train, val = config_util.generate_dataset_group_by_blueprint(blueprint.dataset_group)
        trainer.assert_extra_args(parsed, train, val)
        check("dataset", len(train) == 6 and train.is_latent_cacheable() and train.is_text_encoder_output_cacheable(),
              f"{len(train)} steps an epoch from {data_dir}/1_shapes; latents and text-encoder outputs cacheable; "
              f"assert_extra_args passed")
    check.run("dataset", dataset)

    # 5. loaders
    def flux_loader():
        is_schnell, model = flux_utils.load_flow_model(files["pretrained_model_name_or_path"], None, "cpu")
        meta = [k for k, v in model.state_dict().items() if v.is_meta]
        model.to(torch.float8_e4m3fn)  # what load_target_model does under --fp8_base with a bf16 file
        ours = meta_state_dict("flux_dev")
        with torch.device("meta"):
            full = flux_models.Flux(flux_models.configs["dev"].params)
        theirs = {k: tuple(v.shape) for k, v in full.state_dict().items()}
        missing, unexpected = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
        shapes = [k for k in set(ours) & set(theirs) if tuple(ours[k].shape) != theirs[k]]
        full.enable_block_swap(28, torch.device("cpu"))
        check("FLUX.1 loader", not is_schnell and not meta and model.dtype == torch.float8_e4m3fn and not missing
              and not unexpected and not shapes,
              f"small file: dev, {model.num_double_blocks}+{model.num_single_blocks} blocks, nothing left on meta, "
              f"fp8 after the cast; full size: {len(ours)} keys, missing {missing[:3]}, unexpected {unexpected[:3]}, "
              f"shape mismatches {shapes[:3]}; block swap 28: {full.offloader_double.blocks_to_swap} double + "
              f"{full.offloader_single.blocks_to_swap} single")
        return model
    flux = check.run("FLUX.1 loader", flux_loader)

    def clip_loader():
        clip = flux_utils.load_clip_l(files["clip_l"], torch.bfloat16, "cpu")
        meta = [k for k, v in clip.state_dict().items() if v.is_meta]
        with torch.no_grad():
            pooled = clip(tokenize.tokenize(captions[:1])[0])["pooler_output"]
        check("CLIP-L loader", not meta and tuple(pooled.shape) == (1, 768) and bool(torch.isfinite(pooled).all()),
              f"nothing left on meta; pooled output {tuple(pooled.shape)}, finite")
        return clip
    clip = check.run("CLIP-L loader", clip_loader)

    def t5_loader():
        ours = meta_state_dict("t5xxl_fp8")
        t5 = flux_utils.load_t5xxl(None, None, "cpu", state_dict=dict(ours))
        unloaded = [k for k in t5.state_dict() if k not in ours and k != "encoder.embed_tokens.weight"]
        fp8 = t5.dtype == torch.float8_e4m3fn  # kohya's test for its fp8 T5 path
        trainer.prepare_text_encoder_fp8(1, t5, t5.dtype, torch.bfloat16)
        dtypes = {type(m).__name__: str(next(m.parameters()).dtype).removeprefix("torch.") for m in t5.modules()
                  if type(m).__name__ in ("T5LayerNorm", "Embedding", "Linear")}
        check("T5-XXL loader", t5.encoder.embed_tokens is t5.shared and not unloaded and fp8
              and dtypes == {"Embedding": "bfloat16", "T5LayerNorm": "bfloat16", "Linear": "float8_e4m3fn"},
              f"our layout's {len(ours)} tensors ({sorted({str(v.dtype) for v in ours.values()})}) all loaded, "
              f"embed_tokens tied to shared, model dtype {fp8 and 'fp8'} -> kohya's fp8 path; after its "
              f"preparation: {dtypes}")
        return t5
    t5 = check.run("T5-XXL loader", t5_loader)

    def ae_loader():
        ae = flux_utils.load_ae(files["ae"], torch.bfloat16, "cpu")
        meta = [k for k, v in ae.state_dict().items() if v.is_meta]
        with torch.no_grad():
            latents = ae.encode(torch.rand(1, 3, 64, 64, dtype=torch.bfloat16) * 2 - 1)
        check("ae loader", not meta and tuple(latents.shape) == (1, 16, 8, 8),
              f"nothing left on meta; encode 64² -> {tuple(latents.shape)}")
        return ae
    ae = check.run("ae loader", ae_loader)

    # 6. the LoRA kohya trains (DiT only), on the small model
    def network():
        import importlib
        lora_flux = importlib.import_module("networks.lora_flux")
        net = lora_flux.create_network(1.0, parsed.network_dim, parsed.network_alpha, ae, [clip, t5], flux,
                                       neuron_dropout=None)
        net.apply_to([clip, t5], flux, apply_text_encoder=False, apply_unet=True)
        params = sum(p.numel() for p in net.parameters())
        check("LoRA network", len(net.unet_loras) > 0 and not net.text_encoder_loras,
              f"{len(net.unet_loras)} LoRA modules on 1 double + 1 single block (rank {parsed.network_dim}, "
              f"{params / 1e6:.2f} M parameters), none on the text encoders")
    if flux is not None and clip is not None and t5 is not None and ae is not None:
        check.run("LoRA network", network)
    else:
        check("LoRA network", False, "not run: a loader above failed")
    print(f"[dry-run] {check.failed} failed, {time.perf_counter() - started:.0f} s", flush=True)
    return check.failed
