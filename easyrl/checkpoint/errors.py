"""The one error type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, inconsistent with the run, or holds a file that is not what it claims.

    The message names the folder or file and, where there is one, the fix.
    """
