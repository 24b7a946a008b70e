"""A local judge (`worker.reward.judge.model.model_path`): easyrl serves the model with vLLM for the run and points the
judge at it, so a reward function calls it exactly as it calls a server you run.

The server runs in a Ray actor of its own, which holds `worker.reward.judge.server.num_gpus` GPUs beside the
trainer's (on a CPU run, no GPU): Ray shows the actor its GPUs, and the server it starts inherits them. With
`num_gpus: 0` on a GPU run the server shares the trainer's first GPU of its node: the actor takes no GPU from Ray and
its server is shown that one device, sized by its own `--gpu-memory-utilization`. The server
listens on the actor's node address with a fresh key; the key reaches the reward workers through the driver's
environment (`JUDGE_KEY_ENV`), which they take when they start, and is never written to a config, log or checkpoint.
The run stops the server when it closes; a killed actor takes its server with it (`die_with_parent`).
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from dataclasses import replace
from typing import Any

from easyrl.config.worker import RewardConfig
from easyrl.scorers.server import VLLMServer


__all__ = ["JUDGE_KEY_ENV", "JudgeServerError", "LocalJudge"]

logger = logging.getLogger(__name__)

JUDGE_KEY_ENV = "EASYRL_LOCAL_JUDGE_KEY"
"""The environment variable holding the key of the judge server easyrl started (its `api_key_env`)."""


class JudgeServerError(RuntimeError):
    """The local judge's server cannot start: no room for it, or it failed (the message carries its log's end)."""


class _JudgeServerActor:
    """The Ray actor that owns the judge's vLLM server (one per run)."""

    def __init__(
        self, model: str, name: str, api_key: str, args: list[str], timeout_s: float, share_gpu: bool = False
    ) -> None:
        import ray

        env: dict[str, str] = {}
        if share_gpu:  # Ray left this actor the node's devices (no GPU of its own): the server takes the first one
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            env["CUDA_VISIBLE_DEVICES"] = visible or "0"
        fd, log_path = tempfile.mkstemp(prefix="easyrl-judge-server-", suffix=".log")
        os.close(fd)
        self.server = VLLMServer(
            model,
            log_path,
            name=name,
            api_key=api_key,
            host=ray.util.get_node_ip_address(),  # reachable from the reward workers on every node
            args=tuple(args),
            startup_timeout_s=timeout_s,
            die_with_parent=True,
            env=env,
        )
        try:
            self.server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise JudgeServerError(f"{exc} (full log on {self.server.host}: {log_path})") from None

    def where(self) -> tuple[str, str]:
        """(the server's API root, its log file on the actor's node)."""
        return self.server.base_url, str(self.server.log_path)

    def stop(self) -> None:
        self.server.stop()


class LocalJudge:
    """Starts the judge's server (`reward.judge.model.model_path`) in the running Ray instance; `reward_config` is the
    reward config with the judge pointed at it. `stop()` ends it (idempotent).

    Args:
        reward: `worker.reward`, whose judge is local.
        gpu: the run trains on GPUs (the server then takes `judge.server.num_gpus` of them).

    Raises:
        JudgeServerError: the cluster has not the GPUs free, or the server did not start (its log's end).
    """

    def __init__(self, reward: RewardConfig, gpu: bool) -> None:
        import ray

        judge = reward.judge
        ref, server = judge.model, judge.server
        assert ref.model_path is not None
        name = ref.name or "judge"
        num_gpus = server.num_gpus if gpu else 0
        share = gpu and num_gpus == 0
        args = list(server.args)
        if share and "--gpu-memory-utilization" not in args:
            raise JudgeServerError(
                "worker.reward.judge.server.num_gpus=0 shares the trainer's GPU: give the server its share with "
                "--gpu-memory-utilization in worker.reward.judge.server.args (e.g. 0.1), and lower "
                "worker.rollout.gpu_memory_utilization so both fit"
            )
        if num_gpus > 1 and "--tensor-parallel-size" not in args:
            args += ["--tensor-parallel-size", str(num_gpus)]
        free = ray.available_resources().get("GPU", 0.0)
        if num_gpus > free:
            raise JudgeServerError(
                f"worker.reward.judge.server.num_gpus={num_gpus}: the cluster has {free:g} GPU(s) free beside the "
                "trainer's; free some (lower trainer.n_gpus_per_node) or serve the judge elsewhere and give its "
                "base_url"
            )
        key = secrets.token_urlsafe(24)
        where = "the trainer's GPU, shared" if share else f"{num_gpus} GPU(s)"
        logger.info("starting the local judge's vLLM server (%s) on %s", ref.model_path, where)
        actor_cls: Any = ray.remote(_JudgeServerActor)
        # num_cpus 0: the server must not take a CPU slot a trainer worker's placement needs
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus}
        if share:  # whatever this Ray's default for an actor without GPUs, leave it the node's devices
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        self._actor = actor_cls.options(**options).remote(
            ref.model_path, name, key, args, server.startup_timeout_s, share
        )
        try:
            base_url, log_path = ray.get(self._actor.where.remote(), timeout=server.startup_timeout_s + 120)
        except Exception as exc:
            self.stop()
            cause = getattr(exc, "cause", None) or exc  # a RayActorError carries the actor's exception
            raise JudgeServerError(f"the local judge's server ({ref.model_path}) did not start: {cause}") from None
        logger.info("local judge %s served at %s (log: %s)", name, base_url, log_path)
        # The reward workers take the driver's environment when they start, the key with it.
        os.environ[JUDGE_KEY_ENV] = key
        self.base_url = base_url
        self.reward_config = replace(
            reward,
            judge=replace(
                judge,
                model=replace(
                    ref, model_path=None, base_url=base_url, api_key_env=JUDGE_KEY_ENV, served_model_name=name
                ),
            ),
        )

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL), then its actor."""
        import ray

        actor, self._actor = getattr(self, "_actor", None), None
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except Exception:  # a dead actor's server died with it (die_with_parent)
            logger.debug("the local judge's actor was gone at stop", exc_info=True)
        ray.kill(actor)
        os.environ.pop(JUDGE_KEY_ENV, None)
