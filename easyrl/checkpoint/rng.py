"""Capturing and restoring a process's random number generators (torch CPU/CUDA, Python, NumPy) safely.

Torch generator states are uint8 tensors (stored with safetensors); the Python and NumPy states are stored as
plain JSON (lists of integers and floats), so restoring never unpickles anything.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from easyrl.checkpoint import fsio
from easyrl.checkpoint.errors import CheckpointError


@dataclass
class RngState:
    """The RNG states of one process: `tensors` (torch generators) and `info` (Python and NumPy, JSON-able)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> RngState:
        """The current process's RNG states (the generators are not advanced)."""
        tensors = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"cuda_{i}"] = state
        version, mt, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
        info = {
            "python": {"version": version, "state": list(mt), "gauss_next": gauss},
            "numpy": {
                "name": str(np_name),
                "keys": [int(k) for k in np_keys],
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "cached_gaussian": float(np_gauss),
            },
        }
        return cls(tensors, info)

    def restore(self) -> None:
        """Set the current process's generators to this state."""
        try:
            torch.set_rng_state(self.tensors["torch_cpu"].to(torch.uint8))
            cuda = sorted((k for k in self.tensors if k.startswith("cuda_")), key=lambda k: int(k.split("_")[1]))
            if cuda and torch.cuda.is_available():
                if len(cuda) != torch.cuda.device_count():
                    torch.cuda.set_rng_state(self.tensors[cuda[0]].to(torch.uint8))
                else:
                    torch.cuda.set_rng_state_all([self.tensors[k].to(torch.uint8) for k in cuda])
            py = self.info["python"]
            random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
            npst = self.info["numpy"]
            keys = np.asarray(npst["keys"], dtype=np.uint32)
            np.random.set_state(
                (npst["name"], keys, int(npst["pos"]), int(npst["has_gauss"]), float(npst["cached_gaussian"]))
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"malformed RNG state in checkpoint: {exc}") from exc

    def save(self, tensors_path: str, json_path: str) -> None:
        """Write the torch states to `tensors_path` (safetensors) and the rest to `json_path` (JSON), fsynced."""
        fsio.save_tensors(tensors_path, self.tensors, {"format": "easyrl-rng-v1"})
        fsio.write_json(json_path, self.info)

    @classmethod
    def load(cls, tensors_path: str, json_path: str) -> RngState:
        """Read a state written by `save` (safetensors + JSON only)."""
        tensors, _ = fsio.read_tensors(tensors_path)
        info = fsio.read_json(json_path)
        if "torch_cpu" not in tensors or not isinstance(info, dict) or "python" not in info or "numpy" not in info:
            raise CheckpointError(f"RNG state files {tensors_path} / {json_path} lack expected entries")
        return cls(tensors, info)


def rng_paths(folder: str, stem: str) -> tuple[str, str]:
    """(`<stem>.safetensors`, `<stem>.json`) inside `folder`."""
    return os.path.join(folder, f"{stem}.safetensors"), os.path.join(folder, f"{stem}.json")
