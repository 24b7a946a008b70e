"""A generative judge (LLM-as-judge, GenRM): a jinja template turns a reward input into the judge's message, the
model answers, and a regex or a function reads a number out of the answer.

A reward function gets a ready `Judge` as its `judge` argument and decides what to do with the verdict: return it,
or combine it with checks of its own (a format rule, a length penalty). The judge runs under its model's limits
(`easyrl.scorers.client.RemoteModel`); a request or a reply that fails is scored 0 (`on_error: zero`) or raises
(`on_error: raise`), and is counted either way.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2

from easyrl.config.model_ref import JudgeConfig
from easyrl.data.template_guard import GuardedEnvironment, TemplateLimitError, render_with_deadline
from easyrl.scorers.client import ModelCallError, RemoteModel


__all__ = ["Judge", "JudgeParseError", "Verdict", "load_function"]


class JudgeParseError(ModelCallError):
    """The judge answered, but no score could be read from the answer (with `on_error: raise`)."""


@dataclass(frozen=True)
class Verdict:
    """What the judge said about one sample."""

    score: float
    """The number read from the reply; 0 when the call or the parse failed (`ok` False) with `on_error: zero`."""
    text: str | None
    """The reply as the model wrote it; None when the request failed."""
    ok: bool
    """Both the request and the parse succeeded."""


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """`path/to/file.py:function` imported by path (its folder appended to `sys.path`); errors name `key`."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ValueError(f"{key}: expected path/to/file.py:function, got {spec!r}")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: file not found: {path}")
    module_spec = importlib.util.spec_from_file_location(f"easyrl_scorer_{abs(hash(path))}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    if os.path.dirname(path) not in sys.path:
        sys.path.append(os.path.dirname(path))  # appended: a file named like a stdlib module must not shadow it
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}: {path} has no function {name!r}")
    return fn


def _parser(parse: str, key: str, match: str = "last") -> Callable[[str], float | None]:
    """`parse` as a function of the reply: a `file.py:fn` returning a number (or None), else a regex whose first
    group (or whole match, without a group) is the number, read from its last match (`match: last`) or its first."""
    if parse.rpartition(":")[0].endswith(".py"):
        return load_function(parse, key)
    try:
        pattern = re.compile(parse)
    except re.error as exc:
        raise ValueError(
            f"{key}: {parse!r} is not a regular expression ({exc}) nor path/to/file.py:function"
        ) from None

    def read(text: str) -> float | None:
        if match == "first":
            found = pattern.search(text)
        else:  # the verdict ends the reply: a score quoted earlier (the policy's own "Score: 10") is not it
            found = None
            for found in pattern.finditer(text):  # noqa: B007  (the loop keeps the last)
                pass
        if found is None:
            return None
        try:
            return float(found.group(1) if pattern.groups else found.group(0))
        except (ValueError, OverflowError):
            return None

    return read


class Judge:
    """`JudgeConfig` made ready: `verdict(sample)`, `score(sample)`, `score_batch(samples)` (concurrent) and
    `ascore(sample)` (for async reward functions)."""

    def __init__(self, cfg: JudgeConfig, key: str = "worker.reward.judge") -> None:
        self.cfg = cfg
        self.name = cfg.model.name or "judge"
        if cfg.model.base_url is None:  # a local judge: its server comes with a run (`easyrl.scorers.served`)
            raise ModelCallError(
                f"{key}.model.model_path: a local judge is served by `easyrl train` for the run; outside a run, serve "
                "it yourself (vllm serve) and give its base_url"
            )
        self.model = RemoteModel(cfg.model, self.name)
        assert cfg.template is not None  # config validation requires it with a model
        with open(cfg.template, encoding="utf-8") as f:
            source = f.read()
        env = GuardedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)
        self.template = env.from_string(source)
        self.parse = _parser(cfg.parse, f"{key}.parse", cfg.parse_match)
        s = cfg.sampling
        self.sampling: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
        if s.seed is not None:
            self.sampling["seed"] = s.seed

    @property
    def stats(self) -> Any:
        return self.model.stats

    def messages(self, sample: dict[str, Any]) -> list[dict[str, str]]:
        """The judge's conversation for one reward input: the template rendered with the input's keys (`response`,
        `prompt`, `ground_truth` and every column of the row) as one user message."""
        try:
            text = render_with_deadline(self.template, dict(sample))
        except (jinja2.exceptions.UndefinedError, TemplateLimitError) as exc:
            raise ValueError(f"judge template {self.cfg.template}: {exc}") from exc
        return [{"role": "user", "content": text}]

    def verdict(self, sample: dict[str, Any]) -> Verdict:
        """Ask the judge about `sample`; a failed request or an unreadable reply gives a zero verdict
        (`on_error: zero`) or raises (`on_error: raise`)."""
        text = self.model.chat(self.messages(sample), **self.sampling)
        if text is None:  # the request failed and was counted; on_error is zero
            return Verdict(0.0, None, False)
        try:
            score = self.parse(text)
            score = None if score is None else float(score)
        except (TypeError, ValueError):  # a parse function that returned something other than a number
            score = None
        # An infinite or NaN score (a 400-digit "Score: 1000...") would reach the advantages as one: unreadable, like
        # no score.
        if score is None or not math.isfinite(score):
            self.model.stats.add("parse_errors")
            if self.cfg.model.on_error == "raise":
                what = "no score" if score is None else f"the score {score} is not finite"
                raise JudgeParseError(f"{self.name}: {what} in its reply ({self.cfg.parse!r}): {text[:200]!r}")
            return Verdict(0.0, text, False)
        return Verdict(float(score), text, True)

    def score(self, sample: dict[str, Any]) -> float:
        return self.verdict(sample).score

    def verdict_batch(self, samples: list[dict[str, Any]]) -> list[Verdict]:
        """Verdicts for `samples` in order, up to the model's `max_concurrency` requests at once."""
        if not samples:
            return []
        with ThreadPoolExecutor(max_workers=min(len(samples), self.cfg.model.max_concurrency)) as pool:
            return list(pool.map(self.verdict, samples))

    def score_batch(self, samples: list[dict[str, Any]]) -> list[float]:
        return [v.score for v in self.verdict_batch(samples)]

    async def ascore(self, sample: dict[str, Any]) -> float:
        """`score` for an async reward function: the request runs on a thread, the event loop goes on."""
        return await asyncio.to_thread(self.score, sample)
