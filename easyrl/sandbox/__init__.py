"""Run untrusted Python source (a model's code) in a sandbox: for code rewards and for a ``python`` tool."""

from easyrl.sandbox.local import (
    ISOLATION_MODES,
    STATUSES,
    SandboxLimits,
    SandboxResult,
    detect_isolation,
    process_limit_enforced,
    run_code,
)


__all__ = [
    "ISOLATION_MODES",
    "STATUSES",
    "SandboxLimits",
    "SandboxResult",
    "detect_isolation",
    "process_limit_enforced",
    "run_code",
]
