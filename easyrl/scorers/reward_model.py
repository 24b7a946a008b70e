"""A reward model: a sequence classifier with one output, read as the score of a (prompt, response) pair.

Local (`model_path`): loaded by the process that scores (a reward worker, or the driver), on CPU, and run in
batches of `batch_size` under a lock (one forward at a time per process). Remote (`base_url`): a server's
`/pooling` endpoint without activation (`vllm serve --runner pooling`: the raw output, as the local model's),
under the model's limits. Either way it reads the template rendered from the reward input or, without one, the
model's own chat template over the prompt (user) and the response (assistant), applied by the server when remote
(one conversation per request).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2

from easyrl.config.model_ref import RewardModelConfig
from easyrl.scorers.client import REPLY_BASE_BYTES, BadReply, CallStats, ModelCallError, RemoteModel, finite


__all__ = ["RewardModel"]

BYTES_PER_SCORE = 1 << 16
"""Room per input in a `/pooling` reply: a classifier's few numbers, with room for a server's extra fields."""


class RewardModel:
    """`RewardModelConfig` made ready: `score(sample)` and `score_batch(samples)` (a float each)."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.name = cfg.model.name or "reward_model"
        self.template: jinja2.Template | None = None
        if cfg.template:
            from easyrl.data.template_guard import GuardedEnvironment

            with open(cfg.template, encoding="utf-8") as f:
                env = GuardedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
                self.template = env.from_string(f.read())
        self.remote: RemoteModel | None = None
        self.model: Any = None
        if cfg.model.remote:
            self.remote = RemoteModel(cfg.model, self.name)
            self.stats = self.remote.stats
            self.tokenizer: Any = None
        else:
            self.stats = CallStats(self.name)
            self._load_local()

    def _load_local(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        ref = self.cfg.model
        assert ref.model_path is not None
        self.tokenizer = AutoTokenizer.from_pretrained(
            ref.tokenizer_path or ref.model_path, trust_remote_code=ref.trust_remote_code
        )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            ref.model_path, trust_remote_code=ref.trust_remote_code
        ).eval()
        if self.model.config.num_labels != 1:
            raise ModelCallError(
                f"{self.name}: {ref.model_path} has {self.model.config.num_labels} labels; a reward model has one output"
            )
        # The head reads the last token that is not padding: the model must know the pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._lock = threading.Lock()

    def text(self, sample: dict[str, Any]) -> str:
        """What a local reward model reads for one reward input: the template's text, or its chat template over the
        two turns (`turns`)."""
        if self.template is not None:
            from easyrl.data.template_guard import render_with_deadline

            return render_with_deadline(self.template, dict(sample))
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(turns(sample), tokenize=False)
        return f"{sample.get('prompt', '')}{sample['response']}"

    def score_batch(self, samples: list[dict[str, Any]]) -> list[float]:
        """One score per sample, in order; a failed request scores its samples 0 (`on_error: zero`) or raises."""
        if self.remote is not None and self.template is None:
            # No template: the server applies the model's own chat template to each conversation, one request each.
            with ThreadPoolExecutor(max_workers=min(len(samples), self.cfg.model.max_concurrency) or 1) as pool:
                return [s[0] if s is not None else 0.0 for s in pool.map(self._remote_chat, samples)]
        texts = [self.text(s) for s in samples]
        out: list[float] = []
        for start in range(0, len(texts), self.cfg.batch_size):
            chunk = texts[start : start + self.cfg.batch_size]
            scores = self._remote(chunk) if self.remote is not None else self._local(chunk)
            out += scores if scores is not None else [0.0] * len(chunk)
        return out

    def score(self, sample: dict[str, Any]) -> float:
        return self.score_batch([sample])[0]

    def _local(self, texts: list[str]) -> list[float] | None:
        import torch

        self.stats.add("requests")
        start = time.perf_counter()
        try:
            with self._lock, torch.no_grad():
                enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                logits = self.model(**enc).logits  # (b, 1)
            if not torch.isfinite(logits).all():  # a NaN score would become a NaN advantage: an error, not a reward
                raise FloatingPointError("the model scored a sample NaN or infinite")
        except Exception as exc:  # a forward that fails (too long an input, out of memory) follows on_error
            self.stats.add("errors")
            if self.cfg.model.on_error == "zero":
                return None
            raise ModelCallError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        self.stats.add("_ok")
        self.stats.add("_latency_sum", time.perf_counter() - start)
        return [float(v) for v in logits[:, 0]]

    def _remote(self, texts: list[str]) -> list[float] | None:
        assert self.remote is not None

        def read(reply: Any) -> list[float]:
            data = sorted(reply["data"], key=lambda d: d["index"])
            if len(data) != len(texts):
                raise BadReply(f"{len(data)} scores for {len(texts)} inputs")
            return [finite(d["data"][0], "a score") for d in data]

        # The raw output, as the local model gives it: `/classify` would put a one-label score through a sigmoid.
        body = {"input": texts, "use_activation": False}
        return self.remote.post("/pooling", body, REPLY_BASE_BYTES + BYTES_PER_SCORE * len(texts), read)

    def _remote_chat(self, sample: dict[str, Any]) -> list[float] | None:
        assert self.remote is not None
        body = {"messages": turns(sample), "use_activation": False, "add_generation_prompt": False}
        return self.remote.post(
            "/pooling",
            body,
            REPLY_BASE_BYTES + BYTES_PER_SCORE,
            lambda r: [finite(r["data"][0]["data"][0], "a score")],
        )


def turns(sample: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation a reward model scores: the prompt as the user's turn, the response as the assistant's."""
    return [
        {"role": "user", "content": str(sample.get("prompt", ""))},
        {"role": "assistant", "content": str(sample["response"])},
    ]
