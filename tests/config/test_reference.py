"""The config reference is generated from the dataclasses and kept in sync; the public key set is frozen."""

from __future__ import annotations

from pathlib import Path

from easyrl.config import EasyRLConfig
from easyrl.config.docs import field_docs, render_config_reference
from easyrl.config.loader import _schema_paths


REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("config_keys.txt")


def test_docs_config_md_is_in_sync() -> None:
    expected = render_config_reference()
    actual = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/config.md is stale: run `python scripts/gen_config_docs.py`"


def test_every_field_has_a_docstring() -> None:
    import dataclasses
    import typing

    missing = []
    todo: list[tuple[str, type]] = [("", EasyRLConfig)]
    while todo:
        prefix, schema = todo.pop()
        docs = field_docs(schema)
        for f in dataclasses.fields(schema):
            sub = typing.get_type_hints(schema)[f.name]
            if f.name not in docs:
                missing.append(prefix + f.name)
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                todo.append((f"{prefix}{f.name}.", sub))
    assert not missing, f"fields without a docstring: {missing}"


def test_public_keys_snapshot() -> None:
    """Adding or removing a config key edits tests/config/config_keys.txt in the same change."""
    keys = sorted(_schema_paths(EasyRLConfig))
    assert keys == SNAPSHOT.read_text().split(), "config keys changed: update tests/config/config_keys.txt"


def test_builtin_names_match_the_registry() -> None:
    """The torch-free name lists the validator uses are exactly what easyrl.algorithms registers."""
    import easyrl.algorithms as algorithms
    from easyrl.config import names

    def ours(listed: list[str], get) -> list[str]:  # other tests register their own names in the same registry
        return sorted(n for n in listed if get(n).__module__.startswith("easyrl.algorithms"))

    assert sorted(names.BUILTIN_ADV_ESTIMATORS) == ours(
        algorithms.list_advantage_estimators(), algorithms.get_advantage_estimator
    )
    assert sorted(names.BUILTIN_POLICY_LOSSES) == ours(algorithms.list_policy_losses(), algorithms.get_policy_loss)
    assert frozenset(algorithms.GROUP_ESTIMATORS) == names.GROUP_ESTIMATORS
    assert set(names.KL_PENALTY_KINDS) == set(algorithms.KL_PENALTY_KINDS) - {"full"}
    assert tuple(names.LOSS_AGG_MODES) == tuple(algorithms.LOSS_AGG_MODES)
