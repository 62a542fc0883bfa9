"""nsbox: rootless local sandboxes for Linux on user, mount and PID namespaces."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CommandTimeout,
    HostPrerequisiteError,
    NsboxError,
    OutputLimitExceeded,
    ResourceExhausted,
    SandboxSetupError,
    SandboxUnavailable,
    UserUnsupported,
)

if TYPE_CHECKING:
    from .init.client import ExecResult
    from .network import Network
    from .sandbox import Sandbox
    from .spec import SandboxSpec

__version__ = "0.1.0"

__all__ = [
    "CommandTimeout",
    "ExecResult",
    "HostPrerequisiteError",
    "Network",
    "NsboxError",
    "OutputLimitExceeded",
    "ResourceExhausted",
    "Sandbox",
    "SandboxSetupError",
    "SandboxSpec",
    "SandboxUnavailable",
    "UserUnsupported",
    "__version__",
]

# Loaded on first use: the plan, steps and spec modules need no compiled
# code, so `import nsbox.plan` works without the C extension.
_LAZY = {"Sandbox": "sandbox", "ExecResult": "init.client", "SandboxSpec": "spec", "Network": "network"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups find it without this function
        return value
    raise AttributeError(f"module 'nsbox' has no attribute {name!r}")
