"""Pulling from a real registry (docker-registry on 127.0.0.1) and running the result.

Images are made by umoci from the busybox fixture, or written directly as
OCI layouts (tests/imagekit.py), and pushed with skopeo.
"""

from __future__ import annotations

import base64
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from nsbox.errors import NsboxError
from nsbox.storage import oci
from nsbox.storage import apply as apply_mod
from nsbox.storage import registry as reg_mod
from nsbox.storage.progress import Progress
from nsbox.sandbox import confined
from nsbox.storage.registry import AuthError, pull
from nsbox.storage.resolve import resolve
from nsbox.storage.store import Store

from tests.conftest import MODE
from tests.imagekit import (  # noqa: F401
    Layout,
    Registry,
    TokenServer,
    add,
    busybox_layer,
    busybox_oci,
    push,
    registry,
    run_image,
    store,
    tar_bytes,
)

pytestmark = pytest.mark.timeout(60)


async def test_pull_config_owners_and_user(registry: Registry, busybox_oci: Path, store: Store,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    push(f"oci:{busybox_oci}:app", registry, "test/app:1")
    image = await pull(store, f"{registry.host}/test/app:1")
    cfg = image.config
    assert (cfg.user, cfg.workdir, cfg.env["GREETING"]) == ("app", "/srv", "hello world")
    assert cfg.command == ["sh", "-c", "echo $GREETING"] and cfg.exposed_ports == ["8080/tcp"]
    assert len(image.layers) == 2 and image.name == f"{registry.host}/test/app:1"
    user, note = cfg.effective_user(MODE)
    async with run_image(image, env=cfg.env) as sb:
        r = await sb.exec(["stat", "-c", "%u:%g %a %n", "/home/app", "/home/app/notes.txt", "/usr/local/bin/suid"])
        owner = "0:0" if MODE.mode == "single" else "1000:1000"
        assert r.stdout.split("\n")[:3] == [f"{owner} 750 /home/app", f"{owner} 600 /home/app/notes.txt",
                                            "0:0 4755 /usr/local/bin/suid"], r
        r = await sb.exec(cfg.command, user=user, cwd=cfg.workdir)
        assert r.stdout == "hello world\n", r
        r = await sb.exec(["sh", "-c", "id -u; cat /home/app/notes.txt; touch /home/app/new"], user=user)
        assert r.success, r
        if MODE.mode == "single":
            # Only your own uid is mapped: the image's USER runs as root.
            assert user == "root" and note and "USER app" in note and r.stdout.startswith("0\n")
        else:
            assert user == "app" and note is None and r.stdout == "1000\nmine\n"
    # Pulled again: nothing is downloaded or unpacked twice; a second image
    # with the same base layer shares its directory.
    calls = 0
    real = reg_mod.Registry.blob_to_store

    async def counting(self: Any, *a: Any) -> None:
        nonlocal calls
        calls += 1
        await real(self, *a)

    monkeypatch.setattr(reg_mod.Registry, "blob_to_store", counting)
    again = await pull(store, f"{registry.host}/test/app:1")
    assert again.layers == image.layers and calls == 0
    push(f"oci:{busybox_oci}:plain", registry, "test/plain:1")
    plain = await resolve(store, f"{registry.host}/test/plain:1")
    assert plain.layers == image.layers[:1] and calls == 0
    assert not any(p.name.startswith(".staging") for p in image.layers[0].parent.iterdir())
    assert not list(store.tmp.iterdir())


def _marker(text: str) -> bytes:
    return tar_bytes(lambda t: add(t, "arch", text.encode()))


async def test_manifest_list_with_other_arch_first(registry: Registry, store: Store, tmp_path: Path) -> None:
    here = oci.Platform.current()
    other = "arm64" if here.architecture != "arm64" else "amd64"
    layout = Layout(tmp_path / "multi")
    first = layout.image([busybox_layer(), _marker(other)], arch=other)
    second = layout.image([busybox_layer(), _marker(here.architecture)], arch=here.architecture,
                          variant=here.variant)
    layout.tag_index("multi", [first, second])
    push(f"oci:{layout.path}:multi", registry, "test/multi:1", all_=True)
    image = await pull(store, f"{registry.host}/test/multi:1")
    assert (image.layers[-1] / "arch").read_text() == here.architecture
    assert image.config.architecture == here.architecture
    theirs = await pull(store, f"{registry.host}/test/multi:1", platform=f"linux/{other}")
    assert (theirs.layers[-1] / "arch").read_text() == other
    assert theirs.layers[0] == image.layers[0]  # the same busybox layer, unpacked once
    with pytest.raises(NsboxError, match="no variant for linux/s390x"):
        await pull(store, f"{registry.host}/test/multi:1", platform="linux/s390x")
    async with run_image(image) as sb:
        assert (await sb.exec(["cat", "/arch"])).stdout == here.architecture


async def test_whiteouts_opaque_dirs_and_copy_on_write(registry: Registry, store: Store, tmp_path: Path) -> None:
    def lower(t: tarfile.TarFile) -> None:
        for d in ("data", "data/dir", "opq", "opq/sub"):
            add(t, d, type=tarfile.DIRTYPE)
        for f in ("data/keep", "data/gone", "data/dir/old", "opq/a", "opq/sub/b"):
            add(t, f, f.encode())

    def upper(t: tarfile.TarFile) -> None:
        add(t, "data", type=tarfile.DIRTYPE)
        add(t, "data/.wh.gone")
        add(t, "data/dir", type=tarfile.DIRTYPE)
        add(t, "data/dir/.wh..wh..opq")
        add(t, "data/dir/new", b"new")
        add(t, "opq/.wh..wh..opq")  # its parent comes only implicitly
        add(t, "opq/c", b"c")
        add(t, "etc/.wh.hostname")  # a file of the busybox layer

    layout = Layout(tmp_path / "wh")
    layout.tag("wh", layout.image([busybox_layer(), tar_bytes(lower), tar_bytes(upper)]))
    push(f"oci:{layout.path}:wh", registry, "test/wh:1")
    image = await pull(store, f"{registry.host}/test/wh:1")
    top = image.layers[-1]
    assert os.lstat(top / "data/gone").st_rdev == 0 and Path(top / "data/gone").is_char_device()
    assert os.getxattr(top / "data/dir", "user.overlay.opaque") == b"y"
    before = {p: os.lstat(p).st_mtime_ns for layer in image.layers for p in layer.rglob("*")}
    script = ("ls -A /data /data/dir /opq; test ! -e /etc/hostname && echo no-hostname; "
              "echo x > /data/keep; rm -rf /opq && mkdir /opq && echo y > /opq/fresh && ls /opq")
    async with run_image(image) as a, run_image(image) as b:
        r = await a.exec(["sh", "-c", script])
        assert r.success, r
        assert r.stdout == "/data:\ndir\nkeep\n\n/data/dir:\nnew\n\n/opq:\nc\nno-hostname\nfresh\n"
        # The other sandbox and the layers themselves did not change.
        assert (await b.exec(["cat", "/data/keep"])).stdout == "data/keep"
        assert (await b.exec(["ls", "/opq"])).stdout == "c\n"
    assert {p: os.lstat(p).st_mtime_ns for layer in image.layers for p in layer.rglob("*")} == before


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("token-registry")
    token = TokenServer(work, {"alice": "s3cret"})
    reg = Registry(work / "registry", token=token)
    yield reg, token
    reg.close()
    token.close()


async def test_token_auth(token_registry: tuple[Registry, TokenServer], busybox_oci: Path, store: Store,
                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg, token = token_registry
    push(f"oci:{busybox_oci}:plain", reg, "private/bb:1", creds="alice:s3cret")
    ref = f"{reg.host}/private/bb:1"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    with pytest.raises(AuthError, match="refused an anonymous pull"):
        await pull(store, ref)
    auth_file = tmp_path / "auth.json"
    auth_file.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"alice:wrong").decode()}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file))
    with pytest.raises(AuthError, match="refused your credentials"):
        await pull(store, ref)
    auth_file.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"alice:s3cret").decode()}}}))
    token.issued.clear()
    image = await pull(store, ref)
    assert (image.layers[0] / "bin/busybox").is_file()
    assert {"user": "alice", "access": [{"type": "repository", "name": "private/bb", "actions": ["pull"]}]} \
        in token.issued
    # Anonymous bearer tokens, when the token service hands them out.
    monkeypatch.delenv("REGISTRY_AUTH_FILE")
    token.anonymous = True
    token.issued.clear()
    await pull(Store(tmp_path / "store2", runner=confined), ref)
    assert token.issued and all(t["user"] is None for t in token.issued)


def _unique_image(tmp_path: Path, name: str) -> tuple[Layout, dict[str, Any]]:
    layout = Layout(tmp_path / name)
    layer = tar_bytes(lambda t: add(t, f"{name}.bin", os.urandom(200_000)))
    layout.tag(name, layout.image([layer]))
    return layout, json.loads((layout.path / "blobs/sha256" / layout.index[0]["digest"][7:]).read_bytes())


def _nothing_published(store: Store) -> None:
    assert store.records() == {}
    assert not list(store.tmp.iterdir())
    for key in store.layers_root.iterdir():
        assert list(key.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated", "wrong-digest"])
async def test_damaged_blob(registry: Registry, store: Store, tmp_path: Path, damage: str) -> None:
    layout, manifest = _unique_image(tmp_path, f"damaged-{damage}")
    push(f"oci:{layout.path}:damaged-{damage}", registry, f"test/{damage}:1")
    layer = manifest["layers"][0]
    data = registry.blob_file(layer["digest"])
    content = data.read_bytes()
    if damage == "truncated":
        data.write_bytes(content[: len(content) // 2])
        match = "truncated"
    else:
        data.write_bytes(bytes(len(content)))  # same size, other bytes
        match = "does not match its digest"
    with pytest.raises(oci.DigestMismatch, match=match):
        await pull(store, f"{registry.host}/test/{damage}:1")
    assert not store.has_blob(layer["digest"])
    _nothing_published(store)


async def test_tampered_blob_found_only_at_its_end(registry: Registry, store: Store, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer is unpacked while it downloads; a blob that differs from its
    digest only in its gzip header's timestamp unpacks completely, to the
    right diff_id, and only the digest at its end tells: nothing of it is
    kept (blob, layer, staging directory, temp file, name)."""
    layout, manifest = _unique_image(tmp_path, "tampered-header")
    push(f"oci:{layout.path}:tampered-header", registry, "test/tampered:1")
    layer = manifest["layers"][0]
    data = registry.blob_file(layer["digest"])
    content = bytearray(data.read_bytes())
    assert content[:2] == b"\x1f\x8b" and not content[3] & 0x02  # gzip, no header CRC
    content[4:8] = (1_700_000_000).to_bytes(4, "little")  # MTIME: not under the data's CRC
    data.write_bytes(bytes(content))
    reports: list[Any] = []
    real = apply_mod.Unpacker.apply

    async def watching(self: Any, *a: Any, feed: Any = None) -> Any:
        try:
            reports.append(await real(self, *a, feed=feed))
        except BaseException as e:
            reports.append((feed is not None, e))
            raise
        return reports[-1]

    monkeypatch.setattr(apply_mod.Unpacker, "apply", watching)
    with pytest.raises(oci.DigestMismatch, match="does not match its digest"):
        await pull(store, f"{registry.host}/test/tampered:1")
    streamed, error = reports[0]
    assert streamed and isinstance(error, oci.DigestMismatch)
    assert not store.has_blob(layer["digest"])
    _nothing_published(store)


async def test_registry_dying_mid_blob(store: Store, tmp_path: Path) -> None:
    """The registry is killed while a layer streams in: the pull fails with
    one clear error, after its retries, and keeps nothing."""
    dying = Registry(tmp_path / "dying")
    try:
        layout = Layout(tmp_path / "big")
        # More than the sockets on both sides buffer: the kill cuts the stream.
        layout.tag("big", layout.image([tar_bytes(lambda t: add(t, "big.bin", os.urandom(32 << 20)))],
                                       compress=False))
        push(f"oci:{layout.path}:big", dying, "test/big:1")

        class Killing(Progress):
            def advance(self, nbytes: int) -> None:
                super().advance(nbytes)
                if self.done > 1 << 20 and dying.proc.poll() is None:
                    dying.proc.kill()
                    dying.proc.wait()

        progress = Killing()
        with pytest.raises(NsboxError, match="downloading sha256:[0-9a-f]+ of .* failed"):
            await pull(store, f"{dying.host}/test/big:1", progress=progress)
        assert progress.done == 0  # what came is taken back
        assert len(list(store.blobs.joinpath("sha256").iterdir())) == 2  # the manifest and config only
        _nothing_published(store)
    finally:
        dying.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_streamed_pull_on_trio(registry: Registry, busybox_oci: Path, store: Store) -> None:
    """The pipe a layer streams through is waited on with anyio (the rest
    of this module runs on asyncio)."""
    push(f"oci:{busybox_oci}:app", registry, "test/trio:1")
    image = await pull(store, f"{registry.host}/test/trio:1")
    assert len(image.layers) == 2 and (image.layers[0] / "bin/busybox").is_file()
    assert b"app:x:1000" in (image.layers[1] / "etc/passwd").read_bytes()
    assert all(store.has_blob(d["digest"]) for d in store.read_json(image.digest)["layers"])


async def test_missing_image_and_registry_errors(registry: Registry, store: Store) -> None:
    with pytest.raises(NsboxError, match="not found"):
        await pull(store, f"{registry.host}/test/nothing:1")
    with pytest.raises(NsboxError, match="cannot reach"):
        await pull(store, "127.0.0.1:1/test/nothing:1")


async def test_concurrent_pulls_share_work(registry: Registry, store: Store, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout(tmp_path / "shared")
    layout.tag("shared", layout.image([busybox_layer(), tar_bytes(lambda t: add(t, "big", os.urandom(3 << 20)))]))
    push(f"oci:{layout.path}:shared", registry, "test/shared:1")
    downloads = 0
    real = reg_mod.Registry._download

    async def counting(self: Any, *a: Any) -> None:
        nonlocal downloads
        downloads += 1
        await real(self, *a)

    monkeypatch.setattr(reg_mod.Registry, "_download", counting)
    results: list[Any] = []

    async def one() -> None:
        # A separate Store object: as another process would have.
        results.append(await pull(Store(store.root, runner=confined), f"{registry.host}/test/shared:1"))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert downloads == 2  # two layers, each downloaded once
    assert len({r.layers for r in results}) == 1


async def test_prune_keeps_named_and_in_use(registry: Registry, busybox_oci: Path, store: Store,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a live sandbox stacks is kept, whatever the runtime directory
    of the prune: it is recorded in the store (it was in the runtime
    directory's list, which XDG_RUNTIME_DIR changes from shell to shell)."""
    push(f"oci:{busybox_oci}:app", registry, "test/app:1")
    app = await pull(store, f"{registry.host}/test/app:1")
    layout, _ = _unique_image(tmp_path, "prunable")
    push(f"oci:{layout.path}:prunable", registry, "test/prunable:1")
    gone = await pull(store, f"{registry.host}/test/prunable:1")
    assert (await store.prune()).layers == 0  # everything is named
    assert await store.remove(f"{registry.host}/test/prunable:1") == [f"{registry.host}/test/prunable:1"]
    async with run_image(app) as sb:
        assert await store.remove(app.id[7:19]) == [f"{registry.host}/test/app:1"]  # by id
        (tmp_path / "other-runtime").mkdir(mode=0o700)
        with monkeypatch.context() as m:
            m.setenv("NSBOX_STATE_DIR", os.fspath(tmp_path / "other-runtime"))
            report = await store.prune()
        assert report.layers == 1 and report.blobs >= 5
        assert not gone.layers[0].exists() and all(p.is_dir() for p in app.layers)
        r = await sb.exec(["ls", "/bin/busybox"])
        assert r.success, r.stderr
    report = await store.prune()
    assert report.layers == 2 and not any(p.exists() for p in app.layers)
    assert [p.name for p in store.blobs.joinpath("sha256").iterdir()] == []
    assert not list((store.root / "in-use").iterdir())


async def test_a_prune_during_a_pull_keeps_what_the_pull_stored(registry: Registry, busybox_oci: Path, store: Store,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune that starts while a pull fetches the config (its manifest
    stored already, no name for it yet) waits for the pull: it had deleted
    the manifest, and the pull then named an image without one."""
    push(f"oci:{busybox_oci}:app", registry, "test/raced:1")
    real = reg_mod.Registry.small_blob
    pruned: list[Any] = []

    async with anyio.create_task_group() as tg:
        async def prune() -> None:
            pruned.append(await store.prune())

        async def racing(self: reg_mod.Registry, desc: dict[str, Any]) -> bytes:
            tg.start_soon(prune)
            await anyio.sleep(0.5)  # time enough for a prune that does not wait
            return await real(self, desc)

        monkeypatch.setattr(reg_mod.Registry, "small_blob", racing)
        image = await pull(store, f"{registry.host}/test/raced:1")
    assert pruned and pruned[0].blobs == 0, pruned
    assert store.image(image.digest, name=image.name, key=MODE.key) is not None
    assert all(store.has_blob(d["digest"]) for d in store.read_json(image.digest)["layers"])


async def test_a_pull_restores_a_blob_whose_layer_is_unpacked(registry: Registry, busybox_oci: Path,
                                                              store: Store) -> None:
    """Builds read an image's layer blobs: a pull keeps them, even when the
    layer was unpacked by another image's pull and its blob is gone since."""
    push(f"oci:{busybox_oci}:plain", registry, "test/keep:1")
    push(f"oci:{busybox_oci}:plain", registry, "test/keep:2")
    first = await pull(store, f"{registry.host}/test/keep:1")
    manifest = store.read_json(first.digest)
    blobs = [d["digest"] for d in manifest["layers"]]
    for digest in blobs:
        store.blob_path(digest).unlink()
    second = await pull(store, f"{registry.host}/test/keep:2")
    assert second.layers == first.layers  # not unpacked again
    assert all(store.has_blob(d) for d in blobs)
