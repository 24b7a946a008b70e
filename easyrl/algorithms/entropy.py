"""Token entropy and sampled-token log-probs from logits, in chunks to bound peak memory.

A (B*T, V) logits tensor for a 150k vocabulary is several GiB; softmax/log_softmax would create more tensors of
the same size in fp32. Processing rows in chunks keeps the extra memory to one chunk.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


__all__ = ["entropy_from_logits", "logprobs_from_logits", "logprobs_from_logits_chunked", "scale_logits"]


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / temperature`` (..., V): the distribution the rollout sampled from, the one every training
    head (plain, packed, fused, sequence-parallel) takes log-probs and entropy of.

    Greedy decoding (0) has no such distribution, so training refuses it rather than silently using temperature 1
    (config validation refuses it first: it is for validation only).
    """
    if not temperature > 0:  # `not >`: NaN is refused too
        raise ValueError(
            f"temperature {temperature}: worker.rollout.temperature must be > 0 for training (e.g. 1.0); greedy (0) "
            "is for validation only (worker.rollout.val_override_config)"
        )
    logits = logits.float()
    # Skipping the division at 1 keeps the values bit-identical to the unscaled path (x / 1.0 is exact anyway).
    return logits if temperature == 1.0 else logits / temperature


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of (N, V) logits, computed in fp32: ``logsumexp(l) - sum(softmax(l) * l)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` along the last dimension.

    Rows are processed ``chunk_size`` at a time. When gradients are needed each chunk is checkpointed, so the
    backward pass recomputes the softmax instead of keeping a full-size fp32 copy per chunk alive.

    Args:
        logits: (..., V).
        chunk_size: rows (positions) per chunk.

    Returns:
        (...) entropy in nats, fp32.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    use_ckpt = flat.requires_grad and torch.is_grad_enabled()
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        if use_ckpt:
            parts.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            parts.append(_entropy_rows(chunk))
    if not parts:
        return torch.zeros(lead_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts, dim=0).reshape(lead_shape)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits``: ``log_softmax(logits)[..., labels]``.

    Args:
        logits: (..., V).
        labels: (...) int64 token ids.

    Returns:
        (...) log-probs, in the dtype of ``logits``.
    """
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def _logprob_rows(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N,) labels -> (N,) fp32 log-probs."""
    return torch.log_softmax(logits.float(), dim=-1).gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits_chunked(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Chunked, fp32 version of :func:`logprobs_from_logits` (same values up to rounding).

    Low-precision (bf16) log_softmax loses accuracy for large vocabularies, but an fp32 copy of all logits is
    large; chunking upcasts one slice at a time (checkpointed under autograd, as in ``entropy_from_logits``).

    Args:
        logits: (..., V).
        labels: (...) int64 token ids.
        chunk_size: rows per chunk.

    Returns:
        (...) fp32 log-probs.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    use_ckpt = flat.requires_grad and torch.is_grad_enabled()
    parts = []
    for chunk, chunk_labels in zip(flat.split(chunk_size, dim=0), flat_labels.split(chunk_size, dim=0)):
        if use_ckpt:
            parts.append(checkpoint(_logprob_rows, chunk, chunk_labels, use_reentrant=False))
        else:
            parts.append(_logprob_rows(chunk, chunk_labels))
    if not parts:
        return torch.zeros(lead_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts, dim=0).reshape(lead_shape)
