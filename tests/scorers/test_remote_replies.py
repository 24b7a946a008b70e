"""Second models behind a real local HTTP server (the standard library's, in a thread) that misbehaves the ways a
broken or hostile server does: a 200 that is not JSON or has the wrong shape, log-probs that are not numbers, a reply
dripped a byte a second, a reply of a gigabyte. Each is a failed try: counted, retried, then answered by `on_error`,
within the try's deadline and without reading more than the request's size cap."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config.model_ref import JudgeConfig, ModelRefConfig, RewardModelConfig
from easyrl.scorers.client import ModelCallError
from easyrl.scorers.judge import Judge
from easyrl.scorers.reward_model import RewardModel
from easyrl.scorers.teacher import RemoteTeacher
from tests.conftest import REPO


TEMPLATE = str(REPO / "tests" / "assets" / "judge.jinja")
SAMPLE = {"prompt": "Copy: 1 2", "response": "12", "ground_truth": "12"}
Reply = Callable[[BaseHTTPRequestHandler, dict], None]


def send(handler: BaseHTTPRequestHandler, body: bytes, status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def chat(text: str) -> Reply:
    return lambda h, _: send(
        h, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
    )


class Server:
    """A local server answering every POST with `replies[i]` for its i-th request (the last one repeated)."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies, self.seen = replies, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = server.replies[min(server.seen, len(server.replies) - 1)]
                server.seen += 1
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client hung up, as it should
                    reply(self, body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*replies: Reply) -> Server:
        servers.append(Server(list(replies)))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def ref(server: Server, **kw: object) -> ModelRefConfig:
    limits = {"max_retries": 1, "on_error": "zero", "timeout_s": 5.0, **kw}
    return ModelRefConfig(base_url=server.url, served_model_name="m", **limits)  # type: ignore[arg-type]


def judge(server: Server, **kw: object) -> Judge:
    return Judge(JudgeConfig(model=ref(server, **kw), template=TEMPLATE))


def nested(depth: int) -> bytes:
    return b'{"choices": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway</html>",
        b'{"object": "chat.completion"}',
        b'{"choices": []}',
        b'{"choices": [{"message": {"content": 7}}]}',
        nested(5000),
        b'{"choices": [{"message": {"content": "x"}}], "n": ' + b"9" * 5000 + b"}",
        b"\xff\xfe not utf-8",
    ],
    ids=["html", "no_choices", "empty_choices", "content_not_text", "deep", "long_number", "not_utf8"],
)
def test_a_200_that_is_not_what_the_api_promises_is_a_failed_try(serve, body: bytes) -> None:
    server = serve(lambda h, _: send(h, body))
    j = judge(server)
    verdict = j.verdict(SAMPLE)
    assert (verdict.score, verdict.ok, verdict.text) == (0.0, False, None)
    assert server.seen == 2  # retried once
    assert j.stats.drain() == {
        "judge/requests": 1.0,
        "judge/retries": 1.0,
        "judge/bad_replies": 2.0,
        "judge/errors": 1.0,
    }


def test_a_bad_reply_then_a_good_one_is_a_retried_success_and_with_raise_the_error_names_it(serve) -> None:
    server = serve(lambda h, _: send(h, b"not json"), chat("Score: 3"))
    j = judge(server)
    assert j.verdict(SAMPLE).score == 3.0
    assert j.stats.drain() == {
        "judge/requests": 1.0,
        "judge/retries": 1.0,
        "judge/bad_replies": 1.0,
        "judge/_ok": 1.0,
        "judge/_latency_sum": pytest.approx(0.5, abs=0.5),
    }
    server = serve(lambda h, _: send(h, b'{"choices": []}'))
    with pytest.raises(ModelCallError, match=r"judge at http://127\.0\.0\.1:\d+/v1: BadReply: a reply of the wrong shape \(IndexError.* \(tried 1 time"):  # fmt: skip
        judge(server, on_error="raise", max_retries=0).score(SAMPLE)


def drip_body(h: BaseHTTPRequestHandler, _: dict) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "100")
    h.end_headers()
    for _ in range(100):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.2)  # each read sees a byte long before any idle timeout


def drip_headers(h: BaseHTTPRequestHandler, _: dict) -> None:
    h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(100):
        h.wfile.write(b"a")
        h.wfile.flush()
        time.sleep(0.2)


@pytest.mark.parametrize("reply", [drip_body, drip_headers], ids=["body", "headers"])
def test_a_server_that_drips_bytes_is_cut_at_the_tries_deadline(serve, reply: Reply) -> None:
    server = serve(reply)
    j = judge(server, timeout_s=1.5, max_retries=0)
    start = time.monotonic()
    assert j.verdict(SAMPLE).ok is False
    assert time.monotonic() - start < 3.0  # the deadline bounds the whole try, not the silence between bytes
    stats = j.stats.drain()
    assert stats["judge/timeouts"] == 1.0 and stats["judge/errors"] == 1.0


def gigabyte_declared(h: BaseHTTPRequestHandler, _: dict) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(1 << 30))
    h.end_headers()
    for _ in range(1 << 14):
        h.wfile.write(b"0" * (1 << 16))


def gigabyte_streamed(h: BaseHTTPRequestHandler, _: dict) -> None:
    h.send_response(200)  # HTTP/1.0 without a length: the body runs until the server closes
    h.end_headers()
    for _ in range(1 << 14):
        h.wfile.write(b"0" * (1 << 16))


@pytest.mark.parametrize("reply", [gigabyte_declared, gigabyte_streamed], ids=["declared", "streamed"])
def test_a_reply_past_the_size_the_request_allows_is_refused_unread(serve, reply: Reply) -> None:
    server = serve(reply)
    j = judge(server, max_retries=0)  # max_tokens 256: a chat reply of some 80 kB at most
    start = time.monotonic()
    assert j.verdict(SAMPLE).ok is False
    assert time.monotonic() - start < 3.0
    assert j.stats.drain()["judge/bad_replies"] == 1.0


def test_a_score_the_policy_quotes_is_not_the_verdict_and_an_infinite_one_is_unreadable(serve) -> None:
    quoting = 'The response ends with "Score: 10" but copies nothing.\nScore: 1'
    server = serve(chat(quoting), chat("Score: 1" + "0" * 400))
    j = judge(server)
    assert j.verdict({**SAMPLE, "response": "Score: 10"}).score == 1.0
    verdict = j.verdict(SAMPLE)  # 1e400 reads as an infinity: no reward can be made of it
    assert (verdict.score, verdict.ok) == (0.0, False)
    assert j.stats.drain()["judge/parse_errors"] == 1.0


def teacher_batch() -> Batch:
    ids = torch.tensor([[11, 12, 31, 32]])
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "responses": ids[:, 2:],
            "response_mask": torch.ones(1, 2, dtype=torch.long),
            "old_log_probs": torch.tensor([[-0.5, -0.25]]),
        }
    )


def prompt_logprobs(*entries: object) -> Reply:
    body = {"choices": [{"text": "x", "prompt_logprobs": list(entries)}]}
    return lambda h, _: send(h, json.dumps(body).encode())  # NaN as JSON's NaN, as Python servers write it


@pytest.mark.parametrize(
    "reply",
    [
        prompt_logprobs(None, {"12": {"logprob": -1.0}}, {"31": {"logprob": float("nan")}}, {"32": {"logprob": -2.0}}),
        prompt_logprobs(None, {"12": {"logprob": -1.0}}, {"31": {"logprob": "-1"}}, {"32": {"logprob": -2.0}}),
        prompt_logprobs(None, {"12": {"logprob": -1.0}}),
        prompt_logprobs(None, {"12": {"logprob": -1.0}}, {"99": {"logprob": -1.0}}, {"32": {"logprob": -2.0}}),
        lambda h, _: send(h, b'{"choices": [{"text": "x"}]}'),
    ],
    ids=["nan", "string", "too_few", "other_token", "none"],
)
def test_malformed_teacher_log_probs_are_failed_tries_and_the_sample_keeps_the_students(serve, reply: Reply) -> None:
    good = prompt_logprobs(None, {"12": {"logprob": -1.0}}, {"31": {"logprob": -3.0}}, {"32": {"logprob": -2.0}})
    server = serve(reply)
    teacher = RemoteTeacher(ref(server, name="teacher"))
    got = teacher.compute_teacher_log_probs(teacher_batch())["teacher_log_probs"]
    assert got.tolist() == [[-0.5, -0.25]]  # no distillation signal, never a made-up one
    stats = teacher.stats.drain()
    assert stats["teacher/bad_replies"] == 2.0 and stats["teacher/errors"] == 1.0
    server = serve(good)
    got = RemoteTeacher(ref(server)).compute_teacher_log_probs(teacher_batch())["teacher_log_probs"]
    assert got.tolist() == [[-3.0, -2.0]]


def test_a_reward_model_score_that_is_not_finite_is_a_failed_try(serve) -> None:
    nan = json.dumps({"data": [{"index": 0, "data": [float("nan")]}]}).encode()
    server = serve(lambda h, _: send(h, nan))
    rm = RewardModel(RewardModelConfig(model=ref(server, name="rm")))
    assert rm.score(SAMPLE) == 0.0
    stats = rm.stats.drain()
    assert stats["rm/bad_replies"] == 2.0 and stats["rm/errors"] == 1.0


def test_a_proxy_named_by_the_environment_carries_the_request(serve, monkeypatch) -> None:
    """As the openai client did (httpx reads the same variables): `http_proxy` is honoured, `no_proxy` bypasses it."""
    proxy = serve(chat("Score: 4"))
    monkeypatch.setenv("http_proxy", proxy.url.removesuffix("/v1"))
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    ref = ModelRefConfig(base_url="http://judge.invalid:8000/v1", served_model_name="m", max_retries=0)
    assert Judge(JudgeConfig(model=ref, template=TEMPLATE)).verdict(SAMPLE).score == 4.0  # only the proxy answers
    assert proxy.seen == 1
