"""Starting (or joining) Ray from the driver.

A private (single-node) instance listens on loopback only: Ray's GCS, raylet, object manager, workers and agents
bind to 127.0.0.1, the dashboard is off, and it starts lean (see :func:`_lean_head`: no autoscaler monitor, no API
server, no pre-started idle workers), and the workers' ``torch.distributed`` rendezvous, gloo and NCCL
bootstrap, and vLLM stay on loopback too (see :func:`local_only_env`). Its temp folders lie under a per-user 0700
folder, and its session folder is removed when the driver exits (if the driver is killed, a reaper process stops
Ray's processes and removes it). Joining a cluster (``address`` or ``RAY_ADDRESS``, checked to answer first)
changes none of that: the cluster's own ``ray start`` settings apply.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

from easyrl.signals import keep_handlers


__all__ = ["LOOPBACK", "default_worker_env", "init_ray", "local_only_env"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_LOCAL_ONLY_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray reads this (at import) to decide whether a node may be reached from other hosts; "0" makes a new local
instance take 127.0.0.1 as its node address, which its servers then bind to instead of every interface."""


def default_worker_env(use_gpu: bool | None = None) -> dict[str, str]:
    """Environment variables every worker gets by default.

    ``TOKENIZERS_PARALLELISM=false`` (tokenizers forked into many processes warn and deadlock otherwise), and on
    CPU-only machines ``OMP_NUM_THREADS=1`` / ``MKL_NUM_THREADS=1`` so that several worker processes do not
    oversubscribe the cores.
    """
    if use_gpu is None:
        try:
            import torch

            use_gpu = torch.cuda.is_available()
        except ImportError:  # pragma: no cover - torch is a dependency
            use_gpu = False
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if not use_gpu:
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


def local_only_env() -> dict[str, str]:
    """Worker environment that keeps a single-node run's own sockets on loopback: gloo and NCCL bootstrap on
    ``lo``, vLLM's host address 127.0.0.1 (the rendezvous store follows ``MASTER_ADDR``, see
    :func:`easyrl.distributed.torch_dist.init_distributed`)."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": LOOPBACK}


def _bind_ray_to_loopback() -> None:
    """Make the Ray instance about to start take 127.0.0.1 as its node address (its servers bind to it)."""
    os.environ.setdefault(_LOCAL_ONLY_RAY_ENV, "0")  # read by Ray's child processes and by a later import
    from ray._private import ray_constants

    # Ray is usually imported already (the worker classes import it), so its import-time reading of the variable
    # is set here as well.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ[_LOCAL_ONLY_RAY_ENV].lower() not in ("0", "false")


_LEAN_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""Ray pre-starts one idle Python worker per CPU for the first driver; easyrl's actors never run in them (each rank
has its own ``runtime_env``), so on a small machine they only cost start-up CPU and ~85 MiB each."""


class _TokenAuthOnNotice(logging.Filter):
    """Drops Ray's warning that a new local cluster has token authentication on (its default), printed on every run;
    the warning that it is *off* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _quiet_auth_notice() -> None:
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthOnNotice) for f in log.filters):
        log.addFilter(_TokenAuthOnNotice())


@contextlib.contextmanager
def _lean_head() -> Iterator[None]:
    """While a private instance starts, skip two head processes a single-node run never uses: the autoscaler
    monitor (nothing to scale) and the API server (Ray starts it even with ``include_dashboard=False``, for usage
    stats and the job/state APIs). Together ~220 MiB and two Python start-ups on the cores the run needs.

    ``ray.init`` has no flag for either (``ray start`` has ``--no-monitor`` only), so the two ``Node`` methods are
    stood in for by no-ops for the duration of the call; Ray treats a missing API server as one that failed to
    start, which a ``ray.init`` without ``include_dashboard=True`` tolerates. If a Ray release renames them, the
    start is simply not lean (``tests/distributed/test_ray_session.py`` notices).
    """
    try:
        from ray._private.node import Node
    except ImportError:  # pragma: no cover - a Ray without this private module
        yield
        return
    saved = {name: Node.__dict__.get(name) for name in ("start_monitor", "start_api_server")}
    if any(method is None for method in saved.values()):  # pragma: no cover - renamed in another Ray release
        yield
        return

    def skipped(self: Any, *args: Any, **kwargs: Any) -> None:
        del self, args, kwargs

    try:
        for name in saved:
            setattr(Node, name, skipped)
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


def _private_temp_root() -> str:
    """`<tmp>/easyrl-ray-<uid>`, mode 0700 and ours: Ray makes its temp folders world-writable (0777, no sticky bit,
    so that users can share `/tmp/ray`); under this parent no other user can reach them."""
    import stat
    import tempfile

    root = os.path.join(tempfile.gettempdir(), f"easyrl-ray-{os.getuid()}")
    with contextlib.suppress(FileExistsError):  # checked below: ours, a folder, private
        os.mkdir(root, 0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(
            f"{root} is not a folder owned by you (uid {os.getuid()}); remove it, or set TMPDIR to a private folder"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(root, 0o700)
    return root


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A cluster address that answers nothing is one line now, not minutes of Ray's retries."""
    import socket

    from easyrl.distributed.errors import ClusterUnreachableError

    if address in ("auto", "local"):  # resolved by Ray from its own files
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # a form Ray resolves itself; it reports its own errors
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        source = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") == address else "address"
        raise ClusterUnreachableError(
            f"{source}: {address}: nothing answers at {host}:{port} within {timeout_s:g} s ({exc}); start the cluster, or "
            "unset RAY_ADDRESS to let the run start its own Ray",
        ) from None


def _remove_session_folder_at_exit() -> None:
    """Shut Ray down at exit, then delete this instance's own session folder (never another run's); if the driver
    dies without exiting (SIGKILL), the reaper (`easyrl.distributed.reaper`) does it and says so."""
    import ray

    node = ray._private.worker._global_node  # no public accessor for the session folder
    session = node.get_session_dir_path() if node is not None else None
    if not session:
        return

    from easyrl.distributed.reaper import start_reaper, stop_reaper

    reaper = start_reaper(session)  # acts only if this process dies without running the hook below

    def cleanup() -> None:
        stop_reaper(reaper)
        if ray.is_initialized():
            ray.shutdown()
        latest = os.path.join(os.path.dirname(session), "session_latest")
        if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(session):
            os.unlink(latest)
        shutil.rmtree(session, ignore_errors=True)
        logger.debug("removed the Ray session folder %s", session)

    atexit.register(cleanup)  # registered after Ray's own exit hook, so it runs first (atexit is LIFO)


def init_ray(
    num_cpus: int | None = None,
    env_vars: dict[str, str] | None = None,
    *,
    num_gpus: int | None = None,
    address: str | None = None,
    log_to_driver: bool = True,
    **ray_kwargs: Any,
) -> bool:
    """Start a local Ray instance (or join ``address`` / ``RAY_ADDRESS``) unless Ray is already initialized.

    Args:
        num_cpus: CPUs Ray may schedule on (``None``: all of the machine's).
        env_vars: extra environment variables for every worker process, on top of :func:`default_worker_env`
            (a value given here wins). They go through the job's ``runtime_env``, which per-actor ``env_vars`` of a
            :class:`~easyrl.distributed.WorkerGroup` extend.
        num_gpus: GPUs Ray may schedule on (``None``: autodetect).
        address: a running cluster to join; ``None`` starts a local instance unless ``RAY_ADDRESS`` is set.
        log_to_driver: forward the workers' stdout/stderr to the driver.
        ray_kwargs: anything else for :func:`ray.init`.

    Returns:
        ``True`` if this call initialized Ray, ``False`` if it was already initialized.

    A private instance (no ``address``, no ``RAY_ADDRESS``) listens on 127.0.0.1 only and removes its session
    folder at exit; see the module docstring.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    env = default_worker_env(use_gpu=bool(num_gpus) if num_gpus is not None else None)
    if address is None:
        env.update(local_only_env())
    env.update(env_vars or {})
    runtime_env = dict(ray_kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env, **dict(runtime_env.get("env_vars") or {})}
    init_args: dict[str, Any] = {
        "address": address,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": log_to_driver,
        "runtime_env": runtime_env,
    }
    if address is None:
        _quiet_auth_notice()
        _bind_ray_to_loopback()
        init_args.update(num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address=LOOPBACK)
        if "_temp_dir" not in ray_kwargs and not os.environ.get("RAY_TMPDIR"):
            # A subfolder: Ray makes the temp folder it is given 0777; the 0700 parent is what keeps others out.
            init_args["_temp_dir"] = os.path.join(_private_temp_root(), "ray")
        init_args["_system_config"] = {**_LEAN_SYSTEM_CONFIG, **dict(ray_kwargs.pop("_system_config", None) or {})}
    else:
        _check_reachable(address)
    init_args.update(ray_kwargs)
    lean: contextlib.AbstractContextManager[None] = _lean_head() if address is None else contextlib.nullcontext()
    with keep_handlers(), lean:  # ray.init replaces the SIGTERM handler of the `easyrl` command
        ray.init(**init_args)
    if address is None:
        _remove_session_folder_at_exit()
    logger.info("Ray initialized: %s", ray.cluster_resources())
    return True
