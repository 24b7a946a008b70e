"""A remote model behind an OpenAI-compatible API (`vllm serve`, SGLang, a hosted endpoint), called under the limits
its `ModelRefConfig` sets: requests in flight, a deadline per try, retries with backoff, and what a request that still
fails does (`on_error`). Every call is counted (`CallStats`), so the reward stage reports how the model behaved.

Each try is one HTTP request made here with the standard library rather than through the `openai` client, because
two bounds the client cannot give are needed: `timeout_s` bounds the whole try (an idle timeout alone never ends a
server that drips a byte a second), and a reply is read only up to a size cap derived from what was asked (a
judge's `max_tokens`, a teacher's prompt length), so a 1 GiB reply is refused, not held. A 200 whose body is not
what the API promises (not JSON, no `choices`, a log-prob that is not a finite number) is a failed try like a 503:
counted in `bad_replies`, retried, then answered by `on_error`.

The API key is read here, from the environment variable the config names, in the process that calls; it goes into
the request's `Authorization` header only, never into a message, a metric or a repr.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from easyrl.config.model_ref import ModelRefConfig


__all__ = [
    "BYTES_PER_TOKEN",
    "REPLY_BASE_BYTES",
    "BadReply",
    "CallStats",
    "HTTPStatusError",
    "ModelCallError",
    "RemoteModel",
    "RequestTimeout",
    "finish_stats",
]

T = TypeVar("T")
BACKOFF_S = 0.5
"""Wait before the first retry; doubled before each further one."""
REPLY_BASE_BYTES = 1 << 16
"""What any reply may hold besides its payload: ids, the model's name, usage, a server's extra fields."""
BYTES_PER_TOKEN = 64
"""Room per generated token in a reply: its text JSON-escaped (a token of a few characters, each up to `\\uXXXX`)."""
_CHUNK = 1 << 16


class ModelCallError(RuntimeError):
    """A request to a second model failed after its retries (with `on_error: raise`), or could not be made."""


class BadReply(Exception):
    """A reply that is not what the API promises: not JSON, the wrong shape, over its size cap, a number that is not
    finite."""


class RequestTimeout(Exception):
    """A try that ran past `timeout_s`, however the server spent it (silent, or dripping bytes)."""


class HTTPStatusError(Exception):
    """A reply with a status other than 2xx (its body's start in the message)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


class CallStats:
    """Thread-safe counters of one model's calls, drained into the step's metrics as `<name>/<counter>`:
    `requests` (calls made), `retries` (further tries), `timeouts` (tries that ran past `timeout_s`), `bad_replies`
    (tries whose reply was not what the API promises: not JSON, the wrong shape, too large, a non-finite number),
    `errors` (calls that failed after every try), `parse_errors` (judge replies no finite score could be read from),
    `latency_s` (mean seconds of a successful call, tries included)."""

    COUNTERS = ("requests", "retries", "timeouts", "bad_replies", "errors", "parse_errors")

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
        assert ref.base_url is not None
        self.ref = ref
        self.name = name
        self.stats = CallStats(name)
        self._slots = threading.BoundedSemaphore(ref.max_concurrency)
        self._key: str | None = None
        if ref.api_key_env:
            if ref.api_key_env not in os.environ:
                raise ModelCallError(
                    f"{name}: the environment variable {ref.api_key_env} (its api_key_env) is not set in this process"
                )
            self._key = os.environ[ref.api_key_env]
        self._model: str | None = ref.served_model_name
        self._model_lock = threading.Lock()

    def __repr__(self) -> str:  # no key, whatever a caller prints
        return f"RemoteModel({self.name!r}, base_url={self.ref.base_url!r})"

    @property
    def model(self) -> str | None:
        """The `model` field of each request: `served_model_name`, or the first model the server lists (asked once;
        None while the server cannot be asked, with `on_error: zero`)."""
        with self._model_lock:  # concurrent first calls ask once
            if self._model is None:
                listed = self.request("GET", "/models", None, 1 << 20, _listed_ids)
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
        max_tokens = sampling.get("max_tokens") or 1 << 16  # no limit asked: the most a long reply could need
        cap = REPLY_BASE_BYTES + BYTES_PER_TOKEN * int(max_tokens)
        body = {"model": model, "messages": messages, **sampling}
        return self.request("POST", "/chat/completions", body, cap, _chat_content)

    def post(self, path: str, body: dict[str, Any], max_bytes: int, read: Callable[[Any], T]) -> T | None:
        """A JSON POST to `path` on the server's root (vLLM serves `/pooling` and `/classify` there, beside `/v1`),
        its reply read by `read`; None as `chat`."""
        model = self.model
        if model is None:
            return None
        root = str(self.ref.base_url).rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        return self.request("POST", root + path, {**body, "model": model}, max_bytes, read)

    def request(self, method: str, path: str, body: Any, max_bytes: int, read: Callable[[Any], T]) -> T | None:
        """`read` of the JSON reply to one request under the limits (`path`: under `base_url`, or a full URL);
        whatever `read` raises on a reply of the wrong shape (KeyError, IndexError, TypeError, ValueError, BadReply)
        fails the try as a bad reply."""
        url = path if "://" in path else str(self.ref.base_url).rstrip("/") + path

        def attempt() -> T:
            reply = self._exchange(method, url, body, max_bytes)
            try:
                return read(reply)
            except BadReply:
                raise
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                raise BadReply(f"a reply of the wrong shape ({type(exc).__name__}: {str(exc)[:200]})") from None

        return self.call(attempt)

    def call(self, attempt: Callable[[], T]) -> T | None:
        """Run `attempt` under the limits: a slot, up to `1 + max_retries` tries (connection errors, timeouts, bad
        replies, 429 and 5xx are retried; other 4xx are not), then `on_error`."""
        self.stats.add("requests")
        start = time.perf_counter()
        with self._slots:
            error: Exception | None = None
            for tries in range(1, self.ref.max_retries + 2):
                if tries > 1:
                    self.stats.add("retries")
                    time.sleep(BACKOFF_S * 2 ** (tries - 2))
                try:
                    result = attempt()
                except RequestTimeout as exc:
                    self.stats.add("timeouts")
                    error = exc
                except BadReply as exc:
                    self.stats.add("bad_replies")
                    error = exc
                except HTTPStatusError as exc:
                    error = exc
                    if exc.status < 500 and exc.status != 429:  # the request itself is wrong: a retry gets the same
                        break
                except (OSError, http.client.HTTPException) as exc:  # refused, reset, closed mid-reply
                    error = exc
                else:
                    self.stats.add("_ok")
                    self.stats.add("_latency_sum", time.perf_counter() - start)
                    return result
        self.stats.add("errors")
        if self.ref.on_error == "zero":
            return None
        raise ModelCallError(f"{self.name} at {self.ref.base_url}: {_describe(error)} (tried {tries} time(s))")

    def _exchange(self, method: str, url: str, body: Any, max_bytes: int) -> Any:
        """One try: the parsed JSON of a 2xx reply of at most `max_bytes`, within `timeout_s` from the start."""
        limit = float(self.ref.timeout_s)
        deadline = time.monotonic() + limit
        conn, target = _connection(url, limit)
        # The socket's timeout bounds each read only; this timer bounds the whole try by shutting the socket down,
        # which wakes a read blocked in another thread (closing it would not).
        cutter = _Cutter()
        watchdog = threading.Timer(limit, cutter.fire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            # held here: the connection forgets its socket once a reply without keep-alive owns it
            cutter.arm(conn.sock)
            headers = {"Accept": "application/json"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            if self._key is not None:
                headers["Authorization"] = f"Bearer {self._key}"
            conn.request(method, target, body=data, headers=headers)
            reply = conn.getresponse()
            if not 200 <= reply.status < 300:
                raise HTTPStatusError(reply.status, reply.read(2048).decode("utf-8", "replace"))
            raw = _read_capped(reply, max_bytes)
        except (OSError, http.client.HTTPException) as exc:
            if time.monotonic() >= deadline or isinstance(exc, TimeoutError):
                raise RequestTimeout(f"no complete reply within timeout_s={limit:g} s") from None
            raise
        finally:
            watchdog.cancel()
            conn.close()
        if time.monotonic() >= deadline:  # the cut may have ended the reply early, as a clean end of file
            raise RequestTimeout(f"no complete reply within timeout_s={limit:g} s")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep, a number too long to convert
            raise BadReply(f"the reply is not JSON ({type(exc).__name__}: {str(exc)[:120]}): {raw[:80]!r}") from None


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """An unopened connection for `url` (through the proxy the environment names, as urllib would) and the request
    target to send on it."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(parts.scheme)
    if parts.scheme == "https":
        if proxy:  # a tunnel through the proxy to the server
            p = urllib.parse.urlsplit(proxy)
            tunnel = http.client.HTTPSConnection(p.hostname or "", p.port, timeout=timeout, context=_tls())
            tunnel.set_tunnel(host, port)
            return tunnel, target
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=_tls()), target
    if proxy:  # a plain-HTTP proxy takes the full URL as the target
        p = urllib.parse.urlsplit(proxy)
        return http.client.HTTPConnection(p.hostname or "", p.port, timeout=timeout), url
    return http.client.HTTPConnection(host, port, timeout=timeout), target


@functools.cache
def _tls() -> ssl.SSLContext:
    """The system's CA certificates, loaded once per process (not per request)."""
    return ssl.create_default_context()


class _Cutter:
    """Shuts a socket down when fired, or at once when armed after it fired."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._fired = False

    def arm(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self._fired:
                self._shut()

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # already closed
                self._sock.shutdown(socket.SHUT_RDWR)


def _read_capped(reply: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it is known to pass `max_bytes` (by its declared length, or while it streams)."""
    declared = reply.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise BadReply(f"a reply of {int(declared)} bytes, over the {max_bytes} this request allows")
    chunks: list[bytes] = []
    size = 0
    while chunk := reply.read(_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise BadReply(f"a reply of over {max_bytes} bytes, the most this request allows")
        chunks.append(chunk)
    return b"".join(chunks)


def finite(value: Any, what: str) -> float:
    """`value` as a finite float, or `BadReply` naming `what` (JSON from Python servers may carry NaN and Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadReply(f"{what} is {str(value)[:40]!r}, not a number")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise BadReply(f"{what} is {number}, not a finite number")
    return number


def _listed_ids(reply: Any) -> list[str]:
    return [str(m["id"]) for m in reply["data"]]


def _chat_content(reply: Any) -> str:
    content = reply["choices"][0]["message"]["content"]
    if content is not None and not isinstance(content, str):
        raise BadReply(f"the message content is a {type(content).__name__}, not text")
    return content or ""


def _describe(error: Exception | None) -> str:
    """The error's type and its first line (an HTTP error's body may echo the request, never the key)."""
    if error is None:
        return "no result"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"
