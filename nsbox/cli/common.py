"""What the sub-CLIs share: one-line failures and running a coroutine.

Every command module imports these from here (never from cli.main, which
imports every command module to register it).
"""

from __future__ import annotations

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
    """anyio.run(fn, *args); Ctrl-C: one line, not a traceback."""
    try:
        return anyio.run(fn, *args)
    except KeyboardInterrupt:
        fail("interrupted", 130)
