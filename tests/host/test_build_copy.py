"""COPY's destinations, owners and modes as Docker gives them: --chmod
values, the directories a COPY creates or writes through (symlinks of the
image followed inside its root), and heredocs with variables.

Every owner is root's in single mode (all such a sandbox can represent).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nsbox.dockerfile import BuildError, build, build_image
from nsbox.storage import Store

from tests.conftest import MODE
from .test_build import busybox, context, debian, name, sh  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)

QUIET = {"network": "none", "progress": lambda _: None}


@pytest.mark.parametrize("chmod", ["-1", "77777777777", "10000", "0o755", "+755", "8", "7_55"])
async def test_chmod_outside_0_to_7777_is_refused(tmp_path: Path, name: str, busybox: str, chmod: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY --chmod={chmod} f /f\n", {"f": "f\n"})
    with pytest.raises(BuildError) as e:
        await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    assert str(e.value).startswith("Dockerfile:2 (COPY): --chmod takes an octal mode"), str(e.value)


async def test_chown_and_chmod_reach_the_directories_copy_makes(tmp_path: Path, name: str, busybox: str) -> None:
    """The destination directory of a directory copy gets the source's mode
    (or --chmod) and --chown, as do the parents COPY creates; directories
    the image has keep theirs."""
    single = MODE.mode == "single"
    as_user = "" if single else "USER 1000\nRUN touch /app/new /data/sub/new\nUSER root\n"
    ctx = context(tmp_path, f"""\
FROM {busybox} AS src
RUN mkdir -p /tree/d && chmod 750 /tree && echo t > /tree/d/t
FROM {busybox}
RUN mkdir -m 0711 /existing
COPY --chown=1000:1000 src /app
COPY --chown=1000:1000 . /whole
COPY --chown=1000:1000 f /data/sub/f
COPY --chown=1000:1000 src /existing
COPY --chmod=0700 src /private
COPY empty /made-empty
COPY --from=src --chown=1000:1000 /tree /fromtree
{as_user}""", {"src/x": "x\n", "f": "f\n"})
    (ctx / "empty").mkdir()
    for d in (ctx, ctx / "src", ctx / "empty"):
        d.chmod(0o750)
    for f in (ctx / "src/x", ctx / "f"):
        f.chmod(0o644)
    name = await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    out = await sh(name, "stat -c '%n %u:%g %a' /app /app/x /data /data/sub /data/sub/f /existing /existing/x "
                         "/private /made-empty /fromtree /fromtree/d /whole")
    u = "0:0" if single else "1000:1000"
    assert out.splitlines() == [f"/app {u} 750", f"/app/x {u} 644", f"/data {u} 755", f"/data/sub {u} 755",
                                f"/data/sub/f {u} 644", "/existing 0:0 711", f"/existing/x {u} 644",
                                "/private 0:0 700", "/made-empty 0:0 750", f"/fromtree {u} 750",
                                f"/fromtree/d {u} 755", f"/whole {u} 750"], out


async def test_copy_writes_through_the_images_symlinked_directories(tmp_path: Path, name: str,
                                                                    busybox: str) -> None:
    """A directory COPY follows the image's symlinks to directories (they
    stay symlinks), resolved inside the image's root: one naming a host
    path, absolute or climbing with .., leads to that path in the image,
    never to the host's."""
    host = tmp_path / "host"
    host.mkdir()
    ctx = context(tmp_path, f"""\
FROM {busybox}
RUN mkdir -p /usr/lib2 && echo keep > /usr/lib2/keep && ln -s usr/lib2 /lib2 \\
 && ln -s {host} /evil && ln -s ../../../../..{host}/up /evil2
COPY tree/ /
RUN test -L /lib2 && test -L /evil && test -L /evil2 \\
 && cat /lib2/keep /lib2/new /usr/lib2/sub/deep {host}/x {host}/up/y > /out
""", {"tree/lib2/new": "new\n", "tree/lib2/sub/deep": "deep\n", "tree/evil/x": "x\n", "tree/evil2/y": "y\n"})
    name = await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    assert await sh(name, "cat /out") == "keep\nnew\ndeep\nx\ny\n"
    assert list(host.iterdir()) == []


async def test_copy_into_a_usrmerge_images_lib(tmp_path: Path, name: str, debian: str) -> None:
    ctx = context(tmp_path, f"FROM {debian}\nCOPY tree/ /\nRUN test -L /lib && cat /lib/mytool/cfg > /out\n",
                  {"tree/lib/mytool/cfg": "cfg\n"})
    name = await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    assert await sh(name, "cat /usr/lib/mytool/cfg /out") == "cfg\ncfg\n"


async def test_copy_below_a_file_of_the_image_is_an_error(tmp_path: Path, name: str, busybox: str) -> None:
    """A path through a symlink to a file is not a directory: an error, not
    the file replaced by one."""
    ctx = context(tmp_path, f"FROM {busybox}\nRUN ln -s /etc/passwd /pw\nCOPY tree/ /\n", {"tree/pw/x": "x\n"})
    with pytest.raises(BuildError, match=r"^Dockerfile:3 \(COPY\): cannot write /etc/passwd/x: /etc/passwd is not "
                                         "a directory in the image"):
        await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]


async def test_heredocs_expand_variables_unless_the_delimiter_is_quoted(tmp_path: Path, name: str,
                                                                       busybox: str) -> None:
    """As BuildKit does: the stage's ARG and ENV values, the text's quotes
    kept as written (a single quote does not stop the expansion) and
    escapes applied; a quoted delimiter leaves the text as it is."""
    ctx = context(tmp_path, f"""\
FROM {busybox}
ARG FOO=bar
ENV WHO=world
COPY <<EOF /script.sh
echo "hello ${{FOO}}" '$WHO' \\$HOME ${{NONE:-"un set"}}
EOF
COPY <<"EOF" /quoted.sh
echo "hello ${{FOO}}"
EOF
COPY <<'EOF' <<EOF2 /d/
single $FOO
EOF
two $WHO
EOF2
""")
    files = "cat /script.sh /quoted.sh /d/EOF /d/EOF2"
    name = await build(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    assert await sh(name, files) == ("echo \"hello bar\" 'world' $HOME \"un set\"\n"
                                     "echo \"hello ${FOO}\"\nsingle $FOO\ntwo world\n")
    name = await build(ctx, tag=name, build_args={"FOO": "baz"}, **QUIET)  # type: ignore[arg-type]
    assert (await sh(name, files)).startswith('echo "hello baz"')


async def test_workdir_makes_its_directory(tmp_path: Path, name: str, busybox: str) -> None:
    """As Docker: made even when nothing uses it (a later stage copies it),
    owned by the stage's USER as BuildKit makes it; an existing one gets no
    layer."""
    single = MODE.mode == "single"
    ctx = context(tmp_path, f"""\
FROM {busybox} AS made
WORKDIR /x/y
USER 1000
WORKDIR /home/u
WORKDIR /etc
FROM {busybox}
COPY --from=made /x /copied
COPY --from=made /home/u /u
""")
    result = await build_image(ctx, tag=name, **QUIET)  # type: ignore[arg-type]
    assert await sh(name, "test -d /copied/y && stat -c %u /u") == ("0\n" if single else "1000\n")
    made = await build_image(ctx, tag=name, target="made", **QUIET)  # type: ignore[arg-type]
    history = Store().read_json(made.id)["history"]
    assert [h.get("empty_layer", False) for h in history[-4:]] == [False, True, False, True], history
    assert result.id != made.id


@pytest.mark.parametrize("body, message", [
    ("WORKDIR /etc/passwd\n", "Dockerfile:2 (WORKDIR): /etc/passwd is not a directory in the image"),
    ("COPY --chown=99999999999 Dockerfile /x\n", "Dockerfile:2 (COPY): 99999999999: a uid or gid above 4294967295"),
    ("COPY --chown=1:4294967296 Dockerfile /x\n", "Dockerfile:2 (COPY): 1:4294967296: a uid or gid above"),
])
async def test_what_docker_refuses_is_an_error(tmp_path: Path, name: str, busybox: str, body: str,
                                               message: str) -> None:
    """These had replaced /etc/passwd by a directory and given the file to
    uid 0; Docker refuses them."""
    ctx = context(tmp_path, f"FROM {busybox}\n{body}")
    with pytest.raises(BuildError, match=re.escape(message)):
        await build(ctx, tag=name, no_cache=True, **QUIET)  # type: ignore[arg-type]
