"""An image for a sandbox or a build, under a pull policy: the store's if it
has it ("missing"), pulled from its registry first ("always"), or never
pulled ("never").

Above both the store and the registry client: the store does not know how
to pull, and httpx is imported only when something is pulled.
"""

from __future__ import annotations

import sys

from ..host import idmap
from ..spec import PullPolicy, SandboxSpec
from .progress import Progress
from .confined import Runner
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


async def for_spec(ref: str, spec: SandboxSpec, *, runner: Runner) -> tuple[Image, SandboxSpec, str | None]:
    """A sandbox's image `ref` under its spec's pull policy (progress on
    stderr), the spec with what the image's config fills in where the
    sandbox's own settings leave it open, as `docker run` does, and a note
    for a person (or None)."""
    mapping = idmap.detect(spec.id_mapping)  # type: ignore[arg-type]
    image = await resolve(Store(runner=runner), ref, id_mapping=spec.id_mapping,  # type: ignore[arg-type]
                          pull=spec.pull, platform=spec.platform, progress=Progress(sys.stderr))
    config = image.config
    user, note = config.effective_user(mapping, spec.user)
    # An image without WORKDIR runs in /, as in Docker (not in the user's home).
    workdir = spec.workdir or config.workdir or "/"
    return image, spec.replace(user=user, env=config.merge_env(spec.env), workdir=workdir), note
