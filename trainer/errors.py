import torch


class LeanLoRAError(Exception):
    """A problem the user can fix. The message names the file or field and says what to do."""


class TrainingCancelled(Exception):
    """Raised from inside a step when the host stops the run (ComfyUI's Cancel can surface in the middle of a
    forward pass); the loop ends exactly like a cancel between steps."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OOM error, or another allocator saying the same in words: bitsandbytes and other backends ("out of
    memory"), cuBLAS failing to allocate its handle or workspace (CUBLAS_STATUS_ALLOC_FAILED: not a sticky CUDA
    error, so freeing memory and retrying can succeed)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text


def is_compile_error(error: BaseException) -> bool:
    """Errors of dynamo (tracing) and of the compiler backends it wraps (BackendCompilerFailed)."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return isinstance(error, TorchDynamoException)


def one_line(error: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, for reports and notes."""
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0][:limit] if message else ''}"
