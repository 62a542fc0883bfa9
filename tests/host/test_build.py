"""`nsbox build`: Dockerfiles built into the image store, and sandboxes
made from the results.

Base images are the fixture tarballs imported into the store (no
network). Every test runs in each identity mode; where a mode cannot do
something (single: users other than root) the test checks the error
that says so instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox.host import live
from nsbox.dockerfile import BuildError, build, build_image
from nsbox.sandbox import confined
from nsbox.storage import ImageNotFound, Store
from nsbox.storage.archive import import_image

from tests.conftest import FIXTURES, MODE, fixture_tar
from tests.net_members import host_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)


def _base(name: str) -> str:
    """The fixture tarball `name` as an image of the store (imported once)."""
    tar = fixture_tar(name)
    digest = hashlib.sha256(tar.read_bytes()).hexdigest()[:16]  # tests/run.sh copies it: mtimes change
    ref = f"localhost/nsbox-build-{name}:{digest}"
    try:
        Store().lookup(ref)
    except ImageNotFound:
        anyio.run(lambda: import_image(Store(runner=confined), tar, name=ref))
    return ref


@pytest.fixture(scope="session")
def busybox() -> str:
    return _base("busybox")


@pytest.fixture(scope="session")
def debian() -> str:
    return _base("debian")


def context(tmp_path: Path, dockerfile: str, files: dict[str, str | bytes] | None = None) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir(parents=True, exist_ok=True)
    (ctx / "Dockerfile").write_text(dockerfile)
    for name, content in (files or {}).items():
        path = ctx / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return ctx


async def sh(image: str, script: str, **options: object) -> str:
    async with nsbox.Sandbox(image=image, **options) as sb:  # type: ignore[arg-type]
        r = await sb.exec(["sh", "-c", script])
        assert r.success, r
        return r.stdout


@pytest.fixture
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A tag of this test's own, removed afterwards."""
    ref = "localhost/nsbox-build-test:" + re.sub(r"[^\w.-]+", "-", request.node.name)[:100]
    yield ref
    with contextlib.suppress(ImageNotFound):
        anyio.run(Store().remove, ref)


async def test_stages_args_and_target(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"""\
ARG BASE={busybox}
ARG GREETING=hi
FROM $BASE AS build
ARG GREETING
RUN echo "$GREETING from build" > /built.txt
FROM build AS never
RUN exit 7
FROM ${{BASE}} AS final
COPY --from=build /built.txt /srv/
CMD ["cat", "/srv/built.txt"]
FROM final AS last
RUN exit 9
""")
    lines: list[str] = []
    result = await build_image(ctx, tag=name, target="final", build_args={"GREETING": "hello"},
                               no_cache=True, progress=lines.append)
    assert await sh(result.name, "cat /srv/built.txt") == "hello from build\n"
    text = "".join(lines)
    assert "[build 2/3] ARG GREETING" in text and "[final 2/3] COPY --from=build /built.txt /srv/" in text
    assert "never" not in text and "exit 9" not in text  # stages the target does not need are not built
    assert result.ran == 1


async def test_run_forms(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"""\
FROM {busybox}
RUN echo shell $((6 * 7)) > /out.txt
RUN ["sh", "-c", "echo exec >> /out.txt"]
RUN <<EOF
echo heredoc-script >> /out.txt
echo second line >> /out.txt
EOF
RUN cat >> /out.txt <<'EOT'
as stdin $HOME
EOT
RUN <<EOF
#!/bin/sh -e
echo "shebang $0" >> /out.txt
EOF
SHELL ["/bin/sh", "-ec"]
RUN false; echo never
""")
    with pytest.raises(BuildError) as e:
        await build(ctx, tag=name, network="none", progress=lambda _: None)
    assert "Dockerfile:16 (RUN)" in str(e.value) and "status 1" in str(e.value)  # SHELL -e applied
    (ctx / "Dockerfile").write_text((ctx / "Dockerfile").read_text().replace("RUN false; echo never\n", ""))
    name = await build(ctx, tag=name, network="none", progress=lambda _: None)
    assert await sh(name, "cat /out.txt") == ("shell 42\nexec\nheredoc-script\nsecond line\nas stdin $HOME\n"
                                              "shebang /dev/shm/.nsbox-heredoc\n")


async def test_copy_globs_dockerignore_chown(tmp_path: Path, name: str, debian: str) -> None:
    ctx = context(tmp_path, f"""\
FROM {debian}
RUN useradd -m -u 1000 app
COPY *.txt /dst/
COPY tree /tree
COPY --chown=app:app a.txt /home/app/
COPY --chown=1234:2345 --chmod=0751 b.txt /numeric
COPY <<EOF /etc/greeting
hello from a heredoc
EOF
""", {"a.txt": "a\n", "b.txt": "b\n", "c.log": "log\n", "tree/keep/x": "x\n", "tree/secret/key": "k\n",
      "tree/skip.tmp": "t\n", "tree/keep/also.tmp": "kept by the exception\n",
      ".dockerignore": "*.log\n**/secret\ntree/*.tmp\n# a comment\n!tree/keep/also.tmp\n"})
    name = await build(ctx, tag=name, network="none", progress=lambda _: None)
    out = await sh(name, "cd /dst && ls; find /tree | sort; stat -c '%u:%g %a' /home/app/a.txt /numeric /home/app; "
                         "cat /etc/greeting")
    # single-uid mode maps only root: other owners become root when the layer is unpacked
    app, numeric = ("0:0", "0:0") if MODE.mode == "single" else ("1000:1000", "1234:2345")
    assert out == ("a.txt\nb.txt\n/tree\n/tree/keep\n/tree/keep/also.tmp\n/tree/keep/x\n"
                   f"{app} 644\n{numeric} 751\n{app} 755\nhello from a heredoc\n"), out


async def test_add_local_tar(tmp_path: Path, name: str, busybox: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for member, data in (("pkg/bin/tool", b"#!/bin/sh\necho tool\n"), ("pkg/README", b"read me\n")):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o755
            tf.addfile(info, io.BytesIO(data))
    ctx = context(tmp_path, f"FROM {busybox}\nADD pkg.tar.gz /opt/\nADD plain.txt /opt/plain.txt\n",
                  {"pkg.tar.gz": buf.getvalue(), "plain.txt": "not an archive\n"})
    name = await build(ctx, tag=name, progress=lambda _: None)
    assert await sh(name, "/opt/pkg/bin/tool; cat /opt/pkg/README /opt/plain.txt") == \
        "tool\nread me\nnot an archive\n"


async def test_config_reaches_the_sandbox(tmp_path: Path, name: str, debian: str) -> None:
    user = "app" if MODE.mode != "single" else "root"
    ctx = context(tmp_path, f"""\
FROM {debian}
RUN useradd -m -u 1000 app
ENV APP_HOME=/srv/app MODE="two words"
USER {user}
WORKDIR $APP_HOME
RUN touch made-by-run
LABEL org.example.name="demo" other=1
EXPOSE 8080 53/udp
VOLUME ["/data"]
STOPSIGNAL SIGINT
HEALTHCHECK --interval=30s --retries=3 CMD test -f made-by-run
SHELL ["/bin/bash", "-c"]
ENTRYPOINT ["/bin/echo"]
CMD ["default", "args"]
""")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    out = await sh(result.name, "pwd; id -un; echo $MODE; stat -c %U made-by-run")
    assert out == f"/srv/app\n{user}\ntwo words\n{user}\n"
    async with nsbox.Sandbox(image=result.name) as sb:
        assert sb.image_command() == ["/bin/echo", "default", "args"]
    cfg = json.loads(Store().read_blob(result.id))["config"]
    assert cfg["Labels"] == {"org.example.name": "demo", "other": "1"}
    assert cfg["ExposedPorts"] == {"8080/tcp": {}, "53/udp": {}} and cfg["Volumes"] == {"/data": {}}
    assert cfg["StopSignal"] == "SIGINT" and cfg["Shell"] == ["/bin/bash", "-c"]
    assert cfg["Healthcheck"] == {"Test": ["CMD-SHELL", "test -f made-by-run"], "Interval": 30_000_000_000,
                                  "Retries": 3}


async def test_single_mode_users_and_apt(tmp_path: Path, name: str, debian: str) -> None:
    """RUN as another user, and apt's drop to user _apt: they work with
    subordinate ids; in single-uid mode each fails in one error naming the
    fix, and apt works once told to stay root."""
    quiet = {"network": "none", "progress": lambda _: None}
    user = context(tmp_path / "user", f"FROM {debian}\nRUN useradd -u 1000 app\nUSER app\nRUN id -u > /tmp/x\n")
    apt = context(tmp_path / "apt", f"FROM {debian}\nRUN apt-get update\n")  # no network: warnings, status 0
    if MODE.mode != "single":
        await build(user, tag=name, **quiet)  # type: ignore[arg-type]
        await build(apt, tag=name, **quiet)  # type: ignore[arg-type]
        return
    with pytest.raises(BuildError) as e:
        await build(user, tag=name, **quiet)  # type: ignore[arg-type]
    assert "Dockerfile:4 (RUN)" in str(e.value) and "single-uid mode" in str(e.value)
    with pytest.raises(BuildError) as e:
        await build(apt, tag=name, **quiet)  # type: ignore[arg-type]
    assert "APT::Sandbox::User" in str(e.value)
    (apt / "Dockerfile").write_text(f"""FROM {debian}\nRUN echo 'APT::Sandbox::User "root";' > /etc/apt/apt.conf.d/00nsbox\n"""
                                    "RUN apt-get update\n")
    await build(apt, tag=name, **quiet)  # type: ignore[arg-type]


async def test_run_keeps_tmp(tmp_path: Path, name: str, busybox: str) -> None:
    """RUN sees the image's own /tmp (no tmpfs there), as docker build does."""
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY s.sh /tmp/\nRUN sh /tmp/s.sh > /tmp/made\nRUN cat /tmp/made > /out\n",
                  {"s.sh": "echo from tmp\n"})
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert await sh(result.name, "cat /out") == "from tmp\n"


async def test_deleted_files_are_whiteouts(tmp_path: Path, name: str, debian: str) -> None:
    ctx = context(tmp_path, f"""\
FROM {debian}
RUN mkdir -p /opt/d && touch /opt/d/old1 /opt/d/old2
RUN rm /etc/debian_version && rm -rf /usr/share/doc && rm -rf /opt/d && mkdir /opt/d && touch /opt/d/new
""")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    out = await sh(result.name, "ls /etc/debian_version /usr/share/doc 2>&1; ls /opt/d; true")
    assert "No such file" in out and out.endswith("new\n"), out
    store = Store()
    top = json.loads(store.read_blob(result.digest))["layers"][-1]["digest"]
    with tarfile.open(store.blob_path(top)) as tf:
        names = set(tf.getnames())
    assert {"etc/.wh.debian_version", "usr/share/.wh.doc"} <= names
    assert "opt/d/.wh..wh..opq" in names or "opt/.wh.d" in names, names


async def test_cache(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"""\
FROM {busybox}
ARG V=1
RUN echo "run $V" >> /log
COPY data.txt /
RUN cat /data.txt >> /log
""", {"data.txt": "one\n"})
    first = await build_image(ctx, tag=name, no_cache=True, progress=lambda _: None)  # runs, fills the cache
    assert (first.ran, first.cached) == (2, 0)
    lines: list[str] = []
    again = await build_image(ctx, tag=name, progress=lines.append)  # its speed: make bench
    assert (again.ran, again.cached, again.id) == (0, 3, first.id)
    assert "".join(lines).count(" CACHED\n") == 3
    unique = time.time_ns()  # never built before, by any earlier test run
    (ctx / "data.txt").write_text(f"two {unique}\n")  # invalidates the COPY and what follows only
    changed = await build_image(ctx, tag=name, progress=lambda _: None)
    assert (changed.ran, changed.cached) == (1, 1)
    other_arg = await build_image(ctx, tag=name, build_args={"V": str(unique)}, progress=lambda _: None)
    assert other_arg.ran == 2
    fresh = await build_image(ctx, tag=name, no_cache=True, progress=lambda _: None)
    assert (fresh.ran, fresh.cached) == (2, 0)
    assert await sh(name, "cat /log") == f"run 1\ntwo {unique}\n"


# perl's syscall() passes strings by address: they must be variables.
CAPD = '$p = \"/usr/local/bin/capd\"; $k = \"security.capability\"; '
SETCAP = ("perl -e '" + CAPD + "$v = pack(\"V5\", 0x02000001, 1 << 10, 0, 0, 0); "  # cap_net_bind_service+ep, v2
          "exit(syscall(188, $p, $k, $v, length($v), 0) != 0)'")
GETCAP = ("perl -e '" + CAPD + "$b = \"\\0\" x 64; $n = syscall(191, $p, $k, $b, 64); "
          "print \"caps $n \", unpack(\"V\", substr($b, 4, 4)), \"\\n\"'")


async def test_file_capabilities_set_by_a_step_are_kept(tmp_path: Path, name: str, debian: str) -> None:
    """`setcap` in a RUN: the layer keeps security.capability (as Docker's
    layers do), so the next step and the image's sandboxes see it."""
    if platform.machine() != "x86_64":
        pytest.skip("the test sets the xattr by its x86-64 syscall number (no setcap in the fixture)")
    ctx = context(tmp_path, f"FROM {debian}\nRUN cp /bin/true /usr/local/bin/capd && {SETCAP}\n"
                            f"RUN {GETCAP} > /caps-seen\n")
    await build(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)
    assert await sh(name, "cat /caps-seen") == "caps 20 1024\n"  # 20 bytes, CAP_NET_BIND_SERVICE
    assert await sh(name, GETCAP) == "caps 20 1024\n"


async def test_the_network_is_part_of_a_steps_cache_key(tmp_path: Path, name: str, busybox: str) -> None:
    """A step run without a network made something else than it makes with
    one (a download that failed): never reused for a build that has one."""
    unique = time.time_ns()
    ctx = context(tmp_path, f"FROM {busybox}\nRUN echo {unique} > /n; ls /sys/class/net > /ifaces 2>&1 || true\n")
    first = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert (first.ran, first.cached) == (1, 0)
    host = await build_image(ctx, tag=name, network="host", progress=lambda _: None)
    assert (host.ran, host.cached) == (1, 0)
    again = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert (again.ran, again.cached) == (0, 1)
    flagged = context(tmp_path / "flag", f"FROM {busybox}\nRUN --network=none echo {unique} > /n; "
                                         "ls /sys/class/net > /ifaces 2>&1 || true\n")
    as_flag = await build_image(flagged, tag=name, network="host", progress=lambda _: None)
    assert (as_flag.ran, as_flag.cached) == (0, 1)  # the same step as the first: no network


async def test_failed_run_leaves_no_image(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nRUN echo partial > /p\nRUN echo oops >&2; exit 3\n")
    mine = lambda: {i.id for i in live.entries() if i.owner_pid == os.getpid()}  # noqa: E731
    before = mine()
    lines: list[str] = []
    with pytest.raises(BuildError) as e:
        await build(ctx, tag=name, network="none", progress=lines.append)
    assert str(e.value).startswith("Dockerfile:3 (RUN): the command exited with status 3")
    assert "oops" in "".join(lines)  # the output was streamed
    with pytest.raises(ImageNotFound):
        Store().lookup(name)
    assert mine() == before  # no sandbox left behind


@pytest.mark.parametrize("line, message", [
    ("ONBUILD RUN true", "Dockerfile:2 (ONBUILD): ONBUILD triggers are not supported"),
    ("RUN --mount=type=cache,target=/c true", "Dockerfile:2 (RUN): RUN --mount"),
    ("FROBNICATE x", "Dockerfile:2 (FROBNICATE): unknown or unsupported instruction"),
    ("COPY --parents a /", "Dockerfile:2 (COPY): unsupported flag --parents"),
])
async def test_unsupported_syntax(tmp_path: Path, name: str, busybox: str, line: str, message: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\n{line}\n")
    with pytest.raises(BuildError) as e:
        await build(ctx, tag=name, progress=lambda _: None)
    assert str(e.value).startswith(message), str(e.value)


async def test_platform_must_be_one(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"FROM --platform=garbage {busybox}\n")
    with pytest.raises(BuildError, match=r"^Dockerfile:1 \(FROM\): --platform=garbage: unknown architecture"):
        await build(ctx, tag=name, network="none", progress=lambda _: None)


async def test_escape_directive_after_syntax(tmp_path: Path, name: str, busybox: str) -> None:
    """Parser directives are all the leading `# key=value` lines: the
    escape character a second line sets applies to ENV's words."""
    ctx = context(tmp_path, f"# syntax=docker/dockerfile:1\n# escape=`\nFROM {busybox}\nENV P=C:\\dir Q=a`$b\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    env = Store().read_json(result.id)["config"]["Env"]
    assert "P=C:\\dir" in env and "Q=a$b" in env, env


async def test_default_network_is_announced(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nRUN ip -o link | grep -c . > /links\n")
    lines: list[str] = []
    result = await build_image(ctx, tag=name, no_cache=True, progress=lines.append)
    assert result.network in ("nat", "none")
    assert f"RUN steps use network {result.network}" in "".join(lines)


@pytest.mark.needs("tun", "usernet")
async def test_run_steps_do_not_reach_the_hosts_loopback(tmp_path: Path, name: str, busybox: str,
                                                        host_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Dockerfile (or a package's install script) cannot read the host's
    127.0.0.1 services through nat's gateway, as Docker's RUN cannot.
    slirp4netns refuses the gateway locally (pasta would pass 10.0.2.2 on
    to the real network, which tests never send to)."""
    monkeypatch.setenv("NSBOX_USERNET_TOOL", "slirp4netns")
    ctx = context(tmp_path, f"FROM {busybox}\nRUN (nc -w 2 10.0.2.2 {host_server} || true) > /got; "
                            "cat /etc/hosts > /hosts\n")
    result = await build_image(ctx, tag=name, no_cache=True, progress=lambda _: None)
    assert result.network == "nat"
    assert await sh(result.name, "cat /got") == ""
    assert "host.nsbox.internal" not in await sh(result.name, "cat /hosts")


async def test_run_steps_never_fall_back_to_the_hosts_network(tmp_path: Path, name: str, busybox: str,
                                                              host_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nat cannot work, RUN steps get no network (not the host's, with
    its loopback services), and say how to ask for the host's; a
    Dockerfile's own RUN --network=host needs that opt-in too."""
    monkeypatch.setenv("NSBOX_USERNET_TOOL", "no-such-usernet-tool")
    ctx = context(tmp_path, f"FROM {busybox}\nRUN (nc -w 2 127.0.0.1 {host_server} || true) > /got\n")
    lines: list[str] = []
    result = await build_image(ctx, tag=name, no_cache=True, progress=lines.append)
    assert result.network == "none" and await sh(result.name, "cat /got") == ""
    assert "`nsbox build --network host`" in "".join(lines)
    ctx = context(tmp_path / "explicit", f"FROM {busybox}\nRUN --network=host nc -w 2 127.0.0.1 {host_server} > /got\n")
    with pytest.raises(BuildError, match=r"RUN --network=host .* only with `nsbox build --network host`"):
        await build(ctx, tag=name, no_cache=True, progress=lambda _: None)
    result = await build_image(ctx, tag=name, no_cache=True, network="host", progress=lambda _: None)
    assert await sh(result.name, "cat /got") == "host"  # the explicit opt-in


def test_cli(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nARG WHO\nRUN echo $WHO > /who\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "nsbox", "build", "-t", name, "--build-arg", "WHO=cli",
                        "--network", "none", str(ctx)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == Store().lookup(name).id and "[3/3] RUN echo $WHO > /who" in r.stderr
    run = subprocess.run([sys.executable, "-m", "nsbox", "run", "--image", name, "--", "cat", "/who"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout == "cli\n", run.stderr
    (ctx / "Dockerfile").write_text(f"FROM {busybox}\nRUN true\nMAINTAINERS me\n")
    bad = subprocess.run([sys.executable, "-m", "nsbox", "build", "-t", name, str(ctx)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == "nsbox: Dockerfile:3 (MAINTAINERS): unknown or unsupported instruction MAINTAINERS"
