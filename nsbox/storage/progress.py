"""One progress line for a pull (bytes, rate, ETA) on a terminal; notes always."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("nsbox.storage.tarball")
REDRAW = 0.1  # seconds between redraws


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class Progress:
    """`stream`: where notes go (None: the logging module). `bar`: draw the
    live line there (defaults to whether it is a terminal)."""

    def __init__(self, stream: TextIO | None = None, bar: bool | None = None, label: str = "") -> None:
        self.stream = stream
        self.bar = bool(stream is not None and (stream.isatty() if bar is None else bar))
        self.label = label
        self.total = 0
        self.done = 0
        self.layers = 0
        self.layers_done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._shown = False

    @classmethod
    def for_cli(cls, label: str = "") -> Progress:
        return cls(sys.stderr, label=label)

    def expect(self, nbytes: int) -> None:
        self.total += nbytes
        self.layers += 1

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self._draw()

    def layer_done(self) -> None:
        self.layers_done += 1
        self._draw(force=True)

    def note(self, message: str) -> None:
        if self.stream is None:
            log.warning("%s", message)
            return
        self._clear()
        print(message, file=self.stream, flush=True)
        self._draw(force=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 and self.total > self.done else 0
        eta = f", ETA {left:.0f}s" if left >= 1 else ""
        return (f"{self.label}: {self.layers_done}/{self.layers} layers, {_mb(self.done)}/{_mb(self.total)}, "
                f"{_mb(rate)}/s{eta}")

    def _draw(self, force: bool = False) -> None:
        if not self.bar or self.stream is None:
            return
        now = time.monotonic()
        if not force and now - self._drawn < REDRAW:
            return
        self._drawn = now
        self.stream.write("\r\x1b[K" + self.line())
        self.stream.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown and self.stream is not None:
            self.stream.write("\r\x1b[K")
            self._shown = False

    def finish(self, message: str | None = None) -> None:
        if self.bar and self.stream is not None:
            self._clear()
            if self.total:
                print(self.line().replace(", ETA", "; ETA"), file=self.stream)
        if message and self.stream is not None:
            print(message, file=self.stream, flush=True)
