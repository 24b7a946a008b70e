"""A local judge (`worker.reward.judge.model.model_path`): easyrl serves it with vLLM (the CPU build here) for the run,
the reward workers call it with the key easyrl made, and the server goes when the run closes or its actor dies."""

from __future__ import annotations

import importlib.util
import json
import os
import urllib.error
import urllib.request

import psutil
import pytest

from tests.conftest import REPO, base_config, write_config


pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]
TEMPLATE = str(REPO / "tests" / "assets" / "judge.jinja")
PARSE = str(REPO / "tests" / "assets" / "judge_parse.py") + ":length_score"
JUDGE_REWARD = str(REPO / "reward_functions" / "judge.py") + ":compute_score"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]


def _status(url: str, key: str | None = None) -> int:
    """The HTTP status of GET `url` (0: nothing listens)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _servers() -> list[psutil.Process]:
    """This user's vLLM API servers started as a local judge (the marker is the judge's served name)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and "local-judge-test" in cmd:
            found.append(proc)
    return found


def test_a_command_dies_with_the_process_that_started_it(tmp_path) -> None:
    """The launcher a local judge's server runs under: when its parent is SIGKILLed, the command gets SIGKILL too."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "from easyrl.scorers.server import dying_with_parent\n"
            "cmd, env = dying_with_parent(['sleep', '600'])\n"
            "import os; child = subprocess.Popen(cmd, env={**os.environ, **env})\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "child.wait()\n",
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = psutil.Process(int(pid_file.read_text()))
    time.sleep(1.0)  # the launcher has exec'd `sleep` by now
    assert child.cmdline() == ["sleep", "600"]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    child.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlived its parent


def test_a_run_serves_its_local_judge_and_stops_it(tmp_path, tiny_model_dir, digits_data, monkeypatch) -> None:
    import ray

    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import init_ray
    from easyrl.scorers.served import JUDGE_KEY_ENV
    from easyrl.trainer.trainer import Trainer

    ray.shutdown()  # Ray's processes take the environment they start with: the small CPU KV cache below
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    reward = conf["worker"]["reward"]
    reward.update(reward_function=JUDGE_REWARD, num_workers=1)
    reward["judge"] = {
        "model": {"model_path": tiny_model_dir, "name": "local-judge-test"},
        "server": {"args": SERVER_ARGS},
        "template": TEMPLATE,
        "parse": PARSE,
        "sampling": {"max_tokens": 8},
    }
    init_ray(num_cpus=4)
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        served = trainer.workers.judge_server
        key = os.environ[JUDGE_KEY_ENV]
        assert len(key) >= 24
        assert _status(f"{served.base_url}/models") == 401  # the server takes only its key
        assert _status(f"{served.base_url}/models", key) == 200
        (server,) = _servers()
        trainer.total_steps = 1
        trainer.fit()
    finally:
        trainer.close()
        ray.shutdown()
    server.wait(timeout=60)  # closing the run stopped it
    assert _status(f"{served.base_url.removesuffix('/v1')}/health") == 0
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    assert step["local-judge-test/requests"] == 4 * 2 and step["local-judge-test/errors"] == 0
    assert step["reward/errors"] == 0 and "actor/pg_loss" in step
    assert JUDGE_KEY_ENV not in os.environ  # closing the run takes the key back
    assert key not in (tmp_path / "run" / "experiment_log.jsonl").read_text()
    assert not _servers()
