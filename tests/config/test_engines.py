"""What a rollout engine declares it can do (`easyrl.config.engines`), and the config that asks it for more, refused
in one line naming the key, the engine and the fix. The recipe that trains with a registered engine declaring tensor
parallelism is tests/rollout/test_recipes.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.config import ConfigError, load_config
from easyrl.config.engines import BUILTIN_ENGINE_CAPABILITIES, engine_capabilities, engine_env
from easyrl.rollout import EngineCapabilities, register_engine
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.registry import EngineContext, engine_check, engine_factory
from easyrl.trainer.plan import rollout_engines
from tests.conftest import apply_edits, base_config, write_config


def _replicated_hf(ctx: EngineContext) -> HFRolloutEngine:
    model = ctx.spec.model
    assert model.model_path is not None
    return HFRolloutEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )


# override: each test module run registers them again
register_engine("tp_hf", capabilities=EngineCapabilities(tensor_parallel=True), override=True)(_replicated_hf)
register_engine("plain_hf", override=True)(_replicated_hf)


def _load(tmp_path: Path, model: str, data: dict[str, str], edits: dict[str, object]):  # type: ignore[no-untyped-def]
    conf = apply_edits(base_config(model, data, tmp_path / "run"), edits)
    return load_config(write_config(tmp_path / "c.yaml", conf))


def test_an_engine_declaring_tensor_parallelism_spans_that_many_workers(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    cfg = _load(
        tmp_path,
        tiny_model_dir,
        digits_data,
        {"worker.rollout.name": "tp_hf", "worker.rollout.tensor_parallel_size": 2},
    )
    assert cfg.worker.rollout.ranks_per_engine == 2  # no silent 1 for an engine that is not vLLM
    assert rollout_engines(cfg) == 1  # the 2 workers make one engine


@pytest.mark.parametrize("engine", ["plain_hf", "hf"])
def test_tensor_parallelism_on_an_engine_without_it_is_refused_in_one_line(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], engine: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(
            tmp_path,
            tiny_model_dir,
            digits_data,
            {"worker.rollout.name": engine, "worker.rollout.tensor_parallel_size": 2},
        )
    assert str(err.value) == (
        f"worker.rollout.tensor_parallel_size: 2, but the {engine} engine does not declare tensor parallelism (one "
        "engine per worker): set it to 1, or use worker.rollout.name=vllm"
    )


def test_a_registered_engine_declares_a_plain_engines_capabilities_by_default() -> None:
    assert engine_capabilities("plain_hf") == EngineCapabilities()
    assert engine_capabilities("tp_hf").tensor_parallel and not engine_capabilities("tp_hf").lora_adapters
    assert engine_factory("plain_hf") is _replicated_hf
    assert engine_check("plain_hf").problem(None, False) is None  # type: ignore[arg-type]  # nothing to check
    with pytest.raises(KeyError, match=r"worker.rollout.name='sglang' is not a registered rollout engine; known: "):
        engine_capabilities("sglang")


def test_the_built_in_engines_are_registered_with_their_records() -> None:
    for name, caps in BUILTIN_ENGINE_CAPABILITIES.items():
        assert engine_capabilities(name) is caps
    vllm, hf = BUILTIN_ENGINE_CAPABILITIES["vllm"], BUILTIN_ENGINE_CAPABILITIES["hf"]
    assert vllm.tensor_parallel and vllm.raw_media and vllm.lora_adapters and vllm.sleep_levels == (1, 2)
    assert not (hf.tensor_parallel or hf.raw_media or hf.lora_adapters or hf.sleep_levels or hf.engine_kwargs)
    # what each engine needs in every worker process, more of it on CPU; the HF engine needs nothing
    assert engine_env("vllm", on_gpu=True) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    assert engine_env("vllm", on_gpu=False)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert engine_env("hf", on_gpu=False) == {}


@pytest.mark.parametrize(
    ("edits", "line"),
    [
        (
            {"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.rollout_sync": "adapter"},
            "worker.actor.model.lora.rollout_sync: adapter, but the hf engine does not declare LoRA adapters: use "
            "merged, or worker.rollout.name=vllm",
        ),
        (
            {
                "worker.rollout.name": "vllm",
                "worker.actor.model.lora.rank": 1024,
                "worker.actor.model.lora.rollout_sync": "adapter",
            },
            "worker.actor.model.lora.rank: 1024: the vllm engine serves LoRA ranks up to 512 as adapters; use "
            "rollout_sync=merged",
        ),
        (
            {"worker.rollout.name": "plain_hf", "worker.rollout.sleep_level": 2},
            "worker.rollout.sleep_level: 2, but the plain_hf engine declares no sleep levels: remove it (null), or use "
            "worker.rollout.name=vllm",
        ),
        (
            {"worker.rollout.name": "diffusers"},
            "worker.rollout.name: diffusers, but the diffusers engine samples images from a diffusion pipeline and "
            "worker.actor.model.model_path is not one (no model_index.json; worker.rollout.diffusion.enable): use "
            "worker.rollout.name=hf or =vllm",
        ),
    ],
)
def test_what_the_engine_did_not_declare_is_refused_naming_key_engine_and_fix(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], edits: dict[str, object], line: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, tiny_model_dir, digits_data, edits)
    assert str(err.value) == line
