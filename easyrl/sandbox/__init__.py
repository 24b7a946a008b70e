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
from easyrl.sandbox.remote import run_code_remote


__all__ = [
    "ISOLATION_MODES",
    "STATUSES",
    "SandboxLimits",
    "SandboxResult",
    "detect_isolation",
    "process_limit_enforced",
    "run_code",
    "run_code_remote",
]
