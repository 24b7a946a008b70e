"""`easyrl cache-embeds CONFIG [key=value ...]`: fill `data.cache_dir` with the vision tower's outputs of every image
and video of the training (and validation) data, before a run.

The entries are the ones a run reads (`easyrl.models.embed_cache`): the same processing of each row as the dataset
does, the same settings in the key (`easyrl.trainer.role_specs.embeds_spec` and the tower's patch geometry) and the
tower's weights version from the same checkpoint. Items already cached are skipped, so a second call costs one read
per item. One process, on the first GPU when there is one.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from easyrl.config import EasyRLConfig


__all__ = ["warm_cache"]

logger = logging.getLogger(__name__)


def warm_cache(cfg: EasyRLConfig) -> dict[str, float]:
    """Encode every media item of the run's data that the cache lacks; returns counts and seconds."""
    from easyrl.config import ConfigError
    from easyrl.data import RLDataset
    from easyrl.models import load_tokenizer, vision_tower
    from easyrl.models.dtypes import DTYPES
    from easyrl.models.embed_cache import EmbedCache, tower_version
    from easyrl.models.vl_embeds import install_embed_reuse, tower_settings
    from easyrl.trainer.role_specs import embeds_spec
    from easyrl.workers.model_setup import load_model

    if not cfg.data.cache_dir:
        raise ConfigError("data.cache_dir", "is not set: name the folder to fill (data.cache_dir=/path/to/cache)")
    mcfg = cfg.worker.actor.model
    assert mcfg.tokenizer_path is not None
    tokenizer, processor = load_tokenizer(mcfg.tokenizer_path, trust_remote_code=mcfg.trust_remote_code)
    if processor is None:
        raise ConfigError("worker.actor.model.model_path", "is not a vision-language model: nothing to cache")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the dtype the run's tower computes in (FSDP's mixed-precision parameter dtype on GPUs): part of the key
    compute = cfg.worker.actor.fsdp.mp_param_dtype if device.type == "cuda" else "fp32"
    load_dtype = DTYPES[cfg.worker.actor.fsdp.torch_dtype] if cfg.worker.actor.fsdp.torch_dtype else torch.float32
    model = load_model(mcfg, dtype=load_dtype).eval()
    tower = vision_tower(model)
    assert tower is not None
    version = tower_version(tower)  # of the weights as the actor's workers load them, before any cast
    model.to(device, DTYPES[compute])
    if not mcfg.freeze_vision_tower:
        logger.info("the policy's vision tower is trained: only the reference (frozen, same weights) reads the cache")
    spec = embeds_spec(cfg)
    cache = EmbedCache(cfg.data.cache_dir, spec.max_gb)
    settings = dict(spec.settings) | tower_settings(model) | {"compute_dtype": compute}
    reuse = install_embed_reuse(model, version, cache, settings)
    assert reuse is not None
    files = [cfg.data.train_files, *([cfg.data.val_files] if cfg.data.val_files else [])]
    start, rows = time.perf_counter(), 0
    for spec_files in files:
        data = RLDataset(spec_files, cfg.data, tokenizer, processor)
        for i in range(len(data)):
            media = data[i].get("multi_modal_inputs") or {}
            with torch.no_grad():
                for pixels, grid in (("pixel_values_videos", "video_grid_thw"), ("pixel_values", "image_grid_thw")):
                    if pixels in media:
                        # in the dtype the run's tower receives them (FSDP casts a forward's inputs): same key
                        reuse.features(media[pixels].to(device, DTYPES[compute]), media[grid].to(device))
            rows += 1
    return {
        "rows": rows,
        "encoded": reuse.encoded,
        "cached_already": cache.hits,
        "rebuilt": cache.rebuilt,
        "seconds": round(time.perf_counter() - start, 2),
    }
