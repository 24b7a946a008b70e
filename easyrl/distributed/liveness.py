"""Waiting on worker results without ever hanging on a dead worker.

How dead workers are detected
-----------------------------
Every live :class:`~easyrl.distributed.WorkerGroup` registers itself here and keeps, for each of its actors, at
most one outstanding *ping*: a call of the actor's built-in ``__ray_ready__`` method. Actor tasks run in
submission order, so a ping sent to an idle actor returns at once, while a ping sent to a busy actor stays queued
behind the running method. Either way, when the actor process dies (``ray.kill``, crash, ``os._exit``, OOM kill)
Ray fails the queued ping with :class:`ray.exceptions.RayActorError` -- immediately, there is no polling of
the actor and no call into a busy actor.

:func:`wait_for_results` loops ``ray.wait(result refs + every group's pending pings, num_returns=1,
timeout=tick)``; a ping that completed is re-sent at most once per ``tick`` (1 s), so an idle actor costs one
trivial call a second while the driver waits, a busy one costs nothing.

Guarantee: while the driver waits on *any* group call (a synchronous call, or ``GroupCall.result()``), the death
of *any* actor of *any* live (not shut down) group of this driver process raises :class:`WorkerDiedError` naming
that group's role and the rank -- within about one tick plus Ray's death notification (measured: well under a
second on one node). A death that happens while the driver is not waiting is reported by the next wait (or by
:func:`check_alive`). A group with a dead worker stays broken: every later wait raises until it is shut down.
When a method raises on some rank, the error is reported as :class:`WorkerError` unless a death shows up within
``death_grace_s`` (a rank blocked in a collective usually fails *because* a peer died; the death is the cause).
The first error is raised without waiting for the other ranks, which may be blocked in a collective the failed
rank will never join: :meth:`GroupCall.result <easyrl.distributed.worker_group.GroupCall.result>` then stops them.

Two more ways out of a wait, checked every tick: a worker of any live group whose heartbeat stopped for the
group's ``hang_timeout_s`` (:mod:`easyrl.distributed.hang_watch`) raises :class:`WorkerFrozenError` after every
rank's stack is written out; and a stop signal (:func:`easyrl.signals.stop_requested`) makes a wait on a call
started before it give up once the stop's grace has passed (:class:`WorkerCallInterrupted`), so SIGTERM is honoured
while the driver waits on a call that never ends.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from easyrl import signals
from easyrl.distributed.errors import (
    WorkerCallInterrupted,
    WorkerDiedError,
    WorkerError,
    WorkerFrozenError,
    WorkerTimeoutError,
)
from easyrl.distributed.hang_watch import Rank, dump_stacks


class WatchedGroup(Protocol):
    """What liveness needs of a worker group (`WorkerGroup` is one): its role, the pings in flight, and where to
    record their outcome; its heartbeats and where its stacks go. A protocol, so this module does not import the
    group that imports it."""

    role: str
    stack_dir: str

    def _frozen_rank(self) -> tuple[int, float] | None: ...

    def _armed_ranks(self) -> list[tuple[int, Rank]]: ...

    def _liveness_refs(self) -> dict[Any, int]: ...

    def _ping_done(self, rank: int, ref: Any, error: BaseException | None) -> None: ...

    def _first_failure(self) -> tuple[int, BaseException] | None: ...


__all__ = ["PING_INTERVAL_S", "check_alive", "live_groups", "summarize_remote_error", "wait_for_results"]

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
"""Wait tick, and the shortest time between two pings of one idle actor."""

DEATH_GRACE_S = 1.0
"""How long a method error waits for a worker death that would explain it."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Weak: a group dropped without shutdown() stops being watched rather than being kept alive here.
_registry: weakref.WeakSet[WatchedGroup] = weakref.WeakSet()
_registry_lock = threading.Lock()


def register_group(group: WatchedGroup) -> None:
    """Make ``group``'s actors watched by every wait of this process."""
    with _registry_lock:
        _registry.add(group)


def unregister_group(group: WatchedGroup) -> None:
    """Stop watching ``group`` (on shutdown)."""
    with _registry_lock:
        _registry.discard(group)


def live_groups() -> list[WatchedGroup]:
    """The registered (live) groups."""
    with _registry_lock:
        return list(_registry)


def summarize_remote_error(error: BaseException, max_lines: int = 20) -> str:
    """The tail of a remote error's text, without ANSI colours and ``^^^`` marker lines."""
    text = _ANSI.sub("", str(error))
    lines = [line for line in text.splitlines() if line.strip() and set(line.strip()) != {"^"}]
    return "\n".join(lines[-max_lines:])


def _death_cause(error: BaseException) -> str:
    """A one-line account of an actor death from Ray's error text (without the actor id / pid block)."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines()]
    kept = [line for line in lines if line and not _is_metadata(line)]
    return " ".join(kept) or type(error).__name__


def _is_metadata(line: str) -> bool:
    return bool(re.match(r"^(class_name|actor_id|pid|namespace|ip|name):", line))


def to_group_error(role: str, rank: int, error: BaseException) -> WorkerDiedError | WorkerError:
    """Turn what ``ray.get`` raised for rank ``rank`` of group ``role`` into the driver-side error."""
    import ray

    if isinstance(error, ray.exceptions.RayActorError):
        if getattr(error, "_actor_init_failed", False):  # __init__ raised: a traceback to show, not a death
            return WorkerError(role, rank, summarize_remote_error(error))
        return WorkerDiedError(role, rank, _death_cause(error))
    cause = getattr(error, "cause", None)  # a RayTaskError carries the worker's exception itself
    if getattr(cause, "one_line", False):  # its message names the culprit (e.g. EngineFailedError): no traceback
        return WorkerError(role, rank, f"{type(cause).__name__}: {cause}")
    return WorkerError(role, rank, summarize_remote_error(error))


def _get_ready(ref: Any) -> tuple[bool, Any]:
    """``ray.get`` a ready ref: ``(True, value)`` or ``(False, exception)``."""
    import ray

    try:
        return True, ray.get(ref, timeout=0)  # already ready: never blocks
    except Exception as exc:  # any remote failure is reported as a group error
        return False, exc


def _ping_refs(groups: Iterable[WatchedGroup]) -> dict[Any, tuple[WatchedGroup, int]]:
    """The outstanding pings of ``groups`` (re-sending the ones due), by ref."""
    refs: dict[Any, tuple[WatchedGroup, int]] = {}
    for group in groups:
        for ref, rank in group._liveness_refs().items():
            refs[ref] = (group, rank)
    return refs


def _raise_recorded_deaths(groups: Sequence[WatchedGroup]) -> None:
    """Raise the failure of the first group with a worker known dead."""
    for group in groups:
        failure = group._first_failure()
        if failure is not None:
            rank, error = failure
            raise _ping_error(group.role, rank, error) from error


def _ping_error(role: str, rank: int, error: BaseException) -> WorkerDiedError | WorkerError:
    """The group error for a failed ping (any ping failure means the actor is gone)."""
    if _is_death(error):
        return to_group_error(role, rank, error)
    # `__ray_ready__` cannot raise: any failure of a ping means the actor is gone.
    return WorkerDiedError(role, rank, summarize_remote_error(error))


def _handle_ping(group: WatchedGroup, rank: int, ref: Any) -> None:
    """Account for a ready ping; raise if it failed."""
    ok, value = _get_ready(ref)
    group._ping_done(rank, ref, None if ok else value)
    if not ok:
        raise _ping_error(group.role, rank, value) from value


def _is_death(error: BaseException) -> bool:
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


def check_alive() -> None:
    """Raise :class:`WorkerDiedError` if a worker of a live group is known dead (does not block)."""
    import ray

    groups = live_groups()
    _raise_recorded_deaths(groups)
    pings = _ping_refs(groups)
    if pings:
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0)
        for ref in ready:
            group, rank = pings[ref]
            _handle_ping(group, rank, ref)


def _explain_by_death(error: WorkerError, pending: dict[Any, int], role: str, grace_s: float) -> None:
    """Raise a worker death seen within ``grace_s`` in place of ``error``; return if there is none."""
    import ray

    deadline = time.monotonic() + grace_s
    pending = dict(pending)  # a copy: the caller's map stays as it was
    while True:
        groups = live_groups()
        _raise_recorded_deaths(groups)
        pings = _ping_refs(groups)
        refs = list(pending) + list(pings)
        remaining = deadline - time.monotonic()
        if not refs or remaining <= 0:
            return
        # At most a tick per wait, so the pings due are re-sent.
        ready, _ = ray.wait(refs, num_returns=1, timeout=min(remaining, PING_INTERVAL_S))
        for ref in ready:
            if ref in pending:
                rank = pending.pop(ref)
                ok, value = _get_ready(ref)
                if not ok and _is_death(value):  # another rank's plain error changes nothing: the first stands
                    raise to_group_error(role, rank, value) from error
            else:
                group, rank = pings[ref]
                try:
                    _handle_ping(group, rank, ref)
                except WorkerDiedError as died:
                    raise died from error


def _check_frozen(groups: Sequence[WatchedGroup], role: str, method: str) -> None:
    """Raise :class:`WorkerFrozenError` for the first rank of `groups` whose heartbeat stopped, after writing every
    armed rank's stack (and the driver's) to that group's stack folder."""
    for group in groups:
        frozen = group._frozen_rank()
        if frozen is None:
            continue
        rank, silent_s = frozen
        reason = (
            f"the {group.role} worker of rank {rank} sent no heartbeat for {silent_s:.0f} s while the driver waited "
            f"on {method!r} of the {role} workers"
        )
        logger.error("%s: writing every rank's stack", reason)
        targets = [(g.role, index, armed) for g in groups for index, armed in g._armed_ranks()]
        path = dump_stacks(targets, group.stack_dir, reason)
        raise WorkerFrozenError(group.role, rank, method, role, silent_s, path)


def _check_stop(started_at: float | None, role: str, method: str) -> None:
    """Give up the wait on a call started before a stop request once the stop's grace has passed."""
    stop = signals.stop_requested()
    if stop is None or started_at is None:
        return
    requested_at, name, grace_s = stop
    if started_at < requested_at and time.monotonic() >= requested_at + grace_s:
        raise WorkerCallInterrupted(role, method, name, grace_s)


def wait_for_results(
    refs: Sequence[Any],
    role: str,
    method: str,
    timeout_s: float | None = None,
    deadline: float | None = None,
    death_grace_s: float = DEATH_GRACE_S,
    started_at: float | None = None,
) -> list[Any]:
    """Wait for one result per rank (``refs[rank]``) while watching every live group's workers.

    Args:
        refs: the object refs of a group call, by rank.
        role: the role of the called group (for errors).
        method: the called method (for errors).
        timeout_s: the call's total timeout, reported in :class:`WorkerTimeoutError`.
        deadline: a ``time.monotonic()`` instant after which :class:`WorkerTimeoutError` is raised.
        death_grace_s: how long a method error waits for a death that explains it.
        started_at: the ``time.monotonic()`` instant the call was started: a stop requested after it gives up the
            wait once the stop's grace has passed (``None``: the wait starts now).

    Returns:
        The results, by rank.

    Raises:
        WorkerDiedError: a worker of this or of another live group died.
        WorkerError: a method raised on some rank.
        WorkerTimeoutError: ``deadline`` passed.
        WorkerFrozenError: a worker of any live group stopped beating.
        WorkerCallInterrupted: a stop signal's grace passed while waiting.
    """
    import ray

    results: list[Any] = [None] * len(refs)
    pending: dict[Any, int] = {ref: rank for rank, ref in enumerate(refs)}
    started_at = time.monotonic() if started_at is None else started_at
    while pending:
        groups = live_groups()
        _raise_recorded_deaths(groups)
        _check_stop(started_at, role, method)
        _check_frozen(groups, role, method)
        pings = _ping_refs(groups)
        tick = PING_INTERVAL_S
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeoutError(role, method, timeout_s)
            tick = min(tick, remaining)  # never sleep past the deadline
        # Wake on the first result or ping, or after a tick to re-send pings and check the deadline.
        ready, _ = ray.wait(list(pending) + list(pings), num_returns=1, timeout=tick)
        if ready:  # collect whatever else is ready too, in one go
            more, _ = ray.wait(list(pending) + list(pings), num_returns=len(pending) + len(pings), timeout=0)
            ready = list(dict.fromkeys([*ready, *more]))  # deduplicated, in order
        for ref in ready:
            # A ping: raises if its actor died, else it is re-sent on a later tick.
            if ref in pings:
                group, rank = pings[ref]
                _handle_ping(group, rank, ref)
                continue
            rank = pending.pop(ref)
            ok, value = _get_ready(ref)
            if ok:
                results[rank] = value
                continue
            error = to_group_error(role, rank, value)
            # Logged now, whole: what the driver does next (waiting for a death that would explain it, stopping the
            # ranks left behind, closing the run) may hang or be killed before the error reaches anyone.
            logger.error("%s.%s failed on rank %d:\n%s", role, method, rank, summarize_remote_error(value, 200))
            # A method error may be a symptom: a rank blocked in a collective fails because a peer died. Report the
            # death instead if one shows up within the grace.
            if isinstance(error, WorkerError) and death_grace_s > 0:
                _explain_by_death(error, pending, role, death_grace_s)
            raise error from value
    return results
