"""Which config values are secret, and scrubbing them from everything a run writes.

A value is secret when it sits under a secret-looking key (at any depth of a free-form mapping, list items and
nested mappings included: `api_keys: [...]`, `headers: {Authorization: ...}`) or when it came from the environment
(`${oc.env:X}`, however it is spaced, alone or inside a longer string) or from `${oc.decode:...}` (whatever it
decodes to: a string, a number or a whole mapping). The value of the variable an `api_key_env` key names (a second
model's API key, read from the environment where the model is called) is scrubbed too. Our own dataclass fields are never secret by their name
(`data.prompt_key`, `worker.actor.model.tokenizer_path`), only by such a value. Credentials inside a URL
(`https://user:pass@host`) are masked wherever a URL is written, whatever key it sits under: `https://***@host`.

Masking works twice: by path (the config dump shows `***` there) and by value. Every secret string is replaced by
`***` wherever it appears later, so an interpolation copying it under an innocent key (`judge_copy: ${.judge}`),
a log line, a metric key or a generation cannot carry it out; a secret number is searched for as its text, and
a number whose text holds a secret is masked whole. Strings shorter than `MIN_SCRUB_CHARS` are masked by
path only: replacing every `8` or `abc` in the logs would destroy them, and a secret that short protects nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any


MASK = "***"
# Substrings of key names that hold credentials in the configs of HTTP clients, databases and SDKs. Masking an
# innocent value under such a name costs nothing; missing one writes a credential in clear.
SECRET_KEY = re.compile(
    r"key|token|secret|passw|passphrase|pwd|credential|auth|bearer|cookie|dsn|session|signature|private|"
    r"salt|webhook|conn_?str|connection_?string",
    re.IGNORECASE,
)
MIN_SCRUB_CHARS = 4
# `${oc.env:NAME}` / `${ oc.env : NAME , default }`: the resolver name and the variable, whatever the spacing.
_ENV_REF = re.compile(r"oc\.env\s*:\s*([^\s,}]+)")
# `${oc.decode:...}`: its result (possibly a mapping or a number) comes from text the dump must not repeat.
_DECODE_REF = re.compile(r"oc\.decode\s*:")
# The userinfo of a URL (`scheme://user:pass@host`, or a bare token as the user): everything before the `@`.
_URL_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s@]+)@")


@dataclasses.dataclass(frozen=True)
class Secrets:
    """The secrets of one loaded config: where they are and what they are."""

    paths: frozenset[str] = frozenset()
    """Dotted paths of secret values (list items as `a.b.0`), masked in the config dump."""
    values: tuple[str, ...] = ()
    """The secret strings, longest first (so a secret containing another is replaced whole)."""

    def scrub(self, text: str) -> str:
        """`text` with every secret value, and the credentials of every URL, replaced by `***`."""
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)
        if "://" in text:  # a URL's userinfo, known or not (a short password, a token as the user name)
            text = _URL_USERINFO.sub(rf"\1{MASK}@", text)
        return text

    def scrub_tree(self, tree: Any) -> Any:
        """A copy of `tree` (dicts, lists, tuples, scalars) with every string, keys included, scrubbed, and every
        number whose text holds a secret masked (a secret number copied by interpolation under another key)."""
        if isinstance(tree, str):
            return self.scrub(tree)
        if isinstance(tree, (int, float)) and not isinstance(tree, bool):
            return MASK if self.scrub(str(tree)) != str(tree) else tree
        if isinstance(tree, dict):
            return {self.scrub_tree(k): self.scrub_tree(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return [self.scrub_tree(v) for v in tree]
        return tree

    def mask(self, tree: dict[str, Any]) -> dict[str, Any]:
        """`tree` (the config as plain data) with secret paths replaced by `***`, then every secret value."""

        def walk(node: Any, path: str) -> Any:
            if path in self.paths:
                return MASK
            if isinstance(node, dict):
                return {k: walk(v, _join(path, k)) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return [walk(v, _join(path, i)) for i, v in enumerate(node)]
            return node

        masked = self.scrub_tree(walk(tree, ""))
        assert isinstance(masked, dict)
        return masked


def find_secrets(raw: dict[Any, Any], resolved: dict[str, Any], schema: set[str]) -> Secrets:
    """The secrets of a config.

    Args:
        raw: the user's config as written (interpolations unresolved), to see which values came from the environment.
        resolved: the final config as plain data (`dataclasses.asdict`), for secret-named keys and the values.
        schema: dotted paths of our own dataclass fields (never secret by name).
    """
    paths: set[str] = set()
    values: set[str] = set()
    for path, leaf in _leaves(raw, ""):
        if isinstance(leaf, str):
            names = _ENV_REF.findall(leaf)
            if names:
                paths.add(path)
                values.update(os.environ.get(name, "") for name in names)
            if _DECODE_REF.search(leaf):
                paths.add(path)  # what it decodes to may be a subtree: covered below, leaf by leaf
    covering = set(paths)
    for path, leaf, named_secret in _leaves_with_names(resolved, "", False, schema):
        if named_secret and leaf not in (None, ""):
            paths.add(path)
        if path in paths or _under(path, covering):
            if isinstance(leaf, str):
                values.add(leaf)
            elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
                values.add(str(leaf))  # found as text in logs; a copy of the number itself is masked by scrub_tree
        if path.endswith(".api_key_env") and isinstance(leaf, str) and leaf in os.environ:
            # A second model's key is read from the environment where it is called; its value must never show here.
            values.add(os.environ[leaf])
        if isinstance(leaf, str):
            for match in _URL_USERINFO.finditer(leaf):  # a URL's password may also be written on its own
                _user, colon, password = match.group(2).partition(":")
                if colon and password:  # a bare user name (`ssh://git@host`) is masked in URLs only
                    values.add(password)
    kept = sorted((v for v in values if len(v) >= MIN_SCRUB_CHARS), key=lambda v: (-len(v), v))
    return Secrets(frozenset(paths), tuple(kept))


def _under(path: str, prefixes: set[str]) -> bool:
    """Whether `path` lies below one of `prefixes` (a decoded mapping's leaves below the interpolation's path)."""
    return any(path.startswith(prefix + ".") for prefix in prefixes)


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, _join(path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, _join(path, i))
    else:
        yield path, tree


def _leaves_with_names(tree: Any, path: str, inherited: bool, schema: set[str]) -> Iterator[tuple[str, Any, bool]]:
    """(path, leaf, whether a key on its path is secret-named): a secret key covers everything under it."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            child = _join(path, k)
            named = inherited or (child not in schema and bool(SECRET_KEY.search(str(k))))
            yield from _leaves_with_names(v, child, named, schema)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves_with_names(v, _join(path, i), inherited, schema)
    else:
        yield path, tree, inherited


class ScrubFilter(logging.Filter):
    """Replaces secret values in every record a handler emits: message, arguments and traceback."""

    def __init__(self, secrets: Secrets) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.secrets.scrub(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.secrets.scrub(record.exc_text)
        return True


class ScrubbingStream:
    """A text stream that writes to `stream` with every secret value replaced (each `write` call is scrubbed
    whole: `print` and loggers write a line or a message per call)."""

    def __init__(self, stream: Any, secrets: Secrets) -> None:
        self._stream = stream
        self._secrets = secrets

    def write(self, text: str) -> int:
        self._stream.write(self._secrets.scrub(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding...: the real stream's
        return getattr(self._stream, name)


def guard_console(secrets: Secrets) -> None:
    """Scrub `secrets` from this process's stdout and stderr (prints, progress bars, Ray's forwarded worker logs)
    and from every handler of the root logger (the console and any log file)."""
    if not isinstance(sys.stdout, ScrubbingStream):
        sys.stdout = ScrubbingStream(sys.stdout, secrets)  # type: ignore[assignment]
    if not isinstance(sys.stderr, ScrubbingStream):
        sys.stderr = ScrubbingStream(sys.stderr, secrets)  # type: ignore[assignment]
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ScrubFilter) for f in handler.filters):
            handler.addFilter(ScrubFilter(secrets))
