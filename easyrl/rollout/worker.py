"""The engine side of a process: one rollout engine, its memory ledger, and which policy's weights it holds.

A `RolloutWorker` is composed into whichever process serves rollouts. Today that is the actor (the HybridEngine:
the policy trains and the engine generates in one process, one after the other); a process that only generates
(separate rollout GPUs, asynchronous rollouts) composes the same object and is handed weights by `receive_weights`.

The worker keeps two facts the trainer needs and no one else can know:

- **stale**: the policy moved on (an update, a checkpoint load) or a deep sleep dropped the engine's weights, so the
  next session must push weights before generating;
- **version**: the policy version of the weights the engine holds, stamped on every generated row
  (`policy_version`), so an off-policy consumer can tell how old a sample is.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from easyrl.batch import Batch
from easyrl.distributed.dispatch import Total
from easyrl.distributed.memory import MemoryLedger
from easyrl.models.dtypes import DTYPES
from easyrl.rollout.engine import EngineFailedError, RolloutEngine, SamplingParams
from easyrl.rollout.media_embeds import MediaEmbeds
from easyrl.rollout.registry import EngineContext, engine_factory
from easyrl.rollout.spec import RolloutSpec, WeightSync
from easyrl.seeding import SEED_COLUMN


logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Where a push takes the policy's weights from (the actor's `TrainableModel` is one)."""

    lora: bool
    """Whether the policy trains LoRA adapters over a frozen base."""

    def full_weights(self, aliases: bool) -> Iterable[tuple[str, torch.Tensor]]:
        """Every weight under its HF name, one full tensor at a time (a LoRA policy's merged into its base)."""
        ...

    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The LoRA adapter tensors (PEFT names) and their PEFT config."""
        ...


def build_engine(
    spec: RolloutSpec, device: torch.device, media_per_prompt: dict[str, int] | None = None
) -> RolloutEngine:
    """The engine `worker.rollout.name` names (`easyrl.rollout.registry`), loaded from the policy's model folder.
    ``media_per_prompt``: the most images / videos one prompt of the data carries."""
    from transformers import AutoTokenizer

    model_cfg = spec.model
    assert model_cfg.model_path is not None and model_cfg.tokenizer_path is not None
    factory = engine_factory(spec.config.name)  # before the tokenizer loads: an unknown name fails at once
    tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path, trust_remote_code=model_cfg.trust_remote_code)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    # On CPU the engine samples in fp32 whatever the GPU dtype: bf16 matmuls there are slow and drift from the policy
    dtype = DTYPES[spec.config.dtype] if device.type == "cuda" else torch.float32
    return factory(EngineContext(spec, device, dtype, eos, pad, media_per_prompt or {}))


class RolloutWorker:
    """An engine session at a time: `open` (wake, push weights when stale), any number of `generate`, `close`.

    `ledger` is the process's memory ledger: the engine's pools are measured apart from the training figures when
    it is built, and every sleep and wake goes through it (a wake that does not fit names the levers)."""

    def __init__(
        self,
        spec: RolloutSpec,
        device: torch.device,
        ledger: MemoryLedger,
        media_per_prompt: dict[str, int] | None = None,
        sleeps: bool = True,
        embeds: MediaEmbeds | None = None,
    ) -> None:
        """`sleeps`: the engine sleeps between sessions (it shares its device with training, the HybridEngine);
        False keeps it resident (a device of its own): a session then only loads new weights. `embeds`: where the
        engine takes held vision-tower outputs from in place of pixels (`easyrl.rollout.media_embeds`); None: a
        process without the actor's encodings (every item goes as pixels, said once)."""
        self.spec = spec
        self.ledger = ledger
        self.sleeps = sleeps
        self.device, self.media_per_prompt = device, media_per_prompt
        self.embeds = embeds or MediaEmbeds(None, "a rollout worker of its own holds no actor encodings")
        with ledger.building_engine():  # its pools, kept apart from the training figures
            self.engine = build_engine(spec, device, media_per_prompt)
        self.engine.media_embeds = self.embeds
        self.stale = False  # the engine loaded the same checkpoint the policy did
        self.version = 0  # the initial checkpoint is policy version 0
        self.session_open = False
        self.rebuild_source: WeightSource | None = None
        """Where a rebuilt engine takes the policy's current weights from, read by this process alone (set by the
        owner: a one-rank actor's model, a rollout worker's received weights). None: an engine whose state is lost
        after weights were pushed cannot be rebuilt here, and its failure stops the run (`engine_failed`)."""
        self.pushed = False  # the engine holds pushed weights, not the checkpoint a rebuild loads
        self.sessions = 0  # engine sessions opened: the one line of a failure names the session
        self.restarts = 0  # restarts in the open session (at most one: a second failure stops the run)
        self.first_failure: str | None = None  # the open session's first engine failure, for the one line

    def open(self, source: WeightSource, version: int, make_room: Callable[[], None]) -> dict[str, float]:
        """Wake the engine; when it is stale, push `source`'s weights as policy `version` between waking its weights
        and its KV cache (so a deep-slept engine never holds both beside the training state). `make_room` moves the
        caller's training state off the device; it runs before the KV cache (the larger part) is mapped. Returns
        `timing_s/wake` (and `timing_s/update_weights` after a push)."""
        if self.session_open:
            raise RuntimeError("open_rollout called twice: close the engine session (close_rollout) first")
        self.session_open = True
        self.sessions += 1
        self.restarts, self.first_failure = 0, None
        if not self.sleeps:  # resident: nothing to wake, nothing to make room for; only new weights to load
            if not self.stale:
                return {}
            start = time.perf_counter()
            self.receive_weights(source, version)
            return {"timing_s/update_weights": time.perf_counter() - start}
        if not self.stale:
            start = time.perf_counter()
            make_room()
            self.ledger.wake(self.engine)  # hands the allocator's cache back first
            return {"timing_s/wake": time.perf_counter() - start}
        start = time.perf_counter()
        self.ledger.wake(self.engine, ["weights"])
        wake = time.perf_counter() - start
        start = time.perf_counter()
        self.receive_weights(source, version)
        update = time.perf_counter() - start
        start = time.perf_counter()
        make_room()
        self.ledger.wake(self.engine, ["kv_cache"])
        wake += time.perf_counter() - start
        return {"timing_s/wake": wake, "timing_s/update_weights": update}

    def receive_weights(self, source: WeightSource, version: int) -> None:
        """Load policy `version`'s weights into the (awake) engine the way the driver chose (`spec.weight_sync`);
        the engine is current afterwards."""
        sync = self.spec.weight_sync
        if (sync is WeightSync.FULL) == source.lora:
            raise RuntimeError(
                f"weight_sync={sync.value} for a {'LoRA' if source.lora else 'full'} policy: the rollout spec "
                "was not built by easyrl.trainer.role_specs from this model's lora settings"
            )
        if sync is WeightSync.ADAPTER:
            self.engine.load_adapter(*source.lora_adapter())
        else:  # FULL and MERGED_LORA: `full_weights` merges the adapters in for a LoRA policy
            self.engine.load_weights(source.full_weights(self.engine.loads_tied_aliases))
        self.version = version  # a re-push after a deep sleep keeps the version it had
        self.stale = False
        self.pushed = True

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample `params.n` responses for each of `prompts` (B rows in, B*n rows out) with the weights the engine
        holds; each row carries the `policy_version` (B*n,) int64 of those weights, and each response token its own in
        `token_policy_version` (B*n, R) int64 (-1 past the response). No wake, push or sleep here."""
        if not self.session_open:
            raise RuntimeError("generate outside an engine session: call open_rollout first (or generate_sequences)")
        assert SEED_COLUMN in prompts, f"the driver seeds every prompt of a generate call ({SEED_COLUMN!r} column)"
        out = self.generate_healing(prompts, params)
        # (B*n,) int64: which policy sampled each row (an off-policy consumer compares it with the trained one)
        version = torch.full((len(out),), self.version, dtype=torch.int64)
        # per token: a response resumed after a weight update (the carry-over loop) spans versions
        tokens = torch.where(out["response_mask"].bool(), self.version, -1).to(torch.int64)
        return out.set(policy_version=version, token_policy_version=tokens)

    def close(self) -> dict[str, float]:
        """Put the engine to sleep; returns `rollout/engine_restarts` (the session's, see `generate_healing`),
        `timing_s/sleep` (the caller adds bringing its training state back) and, on CUDA, `perf/sleep_freed_gb`."""
        if not self.session_open:
            raise RuntimeError("close_rollout without an open engine session: call open_rollout first")
        self.ledger.mark("after_generate")
        # A Total: the driver's merge of a lifecycle call sums it over the ranks (the group's restarts), where it
        # takes the mean of the other figures.
        timing: dict[str, float] = {"rollout/engine_restarts": Total(self.restarts)}
        media = self.embeds.counts()  # the session's media items, as tower outputs and as pixels (summed over ranks)
        if any(media.values()):
            timing |= {name: Total(count) for name, count in media.items()}
        if not self.sleeps:
            self.session_open = False
            return timing
        start = time.perf_counter()
        self.ledger.sleep(self.engine)  # hands the allocator's cache back too
        self.stale |= self.engine.discards_weights_on_sleep  # a deep sleep dropped the weights: push them again
        if self.ledger.slept_bytes is not None:  # what sleeping gave back to the device (weights + KV cache; CUDA)
            timing["perf/sleep_freed_gb"] = self.ledger.slept_bytes / 2**30
        timing["timing_s/sleep"] = time.perf_counter() - start
        self.session_open = False
        return timing

    # ---------------------------------------------------------------- self-healing
    def generate_healing(self, prompts: Batch, params: SamplingParams) -> Batch:
        """`engine.generate`, restarted once per session when the engine fails: recovered in place when it can
        (`RolloutEngine.recover`), else rebuilt from the spec with the current weights pushed (`rebuild`), and the
        call's requests re-sent. They carry their own seeds (`sample_seed`), so the rows are the ones the call would
        have given where the engine is deterministic. A second failure in the session stops the run with one line.
        A `ValueError` is bad input, not a dead engine: it is raised as it is (its own line names the culprit)."""
        try:
            return self.engine.generate(prompts, params)
        except ValueError:
            raise
        except Exception as exc:  # BaseException (a stop signal, SystemExit) is never caught: it ends the run
            error = exc
        if self.first_failure is not None:
            raise EngineFailedError(self.failure_line(f"failed again after its restart: {describe(error)}")) from error
        self.first_failure = describe(error)
        start = time.perf_counter()
        how = self.restart()
        self.restarts += 1
        logger.warning(
            "rollout engine %r of rank %s failed in engine session %d (%s); %s in %.1f s, its %d-prompt call "
            "re-sent (rollout/engine_restarts)",
            self.spec.config.name, os.environ.get("RANK", "0"), self.sessions, self.first_failure, how,
            time.perf_counter() - start, len(prompts),
        )  # fmt: skip
        try:
            return self.engine.generate(prompts, params)
        except Exception as exc:
            raise EngineFailedError(self.failure_line(f"failed again after its restart: {describe(exc)}")) from exc

    def restart(self) -> str:
        """Make the engine serve again after a failure; says how (in place, or rebuilt)."""
        if self.spec.config.tensor_parallel_size > 1:
            # its ranks are one engine: one rank alone cannot rebuild it, and its peers are inside the same call
            raise EngineFailedError(
                self.failure_line("is tensor-parallel, and a tensor-parallel engine is not restarted")
            )
        if self.engine.recover():
            return "recovered in place with the weights it holds"
        if self.pushed and self.rebuild_source is None:
            raise EngineFailedError(
                self.failure_line(
                    "lost its state, and its current weights cannot be read by this process alone to rebuild it "
                    "(docs/reliability.md, Self-healing engines)"
                )
            )
        self.engine.discard()
        with self.ledger.building_engine():
            self.engine = build_engine(self.spec, self.device, self.media_per_prompt)
        self.engine.media_embeds = self.embeds
        if self.pushed:  # else the checkpoint the new engine loaded is the policy version it held
            assert self.rebuild_source is not None
            self.receive_weights(self.rebuild_source, self.version)
            return f"rebuilt from its spec with policy version {self.version}'s weights pushed again"
        return "rebuilt from its spec (policy version 0: the checkpoint)"

    def failure_line(self, what: str) -> str:
        """The one line that stops the run: the engine, the session (and its policy version), the first error."""
        first = f"; first error: {self.first_failure}" if self.first_failure else ""
        return (
            f"rollout engine {self.spec.config.name!r} of rank {os.environ.get('RANK', '0')} {what}, in engine "
            f"session {self.sessions} (generating with policy version {self.version}){first}"
        )


def describe(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else '(no message)'}"
