"""The image-store layers that live sandboxes stack, recorded in the store.

A sandbox on an image has <store>/in-use/<sandbox id>.json: its init's pid
and start time, and the layers (<store>/layers/KEY/HEX, storage/store.py).
The live registry (live.py) is under the runtime directory, which differs
from shell to shell when XDG_RUNTIME_DIR does; the store's own directory is
where every prune, and every refused pull, looks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .dirs import PARTIAL, remove_stale_partial, write_whole
from .live import process_alive

IN_USE = "in-use"


def record(sandbox_id: str, init_pid: int, init_start: int | None, layers: Iterable[Path]) -> None:
    """Records a live sandbox's layers in their stores (written whole)."""
    for root, paths in _by_store(layers).items():
        d = root / IN_USE
        data = json.dumps({"init_pid": init_pid, "init_start": init_start, "layers": paths}).encode()
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            write_whole(os.path.join(d, f"{sandbox_id}.json"), data)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # A store this user cannot change: nor can its prune.


def forget(sandbox_id: str, layers: Iterable[Path]) -> None:
    for root in _by_store(layers):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(root / IN_USE / f"{sandbox_id}.json")


def layers_in_use(root: Path) -> set[str]:
    """The layers (real paths) that live sandboxes stack. The records of
    sandboxes whose init is gone are removed, and any that cannot be read
    (written whole and renamed, such a record was not written here), and
    the part of one whose writer was killed."""
    used: set[str] = set()
    try:
        entries = list(os.scandir(root / IN_USE))
    except FileNotFoundError:
        return used
    records = [e for e in entries if e.name.endswith(".json")]  # not one being written
    for entry in entries:
        if entry.name.endswith(PARTIAL):
            remove_stale_partial(entry.path)
    for entry in records:
        try:
            with open(entry.path, "rb") as f:
                rec = json.load(f)
            alive = process_alive(int(rec["init_pid"]), rec["init_start"])
            paths = [os.path.realpath(str(p)) for p in rec["layers"]]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            alive, paths = False, []
        if alive:
            used.update(paths)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    return used


def _by_store(layers: Iterable[Path]) -> dict[Path, list[str]]:
    """Layers grouped by store: a layer is <root>/layers/KEY/HEX (store.py)."""
    out: dict[Path, list[str]] = {}
    for layer in map(Path, layers):
        if len(layer.parents) > 2 and layer.parents[1].name == "layers":
            out.setdefault(layer.parents[2], []).append(os.fspath(layer))
    return out
