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

from .._text import TextBuffer

READ_CHUNK = 65536


class CappedBuffer:
    """Keeps the last `limit` bytes written into it, and counts them all.

    Output that fits one read stays in that chunk; more moves into a ring of
    exactly `limit` bytes that reads land in directly, so a stream costs at
    most limit + one chunk of memory whatever the command writes. The ring
    is a TextBuffer (csrc/pyext/text.c): the very str that take_text() returns,
    so that ASCII output is neither copied nor decoded once more.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._chunks: list[bytes] = []
        self._ring: TextBuffer | None = None
        self._pos = 0  # next write position in the ring
        self._filled = 0  # valid bytes in the ring

    def read_from(self, fd: int) -> int:
        """Reads once from `fd`; returns the byte count, 0 at EOF.

        Raises BlockingIOError when nothing is available.
        """
        if self._ring is None:
            data = os.read(fd, READ_CHUNK)
            if data:
                self.total += len(data)
                if self.limit > 0:
                    self._chunks.append(data)
                    if self.total > min(self.limit, READ_CHUNK):
                        self._start_ring()
            return len(data)
        n = self._ring.read_from(fd, self._pos)
        if n:
            self.total += n
            self._pos = (self._pos + n) % self.limit
            self._filled = min(self.limit, self._filled + n)
        return n

    def _start_ring(self) -> None:
        data = b"".join(self._chunks)[-self.limit :]
        self._chunks = []
        self._ring = TextBuffer(self.limit)
        self._ring.write_at(0, data)
        self._filled = len(data)
        self._pos = len(data) % self.limit

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    @property
    def dropped(self) -> int:
        """How many bytes front-truncation has dropped (0 if none)."""
        return max(0, self.total - self.limit)

    def _start(self) -> int:
        """Where the oldest kept byte is in the ring."""
        return self._pos if self._filled == self.limit else 0

    def take(self) -> bytes:
        """Returns the kept bytes and releases the buffer."""
        ring, self._ring = self._ring, None
        if ring is None:
            data = b"".join(self._chunks)[-self.limit :] if self.limit else b""
        else:
            with memoryview(ring) as view:
                start = self._start()
                data = b"".join([view[start : self._filled], view[:start]])
        self._chunks = []
        return data

    def take_text(self) -> str:
        """The kept bytes as UTF-8 text (invalid bytes replaced); releases
        the buffer. ASCII text is the ring itself; other text is decoded
        from it, so at the peak the host holds twice the limit."""
        ring, self._ring = self._ring, None
        if ring is None:
            return str(self.take(), "utf-8", "replace")
        return ring.take(self._filled, self._start())


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
