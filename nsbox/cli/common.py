"""What the sub-CLIs share: one-line failures and running a coroutine.

Every command module imports these from here (never from cli.main, which
imports every command module to register it).
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Awaitable, Callable, NoReturn, TypeVar

import anyio
import click

T = TypeVar("T")


def exit_with(message: str, code: int = 1) -> NoReturn:
    """Prints `message` as it is on stderr and exits with `code`."""
    click.echo(message, err=True)
    sys.exit(code)


def warn(message: str) -> None:
    click.echo(f"nsbox: {message}", err=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """nsbox's one-line failure: "nsbox: MESSAGE" on stderr, exit `code`."""
    warn(message)
    sys.exit(code)


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """anyio.run(fn, *args); Ctrl-C: one line, not a traceback. SIGTERM
    (a job scheduler's, `timeout`'s, `kill`'s) ends it the same way, so
    that what it made is closed and removed (its default would leave
    sandboxes' layers for `nsbox gc`); exit status 143, as a shell's."""
    terminated = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal terminated
        terminated = True
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)  # as Ctrl-C: the event loop cancels its task

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return anyio.run(fn, *args)
    except KeyboardInterrupt:
        fail("terminated" if terminated else "interrupted", 143 if terminated else 130)
    finally:
        signal.signal(signal.SIGTERM, previous)
