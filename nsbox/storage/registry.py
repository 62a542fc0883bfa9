"""Pulling images over the OCI distribution protocol (a small httpx client).

Why our own client: the protocol subset a pull needs is small (manifests,
blobs, the bearer-token dance), and we need control over what libraries
hide: streaming every blob through a digest check into the store's temp
dir, Docker's plain-HTTP rule for loopback registries, a docker.io mirror,
podman's and Docker's credential files, and anyio (so trio works too).
oras-py is synchronous (requests) and built around artifacts, python-dxf
is synchronous and unmaintained since 2023; both would still need the rest.

Endpoints: loopback registries (localhost, 127.0.0.0/8, ::1) speak plain
HTTP, as in Docker; registries named in NSBOX_INSECURE_REGISTRIES
(comma-separated host[:port]) use unverified TLS, then HTTP; all others
verified TLS. NSBOX_REGISTRY_MIRROR (a URL or host[:port]) is tried first
for docker.io, Docker Hub itself second.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Awaitable, Callable

import anyio
import httpx

from ..host import idmap
from ..errors import NsboxError
from . import oci
from .config import ImageConfig
from .apply import Feed
from .applytar import shown
from .bounds import Budget
from .progress import Progress
from .reference import DOCKER_HUB, DOCKER_HUB_API, Reference, is_loopback, parse
from .store import Image, ImageNotFound, Store, task_group

MIRROR_ENV = "NSBOX_REGISTRY_MIRROR"
INSECURE_ENV = "NSBOX_INSECURE_REGISTRIES"
# Concurrent layer downloads per pull (registries throttle more); each is
# unpacked as it comes (storage/apply.py's PARALLEL at a time).
DOWNLOADS = 4
CHUNK = 1 << 18
TIMEOUT = httpx.Timeout(30.0, read=60.0)
MAX_MANIFEST = oci.MAX_MANIFEST
MAX_CONFIG = oci.MAX_CONFIG  # podman's and skopeo's bound too
MAX_ERROR_BODY = 64 << 10  # read of an error's body, for its text
MAX_TOKEN = 1 << 20  # a token service's answer
RETRIES = 2  # per blob, after a dropped connection


class RegistryError(NsboxError):
    pass


class AuthError(RegistryError):
    pass


# ---- credentials --------------------------------------------------------

def auth_files() -> list[Path]:
    """Where podman and Docker keep credentials, in podman's order."""
    home = Path.home()
    paths = [os.environ.get("REGISTRY_AUTH_FILE")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(f"{os.environ['XDG_RUNTIME_DIR']}/containers/auth.json")
    paths += [os.fspath(home / ".config/containers/auth.json"),
              os.path.join(os.environ.get("DOCKER_CONFIG") or home / ".docker", "config.json")]
    return [Path(p) for p in paths if p]


def _auth_key(key: str) -> str:
    key = re.sub(r"^https?://", "", key).rstrip("/")
    if key.endswith(("/v1", "/v2")):
        key = key[:-3]
    host, sep, path = key.partition("/")
    if host in ("index.docker.io", "registry-1.docker.io"):
        host = DOCKER_HUB
    return host + sep + path


def credentials(ref: Reference) -> tuple[str, str] | None:
    """(user, password) for ref's registry: the most specific entry
    ("host/namespace" beats "host") of the first file that has one."""
    wanted = f"{ref.registry}/{ref.repository}"
    for path in auth_files():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        best: tuple[int, dict[str, Any]] | None = None
        for key, entry in (doc.get("auths") or {}).items():
            k = _auth_key(key)
            if wanted == k or wanted.startswith(k + "/") or k == ref.registry:
                if best is None or len(k) > best[0]:
                    best = (len(k), entry)
        if best is None:
            continue
        entry = best[1]
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            return user, password
        if entry.get("username"):
            return entry["username"], entry.get("password", "")
    return None


# ---- endpoints ----------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    base: str  # scheme://host[:port][/prefix]
    verify: bool

    @classmethod
    def for_host(cls, host: str) -> list[Endpoint]:
        insecure = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
        if is_loopback(host):
            return [cls(f"http://{host}", False)]
        if host in insecure:
            return [cls(f"https://{host}", False), cls(f"http://{host}", False)]
        return [cls(f"https://{host}", True)]


def endpoints(registry: str) -> list[Endpoint]:
    if registry != DOCKER_HUB:
        return Endpoint.for_host(registry)
    found: list[Endpoint] = []
    mirror = os.environ.get(MIRROR_ENV, "").strip().rstrip("/")
    if mirror:
        if "://" in mirror:
            insecure = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",")}
            host = mirror.split("://", 1)[1].split("/")[0]
            found.append(Endpoint(mirror, mirror.startswith("https://") and host not in insecure))
        else:
            found += Endpoint.for_host(mirror)
    return found + Endpoint.for_host(DOCKER_HUB_API)


# ---- the client ---------------------------------------------------------

def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


async def _capped(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of a streamed body, and whether it had more.
    Read raw: httpx decodes gzip a whole network chunk at a time (1000:1),
    so gzip and deflate are decompressed here, bounded as well."""
    encoding = resp.headers.get("content-encoding", "").strip().lower()
    dec = zlib.decompressobj(wbits=47) if encoding in ("gzip", "x-gzip", "deflate") else None
    if encoding not in ("", "identity") and dec is None:
        return b"", True  # br, zstd: not asked for, not decoded
    data = b""
    try:
        async for raw in resp.aiter_raw(CHUNK):
            data += dec.decompress(raw, limit + 1 - len(data)) if dec else raw
            if len(data) > limit:
                return data[:limit], True
    except zlib.error:
        return data, True
    return data, False


async def _error_text(resp: httpx.Response) -> str:
    """What a registry says of an error status (its `errors`, else the
    start of the body), read bounded, on one line, escaped for a terminal."""
    body, _ = await _capped(resp, MAX_ERROR_BODY)
    try:
        errors = json.loads(body).get("errors") or []
        text = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}".strip(": ") for e in errors)
    except (ValueError, RecursionError, AttributeError, TypeError):
        text = ""
    return shown((text or body.decode("utf-8", "replace").strip() or resp.reason_phrase)[:200])[:200]


def _is_digest(reference: str) -> bool:
    """A tag cannot hold ":" (`sha-1a2b3c4` is a tag), a digest always does."""
    return ":" in reference


class Registry:
    """One repository on one registry (or its mirror), with its auth state."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref
        self._endpoints = endpoints(ref.registry)
        self._clients: dict[bool, httpx.AsyncClient] = {}
        self._auth: str | None = None
        self._endpoint = self._endpoints[0]

    async def __aenter__(self) -> Registry:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        for c in self._clients.values():
            await c.aclose()

    def _client(self, verify: bool) -> httpx.AsyncClient:
        if verify not in self._clients:
            # identity: what is read is bounded as it arrives, not after httpx decoded it
            self._clients[verify] = httpx.AsyncClient(verify=verify, timeout=TIMEOUT, follow_redirects=True,
                                                      headers={"User-Agent": "nsbox", "Accept-Encoding": "identity"})
        return self._clients[verify]

    async def _send(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        """GET base/v2/<repo>/path, authenticating once on a 401; streamed."""
        ep = self._endpoint
        url = f"{ep.base}/v2/{self.ref.repository}/{path}"
        client = self._client(ep.verify)
        for attempt in range(2):
            h = dict(headers or {})
            if self._auth:
                h["Authorization"] = self._auth
            resp = await client.send(client.build_request("GET", url, headers=h), stream=True)
            if resp.status_code != 401 or attempt:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            await resp.aclose()
            await self._authenticate(challenge)
        raise AssertionError("unreachable")

    async def _authenticate(self, challenge: str) -> None:
        scheme, params = _challenge(challenge)
        creds = credentials(self.ref)
        where = self.ref.registry
        if scheme == "basic":
            if creds is None:
                raise AuthError(f"{where} wants a user name and password and none is stored for it",
                                hint="log in with `podman login` or `docker login`, or set REGISTRY_AUTH_FILE")
            self._auth = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise AuthError(f"{where} asks for an authentication scheme nsbox does not speak: {challenge!r}")
        query = {"scope": f"repository:{self.ref.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        auth = httpx.BasicAuth(*creds) if creds else None
        realm = params["realm"]
        client = self._client(self._endpoint.verify)
        try:
            resp = await client.send(client.build_request("GET", realm, params=query), auth=auth, stream=True)
            try:
                if resp.status_code != 200:
                    raise AuthError(f"{where}'s token service refused "
                                    f"{'your credentials' if creds else 'an anonymous pull'}"
                                    f" ({resp.status_code}: {await _error_text(resp)})",
                                    hint=None if creds else "log in with `podman login` or `docker login`")
                body, more = await _capped(resp, MAX_TOKEN)
            finally:
                await resp.aclose()
        except httpx.HTTPError as e:
            raise RegistryError(f"cannot reach {where}'s token service {shown(realm)}: {e}") from None
        if more:
            raise AuthError(f"{where}'s token service answered more than {MAX_TOKEN} bytes")
        doc = oci.json_object(body, f"{where}'s token service's answer", AuthError)
        token = doc.get("token") or doc.get("access_token")
        if not isinstance(token, str) or not (token.isascii() and token.isprintable()):
            raise AuthError(f"{where}'s token service answered without a token")
        self._auth = f"Bearer {token}"

    async def manifest(self, reference: str) -> tuple[bytes, str]:
        """The manifest bytes for a tag or digest (digests verified), and its Content-Type."""
        if _is_digest(reference):
            oci.check_digest(reference, f"the index of {self.ref}")
        last: Exception | None = None
        for ep in ([self._endpoint] if self._auth else self._endpoints):
            self._endpoint = ep
            try:
                resp = await self._send(f"manifests/{reference}", {"Accept": oci.ACCEPT})
            except httpx.HTTPError as e:
                last = RegistryError(f"cannot reach {ep.base} for {self.ref}: {e}")
                continue
            try:
                if resp.status_code == 200:
                    data, more = await _capped(resp, MAX_MANIFEST)
                    if more:
                        raise RegistryError(f"the manifest of {self.ref} is larger than {MAX_MANIFEST} bytes")
                    if _is_digest(reference):
                        oci.verify(data, reference, f"the manifest of {self.ref}")
                    return data, resp.headers.get("content-type", "").split(";")[0]
                text = await _error_text(resp)
                if resp.status_code == 404:
                    last = ImageNotFound(f"image {self.ref} not found on {ep.base} ({text})")
                elif resp.status_code in (401, 403):
                    raise AuthError(f"access to {self.ref} denied ({text})",
                                    hint="check the name; for a private image log in with `podman login`")
                else:
                    last = RegistryError(f"{ep.base} answered {resp.status_code} for {self.ref}: {text}")
            finally:
                await resp.aclose()
        assert last is not None
        raise last

    async def small_blob(self, desc: dict[str, Any]) -> bytes:
        """A config: read whole, so bounded like a manifest."""
        digest = oci.check_descriptor(desc, f"the manifest of {self.ref}")["digest"]
        resp = await self._send(f"blobs/{digest}")
        try:
            if resp.status_code != 200:
                raise RegistryError(f"blob {digest} of {self.ref}: {resp.status_code} {await _error_text(resp)}")
            data, more = await _capped(resp, MAX_CONFIG)
            if more:
                raise RegistryError(f"the config {digest} of {self.ref} is larger than {MAX_CONFIG} bytes")
        finally:
            await resp.aclose()
        oci.verify(data, digest, f"blob {digest} of {self.ref}")
        return data

    async def blob_to_store(self, desc: dict[str, Any], store: Store, progress: Progress,
                            unpack: Callable[[Feed | None], Awaitable[object]] | None = None) -> None:
        """Downloads a layer into the store, verifying size and digest; a
        concurrent pull of the same blob waits for this one instead.

        `unpack(feed)` unpacks the layer (Session.layer), called once: with a
        feed, it unpacks the download as it comes (one pass: the blob is
        hashed and stored while the applier decompresses and unpacks it, and
        nothing is published unless all of it matched its digest); with
        None, from the stored blob."""
        digest, size = oci.check_descriptor(desc, f"the manifest of {self.ref}")["digest"], int(desc["size"])
        unpacked = fed = False
        async with store.lock(f"blob-{oci.check_digest(digest)[1]}"):
            if unpack is not None and not store.has_blob(digest):
                async def feed(write: Callable[[bytes], Awaitable[None]]) -> None:
                    nonlocal fed
                    fed = True
                    await self._download(digest, size, store, progress, write)

                await self._retrying(digest, lambda: unpack(feed))
                unpacked = True
            if not store.has_blob(digest):  # the layer was there already: the blob is kept all the same
                await self._retrying(digest, lambda: self._download(digest, size, store, progress))
            elif not fed:
                progress.advance(size)
        if unpack is not None and not unpacked:
            await unpack(None)

    async def _retrying(self, digest: str, attempt: Callable[[], Awaitable[object]]) -> None:
        """attempt(), again after a dropped connection (each starts over)."""
        for n in range(RETRIES + 1):
            try:
                await attempt()
                return
            except httpx.TransportError as e:
                if n == RETRIES:
                    raise RegistryError(f"downloading {digest} of {self.ref} failed: {e}") from None

    async def _download(self, digest: str, size: int, store: Store, progress: Progress,
                        sink: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        """Fetches blob `digest` into the store; `sink` also gets its bytes
        as they come. Stored only once all of it matched the digest."""
        tmp = store.temp_path()
        h = oci.hasher(digest)
        n = 0
        try:
            resp = await self._send(f"blobs/{digest}")
            try:
                if resp.status_code != 200:
                    raise RegistryError(f"blob {digest} of {self.ref}: {resp.status_code} {await _error_text(resp)}")
                with open(tmp, "wb") as f:
                    async for chunk in resp.aiter_bytes(CHUNK):
                        n += len(chunk)
                        if n > size:
                            raise oci.DigestMismatch(f"blob {digest} of {self.ref} is larger than its {size} bytes")
                        h.update(chunk)
                        f.write(chunk)
                        if sink is not None:
                            await sink(chunk)
                        progress.advance(len(chunk))
            finally:
                await resp.aclose()
            if n != size:
                raise oci.DigestMismatch(f"blob {digest} of {self.ref} ended after {n} of {size} bytes (truncated)")
            if f"{digest.split(':')[0]}:{h.hexdigest()}" != digest:
                raise oci.DigestMismatch(f"blob {digest} of {self.ref} does not match its digest",
                                         hint="the registry's copy is damaged or tampered with")
            store.commit_blob(tmp, digest)
        except BaseException:
            progress.advance(-n)
            tmp.unlink(missing_ok=True)
            raise


async def pull(store: Store, ref: str, *, platform: str | None = None, progress: Progress | None = None,
               id_mapping: idmap.Requested = "auto") -> Image:
    """Pulls `ref` into the store, unpacks its layers for this user's id
    mapping and names it; returns the image."""
    r = parse(ref)
    want = oci.Platform.parse(platform) if platform else oci.Platform.current()
    progress = progress or Progress()
    progress.label = progress.label or r.short()
    async with Registry(r) as reg:
        data, ctype = await reg.manifest(r.reference)
        digest = r.digest or oci.digest_of(data)
        doc = oci.json_object(data, f"{r}: the manifest", RegistryError)
        if oci.media_type(doc, ctype) in oci.INDEX_TYPES:
            desc = oci.select_manifest(doc, want)
            digest = desc["digest"]
            data, ctype = await reg.manifest(digest)
            doc = oci.json_object(data, f"{r}: the manifest", RegistryError)
            if oci.media_type(doc, ctype) not in oci.MANIFEST_TYPES:
                raise RegistryError(f"{r}: the index entry for {want} is not an image manifest")
        layers = oci.layer_descriptors(doc)
        # Under the session's shared lock from the first blob stored: a
        # prune (exclusive) would take what no name refers to yet.
        async with store.session(id_mapping, progress) as s:
            store.put_bytes(data)
            config_bytes = await reg.small_blob(doc.get("config"))
            store.put_bytes(config_bytes)
            cfg = ImageConfig.parse(oci.json_object(config_bytes, f"{r}: the config", RegistryError))
            if cfg.architecture and cfg.architecture != want.architecture:
                progress.note(shown(f"warning: {r.short()} is for {cfg.os}/{cfg.architecture}, not {want}"))
            if len(layers) != len(cfg.diff_ids):
                raise RegistryError(f"{r}: the manifest has {len(layers)} layers, its config {len(cfg.diff_ids)}")
            for d in layers:
                progress.expect(int(d["size"]))
            downloads = anyio.Semaphore(DOWNLOADS)
            budget = Budget(r.short())

            async def one(desc: dict[str, Any], diff_id: str) -> None:
                # Every image keeps its blobs (builds read them, prune and
                # remove reason about them), even when another image's pull
                # unpacked the layer already.
                async def unpack(feed: Feed | None) -> object:
                    return await s.layer(desc["digest"], diff_id, budget, feed)

                if not store.has_blob(desc["digest"]):
                    async with downloads:
                        await reg.blob_to_store(desc, store, progress, unpack)
                else:
                    progress.advance(int(desc["size"]))
                    await unpack(None)
                progress.layer_done()

            async with task_group() as tg:
                for desc, diff_id in zip(layers, cfg.diff_ids):
                    tg.start_soon(one, desc, diff_id)
            await store.tag(str(r), digest, source="registry", pinned=True)  # r.digest, if any, was verified
            image = store.image(digest, name=str(r), key=s.mapping.key)
    progress.finish()
    assert image is not None
    return image
