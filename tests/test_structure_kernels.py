"""Architecture as executable rules for the kernels of issue 44 item 3, Triton and torch.compile (tests/test_structure.py
and tests/test_structure_rules.py hold the others; both are at their size budget)."""

from __future__ import annotations

import ast
import re

from tests.test_structure import MODULES, PACKAGE
from tests.test_structure_rules import _third_party_imports


HEAD_KERNEL = "easyrl.workers.head_kernel"


def _top_level_imports_of(source: str, module: str) -> list[int]:
    """Lines of `source` that import `module` (or a name from it) at module level, where every import of the module
    that holds them would run it."""
    lines = []
    for node in ast.parse(source).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        if module in names:
            lines.append(node.lineno)
    return lines


def test_the_rule_finds_a_top_level_import_only() -> None:
    source = f"import {HEAD_KERNEL}\ndef f():\n    from {HEAD_KERNEL} import x\nfrom {HEAD_KERNEL} import y\n"
    assert _top_level_imports_of(source, HEAD_KERNEL) == [1, 4]


def test_triton_is_imported_by_the_head_kernel_module_only_and_it_lazily() -> None:
    """triton is an optional extra (`gpu`, `dev`): one module imports it, and no module imports that one at its top
    level, so `import easyrl...` never needs triton; the fused head reaches it on first use of the switch
    (`worker.actor.fused_head_kernel: triton`)."""
    naming = [f"{m}:{line}" for m, path in MODULES.items() if m != HEAD_KERNEL
              for line in _third_party_imports(path.read_text(encoding="utf-8"), "triton")]  # fmt: skip
    assert not naming, f"import triton in {HEAD_KERNEL} only:\n" + "\n".join(naming)
    assert _third_party_imports(MODULES[HEAD_KERNEL].read_text(encoding="utf-8"), "triton")
    eager = [f"{m}:{line}" for m, path in MODULES.items()
             for line in _top_level_imports_of(path.read_text(encoding="utf-8"), HEAD_KERNEL)]  # fmt: skip
    assert not eager, f"import {HEAD_KERNEL} inside the function that needs it:\n" + "\n".join(eager)


def test_the_gpu_and_dev_extras_bring_triton() -> None:
    """The `gpu` extra runs the kernels; `dev` runs their CPU tests in Triton's interpreter (CI)."""
    import tomllib

    extras = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for extra in ("gpu", "dev"):
        names = {re.split(r"[<>=\[; ]", dep)[0] for dep in extras["optional-dependencies"][extra]}
        assert "triton" in names, (extra, names)


def _compile_calls(source: str) -> list[str]:
    """The receiver of each `X.compile(...)` call (`torch` for torch.compile), `re.compile` aside."""
    calls = [
        n.func for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    return [ast.unparse(f.value) for f in calls if f.attr == "compile" and ast.unparse(f.value) != "re"]


def test_torch_compile_is_applied_in_one_place_in_place() -> None:
    """`worker.actor.model.compile_layers`: one module compiles, with `nn.Module.compile` (in place); `torch.compile`
    would wrap modules and put `_orig_mod.` into every name a checkpoint, merge or weight sync reads."""
    assert _compile_calls("import re, torch\nre.compile('x')\ntorch.compile(m)\nlayer.compile()\n") == [
        "torch",
        "layer",
    ]
    offenders = [
        m for m, path in MODULES.items() if m != "easyrl.models.compiled_layers" and _compile_calls(path.read_text())
    ]
    assert not offenders, "compile through easyrl.models.compiled_layers: " + ", ".join(offenders)
    assert _compile_calls(MODULES["easyrl.models.compiled_layers"].read_text()) == ["layer"]  # never torch.compile


def test_both_fused_heads_take_their_backward_from_head_grad() -> None:
    """One backward walk for both fused heads (`easyrl.workers.head_grad.backward_by_vocab_blocks`: blocks of
    vocabulary columns, no (V, H) sum): each head's autograd backward calls it and makes no buffer shaped like the
    weight itself (`zeros_like(weight, ...)` and kin: the row-chunked sum this replaced)."""
    for module in ("easyrl.workers.packing", HEAD_KERNEL):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        backwards = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "backward"]
        assert len(backwards) == 1, (module, len(backwards))
        calls = [c for c in ast.walk(backwards[0]) if isinstance(c, ast.Call)]
        assert any(isinstance(c.func, ast.Name) and c.func.id == "backward_by_vocab_blocks" for c in calls), module
        like_weight = [
            c.lineno
            for c in calls
            if isinstance(c.func, ast.Attribute)
            and c.func.attr in ("zeros_like", "empty_like", "full_like", "ones_like")
            and c.args[:1]
            and isinstance(c.args[0], ast.Name)
            and c.args[0].id == "weight"
        ]
        assert not like_weight, f"{module}: a buffer shaped like the head weight in its backward, lines {like_weight}"
