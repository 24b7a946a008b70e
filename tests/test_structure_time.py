"""Executable rules that keep `make test` inside its time budget (docs/testing.md, "Test time"): the set-ups that cost
seconds on CI's 2 cores are made once and shared, not remade by each module."""

from __future__ import annotations

import ast
import re
from pathlib import Path


TESTS = Path(__file__).resolve().parent


def _own_ray_sessions(source: str) -> list[int]:
    """Lines of a test module that define a `ray_session` fixture of its own or import another module's."""
    pattern = re.compile(r"^def ray_session\(|^from tests\..* import .*\bray_session\b")
    return [line for line, text in enumerate(source.splitlines(), 1) if pattern.search(text)]


def test_the_ray_modules_share_the_conftest_ray_session() -> None:
    """A local Ray start and stop cost ~5 s on 2 cores: the modules whose runs need Ray ask for tests/conftest.py's
    `ray_session`, which stays up from one such module to the next; a module-scoped copy would start its own."""
    assert _own_ray_sessions("def ray_session():\nfrom tests.trainer.test_e2e import run, ray_session\n") == [1, 2]
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for line in _own_ray_sessions(path.read_text(encoding="utf-8"))
    ]
    assert not found, 'use pytest.mark.usefixtures("ray_session") (tests/conftest.py) instead, at ' + ", ".join(found)


def test_the_ray_modules_of_a_folder_run_one_after_another_after_the_others() -> None:
    """tests/conftest.py orders each folder's modules that use `ray_session` after its other modules, so the shared
    instance starts once per folder."""
    from types import SimpleNamespace

    from tests.conftest import ray_modules_last

    def item(path: str, *fixtures: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path(path), fixturenames=fixtures)

    items = [item("a/x.py", "ray_session"), item("a/x.py"), item("a/y.py"), item("a/z.py", "ray_session"),
             item("a/z.py", "tmp_path"), item("b/u.py", "ray_session"), item("b/v.py")]  # fmt: skip
    assert ray_modules_last(items) == {Path("a/x.py"), Path("a/z.py"), Path("b/u.py")}
    assert [(str(i.path), i.fixturenames) for i in items] == [
        ("a/y.py", ()), ("a/x.py", ("ray_session",)), ("a/x.py", ()), ("a/z.py", ("ray_session",)),
        ("a/z.py", ("tmp_path",)), ("b/v.py", ()), ("b/u.py", ("ray_session",)),
    ]  # fmt: skip
    conftest = (TESTS / "conftest.py").read_text(encoding="utf-8")
    hook = conftest[conftest.index("def pytest_collection_modifyitems") : conftest.index("def ray_modules_last")]
    assert "ray_modules_last(items)" in hook


def _extended_estimators(source: str) -> list[str]:
    """The `algorithm.adv_estimator` of each `pytest.param(..., marks=pytest.mark.extended)` case in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param"):
            continue
        if not any(k.arg == "marks" and "extended" in ast.unparse(k.value) for k in node.keywords):
            continue
        for arg in node.args:
            if isinstance(arg, ast.Dict):
                for key, value in zip(arg.keys, arg.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "algorithm.adv_estimator":
                        found.append(ast.literal_eval(value))
    return found


EXTENDED_ESTIMATOR_COVERS = {"gae": ("workers/test_batching.py", "test_dynamic_batching_two_workers_end_to_end")}
"""An estimator whose trainer path is not the golden run's, left `extended` in test_e2e.py: the `make test` test
that trains it end to end."""


def test_the_extended_estimator_runs_share_the_golden_runs_path() -> None:
    """`test_e2e.py::test_two_steps_per_algorithm` leaves to `make test-extended` only estimators whose trainer path
    is the golden GRPO run's (no critic, no greedy baseline: `easyrl.trainer` branches on nothing else), so their
    `make test` cover is the golden run plus each estimator's own tests against hand numbers; or one that another
    `make test` test (not `extended`) trains end to end (`EXTENDED_ESTIMATOR_COVERS`)."""
    from easyrl.config.names import BUILTIN_ESTIMATOR_NEEDS

    sample = 'pytest.param({"algorithm.adv_estimator": "gae"}, marks=pytest.mark.extended)\n{"a": 1}'
    assert _extended_estimators(sample) == ["gae"]
    moved = _extended_estimators((TESTS / "trainer" / "test_e2e.py").read_text(encoding="utf-8"))
    assert moved, "no extended estimator case found: update this rule with the test"
    # what the run (outside the config's validation and the registry) reads of an estimator's needs
    fields = ("needs_critic", "needs_greedy_baseline", "grouped")
    run_code = [p for p in (TESTS.parent / "easyrl").rglob("*.py") if p.parent.name not in ("config", "algorithms")]
    read = {f for p in run_code for f in fields if re.search(rf"\.{f}\b", p.read_text(encoding="utf-8"))}
    assert read <= {"needs_critic", "needs_greedy_baseline"}, f"the run now branches on {read}: widen this rule"
    golden = BUILTIN_ESTIMATOR_NEEDS["grpo"]
    for name in moved:
        if name in EXTENDED_ESTIMATOR_COVERS:
            file, test = EXTENDED_ESTIMATOR_COVERS[name]
            tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
            (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test]
            assert f'"algorithm.adv_estimator": "{name}"' in ast.unparse(node).replace("'", '"'), f"{test}: not {name}"
            assert not any("extended" in ast.unparse(d) for d in node.decorator_list), f"{file}::{test} is extended"
            continue
        needs = BUILTIN_ESTIMATOR_NEEDS[name]
        same = (needs.needs_critic, needs.needs_greedy_baseline) == (golden.needs_critic, golden.needs_greedy_baseline)
        assert same, f"{name}'s trainer path is not the golden run's: run its two steps in make test (drop the mark)"


E2E = "trainer/test_e2e.py"
MOVED_TO_EXTENDED = {
    (E2E, "test_grpo_three_steps_changes_every_parameter"): [(E2E, "test_same_seed_same_trajectory")],
    (E2E, "test_two_steps_per_algorithm"): [
        (E2E, "test_same_seed_same_trajectory"),
        ("workers/test_batching.py", "test_dynamic_batching_two_workers_end_to_end"),
        (E2E, "test_online_filtering_refills_the_batch"),
    ],
    ("trainer/test_vl_e2e.py", "test_vl_grpo_two_steps"): [("trainer/test_vl_e2e.py", "test_vl_ppo_with_critic")],
    ("trainer/test_val_reward_errors.py", "test_val_reward_errors_are_counted"): [
        ("trainer/test_val_reward_errors.py", "test_validation_asks_the_engines_for_no_log_probs")
    ],
    ("trainer/test_rollout_correction.py", "test_each_correction_trains_and_logs_its_metrics"): [
        ("trainer/test_rollout_correction.py", "test_tis_cap_is_the_token_tis_preset")
    ],
}
"""Tests (or some of their cases) that `make test` leaves to `make test-extended` because another `make test` test
runs their code path or makes their checks on its own run (docs/testing.md, "round 4"): (file, test) -> the covers."""


def _test_text(file: str, name: str) -> tuple[str, ast.FunctionDef]:
    """The source lines of test `name` in tests/`file`, its decorators and their comments included, and its node."""
    source = (TESTS / file).read_text(encoding="utf-8")
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert nodes, f"tests/{file} has no {name}: update MOVED_TO_EXTENDED with the test"
    node = nodes[0]
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return "\n".join(source.splitlines()[first - 1 : node.end_lineno]), node


def test_each_test_moved_to_extended_names_its_make_test_cover() -> None:
    """A moved test carries the `extended` mark (on itself or on its moved cases) and names, in its marker comment or
    docstring, the `make test` test that covers it; that cover exists and is not `extended` itself."""
    for (file, name), covers in MOVED_TO_EXTENDED.items():
        text, _ = _test_text(file, name)
        assert "pytest.mark.extended" in text, f"tests/{file}::{name} is not marked extended"
        for cover_file, cover in covers:
            assert cover in text, f"tests/{file}::{name} does not name its make test cover {cover}"
            _, node = _test_text(cover_file, cover)
            marks = [ast.unparse(d) for d in node.decorator_list]
            assert not [m for m in marks if "extended" in m], f"the cover tests/{cover_file}::{cover} is extended"
