"""`easyrl check` finds, with one line and exit 2, what `train` would otherwise meet later or as a traceback: an
environment whose constructor needs arguments (every episode builds one with none), an environment that fails on
the first row, and workers the machine has no room for (a separate rollout pool beyond `trainer.ray_num_cpus`,
which `train` met only when the pool's placement group timed out a minute in; `train` now says it at once too) (issue 45 item 9)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from easyrl.cli import main
from easyrl.config import load_config
from tests.conftest import REPO


ENVS = '''
class NeedsArgs:
    def __init__(self, size, *, seed):
        self.size = size

    def reset(self, prompt: str, **row) -> str:
        return prompt

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b


class FailsOnReset(NeedsArgs):
    def __init__(self, size=3, *, seed=0):
        super().__init__(size, seed=seed)

    def reset(self, prompt: str, **row) -> str:
        raise RuntimeError("no such level")
'''


def _check(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.chdir(REPO)  # the demo configs name their files relative to the checkout
    code = main(["check", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize(
    ("cls", "line"),
    [
        (
            "NeedsArgs",
            r"easyrl: multi-turn error: environment default \([\w.]+\.NeedsArgs\) takes constructor arguments "
            r"\(size, seed\); each episode builds one with none: give them defaults, or read them from the row in "
            r"reset\(\*\*row\)",
        ),
        (
            "FailsOnReset",
            r"easyrl: multi-turn error: the first row's episode did not open: environment default: "
            r"FailsOnReset\.reset\(\*\*row\) raised RuntimeError: no such level",
        ),
    ],
)
def test_an_environment_that_cannot_start_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cls: str, line: str
) -> None:
    (tmp_path / "envs.py").write_text(ENVS)
    spec = f"worker.rollout.multi_turn.env={tmp_path / 'envs.py'}:{cls}"
    code, err = _check(["configs/demo_tools.yaml", spec], capsys, monkeypatch)
    assert code == 2
    assert re.fullmatch(line, err.strip()), err


def test_a_separate_rollout_pool_beyond_the_cpus_ray_gets_is_refused_at_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ["worker.rollout.placement=separate", "worker.rollout.n_gpus=1", "trainer.ray_num_cpus=2"]
    code, err = _check(["configs/demo_tools.yaml", *extra], capsys, monkeypatch)
    assert code == 2
    assert err.strip() == (
        "easyrl: placement error: trainer.ray_num_cpus=2 gives Ray fewer CPU slots than the 3 its workers take, one "
        "each (trainer.n_gpus_per_node=2 trainer workers + worker.rollout.n_gpus=1 rollout workers of placement: "
        "separate): raise it to 3 or leave it unset"
    ), err


def test_train_refuses_the_same_pool_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train` says it at once too, rather than after the placement group's minute (it starts no Ray, no worker)."""
    monkeypatch.chdir(REPO)
    extra = ["worker.rollout.placement=separate", "worker.rollout.n_gpus=1", "trainer.ray_num_cpus=2"]
    code = main(["train", "configs/demo_tools.yaml", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().startswith("easyrl: placement error: trainer.ray_num_cpus=2 gives Ray fewer CPU slots"), err
    assert "Traceback" not in err


def test_a_gpu_machine_without_the_gpus_of_a_separate_pool_is_named() -> None:
    from easyrl.check import placement_problem

    overrides = ["trainer.device=cuda", "worker.rollout.placement=separate", "worker.rollout.n_gpus=1"]
    cfg = load_config(REPO / "configs" / "demo_tools.yaml", overrides)
    assert placement_problem(cfg, gpus=2) == (
        "this machine has 2 GPU(s); the run takes 3, one per worker (trainer.n_gpus_per_node=2 trainer workers + "
        "worker.rollout.n_gpus=1 rollout workers of placement: separate)"
    )
    assert placement_problem(cfg, gpus=3) is None
    assert placement_problem(cfg, gpus=0) is None  # a login node: not the machine the run goes to
