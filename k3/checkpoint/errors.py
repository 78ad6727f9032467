"""The one error type of checkpoint reading and writing."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message names the file and what to do."""
