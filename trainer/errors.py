class LeanLoRAError(Exception):
    """A problem the user can fix. The message names the file or field and says what to do."""


class TrainingCancelled(Exception):
    """Raised from inside a step when the host stops the run (ComfyUI's Cancel can surface in the middle of a
    forward pass); the loop ends exactly like a cancel between steps."""
