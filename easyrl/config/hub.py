"""Hugging Face hub IDs in the config: models (`org/name`) and datasets (`org/name@split`) become local folders.

Runs once, in the driver, while the config is loaded: downloads go to the Hugging Face cache (with its progress
bars), and the workers only ever see local paths. A local path of the same name always wins. The environment is
read at call time (not at import, as huggingface_hub does): `HF_HOME` / `HF_HUB_CACHE` pick the cache,
`HF_HUB_OFFLINE=1` forbids the network, and `HF_ENDPOINT` picks the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from easyrl.config.errors import ConfigError
from easyrl.config.hub_paths import hf_home, hub_cache_dir, is_hub_id


if TYPE_CHECKING:
    from easyrl.config.schema import EasyRLConfig

logger = logging.getLogger(__name__)

DEFAULT_SPLIT = "train"
"""The split of a dataset ID given without `@split` (EasyR1's default)."""
MODEL_KEYS = (
    "worker.actor.model.model_path",
    "worker.actor.model.tokenizer_path",
    "worker.critic.model.model_path",
    "worker.critic.model.tokenizer_path",
    "algorithm.distill.teacher.model_path",
    "algorithm.distill.teacher.tokenizer_path",
)
DATA_KEYS = ("data.train_files", "data.val_files")


class NotCachedError(ConfigError):
    """A hub ID is not in the cache and the hub cannot be used (offline, or unreachable)."""


def datasets_cache_dir() -> str:
    """The cache `datasets` would use under the current environment."""
    return os.path.expanduser(os.environ.get("HF_DATASETS_CACHE") or os.path.join(hf_home(), "datasets"))


def _offline() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((flag or "").strip().lower() in ("1", "true", "yes", "on") for flag in flags)


def download(repo_id: str, repo_type: str, key: str) -> str:
    """The local snapshot folder of `repo_id` (a `model` or `dataset` repo), downloaded first when needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), _offline()
    endpoint = os.environ.get("HF_ENDPOINT") or None
    cli = f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    if not offline:
        logger.info("%s: fetching %s %s from %s into %s", key, repo_type, repo_id, endpoint or "huggingface.co", cache)
    try:
        path = snapshot_download(
            repo_id, repo_type=repo_type, cache_dir=cache, local_files_only=offline, endpoint=endpoint
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        where = f"the Hugging Face cache ({cache})"
        if repo_type == "dataset":
            where += f" nor in the datasets cache ({datasets_cache_dir()})"
        raise NotCachedError(key, f"{repo_id} is not in {where} and {why}; download it first: {cli}") from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise ConfigError(
            key,
            f"{repo_id} is neither a local path nor a {repo_type} repo on the hub you can read "
            f"({type(exc).__name__}); for a gated or private repo run `hf auth login` first",
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(key, f"cannot download {repo_id}: {first}; or download it first: {cli}") from None
    assert isinstance(path, str)
    return path


def resolve_hub_ids(cfg: EasyRLConfig) -> None:
    """Replace every hub ID among the model paths and data files of `cfg` by its local snapshot folder."""
    fetched: dict[tuple[str, str], str] = {}

    def local(repo_id: str, repo_type: str, key: str) -> str:
        if (repo_id, repo_type) not in fetched:
            fetched[repo_id, repo_type] = download(repo_id, repo_type, key)
            logger.info("%s: %s is %s", key, repo_id, fetched[repo_id, repo_type])
        return fetched[repo_id, repo_type]

    for key in MODEL_KEYS:
        section, _, name = key.rpartition(".")
        owner = _section(cfg, section)
        value = getattr(owner, name)
        if value and is_hub_id(value):
            setattr(owner, name, local(value, "model", key))
    for key in DATA_KEYS:
        value = getattr(cfg.data, key.split(".")[1])
        parts = []
        for part in filter(None, (p.strip() for p in (value or "").split(","))):
            path, split = part, ""
            if "@" in part and not os.path.exists(part):
                path, split = part.rsplit("@", 1)
            if is_hub_id(path):
                try:
                    part = f"{local(path, 'dataset', key)}@{split or DEFAULT_SPLIT}"
                except NotCachedError as exc:
                    # Loaded before with `datasets.load_dataset`: its own cache may hold the prepared split.
                    saved = from_datasets_cache(path, split or DEFAULT_SPLIT)
                    if saved is None:
                        raise exc from None
                    part = saved
            parts.append(part)
        setattr(cfg.data, key.split(".")[1], ",".join(parts))


def from_datasets_cache(repo_id: str, split: str) -> str | None:
    """A `save_to_disk` folder of `split` of `repo_id` as prepared in the `datasets` cache; None when absent.

    `datasets` keeps a prepared dataset in its own arrow format, which the data loader does not read, so the split
    is saved once more next to it (under `<datasets cache>/easyrl/`), keyed by its fingerprint.
    """
    import datasets

    cache = datasets_cache_dir()
    try:
        with _datasets_offline(_offline()):
            dataset = datasets.load_dataset(repo_id, split=split, cache_dir=cache)
    except Exception as exc:  # not cached (offline) or any other failure: the caller reports the hub error
        logger.debug("%s@%s not in the datasets cache %s: %s", repo_id, split, cache, exc)
        return None
    assert isinstance(dataset, datasets.Dataset)
    folder = os.path.join(cache, "easyrl", repo_id.replace("/", "___"), f"{split}-{dataset._fingerprint}")
    if not os.path.isfile(os.path.join(folder, "state.json")):
        dataset.save_to_disk(folder)
    logger.info("%s@%s: from the datasets cache, saved as %s", repo_id, split, folder)
    return folder


@contextlib.contextmanager
def _datasets_offline(offline: bool) -> Iterator[None]:
    """`datasets` reads HF_HUB_OFFLINE once, at import: apply the current value for the duration of the block."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or saved
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def _section(cfg: EasyRLConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
