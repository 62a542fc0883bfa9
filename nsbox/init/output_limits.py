"""Output and file-size limits, read at call time.

Inside an Inspect process the limits are Inspect's (SandboxEnvironmentLimits,
which eval code may override per context); otherwise the
INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE / INSPECT_SANDBOX_MAX_READ_FILE_SIZE
environment variables, else 10 MiB and 100 MiB. Inspect is never imported
here: if it is not loaded, nothing can have overridden its defaults.
"""

from __future__ import annotations

import os
import sys

DEFAULT_EXEC_OUTPUT = 10 * 1024 * 1024
DEFAULT_READ_FILE = 100 * 1024 * 1024
_INSPECT_LIMITS = "inspect_ai.util._sandbox.limits"


def _from_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return limit


def _limit(attr: str, env: str, default: int) -> int:
    inspect_limits = sys.modules.get(_INSPECT_LIMITS)
    if inspect_limits is not None:
        value = int(getattr(inspect_limits.SandboxEnvironmentLimits, attr))
        # A value other than the default was set on purpose (by an eval, or
        # by Inspect from the environment): it wins.
        if value != default or env not in os.environ:
            return value
    return _from_env(env, default)


def exec_output_limit() -> int:
    return _limit("MAX_EXEC_OUTPUT_SIZE", "INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", DEFAULT_EXEC_OUTPUT)


def read_file_limit() -> int:
    return _limit("MAX_READ_FILE_SIZE", "INSPECT_SANDBOX_MAX_READ_FILE_SIZE", DEFAULT_READ_FILE)


def human_size(n: int) -> str:
    """The way Inspect writes limits: '10 MiB', '1 KiB', '100 bytes'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"
