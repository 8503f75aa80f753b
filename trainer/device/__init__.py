"""The device's memory primitives, below both step/ (the step's mechanisms) and memory/ (planning): card.py (every
question put to the device's memory and every move onto it or back to host RAM, CUDA or a CPU test's simulated card),
allocator.py (the caching allocator's settings, the driver's graph pool trimmed), vram.py (peaks, snapshots and the
run's VRAM timeline)."""
