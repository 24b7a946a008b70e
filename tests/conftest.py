"""Shared fixtures: a tiny real model folder, a small dataset, a reward file, and a config writer."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml


if TYPE_CHECKING:
    import subprocess

    import torch


REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


FAILURES_ENV = "EASYRL_FAILURES_DIR"
"""Set by the bounded runners (tests/recipes/each_test.py): each failure is written there the moment it happens."""


STACKS_ENV = "EASYRL_STACKS_FILE"
"""Set by the bounded runners: where SIGUSR1 dumps every thread's stack (pytest's capture holds stderr by then)."""


def pytest_configure(config: pytest.Config) -> None:
    stacks = os.environ.get(STACKS_ENV)
    if stacks:
        import faulthandler
        import signal

        # a runner stopping a hung test asks for the stacks first; the file stays open for the process's life
        config.stash[_STACKS_KEY] = sink = open(stacks, "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=sink, all_threads=True)


_STACKS_KEY = pytest.StashKey[Any]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under a bounded runner, write a failure (test id, phase, exception, the ends of the captured output and of the
    Ray workers' logs) to `$EASYRL_FAILURES_DIR/<test id>.txt` at once: a later hang or kill cannot lose it."""
    folder = os.environ.get(FAILURES_ENV)
    if not folder or not report.failed:
        return
    import re

    from tests.recipes.logs import worker_log_tails

    captured = "\n".join(f"--- {name}\n" + "\n".join(text.splitlines()[-60:]) for name, text in report.sections)
    text = (
        f"{report.nodeid} failed in {report.when}\n\n{report.longreprtext}\n\n"
        f"=== the end of the captured output (the driver's log)\n{captured}\n\n"
        f"=== the newest Ray worker logs\n{worker_log_tails()}\n"
    )
    path = Path(folder) / (re.sub(r"[^A-Za-z0-9_.-]+", "_", report.nodeid)[-150:] + ".txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # Under `make test`'s `-n 2 --dist loadgroup` (pytest-xdist) every vLLM test runs on one worker, one at a time:
    # a CPU engine clears the node's tensor-parallel shared memory as it starts (easyrl/rollout/vllm.py), which would
    # break another worker's engine starting at that moment; and two CPU engines at once would not fit CI's memory.
    vllm_group = pytest.mark.xdist_group("vllm")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords:
            item.add_marker(vllm_group)
    _RAY_MODULES.update(ray_modules_last(items))


def ray_modules_last(items: list[Any]) -> set[Path]:
    """Put the modules whose tests use the shared Ray instance (`ray_session` below) after the other modules of their
    folder, one after another (in place, otherwise in the same order): it then starts once per folder, not once per
    such module (~5 s each on 2 cores). Returns those modules."""
    ray = {item.path for item in items if "ray_session" in getattr(item, "fixturenames", ())}
    folders = {folder: i for i, folder in enumerate(dict.fromkeys(item.path.parent for item in items))}
    items.sort(key=lambda item: (folders[item.path.parent], item.path in ray))
    return ray


_SHARED_RAY: dict[str, bool] = {"up": False}
"""Whether `ray_session` started the Ray instance now up (and so may stop it)."""
_RAY_MODULES: set[Path] = set()
"""The test modules with a test that asks for `ray_session` (filled at collection)."""


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray instance (4 CPUs) for the module's runs. Each run starts and stops its own workers, so the modules
    share nothing through it: it stays up for the next module when that one asks for it too (a start and a stop cost
    ~5-8 s on 2 cores), and stops before any other test (`pytest_runtest_teardown` below). A module whose runs left
    resources held (an actor, a placement group) stops it, so the next module starts on a fresh one."""
    import ray

    from easyrl.distributed import init_ray

    if init_ray(num_cpus=4):
        _SHARED_RAY["up"] = True
    yield
    if _SHARED_RAY["up"] and ray.is_initialized() and not _ray_is_idle(ray):
        _stop_shared_ray()


def _ray_is_idle(ray: Any) -> bool:
    """Every CPU and GPU is free and no placement group is left (Ray frees an ended actor's share within moments)."""
    deadline = time.monotonic() + 5.0
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        if not any("_group_" in key for key in total) and all(
            free.get(k, 0) >= total[k] for k in ("CPU", "GPU") if k in total
        ):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _stop_shared_ray() -> None:
    import ray

    _SHARED_RAY["up"] = False
    ray.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the module fixtures are torn down: stop the shared Ray instance unless the next test is in a module that
    uses it (this one, its module fixture still up, or the next such module)."""
    yield
    if _SHARED_RAY["up"] and (nextitem is None or nextitem.path not in _RAY_MODULES):
        _stop_shared_ray()
    elif nextitem is None or (nextitem.path != item.path and nextitem.path not in _RAY_MODULES):
        # A Ray that a test started itself (a Trainer starts one when none is up) and left up: stopped where the
        # next module does not use Ray, so no later test sees its CPUs (`role_specs.node_cores` reads a live Ray).
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-init 2-layer Qwen2 (hidden 64) with a locally built character tokenizer. Two query heads and
    one KV head of size 32: vLLM's CPU attention kernels reject head size 16."""
    from easyrl.testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Small train/val jsonl files of the digit-copy task."""
    folder = tmp_path_factory.mktemp("data")
    rows = [
        {"prompt": f"Copy: {a} {b} {c}", "answer": f"{a}{b}{c}"} for a in range(4) for b in range(4) for c in range(4)
    ]
    paths = {}
    for split, part in (("train", rows), ("val", rows[:8])):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths[split] = str(path)
    return paths


def base_config(model_dir: str, data: dict[str, str], save_dir: str | Path) -> dict[str, Any]:
    """A small but complete config for tests: GRPO, HF engine, 2 CPU workers, tiny batches."""
    return {
        "data": {
            "train_files": data["train"],
            "val_files": "",
            "max_prompt_length": 48,
            "max_response_length": 8,
            "rollout_batch_size": 4,
            "format_prompt": str(REPO / "prompt_templates" / "digits.jinja"),
        },
        "algorithm": {"adv_estimator": "grpo", "disable_kl": True},
        "worker": {
            "actor": {
                "global_batch_size": 2,
                "micro_batch_size_per_device_for_update": 2,
                "micro_batch_size_per_device_for_experience": 4,
                # The padded path the golden trajectory (tests/trainer/golden_grpo.json) was recorded with; the
                # defaults (all three on) are covered by tests/workers/test_packing.py and test_logprob_fused.py.
                "padding_free": False,
                "dynamic_batching": False,
                "fused_logprobs": False,
                "optim": {"lr": 1e-3, "weight_decay": 0.0},  # parameters move only through gradients
                "model": {"model_path": model_dir, "enable_gradient_checkpointing": False},
            },
            "rollout": {"name": "hf", "n": 2, "temperature": 1.0, "dtype": "fp32"},
            "reward": {
                "reward_function": str(REPO / "tests" / "assets" / "digit_fraction_reward.py") + ":compute_score",
                "num_workers": 0,
            },
        },
        "trainer": {
            "total_epochs": 1,
            "max_steps": 2,
            "n_gpus_per_node": 2,
            "logger": ["file"],
            "val_before_train": False,
            "save_checkpoint_path": str(save_dir),
            "device": "cpu",
            "ray_num_cpus": 4,
        },
    }


def run_script(name: str, *args: str, workdir: Path) -> None:
    """Run ``scripts/<name>`` with ``args`` and ``--workdir workdir`` (from that folder); fail with its output's tail."""
    import subprocess
    import sys

    cmd = [sys.executable, str(REPO / "scripts" / name), *args, "--workdir", str(workdir)]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def run_script_in_process(name: str, *args: str, workdir: Path) -> Any:
    """``scripts/<name>``'s ``main(args + --workdir workdir)`` in this process, from that folder; what it returns.
    The environment, ``sys.path`` and the current folder are put back after, and a Ray instance the script started
    is stopped (one already up, `ray_session`'s, it joins and leaves up). A script of its own costs a Python start
    and torch's import (~5 CPU-s on 2 cores): `run_script` stays for the tests of the script's process."""
    import importlib.util
    import sys

    ray = sys.modules.get("ray")
    ray_was_up = bool(ray and ray.is_initialized())
    saved_env, saved_path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    spec = importlib.util.spec_from_file_location(f"_script_{Path(name).stem}", REPO / "scripts" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        os.chdir(workdir)
        spec.loader.exec_module(module)
        return module.main([*args, "--workdir", str(workdir)])
    finally:
        ray = sys.modules.get("ray")
        if not ray_was_up and ray is not None and ray.is_initialized():
            ray.shutdown()
        os.chdir(cwd)
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def write_config(path: Path, config: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def padded_rows(
    prompt_len: int, response_lengths: list[int], generator: torch.Generator, width: int | None = None, vocab: int = 90
) -> dict[str, torch.Tensor]:
    """The sequence tensors of a rollout batch, as the rollout pads them: row `i` is `prompt_len` prompt tokens and
    `response_lengths[i]` response tokens, padded to `width` (default: the longest); token ids are drawn from
    `generator` first, so a test's later draws stay where they were. `loss_mask` equals `response_mask`
    (single-turn)."""
    import torch

    width = max(response_lengths) if width is None else width
    mask = torch.zeros(len(response_lengths), prompt_len + width, dtype=torch.long)
    for i, n in enumerate(response_lengths):
        mask[i, : prompt_len + n] = 1
    ids = torch.randint(3, vocab, mask.shape, generator=generator) * mask  # padding stays token 0
    return {
        "prompts": ids[:, :prompt_len],
        "responses": ids[:, prompt_len:],
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt_len:].clone(),
        "loss_mask": mask[:, prompt_len:].clone(),
    }


def apply_edits(conf: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    """`conf` (nested dicts) with each `dotted.key: value` of `edits` set, parents made as needed; returns `conf`."""
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node = conf
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return conf


def train_steps(
    tmp_path: Path,
    model: str,
    data: dict[str, str],
    edits: dict[str, Any],
    steps: int,
    weights: bool = False,
    weights_each_step: list | None = None,
) -> tuple[list[dict[str, float]], dict | None, dict | None]:
    """Train `steps` steps with `edits` on the base test config; returns the logged rows (and weights)."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    tmp_path.mkdir(parents=True, exist_ok=True)
    conf = apply_edits(base_config(model, data, tmp_path / "run"), edits)
    conf["trainer"]["max_steps"] = steps
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        before = trainer.actor.full_weights() if weights else None
        if weights_each_step is None:
            trainer.fit()
        else:  # one step at a time, keeping the policy after each
            weights_each_step.append(trainer.actor.full_weights())
            for step in range(1, steps + 1):
                trainer.total_steps = step
                trainer.fit()
                weights_each_step.append(trainer.actor.full_weights())
        after = trainer.actor.full_weights() if weights else None
    finally:
        trainer.close()
    log = tmp_path / "run" / "experiment_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return rows, before, after


def ppo_kl_loss() -> Any:
    """The PPO loss with the low-variance KL as a loss term, as the worker-level tests train it; with no old-log-prob
    pass before it (a test's batch without `old_log_probs`), so its first mini-batch measures the engine's log-probs
    where a batch has them."""
    from easyrl.workers.specs import PolicyLossSpec

    return PolicyLossSpec(
        "ppo",
        params=(("clip_ratio_low", 0.2), ("clip_ratio_high", 0.28), ("clip_ratio_dual", 3.0)),
        kl_in_loss=True,
        kl_penalty="low_var_kl",
        kl_coef=0.1,
        measures_engine=True,
    )


def left_padded_prompts(tokenizer_dir: str, texts: list[str]) -> Any:
    """`texts` tokenized and left-padded as the driver sends prompts to the engines (ids, mask, positions)."""
    import torch
    from transformers import AutoTokenizer

    from easyrl.batch import Batch

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def metric_mismatches(
    got: list[dict[str, float]], want: list[dict[str, float]], rtol: float = 1e-5, atol: float = 1e-6
) -> list[str]:
    """The metrics of two runs' logged rows that differ beyond float noise, one line each (the same keys expected)."""
    import math

    if [sorted(r) for r in got] != [sorted(r) for r in want]:
        return [f"metric keys differ: {[sorted(set(g) ^ set(w)) for g, w in zip(got, want, strict=False)]}"]
    return [
        f"step {g['step']} {k}: {g[k]!r} vs {w[k]!r}"
        for g, w in zip(got, want, strict=True)
        for k in w
        if not math.isclose(g[k], w[k], rel_tol=rtol, abs_tol=atol)
    ]


def easyrl_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`easyrl ARGS` run by the command's own `main` in this process (exit code, stdout, stderr, as `easyrl` gives
    them), with the signal handlers it installs put back after. A command of its own costs a Python start and torch's
    import (~3-5 s on 2 cores) before `main` runs: the tests of the process itself (its exit, its signals, `train`)
    keep `easyrl` (tests/test_structure_rules.py holds `check` to this)."""
    import signal
    import subprocess

    from easyrl.cli import main

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    capsys.readouterr()  # what the test printed before is not the command's
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["easyrl", *args], code, out.out, out.err)
