"""`worker.rollout.engine_kwargs`: one mapping of the engine's extra arguments, loaded whole (nested values too), and
each argument easyrl owns refused with one line naming the easyrl key (or the reason) and the fix. The names vLLM
knows are checked where vLLM is imported (tests/rollout/test_vllm_args.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from easyrl.config import ConfigError, EasyRLConfig, load_config
from easyrl.config.engine_kwargs import KEY, check_engine_kwargs
from easyrl.config.engines import VLLM_OWNED, EngineCapabilities, declare_engine
from tests.conftest import base_config, write_config


def _config(tmp_path: Path, model: str, data: dict[str, str], name: str, kwargs: dict[str, Any]) -> str:
    conf = base_config(model, data, tmp_path / "run")
    conf["worker"]["rollout"] |= {"name": name, "engine_kwargs": kwargs}
    return write_config(tmp_path / "c.yaml", conf)


def test_empty_by_default_and_loaded_whole(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> None:
    assert EasyRLConfig().worker.rollout.engine_kwargs == {}
    kwargs = {"max_num_seqs": 8, "compilation_config": {"mode": 0}, "gdn_prefill_backend": "triton"}
    cfg = load_config(_config(tmp_path, tiny_model_dir, digits_data, "vllm", kwargs))
    assert cfg.worker.rollout.engine_kwargs == kwargs  # the nested mapping stays a mapping, not dotted keys
    cfg = load_config(
        _config(tmp_path, tiny_model_dir, digits_data, "vllm", {}),
        ["worker.rollout.engine_kwargs.async_scheduling=true"],
    )
    assert cfg.worker.rollout.engine_kwargs == {"async_scheduling": True}


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("gpu_memory_utilization", "set worker.rollout.gpu_memory_utilization instead"),
        ("tensor_parallel_size", "set worker.rollout.tensor_parallel_size instead"),
        ("max_model_len", "set worker.rollout.max_model_len instead"),
        ("model", "set worker.actor.model.model_path instead"),
        ("enable_lora", "worker.actor.model.lora.rollout_sync: adapter"),
        ("logprobs_mode", "processed_logprobs"),
    ],
)
def test_an_argument_easyrl_sets_is_refused_naming_its_key(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], name: str, fix: str
) -> None:
    path = _config(tmp_path, tiny_model_dir, digits_data, "vllm", {"max_num_seqs": 8, name: 1})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert err.value.key == f"{KEY}.{name}" and message.startswith(f"{KEY}.{name}: easyrl sets this vllm argument")
    assert fix in message and "\n" not in message


def test_every_refusal_is_one_line_with_a_fix() -> None:
    cfg = EasyRLConfig()
    for name, fix in VLLM_OWNED.items():
        assert fix.startswith(("set ", "easyrl ")) and fix.endswith(("instead", "remove it", "lora.rank) instead"))
        cfg.worker.rollout.engine_kwargs = {name: None}
        with pytest.raises(ConfigError, match=f"^{KEY}.{name}: ") as err:
            check_engine_kwargs(cfg.worker.rollout)
        assert "\n" not in str(err.value)


def test_the_hf_engine_takes_none(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=rf"^{KEY}: the hf engine .* max_num_seqs: remove them, or use") as err:
        load_config(_config(tmp_path, tiny_model_dir, digits_data, "hf", {"max_num_seqs": 8}))
    assert "worker.rollout.name=vllm" in str(err.value)
    assert load_config(_config(tmp_path, tiny_model_dir, digits_data, "hf", {})).worker.rollout.engine_kwargs == {}


def test_an_engine_of_the_users_own_gets_them_unchecked() -> None:
    declare_engine("my_engine", EngineCapabilities())  # what registering it declares by default
    cfg = EasyRLConfig()
    cfg.worker.rollout.name, cfg.worker.rollout.engine_kwargs = "my_engine", {"gpu_memory_utilization": 0.3}
    check_engine_kwargs(cfg.worker.rollout)  # its arguments are its own to read
