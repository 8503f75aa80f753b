"""Thin node shells: inputs/outputs and tooltips here, all work in ../trainer."""
from .apply import LeanLoRAApplyLoRA
from .dataset import LeanLoRADataset
from .monitor import LeanLoRAVRAMMonitor
from .routes import register_routes
from .settings import LeanLoRALoraConfig, LeanLoRAMemorySettings
from .train import LeanLoRATrain

NODE_CLASS_MAPPINGS = {
    "LeanLoRADataset": LeanLoRADataset,
    "LeanLoRAMemorySettings": LeanLoRAMemorySettings,
    "LeanLoRALoraConfig": LeanLoRALoraConfig,
    "LeanLoRATrain": LeanLoRATrain,
    "LeanLoRAVRAMMonitor": LeanLoRAVRAMMonitor,
    "LeanLoRAApplyLoRA": LeanLoRAApplyLoRA,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LeanLoRADataset": "LeanLoRA Dataset",
    "LeanLoRAMemorySettings": "LeanLoRA Memory Settings",
    "LeanLoRALoraConfig": "LeanLoRA LoRA Config",
    "LeanLoRATrain": "LeanLoRA Train",
    "LeanLoRAVRAMMonitor": "LeanLoRA VRAM Monitor",
    "LeanLoRAApplyLoRA": "LeanLoRA Apply LoRA",
}

register_routes()  # the Dataset node's preview route, when ComfyUI's server runs
