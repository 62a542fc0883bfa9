"""`nsbox build`: rootless Dockerfile builds into nsbox's image store.

    name = await nsbox.dockerfile.build(Path("ctx"), tag="app:1")
    async with nsbox.Sandbox(image=name) as sb: ...

Modules, one concern each: parse.py (the Dockerfile, through BuildKit's
own parser) and words.py (variables, quotes); context.py (the build
context, .dockerignore); cache.py (the layer cache); run.py and
capture.py (RUN in a sandbox, its changes as a layer); copy.py, layer.py
and fsview.py (COPY and ADD); metadata.py (config instructions);
builder.py (the stages); cli.py (`nsbox build`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..storage.reference import ReferenceError, parse as parse_reference
from ..storage.store import Store
from .builder import BuildResult, Builder, Output, Sink
from .context import Context, read_text
from .errors import BuildError
from .parse import parse

__all__ = ["BuildError", "BuildResult", "build", "build_image"]


async def build_image(context: str | Path, *, dockerfile: str | Path | None = None, tag: str | Sequence[str],
                      build_args: Mapping[str, str] = {}, target: str | None = None, platform: str | None = None,
                      no_cache: bool = False, network: str | None = None, pull: str = "missing",
                      progress: Sink = None, store: Store | None = None) -> BuildResult:
    """Builds the Dockerfile (default: CONTEXT/Dockerfile) and names the
    image `tag` (several: all of them). `network` is what RUN steps get:
    "nat" (without the host's loopback) when it is usable here, else
    "none", unless given ("none", "host", "nat"; only "host" lets a
    Dockerfile's `RUN --network=host` through). `progress`: a text stream or a callable taking text
    (None: stderr). Returns what was built and how (cache hits, RUNs)."""
    names = [tag] if isinstance(tag, str) else list(tag)
    if not names:
        raise BuildError("a build needs a tag (-t NAME)")
    try:
        refs = [parse_reference(n) for n in names]
    except ReferenceError as e:
        raise BuildError(f"invalid tag: {e.message}") from None
    if pinned := [n for n, r in zip(names, refs) if r.digest]:
        raise BuildError(f"invalid tag {pinned[0]!r}: a tag cannot name a digest (@sha256:...), "
                         "which only the image pulled by it may carry", hint="tag it NAME:TAG")
    names = [str(r) for r in refs]
    if network not in (None, "nat", "host", "none"):
        raise BuildError(f"network must be nat, host or none, not {network!r}")
    root = Path(context)
    path = Path(dockerfile) if dockerfile is not None else root / "Dockerfile"
    ctx = Context(root, path if dockerfile is not None else None)
    if dockerfile is None and path.is_symlink() and not ctx.inside(path):
        # the context's own Dockerfile: an error quoting a line must not quote a host file
        raise BuildError("the Dockerfile is a symlink leading outside the build context",
                         hint="name the file you mean with -f")
    df = parse(read_text(path, "Dockerfile"), str(path))
    stage = df.stages[-1] if target is None else df.stage(target)
    if stage is None:
        raise BuildError(f"no stage named {target!r} in {path.name}",
                         hint=f"stages: {', '.join(s.name or str(s.index) for s in df.stages)}")
    if store is None:
        from ..sandbox import confined

        store = Store(runner=confined)
    out = Output(progress)
    async with store.session(progress=None) as session:
        builder = Builder(store, session, df, ctx, build_args=build_args, platform=platform, no_cache=no_cache,
                          network=network, pull=pull, out=out)
        try:
            state = await builder.build(stage)
            result = await builder.store_image(state, names)
        finally:
            builder.cleanup()
    out.line(f"built {result.name} ({result.id[:19]}): {result.steps} steps, {result.cached} cached, "
             f"{result.ran} RUN executed")
    return result


async def build(context: str | Path, *, dockerfile: str | Path | None = None, tag: str,
                build_args: Mapping[str, str] = {}, target: str | None = None, no_cache: bool = False,
                network: str | None = None, progress: Sink = None, platform: str | None = None) -> str:
    """Builds and names the image; returns its normalised name, for
    nsbox.Sandbox(image=...). See build_image() for the parameters."""
    result = await build_image(context, dockerfile=dockerfile, tag=tag, build_args=build_args, target=target,
                               no_cache=no_cache, network=network, progress=progress, platform=platform)
    return result.name
