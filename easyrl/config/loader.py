"""Build an `EasyRLConfig` from dataclass defaults, a YAML file and `key=value` overrides.

Every problem is reported as a `ConfigError` naming the key and how to fix it, before anything starts.
Secrets: `load_config_and_secrets` also returns the config's `Secrets` (values of secret-looking keys and of
`${oc.env:...}` interpolations; see `easyrl.config.secrets`), which the run scrubs from everything it writes.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from easyrl.config.errors import ConfigError
from easyrl.config.secrets import Secrets, find_secrets


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig

# Keys an EasyR1 config may use that easyrl spells differently: old key -> our key (docs/config.md lists them).
EASYR1_RENAMES = {
    "worker.reward.score_function": "worker.reward.reward_function",
    "worker.reward.score_function_kwargs": "worker.reward.reward_function_kwargs",
    "trainer.total_episodes": "trainer.total_epochs",
    "data.format_prompt_path": "data.format_prompt",
    "trainer.max_try_make_batch": "algorithm.max_try_make_batch",
    # The image limit is a property of the prompts: data.limit_images bounds them for every engine.
    "worker.rollout.limit_images": "data.limit_images",
    # Long-RL's embedding cache folder: one cache per run, which every role reads (docs/vision_language.md)
    "worker.actor.cached_embeds_dir": "data.cache_dir",
}
# EasyR1 keys that describe behaviour easyrl has built in (or not yet): accepted, ignored, and reported.
EASYR1_IGNORED = {
    "worker.hybrid_engine",
    *(f"worker.{role}.strategy" for role in ("actor", "ref", "critic")),
    *(
        f"worker.{role}.fsdp.{key}"
        for role in ("actor", "ref", "critic")
        for key in ("enable_rank0_init", "use_orig_params", "fsdp_size", "mp_buffer_dtype")
    ),
    "worker.actor.use_torch_compile",
    "worker.critic.padding_free",  # the critic follows worker.actor.padding_free
    "worker.critic.dynamic_batching",  # the critic follows worker.actor.dynamic_batching
    "worker.rollout.disable_log_stats",
    "worker.rollout.disable_tqdm",
    "worker.rollout.trust_remote_code",
    "worker.reward.reward_type_name",
    "worker.reward.num_cpus",  # reward processes: worker.reward.num_workers
    "data.filter_overlong_prompts_workers",
    "trainer.ray_timeline",
}
# Long-RL (NVlabs/Long-RL, the EasyR1 fork for hour-long videos): its keys easyrl reads, each with what it does here.
LONGRL_RENAMES = {
    # Long-RL samples exactly N frames per video, evenly over its length (qwen-vl-utils' `nframes`); easyrl samples
    # data.video_fps frames a second, evenly, first and last frame kept, capped at data.max_frames: the same frames
    # whenever the video is long enough for the cap to bind (an hour at 2 fps is 7,200 frames > 3,600).
    "worker.rollout.num_video_frames": "data.max_frames",
}
LONGRL_IGNORED = {
    "worker.rollout.tokens_per_frame": "easyrl counts each frame's tokens from its size (data.max_pixels)",
    "worker.rollout.num_chunk_seq": "it splits the all_gather_object of video pixels between ranks into chunks; "
    "easyrl's driver hands each rank its own shard of the batch, so nothing gathers the pixels",
}
# EasyR1 values easyrl spells differently: key -> {EasyR1 value: easyrl value}.
_EASYR1_VALUES: dict[str, dict[Any, Any]] = {
    "worker.actor.loss_avg_mode": {"token": "token-mean", "seq": "seq-mean-token-mean"},
    "worker.critic.loss_avg_mode": {"token": "token-mean", "seq": "seq-mean-token-mean"},
    "worker.actor.loss_type": {"default": "ppo"},
}
# EasyR1 keys whose null means "the default" (a number in easyrl): a null is dropped.
_EASYR1_NULL_IS_DEFAULT = {f"worker.{role}.optim.min_lr_ratio" for role in ("actor", "critic")}


TASKS = ("rl", "sft")
"""What a config trains: `rl` (`easyrl train`) or `sft` (`easyrl sft`; a config with an `sft` section)."""


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: list[str] | None = None,
    notes: list[str] | None = None,
    task: str = "rl",
) -> EasyRLConfig:
    """Defaults <- YAML file at `path` <- `overrides` (`a.b=c` strings); validated for `task`, paths made absolute.
    `notes`, when given, receives what the caller should tell the user (EasyR1 keys renamed or ignored)."""
    return load_config_and_secrets(path, overrides, notes, task)[0]


def config_task(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> str:
    """`sft` when the config (file and overrides) sets the `sft` section, else `rl`: what `easyrl check` checks it
    as."""
    return "sft" if "sft" in _user_config(path, overrides) else "rl"


def _user_config(path: str | os.PathLike[str] | None, overrides: list[str] | None) -> DictConfig:
    """The YAML file at `path` with the command-line `overrides` merged in, before any default."""
    user = _read_yaml(path) if path is not None else OmegaConf.create({})
    if overrides:
        _check_dotlist_form(overrides)
        # Hydra's `+key=value` (add a key) is accepted: free-form mappings take new keys without it anyway.
        overrides = [item[1:] if item.startswith("+") else item for item in overrides]
        cli = _parse_overrides(overrides)
        merged_cli = OmegaConf.merge(user, cli)
        assert isinstance(merged_cli, DictConfig)
        user = merged_cli
    return user


def load_config_and_secrets(
    path: str | os.PathLike[str] | None = None,
    overrides: list[str] | None = None,
    notes: list[str] | None = None,
    task: str = "rl",
) -> tuple[EasyRLConfig, Secrets]:
    """`load_config`, and the config's secrets (what a run must scrub from every file and line it writes)."""
    from easyrl.config.hub import resolve_hub_ids
    from easyrl.config.schema import EasyRLConfig
    from easyrl.config.validate import validate

    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    user = _user_config(path, overrides)
    if task == "rl" and "sft" in user:
        raise ConfigError(
            "sft",
            "this config has an sft section: it is a supervised fine-tuning config; run `easyrl sft CONFIG` "
            "(or remove the section to train it with RL)",
        )
    notes = [] if notes is None else notes
    user = _apply_easyr1_compat(user, notes)
    _check_unknown_keys(user, EasyRLConfig, "")
    try:
        merged = OmegaConf.merge(_defaults(), user)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_key_of(exc), _type_message(exc)) from None
    assert isinstance(cfg, EasyRLConfig)
    _resolve_paths(cfg, base_dir=Path(path).parent if path is not None else Path.cwd())
    resolve_hub_ids(cfg)  # the driver downloads; workers get local folders
    import_user_modules(cfg.algorithm.user_modules)
    validate(cfg, task)
    raw = OmegaConf.to_container(user, resolve=False)
    assert isinstance(raw, dict)
    secrets = find_secrets(raw, dataclasses.asdict(cfg), set(_schema_paths(EasyRLConfig)))
    return cfg, secrets


@functools.cache
def _defaults() -> DictConfig:
    """The schema's defaults as a structured config, built once per process (~0.25 s each time, which a process
    loading many configs, a test session above all, paid per load): `OmegaConf.merge` deep-copies its first
    argument, so no load changes this one. The defaults are constants (no field's default reads the environment)."""
    from easyrl.config.schema import EasyRLConfig

    return OmegaConf.structured(EasyRLConfig)


def import_user_modules(paths: list[str]) -> None:
    """Import the files of `algorithm.user_modules` (once per process) so their registrations take effect."""
    import importlib.util
    import sys

    for i, file in enumerate(paths):
        name = f"easyrl_user_module_{Path(file).stem}_{abs(hash(file)) % 10**8}"
        if name in sys.modules:
            continue
        if not Path(file).is_file():
            raise ConfigError(f"algorithm.user_modules[{i}]", f"file not found: {file}")
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ConfigError(f"algorithm.user_modules[{i}]", f"importing {file} failed: {exc!r}") from None


def _read_yaml(path: str | os.PathLike[str]) -> DictConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", f"file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{p} is not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{p} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config", f"{p} must hold a mapping of sections (data, algorithm, worker, trainer)")
    # PyYAML builds an alias once and shares it, so a 1 KB "billion laughs" file loads instantly; the blow-up
    # comes when OmegaConf copies the tree. Measure the tree as it would be copied before anything copies it.
    size = expanded_size(raw, MAX_CONFIG_NODES)
    if size > MAX_CONFIG_NODES:
        raise ConfigError(
            "config",
            f"{p} expands to more than {MAX_CONFIG_NODES:,} values through YAML aliases (&anchor/*alias); "
            "a config never needs that many: remove the nested aliases",
        )
    conf = OmegaConf.create(raw)
    assert isinstance(conf, DictConfig)
    return conf


# A real config has a few hundred values; a million leaves room for large free-form kwargs and none for a bomb.
MAX_CONFIG_NODES = 1_000_000


def expanded_size(tree: Any, limit: int) -> int:
    """The number of values in `tree` counting every alias as a full copy, or a number > `limit` as soon as that is
    certain. Shared sub-trees are measured once (memo by id), so a bomb costs its unique nodes, not its size."""
    memo: dict[int, int] = {}

    def size(node: Any) -> int:
        if id(node) in memo:
            return memo[id(node)]
        memo[id(node)] = limit + 1  # a node met again while measuring it is a cycle (`a: &a [*a]`): unbounded
        total = 1
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            total += size(child)
            if total > limit:  # stop early: the exact size of a bomb is not worth computing
                break
        memo[id(node)] = total
        return total

    return size(tree)


def _check_dotlist_form(overrides: list[str]) -> None:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "overrides are written key=value, e.g. worker.rollout.n=8")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes from the shell arrive as lone surrogates
            raise ConfigError(
                item.split("=", 1)[0].encode("utf-8", "backslashreplace").decode(),
                "holds bytes that are not UTF-8 (a file name in another encoding?); rename it or give a UTF-8 value",
            ) from None


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """The overrides as a config; a value that does not parse is named by its key (the value is not repeated: it
    may be a secret)."""
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(
                item.split("=", 1)[0],
                f"the value on the command line does not parse ({problem}); write lists as key=[a,b] and quote "
                "values holding brackets, braces or commas",
            ) from None
    cli = OmegaConf.from_dotlist(list(overrides))
    assert isinstance(cli, DictConfig)
    return cli


def _apply_easyr1_compat(user: DictConfig, notes: list[str]) -> DictConfig:
    from easyrl.config.diffusion import translate_longrl_keys

    flat = translate_longrl_keys(_flatten(OmegaConf.to_container(user, resolve=False)), notes)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key in EASYR1_IGNORED:
            notes.append(f"{key} is an EasyR1 key with no effect in easyrl; ignored")
            continue
        if key in LONGRL_IGNORED:
            notes.append(f"{key} is a Long-RL key with no effect in easyrl ({LONGRL_IGNORED[key]}); ignored")
            continue
        if key in _EASYR1_NULL_IS_DEFAULT and value is None:
            continue
        if key in LONGRL_RENAMES:
            new = LONGRL_RENAMES[key]
            notes.append(
                f"{key} is Long-RL's frame count per video; easyrl samples data.video_fps frames a second capped at "
                f"{new}: using it as {new} (raise data.video_fps if short videos must give that many frames too)"
            )
            if new in flat and flat[new] != value:
                raise ConfigError(key, f"is Long-RL's name for {new}, which is also set, to another value: keep one")
            out[new] = value
            continue
        new = EASYR1_RENAMES.get(key, key)
        if new != key:
            notes.append(f"{key} is EasyR1's name for {new}; using it")
            if new in flat and flat[new] != value:
                raise ConfigError(key, f"is EasyR1's name for {new}, which is also set, to another value: keep one")
        value = _EASYR1_VALUES.get(new, {}).get(value, value) if isinstance(value, str) else value
        out[new] = value
    conf = OmegaConf.create(_unflatten(out))
    assert isinstance(conf, DictConfig)
    return conf


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to dotted keys; dict-valued free-form fields stay whole."""
    if not isinstance(tree, dict) or prefix.endswith(_FREEFORM):
        return {prefix: tree}
    if not tree and prefix:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


# Fields whose value is a free-form mapping (their contents are not config keys).
_FREEFORM = (
    "override_config",
    "val_override_config",
    "engine_kwargs",
    "reward_function_kwargs",
    "chat_template_kwargs",
)


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return root


def _check_unknown_keys(node: DictConfig, schema: type, prefix: str) -> None:
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        full = f"{prefix}{key!s}"
        if key not in names:
            raise ConfigError(full, f"unknown key.{_suggest(str(key), list(names), prefix)}")
        ftype = _dataclass_type(schema, str(key))
        child = node._get_node(key)  # raw node: no interpolation resolved here
        if ftype is not None:
            if not isinstance(child, DictConfig):
                raise ConfigError(full, f"is a section; expected a mapping of its keys, got {_raw(child)!r}")
            _check_unknown_keys(child, ftype, f"{full}.")


def _dataclass_type(schema: type, name: str) -> type | None:
    t = _type_hints(schema).get(name)
    return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


def _suggest(key: str, options: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    if close:
        return f" Did you mean {prefix}{close[0]}?"
    return f" Valid keys here: {', '.join(sorted(options))}."


def _raw(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return getattr(node, "_value", lambda: node)() if hasattr(node, "_value") else node


def _key_of(exc: OmegaConfBaseException) -> str:
    return str(getattr(exc, "full_key", "") or "config")


def _type_message(exc: OmegaConfBaseException) -> str:
    msg = str(getattr(exc, "msg", exc)).splitlines()[0]
    if "oc.env" in msg or "Environment variable" in msg:
        return f"{msg}. Export the variable or give the value directly."
    return f"{msg}. Give a value of the field's type (see docs/config.md)."


def _resolve_paths(cfg: EasyRLConfig, base_dir: Path) -> None:
    """Make local paths absolute (Ray workers may run elsewhere); `path@split` keeps its suffix."""
    from easyrl.config.diffusion_run import apply_diffusion_defaults

    del base_dir  # paths are relative to the working directory, as in EasyR1

    def absolute(p: str | None) -> str | None:
        return os.path.abspath(p) if p and os.path.exists(p) else p

    for model in (cfg.worker.actor.model, cfg.worker.critic.model, cfg.algorithm.distill.teacher):
        model.model_path = absolute(model.model_path)
        model.tokenizer_path = absolute(model.tokenizer_path)
    if cfg.worker.critic.model.model_path is None:
        cfg.worker.critic.model.model_path = cfg.worker.actor.model.model_path
    apply_diffusion_defaults(cfg)  # a pipeline's tokenizer is in its `tokenizer` folder, and its prompts plain text
    if cfg.worker.actor.model.tokenizer_path is None:
        cfg.worker.actor.model.tokenizer_path = cfg.worker.actor.model.model_path
    if cfg.worker.critic.model.tokenizer_path is None:
        cfg.worker.critic.model.tokenizer_path = cfg.worker.actor.model.tokenizer_path
    if cfg.trainer.save_checkpoint_path is None:
        cfg.trainer.save_checkpoint_path = os.path.join(
            "checkpoints", cfg.trainer.project_name, cfg.trainer.experiment_name
        )
    cfg.trainer.save_checkpoint_path = os.path.abspath(cfg.trainer.save_checkpoint_path)
    if cfg.trainer.load_checkpoint_path:
        cfg.trainer.load_checkpoint_path = os.path.abspath(cfg.trainer.load_checkpoint_path)
    for name in ("format_prompt", "image_dir", "video_dir"):
        setattr(cfg.data, name, absolute(getattr(cfg.data, name)))
    if cfg.data.cache_dir:  # made on first use: absolute even before it exists (workers may start elsewhere)
        cfg.data.cache_dir = os.path.abspath(cfg.data.cache_dir)
    cfg.algorithm.user_modules = [os.path.abspath(p) for p in cfg.algorithm.user_modules]
    cfg.worker.rollout.multi_turn.resolve_paths()
    rf = cfg.worker.reward.reward_function
    if rf:
        file, _, fn = rf.rpartition(":") if rf.rpartition(":")[0].endswith(".py") else (rf, "", "")
        cfg.worker.reward.reward_function = f"{absolute(file)}:{fn or 'main'}"


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    """The dataclass's resolved field types, once per class: `typing.get_type_hints` evaluates every annotation
    string (`from __future__ import annotations`) on each call."""
    import typing

    return typing.get_type_hints(schema)


@functools.cache
def _schema_paths(schema: type, prefix: str = "") -> frozenset[str]:
    """Dotted paths of every field of the dataclass tree: our own keys, never secrets by their name."""
    out: set[str] = set()
    for f in dataclasses.fields(schema):
        path = f"{prefix}{f.name}"
        out.add(path)
        sub = _type_hints(schema).get(f.name)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out |= _schema_paths(sub, f"{path}.")
    return frozenset(out)


def to_masked_dict(cfg: EasyRLConfig, secrets: Secrets) -> dict[str, Any]:
    """The config as plain data with its secrets replaced by `***` (safe to print, log and save)."""
    return secrets.mask(dataclasses.asdict(cfg))
