"""The one door through which storage runs programs in a sandbox.

Layers, archives and root filesystem tarballs are unpacked *inside* a
throwaway sandbox: sandbox root of the owner's id mapping, on the
host-composed root with network none, seeing only the host data bound into
it. The kernel then enforces both the confinement (a hostile member can at
worst write into its destination) and the ownership (files end up owned by
ids this user's sandboxes map).

Storage sits below nsbox.Sandbox and never imports it: whoever builds a
Store, or calls import_tarball, passes a `Runner` that makes such a sandbox
(nsbox.sandbox.confined).
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Protocol, Sequence

from ..host import idmap
from ..init.client import ExecResult
from ..spec import Bind


class Confined(Protocol):
    """A throwaway sandbox: started (or entered with `async with`), its
    commands run as its root in /, closed (every process ends)."""

    async def start(self) -> object: ...

    async def close(self) -> None: ...

    async def exec(self, cmd: Sequence[str]) -> ExecResult: ...

    async def run_forwarded(self, cmd: Sequence[str], *, stdin: int | None = None, stdout: int = 1,
                            stderr: int = 2) -> int:
        """Runs cmd on these host descriptors (stdin read as it comes); its exit status."""
        ...

    async def __aenter__(self) -> Confined: ...

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None: ...


class Runner(Protocol):
    """Makes (does not start) a Confined sandbox that sees `binds` of the
    host's files, as root of the `id_mapping` mapping; `label` is for `nsbox ps`."""

    def __call__(self, binds: Sequence[Bind], *, id_mapping: idmap.Requested, label: str = "") -> Confined: ...


def host_python() -> tuple[str, list[Bind]]:
    """A python3 the host-root sandbox can run, and the binds it needs."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate, []
    # Elsewhere (conda, pyenv under $HOME): show this interpreter's prefix.
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    return exe, [Bind(prefix, prefix, readonly=True)]
