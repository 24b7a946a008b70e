"""A distillation teacher behind a server (`algorithm.distill.teacher.base_url`): the log-prob of each token the
student sampled, from vLLM's prompt log-probs (`/v1/completions` with the student's token ids as the prompt,
`prompt_logprobs: 0`, one generated token that is thrown away).

The same contract as the local teacher role (`easyrl.workers.teacher`): `compute_teacher_log_probs(batch)` ->
`teacher_log_probs` (B, R), for the driver's `teacher` stage. One request per sample, up to the model's
`max_concurrency` at once. vLLM's prompt log-probs are the raw model's (temperature 1), which is why config
validation asks for `worker.rollout.temperature: 1` with a remote teacher. A reply without a finite log-prob for every
token sent is a failed try (`teacher/bad_replies`, retried). A sample whose request fails with `on_error: zero` gets the student's own log-probs as the teacher's: no distillation signal for it (counted in
`teacher/errors`), never a made-up one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.config.model_ref import ModelRefConfig
from easyrl.scorers.client import REPLY_BASE_BYTES, BadReply, RemoteModel, finite


__all__ = ["RemoteTeacher"]

BYTES_PER_ENTRY = 1024
"""Room per prompt token in a reply: its log-prob entry (`{"id": {"logprob", "rank", "decoded_token"}}`), the decoded
token JSON-escaped."""


class RemoteTeacher:
    def __init__(self, ref: ModelRefConfig) -> None:
        self.model = RemoteModel(ref, ref.name or "teacher")

    @property
    def stats(self) -> Any:
        return self.model.stats

    def _score(self, ids: list[int], n_response: int) -> list[float] | None:
        """The log-probs of the last `n_response` of `ids` given what precedes each; None when the call failed."""
        model = self.model.model
        if model is None:
            return None

        def read(reply: Any) -> list[float]:
            entries = reply["choices"][0].get("prompt_logprobs")  # vLLM's extra field
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise BadReply(f"no prompt log-probs for the {len(ids)} tokens sent (is the server vLLM?)")
            # A NaN or an infinity would reach the loss as a made-up signal: a failed try instead.
            return [
                finite(entries[j][str(ids[j])]["logprob"], f"the log-prob of token {j}")
                for j in range(len(ids) - n_response, len(ids))
            ]

        # `prompt_logprobs` is vLLM's extension: each prompt token's log-prob under the model, given its prefix.
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        return self.model.request("POST", "/completions", body, REPLY_BASE_BYTES + BYTES_PER_ENTRY * len(ids), read)

    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """`teacher_log_probs` (B, R) of the valid response tokens (0 elsewhere); a failed sample gets its
        `old_log_probs` (the student's: penalty 0)."""
        ids, attention = batch["input_ids"], batch["attention_mask"].bool()
        valid = batch["response_mask"].sum(dim=1).tolist()
        # prompt (left-padded) and response (right-padded) kept only where attended: the sequence as sampled
        rows = [(ids[i][attention[i]].tolist(), int(n)) for i, n in enumerate(valid)]
        workers = max(1, min(len(rows), self.model.ref.max_concurrency))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            scored = list(pool.map(lambda row: self._score(*row), rows))
        out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        for i, (values, (_, n)) in enumerate(zip(scored, rows)):
            if values is None:
                out[i] = batch["old_log_probs"][i]
            elif n:
                out[i, :n] = torch.tensor(values)
        return Batch({"teacher_log_probs": out})
