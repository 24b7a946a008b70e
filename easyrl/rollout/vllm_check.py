"""What `easyrl check` looks at for the vLLM engine before a run, without starting it (`EngineCheck`).

Light to import (the registry registers it with the engine): vLLM, transformers and the argument helpers are
imported inside, when a check runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from easyrl.rollout.engine import EngineCheck


if TYPE_CHECKING:
    from easyrl.config import EasyRLConfig


class VLLMCheck(EngineCheck):
    def problem(self, cfg: EasyRLConfig, on_gpu: bool) -> str | None:
        """vLLM missing, an engine argument the installed vLLM does not take, a model the CPU build cannot serve,
        or a Gated DeltaNet prefill kernel whose package is missing."""
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return (
                "worker.rollout.name=vllm, but vLLM is not installed here (pip install -e '.[vllm]' on a GPU machine, "
                "bash scripts/install_vllm_cpu.sh on CPU), or use worker.rollout.name=hf"
            )
        from transformers import AutoConfig

        from easyrl.rollout.vllm import check_cpu_model
        from easyrl.rollout.vllm_args import check_engine_arg_names, flashinfer_installed, gdn_prefill_problem

        mcfg, kwargs = cfg.worker.actor.model, cfg.worker.rollout.engine_kwargs
        assert mcfg.model_path is not None
        hf_config = AutoConfig.from_pretrained(mcfg.model_path, trust_remote_code=mcfg.trust_remote_code)
        try:
            check_engine_arg_names(kwargs)  # names the installed vLLM's engine does not take
            if not on_gpu:
                check_cpu_model(hf_config, mcfg.model_path)
        except ValueError as exc:
            return str(exc)
        if cfg.trainer.device != "cpu":  # off CUDA vLLM runs its Triton GDN kernel whatever is asked
            return gdn_prefill_problem(hf_config, flashinfer_installed(), kwargs)
        return None

    def plan_lines(self, cfg: EasyRLConfig) -> list[str]:
        """The names of `worker.rollout.engine_kwargs` (not their values: a token may be one), the generation
        settings easyrl derives on CUDA (graph capture, async scheduling), and for a model with Gated DeltaNet layers
        the prefill kernel vLLM runs on CUDA (`easyrl.rollout.vllm_args`)."""
        from easyrl.config.engine_kwargs import sequences_per_engine_call
        from easyrl.rollout.vllm_args import flashinfer_installed, gdn_prefill, generation_args

        rollout = cfg.worker.rollout
        lines = []
        if rollout.engine_kwargs:
            lines.append(
                f"engine arguments (worker.rollout.engine_kwargs): {', '.join(map(str, rollout.engine_kwargs))}"
            )
        config_json = Path(str(cfg.worker.actor.model.model_path)) / "config.json"
        on_cuda = cfg.trainer.device != "cpu"  # a check without a GPU may plan the run a GPU node makes
        for arg in generation_args(rollout, sequences_per_engine_call(cfg), on_cuda):
            chosen = "vLLM's own" if arg.value is None else arg.value
            lines.append(f"vLLM {arg.name} (on CUDA): {chosen}, {arg.reason}")
        hf_config = json.loads(config_json.read_text())
        choice = gdn_prefill(hf_config, on_cuda, flashinfer_installed(), rollout.engine_kwargs)
        if choice is not None:
            where = "on CUDA" if on_cuda else "on CPU"
            lines.append(f"Gated DeltaNet prefill kernel (vLLM {where}): {choice.backend} ({choice.reason})")
        return lines

    def version_warning(self, on_gpu: bool) -> str | None:
        """Why the installed vLLM is not one that easyrl has run on this kind of machine (`easyrl.versions`)."""
        from easyrl.versions import installed_vllm, vllm_version_warning

        found = installed_vllm()
        return None if found is None else vllm_version_warning(*found, on_gpu=on_gpu)
