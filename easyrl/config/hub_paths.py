"""Where hub IDs live on this machine: what a hub ID looks like and the cache huggingface_hub would use, read from the
environment at call time. Its own module, importing nothing of easyrl, so the config's own modules (detection of a
diffusers pipeline) can ask it without an import cycle through `easyrl.config.hub`."""

from __future__ import annotations

import os
import re


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a local path (nor a data file name)."""
    return bool(_HUB_ID.match(value)) and not os.path.exists(value) and not value.lower().endswith(_DATA_SUFFIXES)


def hf_home() -> str:
    """The Hugging Face home folder (`HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else ~/.cache/huggingface)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.expanduser(home)


def hub_cache_dir() -> str:
    """The hub cache huggingface_hub would use under the current environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    return os.path.join(hf_home(), "hub")
