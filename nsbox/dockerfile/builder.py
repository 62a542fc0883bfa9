"""The build: stages in order, each instruction a config edit or a layer.

Each stage starts from its FROM (an image resolved through the store, an
earlier stage, or scratch); RUN, COPY and ADD add layers (run.py,
copy.py), everything else edits the config (metadata.py). Layer steps go
through the cache (cache.py) first. The result is stored as an ordinary
image (blobs, config, manifest) and named last, so a failed build leaves
no name behind; its finished layers stay as cache for the next attempt.
"""

from __future__ import annotations

import copy as copy_mod
import json
import os
import posixpath
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import anyio

from ..net.proxy import internal_reason
from ..storage import oci
from ..storage.config import ImageConfig
from ..storage.progress import Progress
from ..storage.resolve import resolve
from ..storage.store import Session, Store
from . import copy, metadata
from .cache import Cache, chain
from .context import Context, file_digest
from .errors import BuildError
from .fsview import View
from .layer import LayerWriter, NotADirectory
from .parse import Dockerfile, Instruction, Stage
from .run import argv_of, run_step
from .words import WordError, expand

Sink = TextIO | Callable[[str], None] | None


class Output:
    """Progress lines and RUN output, to a stream or a callable (None: stderr)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sys.stderr if sink is None else sink
        self._partial = False

    def write(self, text: str) -> None:
        if callable(self.sink):
            self.sink(text)
        else:
            self.sink.write(text)
            self.sink.flush()

    def line(self, text: str) -> None:
        self.write(("\n" if self._partial else "") + text + "\n")
        self._partial = False

    def run_output(self, data: bytes) -> None:
        text = data.decode(errors="replace")
        self.write(text)
        self._partial = bool(text) and not text.endswith("\n")

    def stream(self) -> TextIO | None:
        return None if callable(self.sink) else self.sink


_MAX_REDIRECTS = 10  # as curl and httpx
# What all variable expansions of a build may produce together (one word:
# words.WORD_LIMIT); far above real Dockerfiles, it bounds the config a
# build of many `ENV X$i=$BIG` lines would make.
EXPANSION_LIMIT = 64 << 20


@dataclass(frozen=True)
class LayerRef:
    blob: str
    diff_id: str
    size: int
    media_type: str = oci.OCI_LAYER


@dataclass
class State:
    """An image being built: its config document, layers, history, cache key."""

    doc: dict[str, Any]
    layers: list[LayerRef]
    key: str
    history: list[dict[str, Any]] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)  # the stage's declared ARGs
    cmd_set: bool = False

    @property
    def cfg(self) -> dict[str, Any]:
        return self.doc.setdefault("config", {})

    def env(self) -> dict[str, str]:
        """What variables expand to: ARGs, then ENV over them (Docker's order)."""
        return {**self.args, **metadata.env_dict(self.cfg)}


@dataclass
class BuildResult:
    name: str  # the normalised tag: nsbox.Sandbox(image=name)
    digest: str  # of the manifest
    id: str  # of the config (the image id)
    steps: int = 0
    cached: int = 0  # layer steps taken from the cache
    ran: int = 0  # RUN steps executed
    network: str | None = None  # what RUN steps got


class Builder:
    def __init__(self, store: Store, session: Session, df: Dockerfile, ctx: Context, *,
                 build_args: Mapping[str, str], platform: str | None, no_cache: bool, network: str | None,
                 pull: str, out: Output) -> None:
        self.store, self.session, self.df, self.ctx = store, session, df, ctx
        self.build_args = dict(build_args)
        self.platform = platform
        self.cache = Cache(store, enabled=not no_cache)
        self.network = network
        self.pull = pull
        self.out = out
        self.used_args: set[str] = set()
        self.states: dict[int, State] = {}
        self._views: dict[tuple[str, ...], View] = {}
        self.result = BuildResult("", "", "")
        self._temps: list[Path] = []  # ADD downloads
        self.expanded = 0  # characters expansions produced, against EXPANSION_LIMIT
        self.global_env = self._global_args()

    # ---- args and stages ---------------------------------------------

    def _global_args(self) -> dict[str, str]:
        target = oci.Platform.parse(self.platform) if self.platform else oci.Platform.current()
        build = oci.Platform.current()
        env = {"TARGETPLATFORM": str(target), "TARGETOS": target.os, "TARGETARCH": target.architecture,
               "TARGETVARIANT": target.variant or "", "BUILDPLATFORM": str(build), "BUILDOS": build.os,
               "BUILDARCH": build.architecture, "BUILDVARIANT": build.variant or ""}
        for ins in self.df.global_args:
            env.update(self._arg_values(ins, env))
        return env

    def _arg_values(self, ins: Instruction, env: Mapping[str, str], inherited: Mapping[str, str] = {}) -> dict[str, str]:
        values = {}
        for word in ins.args:
            name, has_default, default = word.partition("=")
            self.used_args.add(name)
            if name in self.build_args:
                values[name] = self.build_args[name]
            elif has_default:
                values[name] = self._expand(ins, default, env)
            elif name in inherited:
                values[name] = inherited[name]
        return values

    def _expand(self, ins: Instruction, word: str, env: Mapping[str, str]) -> str:
        try:
            value = expand(word, env, self.df.escape)
        except WordError as e:
            raise ins.error(e.message) from None
        self.expanded += len(value)
        if self.expanded > EXPANSION_LIMIT:
            raise ins.error(f"variables expand to more than {EXPANSION_LIMIT >> 20} MiB in this build")
        return value

    def needed(self, target: Stage) -> list[Stage]:
        """The target and the stages it builds on (FROM, COPY --from), in order."""
        want: set[int] = set()
        todo = [target]  # a list, not recursion: stages may chain thousands deep
        while todo:
            stage = todo.pop()
            if stage.index in want:
                continue
            want.add(stage.index)
            refs = [self._expand(stage.origin, stage.base, self.global_env)]
            refs += [self._expand(i, i.flags["from"], self.global_env) for i in stage.instructions if "from" in i.flags]
            for ref in refs:
                dep = self.df.stage(ref)
                if dep is not None and dep.index < stage.index:
                    todo.append(dep)
                elif dep is not None:
                    raise BuildError(f"stage {ref} is used before it is defined", where=stage.origin.where)
        return [s for s in self.df.stages if s.index in want]

    # ---- the build ---------------------------------------------------

    async def build(self, target: Stage) -> State:
        for stage in self.needed(target):
            self.states[stage.index] = await self._stage(stage)
        unused = sorted(set(self.build_args) - self.used_args)
        if unused:
            self.out.line(f"warning: build args not consumed by any ARG: {', '.join(unused)}")
        return self.states[target.index]

    def _label(self, stage: Stage, n: int) -> str:
        total = len(stage.instructions) + 1
        name = stage.name or f"stage-{stage.index}"
        return f"[{name} {n}/{total}]" if len(self.df.stages) > 1 else f"[{n}/{total}]"

    async def _stage(self, stage: Stage) -> State:
        self.out.line(f"{self._label(stage, 1)} {stage.origin.text}")
        state = await self._from(stage)
        self.result.steps += 1
        for n, ins in enumerate(stage.instructions, start=2):
            label = f"{self._label(stage, n)} {ins.text}"
            state = await self._step(ins, state, label)
            self.result.steps += 1
        return state

    async def _from(self, stage: Stage) -> State:
        ins = stage.origin
        ref = self._expand(ins, stage.base, self.global_env)
        platform = self._expand(ins, stage.platform, self.global_env) if stage.platform else self.platform
        if stage.platform and "/" not in platform and platform not in _ARCHES | {"linux"}:
            # as Docker: a lone word must be an OS or an architecture, anything else a typo
            raise ins.error(f"--platform={platform}: unknown architecture", "write OS/ARCH[/VARIANT], e.g. linux/arm64")
        dep = self.df.stage(ref)
        if dep is not None and dep.index in self.states:
            base = self.states[dep.index]
            return State(copy_mod.deepcopy(base.doc), list(base.layers), chain(base.key, "FROM"),
                         list(base.history))
        if ref.lower() == "scratch":
            plat = oci.Platform.parse(platform) if platform else oci.Platform.current()
            doc = json.loads(oci.config_doc([], plat))
            doc["config"] = {}
            return State(doc, [], chain("scratch", str(plat)))
        try:
            image = await resolve(self.store, ref, id_mapping=self._id_mapping, pull=self.pull,  # type: ignore[arg-type]
                                  platform=platform, progress=Progress(self.out.stream()))
        except BuildError:
            raise
        except Exception as e:
            raise ins.error(f"cannot use the base image {ref}: {getattr(e, 'message', e)}",
                            getattr(e, "hint", None)) from None
        doc = self.store.read_json(image.id)
        if triggers := (doc.get("config") or {}).get("OnBuild"):
            # Docker runs them at this FROM; building without would make another image.
            raise ins.error(f"the base image {ref} has ONBUILD triggers ({'; '.join(map(str, triggers))[:200]}), "
                            "which nsbox build does not run", "write them into this Dockerfile after its FROM")
        manifest = self.store.read_json(image.digest)
        layers = [LayerRef(d["digest"], diff, int(d.get("size", 0)), d.get("mediaType") or oci.OCI_LAYER)
                  for d, diff in zip(oci.layer_descriptors(manifest), image.config.diff_ids)]
        doc.setdefault("config", {})
        return State(doc, layers, chain("image", image.digest), list(doc.get("history") or []))

    @property
    def _id_mapping(self) -> str:
        return "single" if self.session.mapping.mode == "single" else "auto"

    async def _step(self, ins: Instruction, state: State, label: str) -> State:
        # A step changes config keys, never a value in place: copying the
        # config dict (not deeply) keeps the state before it as it was.
        state = replace(state, doc={**state.doc, "config": dict(state.cfg)}, layers=list(state.layers),
                        history=list(state.history), args=dict(state.args))
        if ins.cmd == "ARG":
            self.out.line(label)
            values = self._arg_values(ins, state.env(), self.global_env)
            state.args.update(values)
            state.key = chain(state.key, "ARG", values)
            return state
        if ins.cmd in ("RUN", "COPY", "ADD", "WORKDIR"):
            return await self._layer_step(ins, state, label)
        self.out.line(label)
        env = state.env()  # once: all of an instruction's words see the variables before it
        metadata.apply(ins, state.cfg, lambda w: self._expand(ins, w, env), state.cmd_set)
        state.cmd_set = state.cmd_set or ins.cmd == "CMD"
        state.history.append({"created_by": ins.text, "empty_layer": True})
        state.key = chain(state.key, ins.cmd, state.cfg)
        return state

    async def _layer_step(self, ins: Instruction, state: State, label: str) -> State:
        if ins.cmd == "RUN":
            key, make = self._run(ins, state)
        elif ins.cmd == "WORKDIR":
            key, make = self._workdir(ins, state)
        else:
            key, make = await self._copy(ins, state)
        hit = self.cache.get(key)
        if hit is not None:
            self.out.line(f"{label} CACHED")
            self.result.cached += 1
            blob, size = hit.blob, hit.size
        else:
            self.out.line(label)
            blob, size = await make()
            self.cache.put(key, blob, size)
        if blob is not None:
            state.layers.append(LayerRef(blob, blob, size))
        state.history.append({"created_by": ins.text, **({} if blob else {"empty_layer": True})})
        state.key = key
        return state

    # ---- RUN ---------------------------------------------------------

    def _run(self, ins: Instruction, state: State) -> tuple[str, Callable[[], Any]]:
        argv, script = argv_of(ins, metadata.shell(state.cfg))
        env = state.env()
        user = state.cfg.get("User") or "root"
        workdir = state.cfg.get("WorkingDir") or "/"
        network = ins.flags.get("network")
        if network not in (None, "default", "none", "host"):
            raise ins.error(f"RUN --network={network}: expected default, none or host")
        if network == "host" and self.network != "host":
            # Docker too asks for an entitlement (--allow network.host): the
            # host's network is the host's loopback services.
            raise ins.error("RUN --network=host gives the step the host's network (its loopback services too): "
                            "allowed only with `nsbox build --network host`")
        # The network is part of what a step is (as in BuildKit's key): what
        # a step without one made is not what it makes with one. So is the
        # id mapping: with a single uid every file a step makes is root's.
        net = network if network in ("none", "host") else self._default_network()
        key = chain(state.key, "RUN", argv, script, env, user, workdir, net, self._id_mapping)

        async def make() -> tuple[str | None, int]:
            layers = await self._unpacked(state)
            captured = await run_step(ins, self.session, layers, ImageConfig.parse(state.doc), argv=argv,
                                      script=script, user=user, workdir=workdir, env=env, network=net,
                                      output=self.out.run_output)
            self.result.ran += 1
            if captured.files == 0:
                return None, 0
            return captured.blob, captured.size
        return key, make

    def _default_network(self) -> str:
        if self.result.network is None:
            if self.network is not None:
                self.result.network = self.network
                why = "as asked"
            else:
                from ..net import usernet
                try:
                    usernet.check_tun(usernet.TUN_DEVICE)
                    tool, _ = usernet.find_tool()
                    self.result.network, why = "nat", f"outbound access through {tool}"
                except Exception as e:
                    # Never the host's network unasked: a step would reach its loopback.
                    self.result.network, why = "none", (f"nat is not usable here: {getattr(e, 'message', e)}; "
                                                        "`nsbox build --network host` gives them the host's network")
            self.out.line(f"RUN steps use network {self.result.network} ({why})")
        return self.result.network

    # ---- WORKDIR ---------------------------------------------------------

    def _workdir(self, ins: Instruction, state: State) -> tuple[str, Callable[[], Any]]:
        """Sets the working directory and, as Docker, makes it where the image
        lacks it (a layer of its own), owned by the stage's USER as BuildKit
        makes it: a later stage may COPY --from it even if nothing used it."""
        metadata.apply(ins, state.cfg, lambda w: self._expand(ins, w, state.env()), state.cmd_set)
        workdir, user = state.cfg["WorkingDir"], state.cfg.get("User") or ""
        key = chain(state.key, "WORKDIR", state.cfg, user)

        async def make() -> tuple[str | None, int]:
            view = await self._view(state.layers)
            if view.is_dir(view.resolve(workdir)):
                return None, 0
            if view.get(view.resolve(workdir)) is not None:  # Docker's mkdir fails there too
                raise ins.error(f"{workdir} is not a directory in the image")
            owner = (0, 0)
            if user:
                try:
                    owner = _numeric(ins, user) or copy.owner_of(ins, user, view)
                except BuildError:
                    pass  # a USER the image does not name yet: Docker runs it by number later too
            return await anyio.to_thread.run_sync(self._write_layer, ins, view,
                                                  lambda out: out.add_dir(workdir, owner=owner))
        return key, make

    # ---- COPY, ADD -----------------------------------------------------

    async def _copy(self, ins: Instruction, state: State) -> tuple[str, Callable[[], Any]]:
        env = state.env()
        p = copy.plan(ins, lambda w: self._expand(ins, w, env), state.cfg.get("WorkingDir") or "/", self.ctx)
        chown = self._expand(ins, ins.flags["chown"], env) if ins.flags.get("chown") else None
        inputs: list[Any] = [ins.cmd, p.sources, p.dest, chown, p.mode, [h.content for h in ins.heredocs]]
        src_state = None
        if "from" in ins.flags:
            ref = self._expand(ins, ins.flags["from"], self.global_env)
            dep = self.df.stage(ref)
            src_state = self.states[dep.index] if dep is not None and dep.index in self.states else \
                await self._from(Stage(-1, ref, None, None, ins))
            inputs.append(src_state.key)
        else:
            inputs.append(await anyio.to_thread.run_sync(self.ctx.digest, p.context))
        if p.urls and self.network == "none":  # the build has no network: ADD gets none either
            raise ins.error(f"ADD {p.urls[0]}: the build has network none", "COPY the file from the build context")
        downloads = [await self._download(ins, url) for url in p.urls]
        inputs.append([d[1] for d in downloads])
        key = chain(state.key, *inputs)

        async def make() -> tuple[str | None, int]:
            view = await self._view(state.layers)
            if chown:
                p.owner = _numeric(ins, chown) or copy.owner_of(ins, chown, view)
            src_view = await self._view(src_state.layers) if src_state is not None else None
            return await anyio.to_thread.run_sync(self._write_copy, p, view, src_view, downloads)
        return key, make

    def _write_copy(self, p: copy.Plan, view: View, src_view: View | None,
                    downloads: list[tuple[Path, str, str, int | None]]) -> tuple[str, int]:
        def write(out: LayerWriter) -> None:
            if src_view is not None:
                copy.write_from(p, src_view, view, out)
                return
            archives = [s for s in p.context if p.ins.cmd == "ADD" and not s.is_dir and copy.is_archive(self.ctx, s)]
            copy.write_context(replace(p, context=[s for s in p.context if s not in archives]), self.ctx, view, out)
            for src in archives:
                copy.write_archive(p, self.ctx, src, view, out)
            for path, _digest, name, mtime in downloads:
                into = p.dest.endswith("/") or view.is_dir(view.resolve(p.dest))
                target = copy._target(view, p.dest, name, into)
                out.add_download(target, path, owner=p.owner, mode=p.mode or 0o600)
        return self._write_layer(p.ins, view, write)

    def _write_layer(self, ins: Instruction, view: View, write: Callable[[LayerWriter], None]) -> tuple[str, int]:
        """A layer `write` fills for `ins`, stored as a blob: (digest, size)."""
        out = LayerWriter(self.store.temp_path(), view)
        try:
            write(out)
            digest = out.close()
        except BaseException as e:
            out.abort()
            if isinstance(e, NotADirectory):  # a name below a file of the image, wherever it came from
                raise ins.error(e.message) from None
            raise
        size = out.path.stat().st_size
        if self.store.has_blob(digest):
            out.path.unlink()
        else:
            self.store.commit_blob(out.path, digest)
        return digest, size

    async def _download(self, ins: Instruction, url: str) -> tuple[Path, str, str, int | None]:
        """ADD URL: (file, content digest, file name, mtime from Last-Modified)."""
        import email.utils

        import httpx

        path = self.store.temp_path()
        self._temps.append(path)
        self.out.line(f"downloading {url}")
        try:
            # Redirects are followed here, each hop checked like the first.
            async with httpx.AsyncClient(follow_redirects=False, timeout=60) as client:
                for _ in range(_MAX_REDIRECTS + 1):
                    request = await self._checked_request(ins, client, url)
                    r = await client.send(request, stream=True)
                    try:
                        if r.is_redirect and "location" in r.headers:
                            url = str(httpx.URL(url).join(r.headers["location"]))
                            continue
                        # What answered: the address checked, unless a proxy
                        # of the host's environment was asked in between.
                        stream = r.extensions.get("network_stream")
                        peer = stream.get_extra_info("server_addr") if stream is not None else None
                        if peer:
                            self._refuse_internal(ins, url, peer[0])
                        r.raise_for_status()
                        with open(path, "wb") as f:
                            async for chunk in r.aiter_bytes():
                                f.write(chunk)
                        modified = r.headers.get("last-modified")
                        break
                    finally:
                        await r.aclose()
                else:
                    raise ins.error(f"downloading {url}: more than {_MAX_REDIRECTS} redirects")
        except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as e:  # UnicodeError: a name IDNA refuses
            raise ins.error(f"downloading {url} failed: {e}") from None
        try:
            mtime = int(email.utils.parsedate_to_datetime(modified).timestamp()) if modified else None
        except (TypeError, ValueError, OverflowError):
            mtime = None  # as BuildKit: a Last-Modified it cannot read is left out
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        name = posixpath.basename(url.split("?", 1)[0].rstrip("/")) or "index.html"
        return path, await anyio.to_thread.run_sync(file_digest, path), name, mtime

    async def _checked_request(self, ins: Instruction, client: Any, url: str) -> Any:
        """The GET of `url`, sent to an address checked here: ADD URL
        reaches neither the host's own services nor cloud metadata (Docker's
        builder runs in a network of its own). Every address the name
        resolves to is checked as the proxy checks (nsbox/net/proxy.py),
        and the request goes to the first of them, so that a name cannot
        resolve elsewhere for the connection (the name stays in the Host
        header and is the name TLS verifies)."""
        request = client.build_request("GET", url)
        if self.network == "host":
            return request
        target = request.url
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            found = await anyio.getaddrinfo(target.host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ins.error(f"downloading {url} failed: {target.host}: {e.strerror or e}") from None
        addresses = [str(sockaddr[0]) for *_, sockaddr in found]
        for address in addresses:
            self._refuse_internal(ins, url, address)
        if not addresses:
            raise ins.error(f"downloading {url} failed: {target.host} has no address")
        return client.build_request("GET", target.copy_with(host=addresses[0]),
                                    headers={"Host": target.netloc.decode("ascii")},
                                    extensions={"sni_hostname": target.host})

    def _refuse_internal(self, ins: Instruction, url: str, address: str) -> None:
        if self.network == "host":
            return
        why = internal_reason(address)
        if why is not None:
            raise ins.error(f"ADD {url}: {address} is {why}, which a build reaches only with "
                            "`nsbox build --network host`", "COPY the file from the build context")

    # ---- layers ------------------------------------------------------

    async def _unpacked(self, state: State) -> tuple[Path, ...]:
        """The state's layer directories, unpacked for this id mapping."""
        dirs = []
        for layer in state.layers:
            _, path = await self.session.layer(layer.blob, layer.diff_id)
            dirs.append(path)
        return tuple(dirs)

    async def _view(self, layers: list[LayerRef]) -> View:
        blobs = tuple(layer.blob for layer in layers)
        n = len(blobs)
        while n and blobs[:n] not in self._views:
            n -= 1
        view = self._views.get(blobs[:n], View())
        for i in range(n, len(blobs)):
            view = await anyio.to_thread.run_sync(view.with_layer, self.store.blob_path(blobs[i]))
            self._views[blobs[:i + 1]] = view
        return view

    async def store_image(self, state: State, names: list[str]) -> BuildResult:
        """Writes config and manifest, unpacks every layer, then names the image."""
        await self._unpacked(state)
        doc = copy_mod.deepcopy(state.doc)
        doc["rootfs"] = {"type": "layers", "diff_ids": [layer.diff_id for layer in state.layers]}
        doc["history"] = state.history
        doc.pop("created", None)  # an unchanged rebuild gives the same image id
        config = json.dumps(doc, indent=2, sort_keys=True).encode()
        config_digest = self.store.put_bytes(config)
        manifest = oci.manifest_doc((config_digest, len(config)),
                                    [(layer.blob, layer.size, layer.media_type) for layer in state.layers])
        digest = self.store.put_bytes(manifest)
        for name in names:
            await self.store.tag(name, digest, source="build")
        self.result = replace(self.result, name=names[0], digest=digest, id=config_digest)
        return self.result

    def cleanup(self) -> None:
        for path in self._temps:
            path.unlink(missing_ok=True)


_ARCHES = {"386", "amd64", "arm", "arm64", "loong64", "mips", "mipsle", "mips64", "mips64le", "ppc64", "ppc64le",
           "riscv64", "s390x", *oci._ARCH_ALIASES}
_MAX_ID = (1 << 32) - 1  # ids are 32-bit (Docker parses them so)


def _numeric(ins: Instruction, chown: str) -> tuple[int, int] | None:
    user, _, group = chown.partition(":")
    if user.isdigit() and (not group or group.isdigit()):
        ids = int(user), int(group or user)
        if max(ids) > _MAX_ID:
            raise ins.error(f"{chown}: a uid or gid above {_MAX_ID}")
        return ids
    return None
