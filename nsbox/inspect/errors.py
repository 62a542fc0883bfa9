"""nsbox's exceptions, as the ones Inspect's sandbox contract names."""

from __future__ import annotations

import contextlib
from typing import Iterator

from inspect_ai.util import OutputLimitExceededError, SandboxUnavailableError, SandboxUserUnsupportedError

from ..errors import OutputLimitExceeded, SandboxUnavailable, UserUnsupported
from ..init.output_limits import human_size


@contextlib.contextmanager
def as_inspect_errors() -> Iterator[None]:
    """nsbox's exceptions, as the ones Inspect's contract names."""
    try:
        yield
    except UserUnsupported as e:
        raise SandboxUserUnsupportedError(str(e)) from e
    except SandboxUnavailable as e:
        raise SandboxUnavailableError(str(e)) from e
    except OutputLimitExceeded as e:
        output = None if e.stdout is None else e.stdout + (e.stderr or "")
        raise OutputLimitExceededError(human_size(e.limit), output) from e
