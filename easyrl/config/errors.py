"""The error every configuration check raises (its own module: the loader and the validator both raise it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem: `key` names the culprit, the message says how to fix it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
