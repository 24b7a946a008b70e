"""A remote model behind an OpenAI-compatible API (`vllm serve`, SGLang, a hosted endpoint), called under the limits
its `ModelRefConfig` sets: requests in flight, a timeout per try, retries with backoff, and what a request that still
fails does (`on_error`). Every call is counted (`CallStats`), so the reward stage reports how the model behaved.

The API key is read here, from the environment variable the config names, in the process that calls; it goes to
the HTTP client only, never into a message, a metric or a repr.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from easyrl.config.model_ref import ModelRefConfig


__all__ = ["CallStats", "ModelCallError", "RemoteModel", "finish_stats"]

T = TypeVar("T")
BACKOFF_S = 0.5
"""Wait before the first retry; doubled before each further one."""


class ModelCallError(RuntimeError):
    """A request to a second model failed after its retries (with `on_error: raise`), or could not be made."""


class CallStats:
    """Thread-safe counters of one model's calls, drained into the step's metrics as `<name>/<counter>`:
    `requests` (calls made), `retries` (further tries), `timeouts` (tries that ran out of time), `errors` (calls
    that failed after every try), `parse_errors` (replies a judge could not read), `latency_s` (mean seconds of a
    successful call, tries included)."""

    COUNTERS = ("requests", "retries", "timeouts", "errors", "parse_errors")

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, key: str, value: float = 1.0) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + value

    def drain(self) -> dict[str, float]:
        """The counts since the last drain, as additive `<name>/<key>` sums (the latency as a sum and a count, so
        the counts of several processes add up before `finish` turns them into a mean)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return {f"{self.name}/{key}": float(value) for key, value in counts.items()}


def finish_stats(summed: dict[str, float], names: list[str]) -> dict[str, float]:
    """Summed `drain()`s of one step -> metrics of the models `names`: every counter (0 when nothing happened, so
    each step logs the same keys) and the mean latency of the successful calls."""
    out: dict[str, float] = {}
    for name in names:
        for counter in CallStats.COUNTERS:
            out[f"{name}/{counter}"] = summed.get(f"{name}/{counter}", 0.0)
        ok = summed.get(f"{name}/_ok", 0.0)
        if ok:
            out[f"{name}/latency_s"] = summed.get(f"{name}/_latency_sum", 0.0) / ok
    return out


class RemoteModel:
    """One model reference with `base_url`: sync calls from any thread, at most `max_concurrency` in flight."""

    def __init__(self, ref: ModelRefConfig, name: str) -> None:
        try:
            import openai
        except ImportError:
            raise ModelCallError(
                f"{name}: a remote model needs the openai client: pip install 'easyrl[judge]'"
            ) from None
        assert ref.base_url is not None
        self.ref = ref
        self.name = name
        self.stats = CallStats(name)
        self._openai = openai
        self._slots = threading.BoundedSemaphore(ref.max_concurrency)
        key = "EMPTY"  # servers started without --api-key accept any key; the client insists on one
        if ref.api_key_env:
            if ref.api_key_env not in os.environ:
                raise ModelCallError(
                    f"{name}: the environment variable {ref.api_key_env} (its api_key_env) is not set in this process"
                )
            key = os.environ[ref.api_key_env]
        # Our own retries (counted, with `on_error`), so the client's are off.
        self.client = openai.OpenAI(base_url=ref.base_url, api_key=key, timeout=ref.timeout_s, max_retries=0)
        self._model: str | None = ref.served_model_name
        self._model_lock = threading.Lock()

    def __repr__(self) -> str:  # no key, whatever the client's repr might show
        return f"RemoteModel({self.name!r}, base_url={self.ref.base_url!r})"

    @property
    def model(self) -> str | None:
        """The `model` field of each request: `served_model_name`, or the first model the server lists (asked once;
        None while the server cannot be asked, with `on_error: zero`)."""
        with self._model_lock:  # concurrent first calls ask once
            if self._model is None:
                listed = self.call(lambda: [m.id for m in self.client.models.list()])
                if listed == []:
                    raise ModelCallError(f"{self.name}: {self.ref.base_url} lists no model; set served_model_name")
                self._model = listed[0] if listed else None
        return self._model

    def chat(self, messages: list[dict[str, str]], **sampling: Any) -> str | None:
        """The reply to `messages` (`sampling`: temperature, top_p, max_tokens, seed); None when it failed with
        `on_error: zero`."""
        model = self.model
        if model is None:  # the server could not even be asked its model (counted): this request fails with it
            return None

        def request() -> str:
            reply = self.client.chat.completions.create(model=model, messages=messages, **sampling)  # type: ignore[call-overload,arg-type]
            return reply.choices[0].message.content or ""

        return self.call(request)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON POST to `path` on the server's root (vLLM serves `/pooling` and `/classify` there, beside `/v1`);
        None as `chat`."""
        root = str(self.ref.base_url).rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        if self.model is None:
            return None
        return self.call(lambda: self.client.post(root + path, body={**body, "model": self.model}, cast_to=object))

    def call(self, request: Callable[[], T]) -> T | None:
        """Run `request` under the limits: a slot, up to `1 + max_retries` tries (connection errors, timeouts, 429
        and 5xx are retried; other 4xx are not), then `on_error`."""
        self.stats.add("requests")
        start = time.perf_counter()
        with self._slots:
            error: Exception | None = None
            for attempt in range(self.ref.max_retries + 1):
                if attempt:
                    self.stats.add("retries")
                    time.sleep(BACKOFF_S * 2 ** (attempt - 1))
                try:
                    result = request()
                except self._openai.APITimeoutError as exc:  # before APIConnectionError: it is one
                    self.stats.add("timeouts")
                    error = exc
                except (self._openai.APIConnectionError, self._openai.RateLimitError) as exc:
                    error = exc
                except self._openai.APIStatusError as exc:
                    error = exc
                    if exc.status_code < 500:  # the request itself is wrong: another try gets the same answer
                        break
                else:
                    self.stats.add("_ok")
                    self.stats.add("_latency_sum", time.perf_counter() - start)
                    return result
        self.stats.add("errors")
        if self.ref.on_error == "zero":
            return None
        raise ModelCallError(f"{self.name} at {self.ref.base_url}: {_describe(error)} (tried {attempt + 1} time(s))")


def _describe(error: Exception | None) -> str:
    """The error's type and its first line (an HTTP error's body may echo the request, never the key)."""
    if error is None:
        return "no result"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"
