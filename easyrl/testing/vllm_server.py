"""The vLLM server of `easyrl.scorers.server` as the tests and benchmarks of the second models start it: on
127.0.0.1, fp32, a short context, no compile warm-up and a small CPU KV cache, so it starts in a minute on CPU."""

from __future__ import annotations

import os

from easyrl.scorers.server import VLLMServer as _Server
from easyrl.scorers.server import free_port


__all__ = ["TEST_ARGS", "VLLMServer", "free_port"]

TEST_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--enforce-eager",  # no compile warm-up: a test's server starts tens of seconds sooner
)


class VLLMServer(_Server):
    """A test's server: `TEST_ARGS` then `extra_args`; the CPU KV cache at 1 GiB unless the environment says."""

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
        super().__init__(
            model,
            log_path,
            name=name,
            api_key=api_key,
            args=(*TEST_ARGS, *extra_args),
            env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
            startup_timeout_s=startup_timeout_s,
        )
