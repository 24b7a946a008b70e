"""The fused heads' backward, by blocks of vocabulary columns: no (V, H) buffer beside the weight's own gradient.

Both fused heads (`easyrl.workers.packing.FusedLinearLogProbs` in torch, `easyrl.workers.head_kernel` in Triton)
walk their forward by chunks of token rows: a row's log-prob needs its whole vocabulary (the log-sum-exp), so the
forward cannot split the columns. It keeps two floats per row for the backward: the log-sum-exp `lse` and `E_p[z]`.
With those, the gradient of a logit needs nothing else of its row, so the backward can walk the columns instead:

    for each block of columns c:  z = h @ W[c].T (all rows);  grad_z = f(z, lse, E_p[z], labels, incoming grads)
                                   grad_W[c] = grad_z.T @ h     (written once, in the weight's dtype)
                                   grad_h += grad_z @ W[c]

Why columns: over row chunks, every chunk adds a (V, H) product into grad_W, and a bf16 running sum would round
at each chunk, so the sum needs an fp32 (V, H) buffer (4 bytes a weight, 0.9 GB at Qwen2.5-1.5B's head, 2.2 GB at
7B's) plus a (V, H) product per chunk. Over column blocks each block of grad_W is one GEMM over all rows (its
reduction in fp32 inside the GEMM, rounded once); what is summed across blocks is grad_h, (N, H), far smaller than
(V, H) (N tokens of a micro-batch against a 152k vocabulary). Same FLOPs: one recomputed logits GEMM and two
gradient GEMMs, as by rows.

A block holds at most as many logits as the forward's (chunk, V) block (`vocab_block`), so the head's working
memory is the forward's. A micro-batch of at most `chunk` rows is one block: the whole vocabulary, no sum at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def vocab_block(rows: int, vocab: int, chunk: int) -> int:
    """Columns per backward block for `rows` token rows: at most `chunk` x `vocab` logits a block (the forward's
    (chunk, V) block), a multiple of 128 columns where that many fit (the GEMMs' tile width). At least one column:
    past chunk x V rows (33 million at a 32k vocabulary) a block holds more than the forward's."""
    if rows <= chunk:
        return vocab
    cols = max(1, chunk * vocab // rows)
    return cols - cols % 128 if cols >= 128 else cols


class _HiddenGrad:
    """grad_h = sum over blocks of grad_z @ W[c], (N, H), returned in the hidden states' dtype.

    One block: the product is the result. fp32 (the CPU runs): summed in place by the GEMM (`addmm_`). bf16/fp16
    over several blocks: each block's product (the GEMM's fp32 reduction, rounded once) added into an fp32 (N, H)
    sum, rounded once at the end, so the error does not grow with the number of blocks.
    """

    def __init__(self, hidden: torch.Tensor, blocks: int) -> None:
        self.dtype = hidden.dtype
        self.single = blocks == 1
        if self.single:
            self.acc = torch.empty_like(hidden)  # written whole by the one product
        else:  # no rows, or several blocks (zeros: the first block adds into it)
            self.acc = torch.zeros_like(hidden, dtype=torch.promote_types(hidden.dtype, torch.float32))

    def add(self, grad_z: torch.Tensor, w: torch.Tensor) -> None:
        if self.single:
            torch.mm(grad_z, w, out=self.acc)
        elif self.acc.dtype == grad_z.dtype:
            self.acc.addmm_(grad_z, w)
        else:
            self.acc.add_(grad_z @ w)  # (N, H) in the model's dtype, added in fp32

    def result(self) -> torch.Tensor:
        return self.acc if self.acc.dtype == self.dtype else self.acc.to(self.dtype)


BlockGrad = Callable[[int, int, torch.Tensor], torch.Tensor]
"""(first column, end column, the block's logits (N, c) in the model's dtype) -> d loss / d logits (N, c) in the
model's dtype (it may be the same tensor, overwritten)."""


def backward_by_vocab_blocks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk: int,
    grad_block: BlockGrad,
    needs: tuple[bool, bool],
    logits_buffer: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden, grad_weight) of a fused head whose d loss / d logits `grad_block` gives block by block; `needs`:
    which of the two are wanted (a LoRA actor's head weight is frozen). `logits_buffer`: the block's logits are
    computed into one buffer reused by every block (a `grad_block` that overwrites them in place, the Triton
    kernel's), else freshly (the torch head's, which frees them once read in fp32)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cols = vocab_block(n, vocab, chunk)
    starts = range(0, vocab, cols)
    grad_hidden = _HiddenGrad(hidden, len(starts) if n else 0) if needs[0] else None
    # Every block writes its own rows of grad_W: no sum over blocks, so no buffer but the result itself
    grad_weight = torch.empty_like(weight) if needs[1] else None
    if n == 0:  # no token: a zero gradient for the weight (its rows are never written below)
        return (None if grad_hidden is None else grad_hidden.result()), (
            None if grad_weight is None else grad_weight.zero_()
        )
    buf = hidden.new_empty(n * cols) if logits_buffer else None
    for start in starts:
        end = min(start + cols, vocab)
        w = weight[start:end]
        if buf is not None:  # contiguous (N, c) view: the ragged last block takes the buffer's head
            logits = torch.mm(hidden, w.T, out=buf[: n * (end - start)].view(n, end - start))
        else:
            logits = hidden @ w.T
        grad_z = grad_block(start, end, logits)
        del logits  # the torch head's block: its fp32 copies are gone, and this one with them
        if grad_weight is not None:
            torch.mm(grad_z.T, hidden, out=grad_weight[start:end])
        if grad_hidden is not None:
            grad_hidden.add(grad_z, w)
    return (None if grad_hidden is None else grad_hidden.result()), grad_weight
