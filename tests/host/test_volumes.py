"""Compose volumes are seeded with the image's files, as Docker seeds them.

An image built from a Dockerfile on the busybox fixture has /data (a file
owned by 1000, a directory of mode 750, symlinks to host paths and with
`..`, a file a later layer deleted) and /evil, a symlink climbing out of
the image towards the host's /etc. Mounted with named and anonymous
volumes in compose services: the files arrive with their owners (every
owner is root's in single mode, all such a sandbox can represent), symlinks
stay symlinks, `nocopy` leaves a volume empty, a volume already seeded is
not seeded again, and a shared volume is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nsbox import manage
from nsbox.host import live
from tests.conftest import MODE
from .test_build import _base
from .test_compose_eval import _check, _run, _task, output_has

pytestmark = pytest.mark.timeout(300)

# A single-mode sandbox has one id: chown to another fails there.
DOCKERFILE = """\
FROM {base}
RUN mkdir /data && echo seed > /data/f && {{ chown 1000:1000 /data/f || [ "{single}" = 1 ]; }} && mkdir /data/sub && chmod 750 /data/sub \
 && echo deep > /data/sub/g && echo gone > /data/gone \
 && ln -s /etc/shadow /data/shadow && ln -s ../../../../etc/passwd /data/up && ln -s f /data/link
RUN rm /data/gone && echo image-etc > /etc/only-in-image && ln -s ../../../../etc /evil
"""


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """The build context, in the compose file's directory (tmp_path)."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=_base("busybox"), single=int(MODE.mode == "single")))
    return ctx


def _compose(ctx: Path) -> str:
    return textwrap.dedent(f"""\
        services:
          default:
            build: {ctx}
            image: localhost/nsbox-seed-test:1
            command: sleep 600
            network_mode: none
            volumes: ["data:/data"]
          second:
            image: localhost/nsbox-seed-test:1
            command: sleep 600
            network_mode: none
            depends_on: [default]
            volumes: ["data:/shared", "/data"]
          third:
            image: localhost/nsbox-seed-test:1
            command: sleep 600
            network_mode: none
            volumes:
              - type: volume
                source: empty
                target: /data
                volume: {{nocopy: true}}
        volumes:
          data:
          empty:
        """)


def _host_uid(uid: int) -> int:
    for inside, outside, count in MODE.uid_map:
        if inside <= uid < inside + count:
            return outside + uid - inside
    raise AssertionError(f"uid {uid} is not mapped")


async def sh(box: object, script: str) -> str:
    r = await box.exec(["sh", "-c", script])  # type: ignore[attr-defined]
    assert r.success, r
    return r.stdout.strip()


async def test_a_symlink_mount_point_is_resolved_in_the_image(context: Path, tmp_path: Path) -> None:
    """/evil is `../../../../etc` in the image: what is copied is the image's
    /etc, never the host's (a service cannot mount there: nsbox refuses
    symlink mount points, so seed() is called directly)."""
    from nsbox.inspect.compose import prepare
    from nsbox.host.layers import give
    from nsbox.compose.volumes import seed

    (tmp_path / "compose.yaml").write_text(_compose(context))
    task = await prepare(str(tmp_path / "compose.yaml"))
    volume = tmp_path / "vol"
    volume.mkdir()
    give(volume, MODE.host_root)
    image = task.images["default"]
    assert await seed(image, [("/evil", volume), ("/evil/../data/sub", volume)]) == [volume]
    names = sorted(os.listdir(volume))  # the second seed found it full: not seeded twice
    assert "only-in-image" in names and "g" not in names
    assert not (Path("/etc") / "only-in-image").exists()
    import nsbox
    async with nsbox.Sandbox(image=image.id) as box:
        assert names == sorted((await sh(box, "ls -A /etc")).split())
    from nsbox.create.unshare import remove_layer
    remove_layer(volume, MODE)


async def test_named_and_anonymous_volumes_hold_the_images_files(context: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from nsbox.inspect import compose
    from nsbox.inspect.compose import prepare, start_sample

    # Volumes are removed off the event loop: what a sample wrote there,
    # any number of files, held every other sample's loop (1.8 s for 100,000).
    removed_on: list[threading.Thread] = []
    real_remove = compose.remove_volumes
    monkeypatch.setattr(compose, "remove_volumes",
                        lambda *a: (removed_on.append(threading.current_thread()), real_remove(*a))[1])

    (tmp_path / "compose.yaml").write_text(_compose(context))
    task = await prepare(str(tmp_path / "compose.yaml"))
    sample, boxes = await start_sample(task, "seed")
    try:
        owner = "0 0" if MODE.mode == "single" else "1000 1000"
        a, b, c = boxes["default"], boxes["second"], boxes["third"]
        assert await sh(a, "cat /data/f; stat -c '%u %g' /data/f") == f"seed\n{owner}"
        assert await sh(a, "stat -c '%a %F' /data/sub; cat /data/sub/g") == "750 directory\ndeep"
        assert await sh(a, "readlink /data/shadow; readlink /data/up; cat /data/link") == \
            "/etc/shadow\n../../../../etc/passwd\nseed"
        assert await sh(a, "ls -A /data") == "f\nlink\nshadow\nsub\nup"  # the deleted file stays deleted
        # The second service shares the seeded volume (not seeded again) and
        # its anonymous volume is seeded too.
        assert await sh(b, "cat /shared/f && echo from-second > /shared/new && ls -A /data") == "seed\nf\nlink\nshadow\nsub\nup"
        assert await sh(a, "cat /data/new") == "from-second"
        assert await sh(c, "ls -A /data | wc -l") == "0"  # nocopy
        # On the host: symlinks stayed symlinks, nothing of the host came in.
        volume = Path(sample.volumes) / "named" / "data"  # type: ignore[arg-type]
        assert os.readlink(volume / "shadow") == "/etc/shadow"
        assert os.readlink(volume / "up") == "../../../../etc/passwd"
        assert (volume / "f").stat().st_uid == _host_uid(1000 if MODE.mode != "single" else 0)
        # Who uses them, for a collection after this process is killed.
        users = json.loads(Path(f"{sample.volumes}.sandboxes").read_text())
        assert users["owner"][0] == os.getpid()
        assert sorted(users["sandboxes"]) == sorted([b.id, b.pid, live.read(b.id).init_start] for b in boxes.values())
        assert sample.volumes not in manage.orphan_volumes()
    finally:
        await sample.close()
    assert not Path(sample.volumes).exists() and not Path(f"{sample.volumes}.sandboxes").exists()  # type: ignore[arg-type]
    assert removed_on and threading.main_thread() not in removed_on


def test_an_eval_sees_the_seeded_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Inspect: the bash tool (the Debian fixture has bash) reads the
    image's files in the challenge's volume."""
    monkeypatch.chdir(tmp_path)
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=_base("debian"), single=int(MODE.mode == "single")))
    task = _task(tmp_path, f"""\
        services:
          default:
            build: {context}
            command: sleep 600
            network_mode: none
            volumes: [challenge:/data]
        volumes:
          challenge:
        """, "nsbox_compose_seeded_volume", output_has("seed+deep"))
    _check(_run(task, [("bash", {"command": "echo $(cat /data/f)+$(cat /data/sub/g)"})], tmp_path), 1)


async def test_seeding_keeps_links_and_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image's hardlinked files cost the volume no more than they cost
    the image, and the image bounds cap what seeding writes (a hostile
    image could otherwise fill the host's disk through a volume)."""
    from nsbox.dockerfile import build_image
    from nsbox.host.layers import give
    from nsbox.sandbox import confined
    from nsbox.storage import Store
    from nsbox.storage.resolve import resolve
    from nsbox.compose.volumes import seed

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM {_base('busybox')}\n"
        "RUN mkdir /d && head -c 1048576 /dev/urandom > /d/a && ln /d/a /d/b\n")
    result = await build_image(ctx, tag="localhost/nsbox-seed-test:sparse", network="none", progress=lambda _: None)
    image = await resolve(Store(runner=confined), result.name, pull="never")
    volume = tmp_path / "vol"
    volume.mkdir()
    give(volume, MODE.host_root)
    try:
        assert await seed(image, [("/d", volume)]) == [volume]
        assert os.stat(volume / "a").st_ino == os.stat(volume / "b").st_ino
        assert os.stat(volume / "a").st_size == 1 << 20
        # Bounded: 1 MiB of data is more than a 512 KiB bound allows.
        monkeypatch.setenv("NSBOX_IMAGE_LIMITS", "size=512K")
        other = tmp_path / "vol2"
        other.mkdir()
        give(other, MODE.host_root)
        with pytest.raises(Exception, match="more than the image bounds allow .*NSBOX_IMAGE_LIMITS"):
            await seed(image, [("/d", other)])
    finally:
        from nsbox.create.unshare import remove_layer
        for d in (volume, tmp_path / "vol2"):
            if d.exists():
                remove_layer(d, MODE)


def test_seeding_keeps_holes(tmp_path: Path) -> None:
    """A sparse file of a layer (the applier keeps an image's sparse members
    sparse) is copied with its holes: a 1 GiB file of 8 KiB of data stays
    8 KiB on disk. The copier runs here, outside its sandbox, on a layer
    the test makes, so that its own rules are what is tested."""
    from nsbox.compose.volumes import SEEDER

    layer = tmp_path / "layer"
    (layer / "d").mkdir(parents=True)
    with open(layer / "d" / "sparse", "wb") as f:
        f.truncate(1 << 30)
        f.seek(512 << 20)
        f.write(b"x" * 8192)
    volume = tmp_path / "vol"
    volume.mkdir()
    args = {"layers": [str(layer)], "seeds": [["/d", str(volume)]], "single": True,
            "max_bytes": 1 << 20, "max_files": 100}
    r = subprocess.run([sys.executable, "-I", "-S", str(SEEDER), json.dumps(args)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    st = os.stat(volume / "sparse")
    assert st.st_size == 1 << 30 and st.st_blocks * 512 <= 64 << 10, st
    with open(volume / "sparse", "rb") as f:
        f.seek(512 << 20)
        assert f.read(8192) == b"x" * 8192 and f.read(1) == b"\0"
