"""Unpacking layer blobs into directories, inside a confined sandbox.

One throwaway sandbox (the host-composed root, network none; made by the
runner storage/confined.py describes) serves a whole pull or import: it
sees the blob directory read-only at /blobs and one staging directory at
/staging, nothing else of the host's data; a pull streams a layer it is
downloading to the applier's stdin instead (one pass, see `_streamed`). Each layer is applied there by
applytar.py under the host's python3, as sandbox root with the owner's id
mapping, so the kernel enforces both the confinement and the ownership
(see applytar.py for the path rules it adds on top).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import anyio

from ..errors import NsboxError
from ..host.idmap import IdMap
from ..init.client import ExecResult
from ..init.fdwait import write_all
from ..init.pump import grow_pipe
from ..spec import Bind
from .confined import Confined, Runner, host_python
from .oci import check_digest

APPLIER = Path(__file__).with_name("applytar.py")
# Layers applied at once (each applier decompresses on a second thread).
PARALLEL = 3
# feed(write): writes a blob, in order, through `write`; returns once all is
# written and verified.
Feed = Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]


class Exceeded(Exception):
    """The applier stopped at a bound: args[0] is "size" or "files"."""


class CorruptLayer(NsboxError):
    """A layer blob that cannot be unpacked: corrupt, truncated, or not what its digest says."""


@dataclass
class ApplyReport:
    diff_id: str
    size: int  # uncompressed bytes
    compression: str
    files: int
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    entries: int = 0  # everything created (and members read): what the bound counts

    def summary(self) -> str | None:
        """One line on what was left out, or None."""
        words = {"devices": "device nodes", "unsafe": "unsafe members (outside the layer or through a symlink)",
                 "hardlink": "hardlinks to files outside the layer", "owners": "owners the id mapping lacks (now root)",
                 "xattrs": "xattrs", "absolute": "absolute member names (made relative)", "unknown": "unknown entries"}
        parts = [f"{n} {words.get(k, k)}" for k, n in sorted(self.skipped.items())]
        if not parts:
            return None
        eg = f" (e.g. {', '.join(self.examples[:3])})" if self.examples else ""
        return f"layer {self.diff_id[:19]}: skipped {'; '.join(parts)}{eg}"


class Unpacker:
    """Applies layers into `staging`; the sandbox (made by `runner`) starts
    on first use."""

    def __init__(self, blobs: Path, staging: Path, mapping: IdMap, runner: Runner,
                 id_mapping: str = "auto") -> None:
        self.blobs = blobs
        self.staging = staging
        self.mapping = mapping
        self._id_mapping = id_mapping
        self._runner = runner
        self._box: Confined | None = None
        self._lock = anyio.Lock()
        self._slots = anyio.Semaphore(PARALLEL)
        self._source = APPLIER.read_text()

    async def __aenter__(self) -> Unpacker:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._box is not None:
            with anyio.CancelScope(shield=True):
                await self._box.close()

    async def _sandbox(self) -> Confined:
        async with self._lock:
            if self._box is None:
                python, binds = host_python()
                self._python = python
                box = self._runner([Bind(os.fspath(self.blobs), "/blobs", readonly=True),
                                    Bind(os.fspath(self.staging), "/staging"), *binds],
                                   id_mapping=self._id_mapping, label="nsbox image unpack")  # type: ignore[arg-type]
                await box.start()
                self._box = box
        return self._box

    async def apply(self, blob: str, name: str, max_bytes: int, max_files: int,
                    feed: Feed | None = None) -> ApplyReport:
        """Unpacks blob `sha256:…` into staging/`name` (which must not exist),
        its tar stream at most `max_bytes`, its entries at most `max_files`
        (else `Exceeded`). With `feed`, the blob is not read from the store:
        feed(write) writes it as it comes (see `_streamed`)."""
        algo, hexd = check_digest(blob, "a layer descriptor")
        box = await self._sandbox()
        args = json.dumps({"blob": "-" if feed else f"/blobs/{algo}/{hexd}", "dest": f"/staging/{name}",
                           "single": self.mapping.mode == "single", "max_bytes": max_bytes, "max_files": max_files})
        cmd = [self._python, "-I", "-S", "-c", self._source, args]
        async with self._slots:
            r = await (self._streamed(box, cmd, feed) if feed else box.exec(cmd))
        if r.returncode == 4:
            raise Exceeded(r.stderr.strip().splitlines()[-1])
        if r.returncode == 3:
            raise CorruptLayer(f"layer {blob}: {r.stderr.strip()[-500:]}",
                               hint="pull or import the image again; if it recurs, the source is damaged")
        if r.returncode == 5:  # a limit reached (a full disk): the errno, for nsbox/create/exhaustion.py
            last = (r.stderr.strip().splitlines() or [""])[-1]  # "ERRNO what": one line (applytar's _fail)
            code, _, what = last.partition(" ")
            if not code.isdigit():
                raise NsboxError(f"unpacking layer {blob} failed: {last[-1000:]}")
            err = int(code)
            raise NsboxError(f"unpacking layer {blob} failed: {what}") from OSError(
                err, os.strerror(err), os.fspath(self.staging))
        if r.returncode != 0:
            raise NsboxError(f"unpacking layer {blob} failed: {r.stderr.strip()[-1000:]}")
        data = json.loads(r.stdout.strip().splitlines()[-1])
        return ApplyReport(data["diff_id"], data["size"], data["compression"], data["files"],
                           data["skipped"], data["examples"], data["entries"])

    async def _streamed(self, box: Confined, cmd: list[str], feed: Feed) -> ExecResult:
        """Runs the applier on a pipe that `feed` writes the blob into.
        The feed's error (a download that fails, a digest that does not
        match at the end) is the one raised, whatever the applier made of
        what came before it; an applier that stops early stops the feed."""
        r_fd, w_fd = os.pipe2(os.O_CLOEXEC)
        pipe, fds = _Pipe(w_fd), [r_fd]
        failed: list[Exception] = []
        try:
            out = os.memfd_create("stdout", os.MFD_CLOEXEC)
            fds.append(out)
            err = os.memfd_create("stderr", os.MFD_CLOEXEC)
            fds.append(err)
            grow_pipe(w_fd)  # a layer is large: fewer wakeups on both sides
            os.set_blocking(w_fd, False)

            codes: list[int] = []

            async def feeding() -> None:
                try:
                    await feed(pipe.write)
                except Exception as e:
                    failed.append(e)
                finally:
                    pipe.close()  # the applier sees the end of its input

            async def applying() -> None:
                try:
                    codes.append(await box.run_forwarded(cmd, stdin=r_fd, stdout=out, stderr=err))
                except Exception as e:
                    failed.append(e)
                finally:
                    tg.cancel_scope.cancel()  # it read all there was, or stopped: nobody reads the rest

            async with anyio.create_task_group() as tg:
                tg.start_soon(feeding)
                tg.start_soon(applying)
            if failed:
                raise failed[0]
            return ExecResult(codes[0] == 0, codes[0], _read_all(out), _read_all(err))
        finally:
            pipe.close()
            for fd in fds:
                os.close(fd)


class _Pipe:
    """The write end of the applier's stdin (non-blocking)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    async def write(self, data: bytes) -> None:
        await write_all(self.fd, data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_all(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while data := os.read(fd, 1 << 16):
        chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def dir_size(path: Path) -> int:
    """Bytes of regular files under path (hardlinks once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total

