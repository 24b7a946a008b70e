"""Run code on a SandboxFusion server (its ``POST /run_code`` API): the option for scale, isolated by the server.

The server's own limits apply (its configured memory and process limits); ``timeout_s`` is sent as
``run_timeout`` and the output is cut to ``max_output_bytes`` here. Only the standard library is used.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from easyrl.sandbox.local import SandboxLimits, SandboxResult


__all__ = ["run_code_remote"]

_HTTP_GRACE_S = 30.0  # the server queues and starts a container before the run's own timeout begins


def _result(reply: dict[str, Any], limits: SandboxLimits, start: float) -> SandboxResult:
    run = reply.get("run_result") or {}
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    exit_code = run.get("return_code")
    wall = time.monotonic() - start
    if reply.get("status") == "SandboxError" or not run:
        message = str(reply.get("message") or "no run_result in the reply")
        return SandboxResult("sandbox_error", stdout, stderr or message, exit_code, wall, "sandboxfusion")
    if len(stdout.encode()) + len(stderr.encode()) > limits.max_output_bytes:
        status = "output_limit"
    elif run.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif run.get("status") == "Finished" and exit_code == 0:
        status = "ok"
    elif "MemoryError" in stderr:
        status = "memory"
    else:
        status = "error"
    cap = limits.max_output_bytes
    return SandboxResult(status, stdout[:cap], stderr[:cap], exit_code, wall, "sandboxfusion")


def run_code_remote(base_url: str, source: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    """Run Python ``source`` on the SandboxFusion server at ``base_url``; a failed request is ``sandbox_error``."""
    body = {"code": source, "stdin": stdin, "language": "python", "run_timeout": limits.timeout_s}
    request = urllib.request.Request(
        base_url.rstrip("/") + "/run_code",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=limits.timeout_s + _HTTP_GRACE_S) as response:
            reply = json.loads(response.read())
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as error:
        return SandboxResult(
            "sandbox_error", "", f"{base_url}: {error}", None, time.monotonic() - start, "sandboxfusion"
        )
    if not isinstance(reply, dict):
        return SandboxResult("sandbox_error", "", f"{base_url}: reply is not an object", None, 0.0, "sandboxfusion")
    return _result(reply, limits, start)
