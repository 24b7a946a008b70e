"""The CPU examples beside the demo run as they ship and learn, each for a few steps through the command a user types
(`easyrl train|sft configs/<example>.yaml`, from the repository root, with only the step count, validation and
logging overridden):

- configs/demo_distill.yaml: the demo's fresh student distilled from the shipped teacher (assets/demo_teacher): its
  sampled validation reward rises and its reverse KL to the teacher falls;
- configs/demo_judge.yaml: the same student scored by a judge easyrl serves from assets/demo_judge (vLLM's CPU build):
  the reward under the dataset's rule, which the student never sees, rises;
- configs/demo_sft.yaml: the warm start's rows shipped in assets/demo_sft: the validation loss falls.

The bounds leave a wide margin under what the full runs measured (README, "Examples"). The shipped teacher and judge
are the demo's trained policy: the judge computes the teacher's logits (a copy with wider heads), checked here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _run(tmp_path: Path, command: str, config: str, *overrides: str) -> list[dict[str, float]]:
    """`easyrl <command> configs/<config>` from the repository root; the logged rows."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "easyrl.cli", command, f"configs/{config}", "trainer.logger=[file]",
         "trainer.val_generations_to_log=0", f"trainer.save_checkpoint_path={run}", *overrides],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run / "experiment_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_distillation_example_learns_from_its_teacher(tmp_path: Path) -> None:
    # full run (30 steps): 0.26 -> 0.8x sampled validation reward; here 5 steps (4 epochs each)
    rows = _run(tmp_path, "train", "demo_distill.yaml", "trainer.max_steps=5", "trainer.val_freq=5")
    val = [r for r in rows if "val/reward/mean@4" in r]
    assert [r["step"] for r in val] == [0, 5]
    assert val[1]["val/reward/mean@4"] > val[0]["val/reward/mean@4"] + 0.15, val
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    assert len(kl) == 5 and kl[-1] < 0.7 * kl[0], kl


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_served_judge_example_learns_from_its_verdicts(tmp_path: Path) -> None:
    rows = _run(tmp_path, "train", "demo_judge.yaml", "trainer.max_steps=8", "trainer.val_freq=-1",
                "trainer.val_before_train=false")  # fmt: skip
    steps = [r for r in rows if "reward/rule" in r]
    assert len(steps) == 8  # the full run gained +0.22 by step 8 (README, "Examples")
    assert sum(r["judge/errors"] + r["judge/parse_errors"] for r in steps) == 0
    assert all(r["judge/requests"] > 0 for r in steps)
    first, last = steps[:3], steps[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "reward/rule") > mean(first, "reward/rule") + 0.1, [r["reward/rule"] for r in steps]


@pytest.mark.slow
def test_the_sft_example_runs_on_its_shipped_data(tmp_path: Path) -> None:
    # full run (550 steps): validation loss 5.62 -> 0.03; here 20 steps
    rows = _run(tmp_path, "sft", "demo_sft.yaml", "trainer.max_steps=20", "trainer.val_freq=20")
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(val) == 2 and val[1] < 0.8 * val[0], val


def test_the_shipped_judge_is_the_shipped_teacher_with_wider_heads() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "demo_teacher", dtype=torch.float32).eval()
    judge = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "demo_judge", dtype=torch.float32).eval()
    assert judge.config.head_dim == 32 and teacher.config.hidden_size // teacher.config.num_attention_heads == 16
    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "demo_teacher")
    ids = tokenizer(["Copy: 4 1 7", "Reverse: 6 3 1 7 0 6"], return_tensors="pt", padding=True)
    with torch.no_grad():
        gap = (teacher(**ids).logits - judge(**ids).logits).abs().max().item()
    assert gap < 1e-4, gap
