"""Everything that knows ComfyUI: its MODEL/CLIP/VAE behind the trainer's ModelAdapter (comfy_adapter.py), fp8 and
streaming through its cast ops (cast_weights.py), fingerprints of its models, and the trained LoRA as its patches.
The trainer (../trainer) imports none of this."""
