"""Running a host program inside a user namespace with a sandbox's id map.

Files that sandbox users other than root create in a writable layer belong
to subordinate ids on the host, which the invoking user cannot delete or
chown directly; inside a user namespace with the same mapping they are
ordinary files of ordinary users. This is what `podman unshare` does.
remove_layer() deletes a layer that way when such files are left in it
(nsbox/host/removal.py deletes everything else, without the zygote).
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from typing import Sequence

from . import zygote
from ..plan import steps
from ..errors import NsboxError
from ..host.idmap import IdMap
from ..host.removal import RemovalError, remove_tree


def run_in_userns(mapping: IdMap, argv: Sequence[str], *, check: bool = True) -> int:
    """Runs `argv` (found through the host's PATH) as root of a new user
    namespace; returns its exit status. The host's filesystem stays visible."""
    err_r, err_w = os.pipe()
    try:
        try:
            pid, pidfd = zygote.spawn(
                clone_flags=zygote.CLONE_NEWUSER, steps=[steps.become_root()], idmaps=mapping.how_to_write(), error_fd=err_w,
                keep_fds=[], exec_fd=-1, argv=list(argv), envp=[f"{k}={v}" for k, v in os.environ.items()],
                keep_stdio=True, new_session=False,
            )
        except zygote.IdMapError as e:
            os.waitpid(e.pid, 0)
            raise NsboxError(f"running {argv[0]} in a user namespace failed: {e.message or e.strerror}") from None
        except OSError as e:
            from .hostcheck import clone_failed
            raise clone_failed(e.errno) from None
        finally:
            os.close(err_w)
        if pidfd >= 0:
            os.close(pidfd)
        report = os.read(err_r, 64)
    finally:
        os.close(err_r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if report:
        _, err = struct.unpack("=ii", report[:8])
        raise NsboxError(f"running {argv[0]} in a user namespace failed: {os.strerror(err)}")
    if check and code != 0:
        raise subprocess.CalledProcessError(code, list(argv))
    return code


def remove_layer(layer: Path, mapping: IdMap | None) -> None:
    """Deletes a layer directory, from inside a user namespace with the
    sandbox's mapping when other sandbox users own files in it."""
    try:
        remove_tree(layer)
    except PermissionError:
        if mapping is None or mapping.mode != "subuid":
            raise
        # GNU rm walks trees of any depth relative to directory descriptors.
        # Its complaints (one line per entry) would flood our caller's
        # stderr: the caller reports the failure in one line instead.
        argv = ["sh", "-c", 'exec rm -rf -- "$1" 2>/dev/null', "rm", os.fspath(layer)]
        status = run_in_userns(mapping, argv, check=False)
        if status != 0:
            raise RemovalError(f"rm -rf in the sandbox's user namespace failed (exit status {status})") from None
