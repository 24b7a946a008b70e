"""Engine fault injection: make a real engine fail inside its `generate`, on chosen calls, the way engines die in
production, so the self-healing of `easyrl.rollout.worker` is tested against the engine's own failure path.

`EASYRL_ENGINE_FAULT=<kind>@<calls>` (e.g. `kill@2` or `oom@1,2`): the engine generate calls of this process are
counted from 1 (a restarted engine continues the count), and each call listed fails in the engine itself:

- `raise`: a `RuntimeError` from inside the generation (the engine's state survives: it recovers in place);
- `oom`: a `torch.OutOfMemoryError` from inside the generation (the HF engine's decoding step; the state survives);
- `kill`: the engine's own state is destroyed before its requests run (vLLM: the engine core's worker, with its
  weights and KV cache, is torn down, and the generation fails in the core; HF: the model is dropped), so the engine
  cannot recover in place and must be rebuilt.

Unset (every real run), `next_fault` costs one environment read per generate call. Nothing here mocks an engine:
the engines call `next_fault` and act it out on themselves.
"""

from __future__ import annotations

import os
import threading


FAULT_ENV = "EASYRL_ENGINE_FAULT"
FAULT_KINDS = ("raise", "oom", "kill")
_lock = threading.Lock()
_calls = 0


class InjectedEngineFault(RuntimeError):
    """The failure `EASYRL_ENGINE_FAULT` asked for (kind `raise`)."""


def parse_fault(value: str) -> tuple[str, set[int]]:
    """(kind, call numbers) of an `EASYRL_ENGINE_FAULT` value; a malformed one is one line naming the variable."""
    kind, _, calls = value.partition("@")
    try:
        numbers = {int(c) for c in calls.split(",") if c.strip()}
    except ValueError:
        numbers = set()
    if kind not in FAULT_KINDS or not numbers or min(numbers) < 1:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected <kind>@<call>[,<call>...] with kind one of {list(FAULT_KINDS)} "
            "and calls counted from 1, e.g. kill@2"
        )
    return kind, numbers


def next_fault() -> str | None:
    """Count one engine generate call; the fault kind it must suffer, or None."""
    global _calls
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    kind, numbers = parse_fault(value)
    with _lock:
        _calls += 1
        call = _calls
    return kind if call in numbers else None


def reset_fault_count() -> None:
    """Count the calls from 1 again (a test that sets `EASYRL_ENGINE_FAULT` starts here)."""
    global _calls
    with _lock:
        _calls = 0
