"""Test kit for images: a real registry on 127.0.0.1, a token server, OCI layouts.

- `Registry`: Debian's docker-registry (distribution 2.8) on 127.0.0.1 and a
  free port, storage in a temp dir, optionally with token auth served by
  `TokenServer` (an in-process HTTP server on 127.0.0.1 signing RS256 JWTs
  with a throwaway key made by openssl). Nothing listens elsewhere.
- `Layout`: writes OCI image layouts directly (layers are tars built with
  tarfile), for synthetic images: multi-arch indexes, whiteouts, hostile
  layers. Images from the fixture rootfs tarballs are made with umoci.
- `push()`: skopeo copy to the registry.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import os
import socket
import subprocess
import tarfile
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from .components import require as need  # noqa: F401 (the image tools are components)
from .components import which


def tool(name: str) -> str:
    return which(name) or name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """Issues bearer tokens the registry trusts; `users` may log in with
    basic auth, anonymous callers get pull only if `anonymous`."""

    def __init__(self, workdir: Path, users: dict[str, str], anonymous: bool = False) -> None:
        need("openssl")
        self.key, self.cert = workdir / "token.key", workdir / "token.pem"
        subprocess.run([tool("openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key,
                        "-out", self.cert, "-days", "2", "-subj", "/CN=nsbox-test-token"],
                       check=True, capture_output=True)
        der = subprocess.run([tool("openssl"), "x509", "-in", self.cert, "-outform", "DER"], check=True,
                             capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.users = users
        self.anonymous = anonymous
        self.issued: list[dict[str, Any]] = []
        self.service = "nsbox-test-registry"
        self.issuer = "nsbox-test-issuer"
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                owner._handle(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def _handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        q = urllib.parse.parse_qs(urllib.parse.urlparse(req.path).query)
        user = None
        header = req.headers.get("Authorization", "")
        if header.startswith("Basic "):
            name, _, pw = base64.b64decode(header[6:]).decode().partition(":")
            if self.users.get(name) != pw:
                req.send_response(401)
                req.end_headers()
                return
            user = name
        access = []
        for scope in q.get("scope", []):
            kind, name, actions = scope.split(":")
            allowed = actions.split(",") if user else (["pull"] if self.anonymous else [])
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a in allowed]})
        if user is None and not self.anonymous:
            req.send_response(401)
            req.end_headers()
            return
        self.issued.append({"user": user, "access": access})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user or "", "aud": self.service, "exp": now + 600, "nbf": now - 10,
                  "iat": now, "jti": os.urandom(8).hex(), "access": access}
        head = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        signing = f"{_b64url(json.dumps(head).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run([tool("openssl"), "dgst", "-sha256", "-sign", self.key], input=signing.encode(),
                             capture_output=True, check=True).stdout
        body = json.dumps({"token": f"{signing}.{_b64url(sig)}"}).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Registry:
    """docker-registry on 127.0.0.1:<free port>, storage under `workdir`."""

    def __init__(self, workdir: Path, token: TokenServer | None = None) -> None:
        need("docker-registry")
        self.dir = workdir
        self.storage = workdir / "storage"
        self.storage.mkdir(parents=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        auth = ""
        if token is not None:
            auth = (f"auth:\n  token:\n    realm: {token.realm}\n    service: {token.service}\n"
                    f"    issuer: {token.issuer}\n    rootcertbundle: {token.cert}\n")
        # No blob descriptor cache: tests tamper with stored blobs on disk.
        config = workdir / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: nsbox-test-secret\n{auth}")
        self.log = open(workdir / "registry.log", "wb")
        self.proc = subprocess.Popen([tool("docker-registry"), "serve", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {(workdir / 'registry.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not start listening in 15 s") from None
                time.sleep(0.02)

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def push(source: str, registry: Registry, name: str, *, all_: bool = False, creds: str | None = None) -> None:
    """skopeo copy SOURCE (e.g. oci:DIR:TAG) to the registry as NAME (repo:tag)."""
    need("skopeo")
    cmd = [tool("skopeo"), "copy", "-q", "--dest-tls-verify=false"]
    if all_:
        cmd.append("--all")
    if creds:
        cmd += ["--dest-creds", creds]
    cmd += [source, f"docker://{registry.host}/{name}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HOME": os.environ.get("HOME", "/")})
    if r.returncode != 0:
        raise RuntimeError(f"skopeo copy to {name} failed: {r.stderr.strip()}")


# ---- OCI layouts written directly ----------------------------------------

TarBuild = Callable[[tarfile.TarFile], None]


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **attrs: Any) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    if "mode" not in attrs:
        info.mode = 0o755 if attrs.get("type") == tarfile.DIRTYPE else 0o644
    for k, v in attrs.items():
        if k == "xattrs":
            info.pax_headers = {f"SCHILY.xattr.{n}": val for n, val in v.items()}
        else:
            setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data) if data else None)


def tar_bytes(build: TarBuild, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        build(tar)
    return buf.getvalue()


class Layout:
    """An OCI image layout directory, written by hand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs/sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.index: list[dict[str, Any]] = []

    def blob(self, data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (self.path / "blobs/sha256" / digest[7:]).write_bytes(data)
        return {"digest": digest, "size": len(data)}

    def image(self, layers: list[bytes], *, arch: str = "amd64", config: dict[str, Any] | None = None,
              compress: bool = True, variant: str | None = None) -> dict[str, Any]:
        """Adds an image (layers are uncompressed tars); returns its manifest descriptor."""
        descs, diff_ids = [], []
        for raw in layers:
            diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
            data = gzip.compress(raw, mtime=0) if compress else raw
            mt = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
            descs.append({"mediaType": mt, **self.blob(data)})
        cfg: dict[str, Any] = {"architecture": arch, "os": "linux", "config": config or {},
                               "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        if variant:
            cfg["variant"] = variant
        cdesc = {"mediaType": "application/vnd.oci.image.config.v1+json", **self.blob(json.dumps(cfg).encode())}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": cdesc, "layers": descs}
        mdesc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **self.blob(json.dumps(manifest).encode())}
        plat = {"architecture": arch, "os": "linux", **({"variant": variant} if variant else {})}
        return {**mdesc, "platform": plat}

    def tag(self, tag: str, desc: dict[str, Any]) -> None:
        self.index.append({**desc, "annotations": {"org.opencontainers.image.ref.name": tag}})
        self._write()

    def tag_index(self, tag: str, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        """A multi-platform index of `manifests`, in the order given, tagged."""
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}
        desc = {"mediaType": "application/vnd.oci.image.index.v1+json", **self.blob(json.dumps(index).encode())}
        self.tag(tag, desc)
        return desc

    def _write(self) -> None:
        (self.path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": self.index}))


def umoci_image(layout: Path, tag: str, rootfs_tar: Path, *config: str) -> None:
    """An image of one layer (the fixture tarball) made with umoci, plus `umoci config` options."""
    need("umoci")
    u = tool("umoci")
    if not (layout / "index.json").exists():
        subprocess.run([u, "init", "--layout", layout], check=True, capture_output=True)
    for cmd in ([u, "new", "--image", f"{layout}:{tag}"],
                [u, "raw", "add-layer", "--image", f"{layout}:{tag}", rootfs_tar],
                [u, "config", "--image", f"{layout}:{tag}", *config] if config else None):
        if cmd:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(map(str, cmd))}: {r.stderr.strip()}")


# ---- fixtures (test modules import them by name) --------------------------

def fixture_tar(name: str) -> Path:
    from .conftest import fixture_tar

    return fixture_tar(name)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A plain docker-registry on 127.0.0.1 for the whole session."""
    reg = Registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.close()


@pytest.fixture(scope="session")
def busybox_oci(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OCI layout made by umoci from the busybox fixture: tag `plain` (one
    layer) and `app` (USER app, WORKDIR, ENV; a second layer adding user
    app (uid 1000) and its home)."""
    need("umoci")
    layout = tmp_path_factory.mktemp("oci") / "busybox"
    umoci_image(layout, "plain", fixture_tar("busybox"))
    umoci_image(layout, "app", fixture_tar("busybox"))

    def app_layer(tar: tarfile.TarFile) -> None:
        add(tar, "etc", type=tarfile.DIRTYPE)
        add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
                               b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        add(tar, "etc/group", b"root:x:0:\napp:x:1000:\ntty:x:5:\nnogroup:x:65534:\n")
        add(tar, "home", type=tarfile.DIRTYPE)
        add(tar, "home/app", type=tarfile.DIRTYPE, uid=1000, gid=1000, mode=0o750)
        add(tar, "home/app/notes.txt", b"mine\n", uid=1000, gid=1000, mode=0o600)
        add(tar, "srv", type=tarfile.DIRTYPE, uid=1000, gid=1000)
        add(tar, "usr/local/bin", type=tarfile.DIRTYPE)
        add(tar, "usr/local/bin/suid", b"#!/bin/sh\n", mode=0o4755)

    extra = layout.parent / "app-layer.tar"
    extra.write_bytes(tar_bytes(app_layer))
    r = subprocess.run([tool("umoci"), "raw", "add-layer", "--image", f"{layout}:app", extra], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    subprocess.run([tool("umoci"), "config", "--image", f"{layout}:app", "--config.user=app",
                    "--config.workingdir=/srv", "--config.env=GREETING=hello world", "--config.cmd=sh",
                    "--config.cmd=-c", "--config.cmd=echo $GREETING", "--config.exposedports=8080/tcp"],
                   check=True, capture_output=True)
    return layout


@pytest.fixture
def store(tmp_path: Path) -> Any:
    """An empty image store of its own; deleted afterwards (files of other
    sandbox users included)."""
    from nsbox.create.unshare import remove_layer
    from nsbox.sandbox import confined
    from nsbox.storage.store import Store

    from .conftest import MODE

    s = Store(tmp_path / "store", runner=confined)
    yield s
    remove_layer(s.root, MODE)


def busybox_layer() -> bytes:
    return fixture_tar("busybox").read_bytes()


@contextlib.asynccontextmanager
async def run_image(image: Any, **options: Any) -> AsyncIterator[Any]:
    """A sandbox whose root is the image's layers stacked with overlay."""
    import nsbox
    from nsbox.plan.rootfs import ImageRootfs

    sb = nsbox.Sandbox(workdir=options.pop("workdir", "/"), **options)
    sb.rootfs = ImageRootfs.of(image)
    async with sb:
        yield sb


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under root (but `skip`): mode, size, mtime, link target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        if skip is not None and Path(dirpath) == skip.parent:
            dirs[:] = [d for d in dirs if Path(dirpath, d) != skip]
            files = [f for f in files if Path(dirpath, f) != skip]
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, os.readlink(p) if os.path.islink(p) else "")
    return out


WAITING_CHECKS = ("test_exec_timeout", "test_exec_timeout_kills_process", "test_exec_timeout_kills_child_processes")


async def self_check_failures(task: str, config: Any) -> list[str]:
    """Inspect's sandbox self-check on sandboxes of `config`, each check on a
    fresh sample: "name: traceback" of each failed check. Not the three
    checks that wait out a timeout (7 s): what they test (a command killed
    with its children, the exception) does not depend on where the
    sandbox's files come from, and test_inspect_conformance.py's
    test_timeout_checks runs them on a root filesystem and on the host's,
    in every identity mode."""
    import traceback

    from inspect_ai.util._sandbox import self_check

    from nsbox.inspect.provider import NsboxSandboxEnvironment as Env

    checks = [name for name in dir(self_check) if name.startswith("test_")]
    await Env.task_init(task, config)
    failures: list[str] = []

    async def check(name: str) -> None:
        envs = await Env.sample_init(task, config, {})
        try:
            await getattr(self_check, name)(envs["default"])
        except Exception:
            failures.append(f"{name}: {traceback.format_exc(limit=2)}")
        finally:
            await Env.sample_cleanup(task, config, envs, False)

    try:
        for name in checks:
            if name not in WAITING_CHECKS:
                await check(name)
    finally:
        await Env.task_cleanup(task, config, True)
    return failures
