"""Users inside a sandbox, looked up in the sandbox's own /etc/passwd; the
default user and working directory of a sandbox, settled as it starts."""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Hashable, Iterator, Sequence

import anyio

from ..errors import OutputLimitExceeded, SandboxSetupError, UserUnsupported

if TYPE_CHECKING:
    from ..host.idmap import IdMap
    from .client import ExecResult, InitClient
    from .protocol import Creds


@dataclass(frozen=True)
class Identity:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, primary gid first
    home: str
    shell: str = "/bin/sh"


ROOT = Identity("root", 0, 0, (0,), "/root")


# The largest /etc/passwd or /etc/group a sandbox's users are looked up in:
# ~15,000 entries. The files are the sandbox's to write, and every exec as
# another user reads and scans them on the host's event loop.
IDENTITY_FILE_MAX = 1 << 20


def _rows(text: str, fields: int) -> Iterator[list[str]]:
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) >= fields:
            yield parts


def lookup(user: str, passwd: str, group: str) -> Identity | None:
    """Resolves a user name or numeric uid, optionally with ":GROUP" (a
    name or gid, as Docker's USER takes it); None if a name is unknown.

    A numeric uid without a passwd entry is allowed, as with docker exec:
    it runs with gid 0 and HOME=/.
    """
    if ":" in user:
        user, _, grp = user.partition(":")
        base = lookup(user, passwd, group)
        gid = _group_id(grp, group)
        if base is None or gid is None:
            return None
        return Identity(base.name, base.uid, gid, (gid,), base.home, base.shell)
    entry = None
    for row in _rows(passwd, 7):
        if (user.isdigit() and row[2] == user) or row[0] == user:
            entry = row
            break
    if entry is None:
        if user.isdigit():
            return Identity(user, int(user), 0, (0,), "/")
        return None
    try:
        name, uid, gid, home, shell = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/", entry[6] or "/bin/sh"
    except ValueError:
        return None
    groups = [gid]
    for row in _rows(group, 4):
        members = row[3].split(",") if row[3] else []
        if name in members:
            try:
                g = int(row[2])
            except ValueError:
                continue
            if g not in groups:
                groups.append(g)
    return Identity(name, uid, gid, tuple(groups), home, shell)


def _group_id(name: str, group: str) -> int | None:
    if name.isdigit():
        return int(name)
    for row in _rows(group, 4):
        if row[0] == name:
            try:
                return int(row[2])
            except ValueError:
                return None
    return None


# lookup_in's answers, by user and a digest of the files (not the files:
# they may be a megabyte each, and change from call to call).
_looked_up: dict[tuple[str, bytes], Identity | None] = {}
LOOKED_UP_MAX = 256


def lookup_in(user: str, files: tuple[bytes, bytes]) -> Identity | None:
    """`user` in the contents of an /etc/passwd and an /etc/group."""
    passwd, group = files
    key = (user, hashlib.sha256(b"%d:" % len(passwd) + passwd + group).digest())
    if key not in _looked_up:
        if len(_looked_up) >= LOOKED_UP_MAX:
            _looked_up.clear()
        _looked_up[key] = lookup(user, passwd.decode(errors="replace"), group.decode(errors="replace"))
    return _looked_up[key]


def check_mapped(identity: Identity, asked: str, mapping: "IdMap") -> None:
    """Raises UserUnsupported if the id mapping cannot represent `identity`."""
    if identity.uid == 0 and identity.gid == 0:
        return
    if mapping.mode == "single":
        raise UserUnsupported(
            f"cannot run as {asked!r} (uid {identity.uid}): this sandbox maps only your own uid, "
            f"because {mapping.reason}")
    top = max(identity.uid, identity.gid, *identity.groups)
    if top >= mapping.size:
        raise UserUnsupported(
            f"cannot run as {asked!r}: id {top} is outside the ids mapped into this sandbox "
            f"(0..{mapping.size - 1})")


def creds(identity: Identity) -> "Creds":
    """What the init is told to run as."""
    # Imported here, as `files` below: looking users up needs no compiled extension.
    from .protocol import Creds

    return Creds(identity.uid, identity.gid, identity.groups)


async def identity_files(client: "InitClient") -> tuple[bytes, bytes]:
    """The sandbox's /etc/passwd and /etc/group, read inside it as root
    (empty where missing)."""
    from . import files

    found: dict[str, bytes | Exception] = {}

    async def read(path: str) -> None:
        try:
            data = await files.read_file(client, creds(ROOT), path, text=False, limit=IDENTITY_FILE_MAX)
            assert isinstance(data, bytes)
            found[path] = data
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            found[path] = b""  # no users: Docker runs such an image as root, and finds no named user
        except OSError as e:  # a FIFO, a socket or a device there ("Not a regular file"): the same
            found[path] = b"" if e.errno == errno.EINVAL else e
        except OutputLimitExceeded:
            found[path] = UserUnsupported(f"cannot look users up in the sandbox's {path}: it is larger than "
                                          f"{IDENTITY_FILE_MAX >> 20} MiB")
        except Exception as e:  # raised below as itself, not in a group
            found[path] = e

    async with anyio.create_task_group() as tg:
        for path in ("/etc/passwd", "/etc/group"):
            tg.start_soon(read, path)
    passwd, group = found["/etc/passwd"], found["/etc/group"]
    for result in (passwd, group):
        if isinstance(result, Exception):
            raise result
    assert isinstance(passwd, bytes) and isinstance(group, bytes)
    return passwd, group


class Users:
    """The users of one running sandbox, looked up in its identity files
    (read again on each lookup; an answer is kept while they stay the same,
    by lookup_in)."""

    async def lookup(self, client: "InitClient", user: str) -> Identity | None:
        return lookup_in(user, await identity_files(client))


# What sandboxes found in their images (keyed by the image's layers, see
# Sandbox._fresh_image_key): the identity files, and the working directories
# that exist, by who opened them.
_image_identity_files: dict[object, tuple[bytes, bytes]] = {}
_image_workdirs: dict[object, bool] = {}
IMAGE_FACTS_MAX = 256


def _remember(cache: dict[object, Any], key: object, value: Any) -> None:
    """cache[key] = value, starting the cache over once it holds IMAGE_FACTS_MAX."""
    if len(cache) >= IMAGE_FACTS_MAX:
        cache.clear()
    cache[key] = value


def known_home(user: str, known: dict[str, str], image: Hashable | None) -> str | None:
    """`user`'s home directory if it is known before the sandbox runs: from
    the identity files nsbox wrote (`known`), or those a sandbox of the same
    image found."""
    files = _image_identity_files.get(image) if image is not None else None
    if known:
        identity = lookup(user, known["passwd"], known["group"])
    elif files is not None:
        identity = lookup_in(user, files)
    else:
        return None
    return identity.home if identity else None


async def default_identity(client: "InitClient", user: str, known: dict[str, str], image: Hashable | None,
                           users: Users, mapping: "IdMap") -> Identity:
    """Who a sandbox's default `user` is: from the identity files nsbox
    wrote (`known`), those a sandbox of the same `image` found, or those it
    has. Raises SandboxSetupError if there is no such user (root is root
    without an entry), UserUnsupported if the mapping cannot represent it."""
    if known:
        # The sandbox was created a moment ago from files we wrote.
        identity = lookup(user, known["passwd"], known["group"])
    elif image is not None:
        files = _image_identity_files.get(image)
        if files is None:
            files = await identity_files(client)
            _remember(_image_identity_files, image, files)
        identity = lookup_in(user, files)
    else:
        identity = await users.lookup(client, user)
    if identity is None:
        if user not in ("root", "0"):
            raise SandboxSetupError(f"user {user!r} does not exist in the sandbox's /etc/passwd")
        identity = ROOT
    check_mapped(identity, user, mapping)
    return identity


async def ensure_workdir(client: "InitClient", workdir: str, identity: Identity, image: Hashable | None,
                         run_as_root: Callable[[Sequence[str]], Awaitable["ExecResult"]]) -> None:
    """Makes sure `workdir` exists for `identity`: created by root where
    missing, like a Dockerfile's WORKDIR, then given to the user. What a
    sandbox of `image` found is remembered for the next ones."""
    seen = (image, workdir, identity) if image is not None else None
    if seen in _image_workdirs:
        return
    try:
        fd, is_dir = await client.open(creds(identity), workdir, os.O_RDONLY)
        os.close(fd)
        if not is_dir:
            raise SandboxSetupError(f"the working directory {workdir} is not a directory")
        if seen is not None:
            _remember(_image_workdirs, seen, True)
    except PermissionError:
        raise SandboxSetupError(f"the working directory {workdir} is not open to {identity.name} (uid {identity.uid})",
                                hint="a root filesystem unpacked by another user (host root, say) has files no id "
                                     "of the sandbox owns: unpack it as yourself, or import it "
                                     "(`nsbox image import`)") from None
    except FileNotFoundError:
        commands = [["mkdir", "-p", "--", workdir]]
        if identity.uid != 0:
            commands.append(["chown", f"{identity.uid}:{identity.gid}", "--", workdir])
        for cmd in commands:
            r = await run_as_root(cmd)
            if not r.success:
                raise SandboxSetupError(f"creating the working directory {workdir} failed: "
                                        f"{(r.stderr or r.stdout).strip()}")
