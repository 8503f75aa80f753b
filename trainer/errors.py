class LeanLoRAError(Exception):
    """A problem the user can fix. The message names the file or field and says what to do."""
