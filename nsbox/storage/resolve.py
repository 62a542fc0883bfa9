"""An image for a sandbox or a build, under a pull policy: the store's if it
has it ("missing"), pulled from its registry first ("always"), or never
pulled ("never").

Above both the store and the registry client: the store does not know how
to pull, and httpx is imported only when something is pulled.
"""

from __future__ import annotations

from ..host import idmap
from ..spec import PullPolicy
from .progress import Progress
from .store import IMAGE_ID, Image, ImageNotFound, Store


async def resolve(store: Store, ref: str, *, id_mapping: idmap.Requested = "auto", pull: PullPolicy = "missing",
                  platform: str | None = None, progress: Progress | None = None) -> Image:
    """The image `ref` (name or id) with its layers unpacked for this
    user's id mapping: pulled first if missing (or always), unpacked
    for this mapping if it was not yet."""
    if pull != "always":
        try:
            rec = store.lookup(ref)
        except ImageNotFound:
            if pull == "never" or IMAGE_ID.fullmatch(ref):
                raise
        else:
            return await store.unpacked(rec, id_mapping=id_mapping, progress=progress)
    from .registry import pull as do_pull  # the HTTP client, only now

    return await do_pull(store, ref, platform=platform, progress=progress, id_mapping=id_mapping)
