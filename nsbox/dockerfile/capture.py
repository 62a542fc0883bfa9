"""Turning what a RUN step wrote (its sandbox's overlay upper directory)
into a layer blob in the store.

The upper directory's files belong to the sandbox's mapped ids, so it is
archived by capture_tar.py inside a second, short-lived sandbox with the
same id mapping, which sees only that directory (read-only) and the store
session's staging directory (where the tar goes). The tar is then moved
into the blobs: same filesystem, one rename.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..storage.confined import host_python
from ..storage.store import Session
from .errors import BuildError

SCRIPT = Path(__file__).with_name("capture_tar.py")
# Docker bind-mounts these into RUN containers: never part of a layer.
NETWORK_FILES = ("etc/hosts", "etc/resolv.conf", "etc/hostname")


@dataclass(frozen=True)
class Captured:
    blob: str  # == diff_id: the tar is uncompressed
    size: int
    files: int


async def capture(session: Session, upper: Path, exclude: tuple[str, ...] = NETWORK_FILES) -> Captured:
    from ..plan.rootfs import Bind
    from ..sandbox import confined

    python, binds = host_python()
    name = f"run-{secrets.token_hex(6)}.tar"
    out = session.staging / name
    box = confined([Bind(os.fspath(upper), "/upper", readonly=True), Bind(os.fspath(session.staging), "/out"), *binds],
                   id_mapping="single" if session.mapping.mode == "single" else "auto", label="nsbox build capture")
    try:
        async with box:
            args = json.dumps({"upper": "/upper", "out": f"/out/{name}", "exclude": list(exclude)})
            r = await box.exec([python, "-I", "-S", "-c", SCRIPT.read_text(), args])
        if r.returncode != 0:
            raise BuildError(f"archiving the step's changes failed: {r.stderr.strip()[-1000:]}")
        data = json.loads(r.stdout.strip().splitlines()[-1])
        digest = data["diff_id"]
        if session.store.has_blob(digest):
            out.unlink()
        else:
            session.store.commit_blob(out, digest)
        return Captured(digest, int(data["size"]), int(data["files"]))
    finally:
        out.unlink(missing_ok=True)
