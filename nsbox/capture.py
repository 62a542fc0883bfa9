"""Capturing a command's output streams on the host.

Each output stream keeps only its last `limit` bytes (front-truncation), in
a ring buffer allocated once the output outgrows one read. Whatever the
command writes, the host holds at most limit + one read chunk per stream.
The CLI forwards streams to its own descriptors instead.
"""

from __future__ import annotations

import math
import os
import select
from collections import deque

READ_CHUNK = 65536

# Rings of finished commands, kept for the next ones: a fresh 10 MiB buffer
# costs a page fault per 4 KiB on every exec, which made large captures
# slow. At most SPARE_RINGS are kept.
SPARE_RINGS = 2
_spare_rings: list[bytearray] = []


def _get_ring(size: int) -> bytearray:
    for i, ring in enumerate(_spare_rings):
        if len(ring) == size:
            return _spare_rings.pop(i)
    return bytearray(size)


def _put_ring(ring: bytearray) -> None:
    if len(_spare_rings) < SPARE_RINGS:
        _spare_rings.append(ring)


class CappedBuffer:
    """Keeps the last `limit` bytes written into it, and counts them all.

    Output that fits one read stays in that chunk; more moves into a ring of
    exactly `limit` bytes that reads land in directly (no copy), so a stream
    costs at most limit + one chunk of memory whatever the command writes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._chunks: list[bytes] = []
        self._ring: bytearray | None = None
        self._view: memoryview | None = None
        self._pos = 0  # next write position in the ring
        self._filled = 0  # valid bytes in the ring

    def read_from(self, fd: int) -> int:
        """Reads once from `fd`; returns the byte count, 0 at EOF.

        Raises BlockingIOError when nothing is available.
        """
        if self._view is None:
            data = os.read(fd, READ_CHUNK)
            if data:
                self.total += len(data)
                self._chunks.append(data)
                if self.total > min(self.limit, READ_CHUNK):
                    self._start_ring()
            return len(data)
        view, pos = self._view, self._pos
        n = os.readv(fd, [view[pos:], view[:pos]])
        if n:
            self.total += n
            self._pos = (pos + n) % self.limit
            self._filled = min(self.limit, self._filled + n)
        return n

    def _start_ring(self) -> None:
        data = b"".join(self._chunks)[-self.limit :]
        self._chunks = []
        self._ring = _get_ring(self.limit)
        self._ring[: len(data)] = data
        self._view = memoryview(self._ring)
        self._filled = len(data)
        self._pos = len(data) % self.limit

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    @property
    def dropped(self) -> int:
        """How many bytes front-truncation has dropped (0 if none)."""
        return max(0, self.total - self.limit)

    def _pieces(self) -> list[bytes | memoryview]:
        """The kept bytes, oldest first, without copying them."""
        if self._view is None:
            return [b"".join(self._chunks)[-self.limit :] if self.limit else b""]
        if self._filled < self.limit or self._pos == 0:
            return [self._view[: self._filled]]
        return [self._view[self._pos :], self._view[: self._pos]]

    def _release(self) -> None:
        if self._view is not None:
            self._view.release()
            assert self._ring is not None
            _put_ring(self._ring)
        self._chunks, self._ring, self._view = [], None, None

    def take(self) -> bytes:
        """Returns the kept bytes and releases the buffer."""
        data = b"".join(self._pieces())
        self._release()
        return data

    def _unwrap(self) -> None:
        """Rotates a wrapped ring in place so the kept bytes start at 0
        (the temporary copy is at most half the ring)."""
        view, pos, size = self._view, self._pos, self.limit
        if view is None or pos == 0 or self._filled < size:
            return
        if pos <= size // 2:
            head = bytes(view[:pos])
            view[: size - pos] = view[pos:]
            view[size - pos :] = head
        else:
            tail = bytes(view[pos:])
            view[size - pos :] = view[:pos]
            view[: size - pos] = tail
        self._pos = 0

    def take_text(self) -> str:
        """The kept bytes as UTF-8 text (invalid bytes replaced), decoded
        straight from the buffer; releases the buffer. At the peak this
        holds the buffer and the text: twice the limit."""
        self._unwrap()
        (piece,) = self._pieces()
        text = str(piece, "utf-8", "replace")
        del piece
        self._release()
        return text


class Forwarder:
    """Copies a stream to a host descriptor as it arrives (for the CLI)."""

    truncated = False
    dropped = 0

    def __init__(self, target: int) -> None:
        self.target = target
        self.total = 0  # bytes forwarded, as CappedBuffer counts them

    def read_from(self, fd: int) -> int:
        data = os.read(fd, READ_CHUNK)
        self.total += len(data)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.target, view) :]
            except BlockingIOError:
                # poll, not select: the descriptor may be above 1024.
                p = select.poll()
                p.register(self.target, select.POLLOUT)
                p.poll()
            except BrokenPipeError:
                break  # nobody reads our output any more; keep draining
        return len(data)



class OutputQueue:
    """One stream of a running command, waiting for its consumer (streaming).

    Chunks keep the order they arrived in, each tagged with a sequence
    number that a command's streams share, so that a consumer can
    interleave stdout and stderr as they came. At most `limit` bytes wait:
    when the command writes faster than the consumer takes, the oldest are
    dropped (front-truncation, as exec keeps the last bytes) and counted in
    `dropped`.

    Memory: small reads are merged into the last chunk (up to one read's
    size), and past MAX_CHUNKS waiting chunks reads are merged even across
    the other stream's (the interleaving gets coarser, the memory does
    not grow), so the host holds at most limit + one read + a constant per
    stream, whatever the command writes and however slowly it is consumed.
    """

    MAX_CHUNKS = 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0  # bytes the command wrote
        self.dropped = 0  # bytes dropped before the consumer took them
        self.size = 0  # bytes waiting
        # Sealed chunks are bytes (no spare capacity); only the last one,
        # still open to merges, is a bytearray.
        self._chunks: deque[list] = deque()  # [seq, bytes | bytearray]

    def __bool__(self) -> bool:
        return self.size > 0

    def append(self, data: bytes, seq: int) -> None:
        n = len(data)
        self.total += n
        self.size += n
        chunks = self._chunks
        last = chunks[-1] if chunks else None
        if (last is not None and isinstance(last[1], bytearray) and len(last[1]) < READ_CHUNK
                and (last[0] == seq or len(chunks) >= self.MAX_CHUNKS)):
            last[1] += data
        else:
            if last is not None and isinstance(last[1], bytearray):
                last[1] = bytes(last[1])
            chunks.append([seq, bytearray(data) if n < READ_CHUNK else data])
        excess = self.size - self.limit
        while excess > 0:
            first = chunks[0]
            if len(first[1]) <= excess:
                cut = len(chunks.popleft()[1])
            else:
                cut = excess
                if isinstance(first[1], bytearray):
                    del first[1][:cut]
                else:
                    first[1] = first[1][cut:]
            excess -= cut
            self.size -= cut
            self.dropped += cut

    def head(self) -> int | None:
        """The sequence number of the oldest waiting chunk (None: empty)."""
        return self._chunks[0][0] if self._chunks else None

    def take(self, before: float = math.inf) -> bytes:
        """Removes and returns the waiting bytes whose sequence number is
        below `before` (all of them by default), oldest first."""
        chunks = self._chunks
        parts = []
        while chunks and chunks[0][0] < before:
            parts.append(chunks.popleft()[1])
        data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        self.size -= len(data)
        return data


Sink = CappedBuffer | Forwarder
