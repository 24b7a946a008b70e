"""Bounds on what a prompt template may cost per row: output size and render time.

jinja's sandbox stops a template from reaching Python, not from exhausting the machine: `{{ 'x' * 2000000000 }}`,
`{{ 'x'|center(2000000000) }}`, a `~` chain that doubles a string forty times, or two nested `range(100000)` loops
all pass it and grow to gigabytes or run for hours. This environment checks every operation that can multiply
text before it runs (or, for concatenation, as soon as it has run), and a watchdog interrupts a render that runs
past its deadline; either stops the run with one line naming the template (`TemplateLimitError`).
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.sandbox
import jinja2.utils


__all__ = [
    "MAX_RENDER_CHARS",
    "RENDER_TIMEOUT_S",
    "GuardedEnvironment",
    "TemplateLimitError",
    "render_with_deadline",
]

# ~2M tokens: past any model's context, so no real prompt is refused; a string is checked right after a `~` join,
# so the largest transient allocation is twice this (tens of MB), never gigabytes.
MAX_RENDER_CHARS = 8_000_000
# A prompt template renders in microseconds; seconds per row means a loop the author did not mean.
RENDER_TIMEOUT_S = 10.0
# Widths and precisions only: `%-2000000000s`, `%.9999999999f`, and the spec after ':' in `{:>2000000000}`; other
# digits in the text ("ID 123456789: %s") are not sizes.
_PERCENT_SIZES = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d+))?")
_BRACE_SPECS = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")


class TemplateLimitError(ValueError):
    """A render went past `MAX_RENDER_CHARS` or `RENDER_TIMEOUT_S` (the message says which and where)."""


class _Deadline(BaseException):
    """Raised inside a render by the watchdog; a BaseException so no `except Exception` in between swallows it."""


def _check_size(n: float, what: str) -> None:
    if n > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{what} would make {n:,.0f} characters, past the {MAX_RENDER_CHARS:,} limit")


def _check_format_string(text: str, what: str) -> None:
    """A width or precision in a format string (`%2000000000s`, `{:>2000000000}`) is a size too."""
    sizes = [d for pair in _PERCENT_SIZES.findall(text) for d in pair if d]
    sizes += [d for spec in _BRACE_SPECS.findall(text) for d in _DIGITS.findall(spec)]
    for digits in sizes:
        if len(digits) > 9 or int(digits) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"{what}: the number {digits} in the format string is past the size limit")


def _check_args(args: tuple[Any, ...], kwargs: dict[str, Any], what: str) -> None:
    """Integer arguments (widths, counts) no larger than the output may be: `center`, `ljust`, `indent`, ..."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _check_size(abs(value), what)


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple | bytes) else None


class _GuardedNamespace(jinja2.utils.Namespace):
    """`namespace()` whose attributes, set in a loop, cannot grow a string without bound."""

    def __setitem__(self, name: str, value: Any) -> None:
        size = _sized(value)
        if size is not None:
            _check_size(size, f"namespace attribute {name!r}")
        super().__setitem__(name, value)


class _GuardedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Routes every `~` concatenation through `environment.checked_text`: the sandbox has no hook for it."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.checked_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class GuardedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus size checks on `*`, `**`, `+`, `%`, `~`, calls and filters (module docstring)."""

    code_generator_class = _GuardedCodeGenerator
    # Intercepting also keeps jinja from folding `'x' * 2000000000` at compile time (it would hang the load).
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # lorem-ipsum generation: no use in a prompt, and unbounded
        self.globals["namespace"] = _GuardedNamespace
        self.filters = {name: _guarded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        what = f"the operation {operator!r}"
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _sized(seq) is not None and isinstance(count, int):
                    _check_size(_sized(seq) * count, what)  # type: ignore[operator]
        elif operator == "**" and isinstance(left, int | float) and isinstance(right, int | float):
            if abs(left) > 1 and right > 0:  # the result's digits grow with right * log(left)
                _check_size(right * math.log10(abs(left)), what)
        elif operator == "+" and _sized(left) is not None and _sized(right) is not None:
            _check_size(_sized(left) + _sized(right), what)  # type: ignore[operator]
        elif operator == "%" and isinstance(left, str):
            _check_format_string(left, what)
        return super().call_binop(context, operator, left, right)

    # Double-underscore names, as in jinja: a call passing `obj=` or `context=` as a keyword must not collide.
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(__obj, "__name__", "a call")
        # The sandbox hands `str.format` over wrapped (functools.wraps): the string is the wrapped method's owner.
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str) and name in ("format", "format_map"):
            _check_format_string(owner, f"{name}()")  # its arguments are values; the widths are in the string
        else:
            _check_args(args, kwargs, f"{name}()")  # str.center/ljust/zfill/expandtabs widths, counts
        return super().call(__context, __obj, *args, **kwargs)

    def checked_text(self, text: Any) -> Any:
        size = _sized(text)
        if size is not None:
            _check_size(size, "the '~' concatenation")
        return text


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` refusing integer parameters past the size limit (`center(2000000000)`), and for `format`, widths in
    its format string. The filtered value itself is not a size (`{{ 3000000000|string }}` is fine); it comes after
    the context/environment that jinja passes first to filters marked pass_context and the like."""
    marker = jinja2.utils._PassArg.from_obj(func)
    first = 1 if marker is None else 2  # args[first - 1] is the value

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if name == "format":  # its arguments are values to format; the widths are in the format string
            _check_format_string(str(args[first - 1]), "the filter 'format'")
        else:
            _check_args(args[first:], kwargs, f"the filter {name!r}")
        return func(*args, **kwargs)

    if marker is not None:
        guarded.jinja_pass_arg = marker  # type: ignore[attr-defined]  # how jinja knows what to pass first
    return guarded


class _Watchdog:
    """Interrupts a render that runs past its deadline (see `render_with_deadline`).

    One daemon thread for the process: a render only records (deadline, fired) under its thread id. Past the
    deadline the watchdog raises `_Deadline` asynchronously in that thread (`PyThreadState_SetAsyncExc`), which
    CPython delivers between bytecodes: jinja's compiled templates are Python code, so any loop stops; the single
    operations that could run long in C are the ones `GuardedEnvironment` bounds by size.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[int, list[Any]] = {}  # thread id -> [deadline, fired]
        self.thread: threading.Thread | None = None

    def watch(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self.lock:
                for tid, entry in self.active.items():
                    if not entry[1] and now > entry[0]:
                        entry[1] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Deadline))


_WATCHDOG = _Watchdog()


def render_with_deadline(
    template: jinja2.Template, variables: dict[str, Any], timeout_s: float = RENDER_TIMEOUT_S
) -> str:
    """`template` rendered with `variables`, streamed so the output size is checked as it grows, and stopped with
    `TemplateLimitError` past `timeout_s`."""
    tid, dog = threading.get_ident(), _WATCHDOG
    with dog.lock:
        if dog.thread is None:
            dog.thread = threading.Thread(target=dog.watch, name="easyrl-template-watchdog", daemon=True)
            dog.thread.start()
        dog.active[tid] = [time.monotonic() + timeout_s, False]
    try:
        return _joined(template.generate(**variables))
    except _Deadline:
        pass
    finally:
        with dog.lock:
            if dog.active.pop(tid)[1]:  # clear an interrupt sent but not delivered, so it cannot land elsewhere
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
    raise TemplateLimitError(f"rendering one row took more than {timeout_s:g} s (a loop too large?)")


def _joined(chunks: Iterator[str]) -> str:
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        _check_size(size, "the rendered prompt")
        parts.append(chunk)
    return "".join(parts)
