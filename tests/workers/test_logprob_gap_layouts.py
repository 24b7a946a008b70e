"""Without the old-log-prob pass the update's own forward measures the engine against the trainer
(`rollout/token_prob_error`, `rollout/logprob_diff_mean`, `_max`: `policy_objective`), and the figure is the whole
mini-batch's at every layout: 1 rank, 2 data-parallel ranks with 1 or 4 rows a micro-batch, a Ulysses group of 2,
and 2 ranks holding 5 and 3 rows with token-budget micro-batches (rank 1 runs a dummy, a copy of a scored row). Only
some rows have engine log-probs, none of them on rank 0 in the even split: a mean of per-micro-batch or per-rank
means would weigh them wrongly, and a rank with nothing scored must still join the reduction. FSDP2 over gloo, the
tiny Qwen2, the actor's real objective."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from easyrl.algorithms.logprob_gap import DIFF_MAX, DIFF_MEAN, TOKEN_PROB_ERROR
from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks
from tests.workers.test_layout_invariance import RESPONSES, WORLD, _batch, _step


FIGURES = (TOKEN_PROB_ERROR, DIFF_MEAN, DIFF_MAX)
SCALE = [1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 5.0, 1.3]
"""Per row, the engine's probability of each sampled token over the trainer's: rows 0-3 and 6 get no engine
log-probs (row 6's would be far off: it must not count), rows 4, 5, 7 (10, 10 and 2 tokens) are off by 1.1, 1.2,
1.3."""
SAMPLED = [False, False, False, False, True, True, False, True]
WANT = {
    TOKEN_PROB_ERROR: (10 * 1.1 + 10 * 1.2 + 2 * 1.3) / 22,  # 1.1636; the rows' own means averaged: 1.2
    DIFF_MEAN: (10 * math.log(1.1) + 10 * math.log(1.2) + 2 * math.log(1.3)) / 22,
    DIFF_MAX: math.log(1.3),
}
LAYOUTS: list[tuple[str, ForwardOptions, int, list[int]]] = [
    # (name, forward options, micro-batch size, rows of each rank: a DP split, or uneven)
    ("dp2", ForwardOptions(padding_free=True), 4, [4, 4]),
    ("dp2-micro1", ForwardOptions(padding_free=True), 1, [4, 4]),
    ("sp2", ForwardOptions(padding_free=True, ulysses_size=2), 8, [8, 8]),
    # budget 11: rank 0's rows (5, 6, 6, 7, 14 tokens) make 4 micro-batches, rank 1's (14, 8, 6) 3 and a dummy
    ("dp2-uneven-dynamic", ForwardOptions(padding_free=True, max_token_len=11), 8, [5, 3]),
]


def _with_engine_log_probs(model_dir: str) -> Batch:
    """The test batch with an engine that is the policy scaled by `SCALE` on the rows in `SAMPLED`, a reference a
    little off (the objective's KL loss), and no old log-probs: the pass was skipped."""
    from easyrl.config import ModelConfig
    from easyrl.workers.forward_backward import token_log_probs
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.varlen import register_varlen_attention

    batch = _batch()
    model = load_model(ModelConfig(model_path=model_dir), attn_implementation=register_varlen_attention())
    with torch.no_grad():
        policy, _ = token_log_probs(model, batch, torch.device("cpu"), 1.0, False, ForwardOptions(padding_free=True))
    engine = policy + torch.tensor(SCALE).log().unsqueeze(1)
    noise = 0.1 * torch.randn(policy.shape, generator=torch.Generator().manual_seed(1))
    return batch.set(
        rollout_log_probs=engine, rollout_logprob_mask=torch.tensor(SAMPLED), ref_log_probs=policy + noise
    )


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:

    torch.set_num_threads(1)
    batch = _with_engine_log_probs(model_dir)
    single = _step(model_dir, batch, "actor", "token-mean", ForwardOptions(padding_free=True), 8)["metrics"]
    init_rank(rank, world)
    report: dict[str, Any] = {"single": {k: single.get(k) for k in FIGURES}}
    for name, opts, micro, split in LAYOUTS:
        start = 0 if opts.ulysses_size > 1 or rank == 0 else split[0]  # a sequence-parallel group shares its rows
        rows = batch.slice(start, start + split[rank])
        got = _step(model_dir, rows, "actor", "token-mean", opts, micro)["metrics"]
        report[name] = {k: got.get(k) for k in FIGURES}
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    close_rank()


def test_the_update_measures_the_engine_over_the_whole_mini_batch_at_every_layout(tmp_path: Path) -> None:
    from easyrl.testing.tiny import build_tiny_checkpoint

    assert len(RESPONSES) == len(SCALE) == len(SAMPLED) and WORLD == 2
    model_dir = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    out = tmp_path / "report.json"
    run_ranks(_worker, WORLD, model_dir, str(out))
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(["single", *(name for name, *_ in LAYOUTS)])
    for name, figures in report.items():
        # The training forward against the no-grad one that made the engine's log-probs: float32 noise only.
        for key, want in WANT.items():
            assert figures[key] is not None, (name, key)
            assert abs(figures[key] - want) < 1e-5, (name, key, figures[key], want)
            assert abs(figures[key] - report["single"][key]) < 1e-6, (name, key, figures[key])
