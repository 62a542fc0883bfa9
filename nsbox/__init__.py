"""nsbox: rootless local sandboxes for Linux on user, mount and PID namespaces."""

from .errors import (
    CommandTimeout,
    HostPrerequisiteError,
    NsboxError,
    OutputLimitExceeded,
    SandboxSetupError,
    SandboxUnavailable,
    UserUnsupported,
)
from .sandbox import ExecResult, Sandbox

__version__ = "0.1.0"

__all__ = [
    "CommandTimeout",
    "ExecResult",
    "HostPrerequisiteError",
    "NsboxError",
    "OutputLimitExceeded",
    "Sandbox",
    "SandboxSetupError",
    "SandboxUnavailable",
    "UserUnsupported",
    "__version__",
]
