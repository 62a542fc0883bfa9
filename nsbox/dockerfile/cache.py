"""The build cache: which layer a step made, by what the step depends on.

A step's key chains the key of the step before it (the base image's
manifest digest first) with the step's own inputs: its text with
variables resolved, the build args and environment a RUN sees, the
content hash of the files a COPY or ADD takes. So a hit means the very
same step on the very same image. An entry names a blob in the store;
a pruned blob makes the entry a miss.

Entries live in the image store, one small JSON file each:
images/build-cache/KEY.json.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ..storage.store import Store


def chain(parent: str, *parts: Any) -> str:
    """The key of a step after `parent` with these inputs."""
    return hashlib.sha256(json.dumps([parent, *parts], sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Hit:
    blob: str | None  # None: the step changed no file (no layer)
    size: int


class Cache:
    def __init__(self, store: Store, enabled: bool = True) -> None:
        self.store = store
        self.enabled = enabled
        self.dir = store.root / "build-cache"

    def get(self, key: str) -> Hit | None:
        if not self.enabled:
            return None
        try:
            entry = json.loads((self.dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        blob = entry.get("blob")
        if blob is not None and not self.store.has_blob(blob):
            return None  # pruned since
        return Hit(blob, int(entry.get("size", 0)))

    def put(self, key: str, blob: str | None, size: int) -> None:
        """Recorded even with --no-cache: the next build may use it."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        tmp = self.store.temp_path()
        tmp.write_text(json.dumps({"blob": blob, "size": size}))
        os.rename(tmp, self.dir / f"{key}.json")
