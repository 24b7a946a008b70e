"""What changed in the config since a checkpoint was saved, and whether resuming from it may go on.

Each checkpoint keeps the (masked) config it was saved under. On resume the two are compared key by key:

* run-management keys (how long to run, where to log, how often to save or validate): one info line naming them;
* anything else (a learning rate, the advantage estimator, the seed, the data): a warning naming each key with its
  old and new value, since the run's record then mixes two configurations;
* the model itself (its path, tokenizer, config overrides or LoRA shape): refused, because the checkpoint's weights
  would be loaded into a model they were not trained as, unless `trainer.allow_model_change_on_resume` is set.

Values are compared in their masked form, so a secret is never shown (and a changed secret is not reported).
"""

from __future__ import annotations

from typing import Any

from easyrl.config.errors import ConfigError


__all__ = ["ALLOW_MODEL_CHANGE", "config_changes", "resume_config_report"]

ALLOW_MODEL_CHANGE = "trainer.allow_model_change_on_resume"

# Keys that steer the run around the training (length, logging, saving, validation cadence, resume itself):
# changing them on resume is ordinary, e.g. raising max_steps to train longer.
_RUN_MANAGEMENT = frozenset(
    f"trainer.{name}"
    for name in (
        "max_steps",
        "total_epochs",
        "logger",
        "project_name",
        "experiment_name",
        "save_freq",
        "save_limit",
        "save_model_only",
        "save_on_interrupt",
        "val_freq",
        "val_before_train",
        "val_generations_to_log",
        "val_only",
        "load_checkpoint_path",
        "find_last_checkpoint",
        "verify_checkpoint",
        "fallback_to_older_checkpoint",
        "allow_model_change_on_resume",
        "worker_timeout_s",
        "hang_timeout_s",
        "stop_grace_s",
        "ray_num_cpus",
    )
)
# Under `worker.<role>.model.`: what decides which model the checkpoint's weights are loaded into.
_MODEL_FIELDS = ("model_path", "tokenizer_path", "override_config", "lora")
_LORA_HARMLESS = ("lora.dropout", "lora.rollout_sync")  # no effect on the adapter's shapes


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _kind(key: str) -> str:
    """ "model", "run" (run management) or "training"."""
    if key in _RUN_MANAGEMENT:
        return "run"
    role_field = key.split(".model.", 1)[1] if key.startswith("worker.") and ".model." in key else ""
    if role_field.startswith(_MODEL_FIELDS) and not role_field.startswith(_LORA_HARMLESS):
        return "model"
    return "training"


def config_changes(
    saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, tuple[Any, Any, str]]:
    """`{dotted key: (saved value, current value, kind)}` for every leaf that differs (or exists in one only);
    kind is "model", "run" or "training" (see the module docstring). With `defaults` (the schema's config, same
    shape), a key the saved record lacks and the current config holds at its default is no change: the key came with
    a newer easyrl, and its default is what the checkpoint was trained with (a feature off, as it did not exist)."""
    old, new = _flatten(saved), _flatten(current)
    default = _flatten(defaults) if defaults is not None else {}
    missing = object()
    out: dict[str, tuple[Any, Any, str]] = {}
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, missing), new.get(key, missing)
        if before is missing and key in default and after == default[key]:
            continue
        if before != after:
            out[key] = (
                "(absent)" if before is missing else before,
                "(absent)" if after is missing else after,
                _kind(key),
            )
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def resume_config_report(
    saved: dict[str, Any],
    current: dict[str, Any],
    checkpoint: str,
    allow_model_change: bool,
    defaults: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """(info lines, warning lines) about resuming `checkpoint` (saved under `saved`) with `current`; `defaults` as in
    `config_changes`.

    Raises:
        ConfigError: the model changed and `trainer.allow_model_change_on_resume` is not set; names each key.
    """
    changes = config_changes(saved, current, defaults)
    by_kind: dict[str, list[str]] = {"run": [], "training": [], "model": []}
    for key, (before, after, kind) in changes.items():
        by_kind[kind].append(f"{key}: {_shown(before)} -> {_shown(after)}")
    if by_kind["model"] and not allow_model_change:
        first = next(key for key, change in changes.items() if change[2] == "model")
        raise ConfigError(
            first,
            f"the model changed since {checkpoint} was saved ({'; '.join(by_kind['model'])}): its weights would be "
            f"loaded into another model. Put the old value back, start a new run (another save_checkpoint_path), "
            f"or set {ALLOW_MODEL_CHANGE}=true if the change is intended",
        )
    info = [f"resuming {checkpoint} with changed run settings: {'; '.join(by_kind['run'])}"] if by_kind["run"] else []
    warnings = []
    if by_kind["training"]:
        warnings.append(
            f"resuming {checkpoint} with a changed training config (the run's record now mixes two): "
            + "; ".join(by_kind["training"])
        )
    if by_kind["model"]:
        warnings.append(
            f"resuming {checkpoint} with a changed model ({ALLOW_MODEL_CHANGE}): " + "; ".join(by_kind["model"])
        )
    return info, warnings
