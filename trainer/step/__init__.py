"""The training step: micro steps and CUDA graphs, compiled blocks, precision, checkpointing, activation offload
and the frozen weights' storage."""
