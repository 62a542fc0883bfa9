"""Inspect's throttle for local subprocesses (max_subprocesses, default: the
CPU count), which the provider's exec enters as Inspect's own `local` and
`docker` sandboxes do through `inspect_ai.util.subprocess`.

It is the same limiter, taken from Inspect's registry under the same key,
so Inspect's status display counts nsbox's commands and the control
channel can retune the limit. Only the uncontended entry is cheaper:
Inspect's `concurrency()` makes an event-loop round trip even when a slot
is free (anyio's cancel-shielded checkpoint after the acquire), ~0.1 ms of
an exec that takes ~1 ms. A free slot is taken here without it; when none
is free, the caller waits in Inspect's own `concurrency()`, in its queue
and with the wait counted against the sample, as before.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

import anyio

try:
    from inspect_ai.util import concurrency
    from inspect_ai.util._subprocess import max_subprocesses_context_var
except ImportError:  # another Inspect version: commands run unthrottled
    concurrency = None  # type: ignore[assignment]
try:  # the registry's own doors, for a free slot taken at once
    from inspect_ai.util._concurrency import get_or_create_semaphore, register_subprocess_limiter
except ImportError:  # another Inspect version: every entry goes through concurrency()
    get_or_create_semaphore = None  # type: ignore[assignment]

KEY = "subprocesses"  # the registry key of Inspect's subprocess() limit


@contextlib.asynccontextmanager
async def subprocess_slot(enabled: bool = True) -> AsyncIterator[None]:
    """Hold one of Inspect's subprocess slots for the block (none when
    `enabled` is false, Inspect's `concurrency=False`)."""
    if not enabled or concurrency is None:
        yield
        return
    limit = max_subprocesses_context_var.get()
    release = None
    if get_or_create_semaphore is not None:
        semaphore = await get_or_create_semaphore(KEY, limit, None, True, resizable=True)
        register_subprocess_limiter(semaphore)  # as subprocess() does: the control channel finds it
        release = take_free_slot(semaphore)
    if release is None:
        async with concurrency(KEY, limit, resizable=True):
            yield
        return
    try:
        yield
    finally:
        release()


def take_free_slot(semaphore: Any) -> Callable[[], None] | None:
    """A slot taken at once if one is free and nobody queues for one (what
    anyio's own acquire checks before it would wait), with the function that
    gives it back; None when the caller must wait, or when the limiter is
    not the kind Inspect's registry makes today (a resizable limiter over
    an anyio CapacityLimiter)."""
    limiter = getattr(semaphore.semaphore, "_limiter", None)
    if not isinstance(limiter, anyio.CapacityLimiter):
        return None
    borrower = object()  # one per slot, as Inspect's limiter uses: one task may hold several
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except anyio.WouldBlock:
        return None
    return lambda: limiter.release_on_behalf_of(borrower)
