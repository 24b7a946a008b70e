"""The config reference (docs/config.md), generated from the dataclasses and the docstring under each field."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing


def field_docs(schema: type) -> dict[str, str]:
    """{field name: the docstring written under it} for one dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return ""
    return "`null`" if value is None else f"`{value!r}`"


def _rows(schema: type, prefix: str, out: list[str], sections: list[tuple[str, type]]) -> None:
    hints = typing.get_type_hints(schema)
    docs = field_docs(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            sections.append((f"{prefix}{f.name}", kind))
            continue
        type_name = (getattr(kind, "__name__", None) or str(kind).replace("typing.", "")).replace(" | ", " or ")
        out.append(f"| `{prefix}{f.name}` | {type_name} | {_default(f)} | {docs.get(f.name, '')} |")


def render_config_reference() -> str:
    from easyrl.config import EasyRLConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the dataclasses in `easyrl/config/` by `python scripts/gen_config_docs.py`; a test keeps it",
        "in sync. Values load as dataclass defaults <- YAML file <- command-line `key=value`.",
        "",
    ]
    sections: list[tuple[str, type]] = [
        (f.name, typing.get_type_hints(EasyRLConfig)[f.name]) for f in dataclasses.fields(EasyRLConfig)
    ]
    while sections:
        name, schema = sections.pop(0)
        rows: list[str] = []
        nested: list[tuple[str, type]] = []
        _rows(schema, f"{name}.", rows, nested)
        lines += [f"## `{name}`", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
        sections[0:0] = nested
    from easyrl.config.loader import EASYR1_IGNORED, EASYR1_RENAMES

    lines += ["## Coming from EasyR1", "", "Renamed keys (applied automatically, with a note):", ""]
    lines += [f"- `{old}` -> `{new}`" for old, new in EASYR1_RENAMES.items() if old != new]
    lines += ["- `worker.{actor,critic}.loss_avg_mode: token|seq` -> `token-mean|seq-mean-token-mean`"]
    lines += ["- `worker.actor.loss_type: default` -> `ppo`", ""]
    lines += ["Accepted and ignored (easyrl has the behaviour built in, or it does not apply):", ""]
    lines += [f"- `{key}`" for key in sorted(EASYR1_IGNORED)]
    from easyrl.config.loader import LONGRL_IGNORED, LONGRL_RENAMES

    lines += ["", "## Coming from Long-RL", "", "Renamed keys (applied automatically, with a note):", ""]
    lines += [
        f"- `{old}` -> `{new}` (a cap on fps sampling; docs/vision_language.md)" for old, new in LONGRL_RENAMES.items()
    ]
    lines += ["", "Accepted and ignored:", ""]
    lines += [f"- `{key}`: {why}" for key, why in sorted(LONGRL_IGNORED.items())]
    return "\n".join(lines) + "\n"
