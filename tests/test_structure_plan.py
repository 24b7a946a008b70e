"""Structure rules of the run plan's decisions that later changes added (tests/test_structure.py is at its size
budget): each names what it keeps in one place."""

from __future__ import annotations

import ast

from tests.test_structure import MODULES, _inside


def _reuse_reads(source: str) -> list[int]:
    """Lines of `source` that read `.reuse_first_forward` or call `old_pass_rows`: the old pass's rows decided anew."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        read = (
            isinstance(node, ast.Attribute) and node.attr == "reuse_first_forward" and isinstance(node.ctx, ast.Load)
        )
        called = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "old_pass_rows"
        if read or called:
            hits.append(node.lineno)
    return sorted(set(hits))


def test_only_the_run_plan_decides_which_rows_the_old_log_prob_pass_runs_over() -> None:
    """`RunPlan.old_log_prob_pass` (all rows / all but mini-batch 1 / none) is decided once; the trainer, the role
    specs and `easyrl check` read it (the worker its spec), never `worker.actor.reuse_first_forward` again."""
    assert _reuse_reads(
        "a = cfg.worker.actor.reuse_first_forward\nb = old_pass_rows(x=1)\nc = dict(old_pass_rows=1)\n"
    ) == [1, 2]
    rooms = ("easyrl.config", "easyrl.trainer.plan")
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if not any(_inside(m, room) for room in rooms)
        for line in _reuse_reads(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "read easyrl.trainer.plan.RunPlan.old_log_prob_pass:\n" + "\n".join(offenders)
