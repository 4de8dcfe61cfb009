"""The one error type of checkpoints (its own module: the format and the store both raise it)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit: the message names the file or key."""
