"""RUN: the command in a sandbox on the image built so far, its output
streamed, what it wrote captured as a layer (capture.py).

The sandbox is an ordinary nsbox sandbox whose root is the image's layers
(overlay lower dirs, shared, nothing copied) under a fresh writable layer,
with the step's user, working directory, environment and network.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import NsboxError, UserUnsupported
from ..storage.config import ImageConfig
from ..storage.store import Image, Session
from .capture import Captured, capture
from .errors import BuildError
from .parse import Instruction

SINGLE_HINT = ("single-uid mode maps only your own uid, so a build runs as root only: drop the USER before this "
               "RUN (files still belong to you), or give your user a subordinate id range (see `nsbox doctor`)")
APT_HINT = ("apt drops privileges to user _apt, which single-uid mode cannot map: add "
            "`RUN echo 'APT::Sandbox::User \"root\";' > /etc/apt/apt.conf.d/00nsbox` before apt-get, or give "
            "your user a subordinate id range")
HEREDOC_SCRIPT = "/dev/shm/.nsbox-heredoc"  # a tmpfs: never part of the layer


def argv_of(ins: Instruction, shell: list[str]) -> tuple[list[str], str | None]:
    """(argv, script): the command of a RUN; `script` is a heredoc with a
    shebang, to be written to HEREDOC_SCRIPT and run by its interpreter."""
    if ins.json:
        if not ins.args:
            raise ins.error("RUN [] has no command")
        return list(ins.args), None
    line = ins.args[0] if ins.args else ""
    if ins.heredocs:
        first = ins.heredocs[0]
        if line.strip().lstrip("<-").strip("'\"") == first.name and len(ins.heredocs) == 1:
            # `RUN <<EOF`: the heredoc is the script
            if first.content.startswith("#!"):
                try:
                    interp = shlex.split(first.content.splitlines()[0][2:])
                except ValueError as e:
                    raise ins.error(f"the heredoc's #! line cannot be read: {e}") from None
                if not interp:
                    raise ins.error("the heredoc's #! line names no interpreter")
                return [*interp, HEREDOC_SCRIPT], first.content
            return [*shell, first.content], None
        # `RUN cmd <<EOF`: the shell reads the heredocs itself
        line += "\n" + "".join(f"{h.content}{h.name}\n" for h in ins.heredocs)
    if not line.strip():
        raise ins.error("RUN has no command")
    return [*shell, line], None


async def run_step(ins: Instruction, session: Session, layers: tuple[Path, ...], config: ImageConfig, *,
                   argv: list[str], script: str | None, user: str, workdir: str, env: Mapping[str, str],
                   network: str, output: Callable[[bytes], None]) -> Captured:
    from ..init import streaming
    from ..sandbox import Sandbox

    if not layers:
        raise ins.error("RUN on an empty image (FROM scratch with no files yet): there is no program to run")
    mapping = session.mapping
    # The image built so far (not a stored one). Its /tmp is its own (no
    # tmpfs there, as for every image): what a RUN writes there is kept,
    # and what COPY put there is seen, as with docker build.
    image = Image("(build)", "", "", config, layers, mapping.key)
    box = Sandbox.on_image(image, user=user, workdir=workdir, env=env, network=network,
                           id_mapping="single" if mapping.mode == "single" else "auto", label="nsbox build")
    tail = bytearray()
    try:
        async with box:
            if script is not None:
                await box.write_file(HEREDOC_SCRIPT, script)
            try:
                proc = await box.start_process(argv)
            except (FileNotFoundError, PermissionError) as e:  # not there, not executable
                raise ins.error(f"cannot run {argv[0]}: {e.strerror or e}") from None
            code = None
            async for event in proc:
                if isinstance(event, streaming.Output):
                    output(event.data)
                    tail[:] = (tail + event.data)[-4096:]
                elif isinstance(event, streaming.Exit):
                    code = event.returncode
            if code != 0:
                hint = APT_HINT if mapping.mode == "single" and b"_apt" in tail else None
                raise ins.error(f"the command exited with status {code}: {shlex.join(argv)[:200]}", hint)
            upper = box.upper_dir  # its writable layer: the step's changes
            assert upper is not None
            # What the command left running (a daemon, a process racing the
            # archiver with symlinks or FIFOs) ends with the step, as in
            # Docker, before the layer is read.
            await box.stop()
            return await capture(session, upper)
    except UserUnsupported as e:
        raise ins.error(e.message, SINGLE_HINT if mapping.mode == "single" else e.hint) from None
    except BuildError:
        raise
    except NsboxError as e:
        raise ins.error(str(e)) from None
