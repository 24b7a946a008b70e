"""Rollout with Hugging Face transformers' `generate`: for CPU runs, tests, and models vLLM cannot serve.

The engine keeps its own unsharded copy of the policy in eval mode; the actor streams new weights into it
after every update. Log-probs are computed from the raw logits of each decoding step divided by the
temperature, which is what the actor computes for the same tokens.

Sampling departs from `generate(do_sample=True)`: that draws every row of a batch from one global generator, so a
row's tokens would depend on how many rows come before it (on the batch's split over engines). Here each row owns a
`torch.Generator` seeded from its own seed (`easyrl.seeding`), and a token is drawn by the Gumbel-max trick: the
argmax of the warped scores (temperature, top-k, top-p, in transformers' order) plus Gumbel noise from the row's
generator is an exact draw from the softmax of those scores. `generate` then runs greedily over the perturbed scores.
"""

from __future__ import annotations

import gc
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from easyrl.batch import Batch
from easyrl.models import generate_with_media, model_class_for
from easyrl.rollout.engine import (
    RolloutEngine,
    SamplingParams,
    assemble_sequences,
    copy_weights_into,
    seeds_of_prompts,
)
from easyrl.rollout.faults import InjectedEngineFault, next_fault
from easyrl.rollout.media_embeds import batch_outputs


logger = logging.getLogger(__name__)


class RowGumbelNoise(LogitsProcessor):
    """Adds Gumbel noise to each row's scores from that row's own generator, so that the greedy pick that follows is
    a sample from the row's softmax that no other row can change. A row draws one noise vector per decoding step,
    also after it finished (those tokens are replaced by padding): its t-th token always uses its t-th draw."""

    def __init__(self, seeds: list[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # torch.rand is in [0, 1): -log(-log(0)) is -inf (never picked) and u < 1 keeps the noise finite.
        # (B, V): one draw per row per step, from that row's generator alone
        uniform = torch.stack(
            [torch.rand(scores.shape[1], generator=g, device=scores.device) for g in self.generators]
        )
        gumbel = -torch.log(-torch.log(uniform))
        return scores + gumbel.to(scores.dtype)  # type: ignore[return-value]


class FailAtStep(LogitsProcessor):
    """The fault `EASYRL_ENGINE_FAULT` asked for (`easyrl.rollout.faults`), raised from decoding step `step` (from 1):
    a failure in the middle of a generation, as a real OOM of the decoding loop would be."""

    def __init__(self, kind: str, step: int) -> None:
        self.kind, self.step, self.seen = kind, step, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.seen += 1
        if self.seen == self.step:
            message = f"injected by EASYRL_ENGINE_FAULT at decoding step {self.step}"
            raise torch.OutOfMemoryError(message) if self.kind == "oom" else InjectedEngineFault(message)
        return scores


class SampledLogProbs(LogitsProcessor):
    """The sampled token's log-prob at each decoding step, taken as `generate` runs.

    Why not `output_logits`: it keeps every step's (B, V) fp32 logits until `generate` returns, B x steps x V x 4
    bytes (160 GB for 128 rows x 2,048 tokens x 152k vocabulary: an OOM on any GPU); this keeps one (B,) per step.
    It goes last among the processors, so the argmax of the scores it is given is the token greedy search takes
    next. The log-prob is of the model's raw logits at `temperature` (what the actor computes), which a forward hook
    reads from the model's output: transformers runs its own processors (EOS held back by `min_new_tokens`,
    suppressed media tokens) before any custom one, and those would change the softmax. `close()` removes the hook.
    """

    def __init__(self, model: Any, temperature: float) -> None:
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []
        self._raw: torch.Tensor | None = None
        self._hook = model.register_forward_hook(self._keep_last_logits)

    def _keep_last_logits(self, module: Any, args: Any, output: Any) -> None:
        self._raw = output.logits[:, -1]  # the step's next-token logits, before any processor

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert self._raw is not None, "generate called the processors before the model"
        # .float() of the model's logits: the same values as the fp32 copy `generate` hands the processors
        logp = torch.log_softmax(self._raw.float() / self.temperature, dim=-1)
        self.steps.append(logp.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1))
        self._raw = None
        return scores

    def close(self) -> None:
        self._hook.remove()

    def log_probs(self, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """(rows, width) fp32: step t's log-probs in column t, zeros after the last step."""
        out = torch.zeros(rows, width, dtype=torch.float32, device=device)
        if self.steps:
            out[:, : len(self.steps)] = torch.stack(self.steps, dim=1)
        return out


def row_sampler(params: SamplingParams, seeds: list[int], device: torch.device) -> LogitsProcessorList:
    """The processors that turn `generate`'s greedy search into per-row seeded sampling with `params`' warpers,
    in the order transformers applies them when it samples (temperature, top-k, top-p)."""
    warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return LogitsProcessorList([*warpers, RowGumbelNoise(seeds, device)])


class HFRolloutEngine(RolloutEngine):
    def __init__(
        self,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: list[int],
        pad_token_id: int,
        trust_remote_code: bool = False,
    ) -> None:
        self.device = device
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        model: Any = model_class_for(config).from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code
        )
        self.model = model.to(device).eval()
        self.model.requires_grad_(False)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        # Every name, aliases included: a tied head's name maps to the embedding tensor itself, so weights sent under
        # either name land in the one tensor.
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        takes = "mm_encoder_outputs" in inspect.signature(self.model.forward).parameters
        self._no_embeds = None if takes else f"{type(self.model).__name__} takes no pre-encoded media"
        """Why this model's media always go as pixels (None: it takes tower outputs, `mm_encoder_outputs`)."""

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        input_ids = prompts["input_ids"].to(self.device)
        attention_mask = prompts["attention_mask"].to(self.device)
        media = list(prompts["multi_modal_inputs"]) if "multi_modal_inputs" in prompts else None
        # Tower outputs the actor holds go in place of their pixels (easyrl.rollout.media_embeds), n times per row.
        held = batch_outputs(self.media_embeds, media or [], params.n, self._no_embeds, self.device)
        # Sample j of prompt p is row p * n + j, as in the vLLM engine and the seeds below.
        if params.n > 1:
            input_ids = input_ids.repeat_interleave(params.n, dim=0)
            attention_mask = attention_mask.repeat_interleave(params.n, dim=0)
            media = [m for m in media for _ in range(params.n)] if media is not None else None
        greedy = params.temperature == 0
        stop_ids = [] if params.ignore_eos else self.eos_token_ids + list(params.stop_token_ids)
        # Greedy search in both cases: sampling is greedy over Gumbel-perturbed scores (see the module docstring).
        gen_cfg = GenerationConfig(
            do_sample=False,  # so transformers builds no warpers: unset temperature / top-p / top-k do nothing
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.max_tokens if params.ignore_eos else None,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )
        processors = LogitsProcessorList()
        if not greedy:
            # Sample j gets the prompt's seed + j, as vLLM seeds the j-th sample of a request.
            seeds = [s + j for s in seeds_of_prompts(prompts, params, unseeded=0) for j in range(params.n)]
            processors = row_sampler(params, seeds, self.device)
        fault = next_fault()
        if fault == "kill":  # the engine's state is gone: this call and any later one fail until it is rebuilt
            self.model = None
        elif fault is not None:  # fails inside the decoding loop, after the first token of every row was drawn
            processors.append(FailAtStep(fault, min(2, params.max_tokens)))
        recorder = None
        if params.logprobs and self.model is not None:  # last: it reads the token the perturbed scores pick
            # greedy (0) has no distribution: its tokens are scored at T = 1
            recorder = SampledLogProbs(self.model, 1.0 if greedy else params.temperature)
            processors.append(recorder)
        extra: dict[str, Any] = {"logits_processor": processors} if processors else {}
        try:
            out: Any = generate_with_media(
                self.model, input_ids, attention_mask, media, held, generation_config=gen_cfg, **extra
            )
        finally:
            if recorder is not None:
                recorder.close()
        prompt_len = input_ids.shape[1]
        responses = out.sequences[:, prompt_len:]  # generate returns the prompt and the new tokens
        if responses.shape[1] < params.max_tokens:  # every sequence stopped early: pad to a fixed width
            pad = torch.full((responses.shape[0], params.max_tokens - responses.shape[1]), self.pad_token_id)
            responses = torch.cat([responses, pad.to(responses)], dim=1)
        rows, device = responses.shape[0], responses.device
        log_probs = (
            recorder.log_probs(rows, params.max_tokens, device)
            if recorder is not None
            else torch.zeros(responses.shape, dtype=torch.float32, device=device)
        )
        stop = set() if params.ignore_eos else set(stop_ids)
        return assemble_sequences(
            input_ids.cpu(), attention_mask.cpu(), responses.cpu(), stop, self.pad_token_id, log_probs.cpu()
        )

    def recover(self) -> bool:
        """A failed `generate` (an OOM, a raise inside a decoding step) leaves nothing behind but freed tensors and
        the weights untouched (they are only read): give the cached memory back and go on, unless the model is
        gone."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.model is not None

    def discard(self) -> None:
        self.model, self._params = None, {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded = copy_weights_into(self._params, weights, "rollout model")
        logger.debug("loaded %d tensors into the HF rollout engine", loaded)
