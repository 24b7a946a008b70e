"""Fused kernels for the training forward and backward, behind one switch each (issue 44 item 3).

`liger_kernels` (`worker.actor.model.liger_kernels`): Liger-Kernel's Triton RMSNorm, SwiGLU MLP and rotary embedding
for the Qwen2 and Qwen3 dense families, through Liger's own `apply_liger_kernel_to_<family>(model=...)`: it patches
the loaded model's norms and MLPs in place and swaps the family's RMSNorm / MLP classes and its
`apply_rotary_pos_emb` in transformers' module, so everything of that family built later in this process gets them
too (easyrl builds each role's model in a worker process of its own). Liger's fused linear cross-entropy is left off:
easyrl's head (`easyrl.workers.head`) computes per-token log-probs and entropy, which a loss-only kernel does not give.

Why not Liger's fused linear log-prob ops for the head (read in liger-kernel 0.8.5): its Triton fused linear
cross-entropy (ops/fused_linear_cross_entropy.py) computes the gradient inside the forward, so a per-token upstream
gradient must be known before the loss is (`token_grad_output`), and it returns no entropy; its PPO/GRPO chunked
loss (chunked_loss/fused_linear_ppo.py) is PyTorch, not Triton, builds fp32 (rows x vocab-chunk) blocks and keeps an
fp32 (V x H) gradient buffer, the very temporary issue 44 wants gone. easyrl's own head kernel is
`easyrl.workers.head_kernel` (`worker.actor.fused_head_kernel: triton`).

Triton runs on CUDA only: on CPU the switch is refused in one line (the config check, and here for a worker built
without it), never dropped silently.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from easyrl.models.family import FAMILIES, family_of


logger = logging.getLogger(__name__)


def liger_families() -> list[str]:
    """The families Liger is wired for (``FamilyProfile.liger``)."""
    return [p.model_type for p in FAMILIES.values() if p.liger is not None]


def apply_liger_kernels(model: Any, key: str) -> None:
    """Swap `model`'s RMSNorms, SwiGLU MLPs and rotary embedding for Liger's Triton kernels in place, before it is
    sharded; refuse in one line naming `key` (the config switch) a model of another family, a process without CUDA,
    or a machine without the package."""
    family = family_of(model)
    if family.liger is None:
        wired = ", ".join(liger_families())
        raise ValueError(f"{key}: wired for {wired} models only, not {family.model_type}: set it to false")
    if not torch.cuda.is_available():
        raise ValueError(f"{key}: Liger's kernels are Triton (CUDA only) and this worker has no GPU: set it to false")
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError:
        raise ValueError(
            f"{key}: liger-kernel is not installed: pip install -e '.[gpu]', or set it to false"
        ) from None
    # The head stays easyrl's (module docstring): no Liger cross-entropy of either kind.
    getattr(monkey_patch, family.liger)(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
    )
    logger.info("Liger kernels (RMSNorm, SwiGLU, RoPE) on the %s model (%s)", family.title, key)
