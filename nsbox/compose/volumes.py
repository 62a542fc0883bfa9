"""Seeding compose volumes from the image, as Docker does.

A named or anonymous volume that is empty when a container mounts it gets a
copy of what the container's image has at the mount point (files,
directories, symlinks, owners, modes); `volume.nocopy: true` turns that
off, binds are never seeded, and a volume that holds anything already is
left as it is, so the first service to mount a shared volume seeds it.

The copy runs inside a throwaway sandbox with the user's id mapping (the
host-composed root, as image unpacking does: nsbox/storage/apply.py), so
the image's owners become the same host ids they have in the layers, and
seedtree.py walks the layers without following any symlink.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from .mapping import volume_dir
from .model import Project, Service
from ..errors import NsboxError
from ..storage.bounds import ImageBounds
from ..storage.store import Image

SEEDER = Path(__file__).with_name("seedtree.py")


def seeds(service: Service, volume_root: Path) -> list[tuple[str, Path]]:
    """(path in the image, volume directory) for each volume of `service`
    Docker would seed."""
    out = []
    for index, m in enumerate(service.volumes):
        # A subpath mounts part of a volume: Docker copies nothing into it.
        if m.type == "volume" and not m.nocopy and not m.subpath:
            out.append((m.target.rstrip("/") or "/", volume_dir(service, m, index, volume_root)))
    return out


def start_order(project: Project) -> list[Service]:
    """The services, each after those it depends on (the order compose
    creates containers in, so the order volumes are first mounted in)."""
    return [project.services[n] for n in project.dependency_order()]


async def seed(image: Image, targets: Iterable[tuple[str, Path]], id_mapping: str = "auto") -> list[Path]:
    """Copies `image`'s content at each path into its volume directory if
    that is empty; returns the directories it seeded."""
    from ..spec import Bind
    from ..sandbox import confined
    from ..storage.confined import host_python

    targets = list(targets)
    if not targets or not image.layers:
        return []
    python, binds = host_python()
    layers = [Bind(os.fspath(p), f"/layers/{i}", readonly=True) for i, p in enumerate(image.layers)]
    volumes = [Bind(os.fspath(d), f"/volumes/{i}") for i, (_, d) in enumerate(targets)]
    box = confined([*layers, *volumes, *binds], id_mapping=id_mapping, label="nsbox volume seed")  # type: ignore[arg-type]
    bounds = ImageBounds.from_env()
    args = {"layers": [b.target for b in layers], "single": False,
            "max_bytes": bounds.size, "max_files": bounds.files,
            "seeds": [[path, v.target] for (path, _), v in zip(targets, volumes)]}
    async with box:
        args["single"] = box.idmap is not None and box.idmap.mode == "single"
        r = await box.exec([python, "-I", "-S", "-c", SEEDER.read_text(), json.dumps(args)])
    if r.returncode != 0:
        raise NsboxError(f"copying the image's files into its volumes failed: {r.stderr.strip()[-1000:]}")
    done = set(json.loads(r.stdout.strip().splitlines()[-1]))
    return [d for v, (_, d) in zip(volumes, targets) if v.target in done]
