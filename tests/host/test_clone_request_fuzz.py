"""nsbox-create, the zygote, under requests it must refuse; and what it hands
to the programs it runs.

The zygote (csrc/create/) lives as long as its owner and parses every
request with nsbox_clone_request_unpack (csrc/common/clone_request.c). A
malformed, truncated or oversized request must be refused (an EINVAL reply, or silence when no
socket came to reply on), and must never crash or hang it or leave memory
or descriptors behind. Besides: failed system calls in the sandbox's first
process reach the host as a stage on the error pipe, the setuid
newuidmap/newgidmap get none of the zygote's descriptors, and the kernel
constants Python puts in a request come from the C headers.

Some tests run a zygote of their own under a seccomp filter that makes one
system call fail, or kills the zygote when it makes it: from outside, that
is the only way to reach those paths.
"""

from __future__ import annotations

import array
import contextlib
import errno
import json
import os
import platform
import random
import select
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nsbox
from nsbox.create import zygote
from nsbox.plan import steps as nsteps
from nsbox.create.zygote import ffi, lib
from nsbox.host.idmap import IdMaps

# --- the wire format of csrc/common/clone_request.c -------------------------------------------------

# struct header and struct wire_step, field by field.
HEADER = struct.Struct("=10Ii9IQ")
FIELDS = ("magic", "nsteps", "argc", "envc", "nkeep", "keep_present", "has_exec_fd", "has_go_fd", "keep_stdio",
          "new_session",
          "lock_slot", "lock_uid_map", "lock_gid_map", "uid_map", "gid_map", "newuidmap", "newgidmap",
          "deny_setgroups", "strtab_len", "host_go", "clone_flags")
STEP = struct.Struct("=iiI4xQQQ4I")
OFFSET = struct.Struct("=I")
NONE = 0xFFFFFFFF  # the offset of a NULL string
MAGIC = 0x6E73626F
STRING_FIELDS = ("lock_uid_map", "lock_gid_map", "uid_map", "gid_map", "newuidmap", "newgidmap")

NAMESPACES = (zygote.CLONE_NEWNS | zygote.CLONE_NEWCGROUP | zygote.CLONE_NEWUTS | zygote.CLONE_NEWIPC
              | zygote.CLONE_NEWUSER | zygote.CLONE_NEWPID | zygote.CLONE_NEWNET)
# clone flags that would make the child share the zygote's memory, files or
# root, make the zygote wait for it, or need pointers the request cannot give.
FOREIGN_CLONE_FLAGS = {
    "CLONE_VM": 0x100, "CLONE_FS": 0x200, "CLONE_FILES": 0x400, "CLONE_SIGHAND": 0x800, "CLONE_PIDFD": 0x1000,
    "CLONE_PTRACE": 0x2000, "CLONE_VFORK": 0x4000, "CLONE_PARENT": 0x8000, "CLONE_THREAD": 0x10000,
    "CLONE_SETTLS": 0x80000, "CLONE_PARENT_SETTID": 0x100000, "CLONE_CHILD_SETTID": 0x1000000,
    "CLONE_NEWTIME": 0x80, "CLONE_INTO_CGROUP": 1 << 33, "bit 63": 1 << 63,
}

UID_MAP = f"0 {os.getuid()} 1\n"
GID_MAP = f"0 {os.getgid()} 1\n"
DIRECT_MAPS = IdMaps(UID_MAP, GID_MAP, deny_setgroups=True)


def pack(*, steps: Sequence[nsteps.Step] | None = None, clone_flags: int = zygote.CLONE_NEWUSER | zygote.CLONE_NEWNS,
         argv: Sequence[str] = ("nsbox-init", "box"), envp: Sequence[str] = ("A=b",),
         keep_fds: Sequence[int] = (5, 6, -1, -1), has_exec: bool = True, keep_stdio: bool = False,
         new_session: bool = True, lock_maps: tuple[str, str] | None = ("0 0 1\n", "0 0 1\n"), lock_slot: int = 2,
         idmaps: IdMaps = DIRECT_MAPS, has_go: bool = False,
         host_go: bool = False) -> bytes:
    """A request as nsbox/create/zygote.py packs it (the memfd's bytes)."""
    if steps is None:
        steps = [
            nsteps.mkdir("/a"), nsteps.hostname("box"), nsteps.become_root(),
            nsteps.mount("tmpfs", "/t", "tmpfs", {"MS_NOSUID"}, "size=1m", "mount /t"),
            nsteps.tree_clone("/usr", 0, "clone /usr", recursive=True, readonly=True),
        ]
    memfd = zygote.request_memfd(steps=steps, clone_flags=clone_flags, argv=argv, envp=envp, keep_fds=keep_fds,
                                 exec_fd=0 if has_exec else -1, keep_stdio=keep_stdio, new_session=new_session,
                                 lock_maps=lock_maps, lock_slot=lock_slot, idmaps=idmaps,
                                 go_fd=0 if has_go else -1, host_go=host_go)
    try:
        return os.pread(memfd, os.fstat(memfd).st_size, 0)
    finally:
        os.close(memfd)


class Parts:
    """A packed request taken apart, to be changed and put together again with
    consistent counts and lengths (so that the checks past them are reached)."""

    def __init__(self, data: bytes) -> None:
        self.h: dict[str, int] = dict(zip(FIELDS, HEADER.unpack_from(data)))
        p = HEADER.size
        self.steps = [list(STEP.unpack_from(data, p + i * STEP.size)) for i in range(self.h["nsteps"])]
        p += self.h["nsteps"] * STEP.size
        offs = [OFFSET.unpack_from(data, p + 4 * i)[0] for i in range(self.h["argc"] + self.h["envc"])]
        self.argv, self.envp = offs[: self.h["argc"]], offs[self.h["argc"]:]
        self.strtab = data[p + 4 * len(offs):]
        assert len(self.strtab) == self.h["strtab_len"], "the test's idea of the wire format is out of date"

    def bytes(self, **header: int) -> bytes:
        h = dict(self.h, nsteps=len(self.steps), argc=len(self.argv), envc=len(self.envp),
                 strtab_len=len(self.strtab))
        h.update(header)
        return (HEADER.pack(*(h[f] for f in FIELDS)) + b"".join(STEP.pack(*s) for s in self.steps)
                + b"".join(OFFSET.pack(o) for o in self.argv + self.envp) + self.strtab)


def with_header(data: bytes, **fields: int) -> bytes:
    """data with header fields replaced, and nothing else changed."""
    h = dict(zip(FIELDS, HEADER.unpack_from(data)))
    h.update(fields)
    return HEADER.pack(*(h[f] for f in FIELDS)) + data[HEADER.size:]


def leaky_request() -> bytes:
    """A request consistent in every length, refused only after unpack has
    allocated its arrays (a large argv, its last offset out of range)."""
    p = Parts(pack())
    p.argv = [0] * 65535 + [len(p.strtab) + 5]
    return p.bytes()


REQUEST_SIZE = ffi.sizeof("struct nsbox_clone_request")


def unpack(data: bytes, buf: Any = None) -> tuple[int, Any, Any]:
    """nsbox_clone_request_unpack on a copy of data, into a request filled
    with garbage."""
    if buf is None:
        buf = ffi.new("char[]", max(len(data), 1))
        ffi.memmove(buf, data, len(data))
    req = ffi.new("struct nsbox_clone_request *")
    ffi.memmove(req, b"\xa5" * REQUEST_SIZE, REQUEST_SIZE)
    return lib.nsbox_clone_request_unpack(buf, len(data), req), req, buf


def check(data: bytes) -> int:
    """Unpacks data; a refusal must be -EINVAL and leave the request zeroed, an
    acceptance must give a request whose every pointer lies in the buffer and
    that the zygote can use as it is. Returns unpack's result."""
    rc, req, buf = unpack(data)
    if rc != 0:
        assert rc == -errno.EINVAL
        assert bytes(ffi.buffer(req)) == bytes(REQUEST_SIZE), "a refused request must be left zeroed"
        return rc
    try:
        check_accepted(data, req, buf)
    finally:
        lib.nsbox_clone_request_free(req)
    assert bytes(ffi.buffer(req)) == bytes(REQUEST_SIZE)
    return rc


def check_accepted(data: bytes, req: Any, buf: Any) -> None:
    lo = int(ffi.cast("uintptr_t", buf))
    hi = lo + len(data)

    def string(p: Any, optional: bool = True) -> bytes | None:
        if p == ffi.NULL:
            assert optional, "a required string is missing"
            return None
        at = int(ffi.cast("uintptr_t", p))
        assert lo <= at < hi, "a string points outside the request"
        text = bytes(ffi.buffer(p, hi - at))
        assert b"\0" in text, "a string runs past the end of the request"
        return text[: text.index(b"\0")]

    h = dict(zip(FIELDS, HEADER.unpack_from(data)))
    assert req.clone_flags & ~NAMESPACES == 0
    assert req.nsteps == h["nsteps"] <= 4096
    for i in range(req.nsteps):
        s = req.steps[i]
        for p in (s.a, s.b, s.c, s.d):
            string(p)
    for vec, n in ((req.argv, h["argc"]), (req.envp, h["envc"])):
        for i in range(n):
            string(vec[i], optional=False)
        assert vec[n] == ffi.NULL
    assert h["argc"] >= 1
    assert 0 <= req.nkeep <= 4
    assert all(req.keep_fds[i] in (0, -1) for i in range(req.nkeep))
    assert req.exec_fd in (0, -1) and req.go_fd in (0, -1) and req.sync_fd == req.error_fd == -1
    assert req.host_go in (0, 1) and (req.go_fd == 0 or req.host_go == 0)
    string(req.uid_map, optional=False)
    string(req.gid_map, optional=False)
    assert (string(req.newuidmap) is None) == (string(req.newgidmap) is None)
    lock = string(req.lock_uid_map)
    assert (lock is None) == (string(req.lock_gid_map) is None)
    if lock is not None:
        assert 0 <= req.lock_slot and req.lock_slot + 1 < req.nkeep
        assert req.keep_fds[req.lock_slot] == req.keep_fds[req.lock_slot + 1] == -1


# --- nsbox_clone_request_unpack, called directly -----------------------------------------------


@pytest.mark.timeout(60)
def test_a_packed_request_round_trips() -> None:
    data = pack()
    rc, req, buf = unpack(data)
    assert rc == 0
    try:
        check_accepted(data, req, buf)
        assert [ffi.string(req.argv[i]) for i in range(2)] == [b"nsbox-init", b"box"]
        assert ffi.string(req.envp[0]) == b"A=b" and req.envp[1] == ffi.NULL
        assert req.nsteps == 5 and ffi.string(req.steps[1].a) == b"box" and req.steps[1].b == ffi.NULL
        assert req.steps[3].flags == zygote.MS_NOSUID
        assert req.steps[4].attr_set == zygote.MOUNT_ATTR_RDONLY and req.steps[4].flags == zygote.AT_RECURSIVE
        assert req.clone_flags == zygote.CLONE_NEWUSER | zygote.CLONE_NEWNS
        assert list(req.keep_fds) == [0, 0, -1, -1] and req.nkeep == 4 and req.exec_fd == 0
        assert req.lock_slot == 2 and ffi.string(req.lock_uid_map) == b"0 0 1\n"
        assert ffi.string(req.uid_map) == UID_MAP.encode() and req.newuidmap == ffi.NULL
        assert (req.new_session, req.keep_stdio, req.deny_setgroups) == (1, 0, 1)
        assert lib.nsbox_clone_request_fds(req) == 5  # error pipe, sync pipe, program, two kept descriptors
        assert req.go_fd == -1
    finally:
        lib.nsbox_clone_request_free(req)
    rc, req, buf = unpack(pack(has_go=True))
    assert rc == 0
    try:
        assert req.go_fd == 0 and lib.nsbox_clone_request_fds(req) == 6  # and the sync pipe's write end
        assert req.host_go == 0
    finally:
        lib.nsbox_clone_request_free(req)
    rc, req, buf = unpack(pack(has_go=True, host_go=True))
    assert rc == 0
    try:
        assert req.go_fd == 0 and req.host_go == 1 and lib.nsbox_clone_request_fds(req) == 6
    finally:
        lib.nsbox_clone_request_free(req)
    # Without the zygote's go there is only the host's: the flag is not packed.
    assert Parts(pack(host_go=True)).h["host_go"] == 0


def accepted_requests() -> dict[str, bytes]:
    return {
        "sandbox": pack(),
        "no lock, no program, no steps": pack(steps=[], lock_maps=None, has_exec=False, keep_fds=()),
        "go from the zygote": pack(has_go=True),
        "go from the zygote and the host": pack(has_go=True, host_go=True),
        "newuidmap": pack(idmaps=IdMaps(UID_MAP, GID_MAP, "/usr/bin/newuidmap", "/usr/bin/newgidmap")),
        "lock in slots 0 and 1": pack(keep_fds=(-1, -1), lock_slot=0),
        "every namespace": pack(clone_flags=NAMESPACES),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(accepted_requests()))
def test_well_formed_requests_are_accepted(name: str) -> None:
    assert check(accepted_requests()[name]) == 0


def refused_requests() -> dict[str, bytes]:
    good = pack()
    p = Parts(good)
    cases: dict[str, bytes] = {
        "empty": b"",
        "short header": good[: HEADER.size - 1],
        "header only": good[: HEADER.size],
        "bad magic": with_header(good, magic=0x6E73626E),
        "truncated by one byte": good[:-1],
        "one byte too many": good + b"\0",
        "string table not NUL-terminated": good[:-1] + b"x",
        "string table length 2**32-1": with_header(good, strtab_len=0xFFFFFFFF),
        "every count at its maximum, short": with_header(good, nsteps=4096, argc=65536, envc=65536),
        "nsteps 2**32-1": with_header(good, nsteps=0xFFFFFFFF),
        "5 kept descriptors": p.bytes(nkeep=5),
        "host go without the zygote's": p.bytes(host_go=1),
        "host go 2": Parts(pack(has_go=True)).bytes(host_go=2),
        "host go 2**32-1": Parts(pack(has_go=True)).bytes(host_go=0xFFFFFFFF),
        "no argv": _with(p, argv=[]),
        "argc 65537": _with(p, argv=[0] * 65537),
        "4097 steps": _with(p, steps=[p.steps[0]] * 4097),
        "argv[0] NULL": _with(p, argv=[NONE, p.argv[1]]),
        "argv[1] NULL": _with(p, argv=[p.argv[0], NONE]),
        "envp[0] NULL": _with(p, envp=[NONE]),
        "argv offset past the strings": _with(p, argv=[p.argv[0], len(p.strtab)]),
        "envp offset 2**32-2": _with(p, envp=[NONE - 1]),
        "step string past the strings": _with(p, steps=[p.steps[0][:-4] + [len(p.strtab)] * 4, *p.steps[1:]]),
        "no uid map": p.bytes(uid_map=NONE),
        "no gid map": p.bytes(gid_map=NONE),
        "uid map past the strings": p.bytes(uid_map=len(p.strtab)),
        "newuidmap without newgidmap": p.bytes(newuidmap=p.h["uid_map"]),
        "newgidmap without newuidmap": p.bytes(newgidmap=p.h["uid_map"]),
        "lock uid map without gid map": p.bytes(lock_gid_map=NONE),
        "lock gid map without uid map": p.bytes(lock_uid_map=NONE),
        "lock slot -1": p.bytes(lock_slot=-1),
        "lock slot -2**31": p.bytes(lock_slot=-(2 ** 31)),
        "lock slot 3 (its second descriptor past nkeep)": p.bytes(lock_slot=3),
        "lock slot 100": p.bytes(lock_slot=100),
        "lock slot 2**31-1": p.bytes(lock_slot=2 ** 31 - 1),
        "lock slot 2 with nkeep 3": p.bytes(nkeep=3),
        "lock slot on a kept descriptor": p.bytes(lock_slot=1),
        "lock slot 0 with nothing kept": p.bytes(nkeep=0, keep_present=0, lock_slot=0),
    }
    for name, flag in FOREIGN_CLONE_FLAGS.items():
        cases[f"clone flag {name}"] = p.bytes(clone_flags=p.h["clone_flags"] | flag)
    return cases


def _with(p: Parts, **changes: Any) -> bytes:
    q = Parts(p.bytes())
    for k, v in changes.items():
        setattr(q, k, v)
    return q.bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(refused_requests()))
def test_malformed_requests_are_refused_and_leave_the_request_zeroed(name: str) -> None:
    assert check(refused_requests()[name]) == -errno.EINVAL


def vm_kib(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.timeout(60)
def test_refusals_free_what_unpack_allocated() -> None:
    # Each refusal of this request used to leak its 512 KiB argv array.
    data = leaky_request()
    buf = ffi.new("char[]", data)
    assert unpack(data, buf)[0] == -errno.EINVAL
    before = vm_kib("self", "VmData")
    for _ in range(200):
        assert unpack(data, buf)[0] == -errno.EINVAL
    assert vm_kib("self", "VmData") - before < 16 * 1024


# Hypothesis: random bytes, and valid requests mutated at random and at the
# values where bounds checks go wrong.
FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BASES = list(accepted_requests().values())
U32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 4095, 4096, 4097, 65535, 65536, 65537, 0x7FFFFFFF,
                                 0x80000000, NONE - 1, NONE]), st.integers(0, NONE))
I32 = st.one_of(st.sampled_from([-(2 ** 31), -2, -1, 0, 1, 2, 3, 4, 5, 2 ** 31 - 1]),
                st.integers(-(2 ** 31), 2 ** 31 - 1))
U64 = st.one_of(st.sampled_from([0, NAMESPACES, *(NAMESPACES | f for f in FOREIGN_CLONE_FLAGS.values())]),
                st.integers(0, 2 ** 64 - 1))


@pytest.mark.timeout(60)
@FUZZ
@given(st.one_of(st.binary(max_size=600), st.binary(max_size=600).map(lambda b: OFFSET.pack(MAGIC) + b)))
def test_random_bytes(data: bytes) -> None:
    check(data)


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(BASES), st.lists(st.tuples(st.integers(0, 2 ** 20), st.integers(0, 255)), max_size=8),
       st.one_of(st.none(), st.integers(0, 2 ** 20)))
def test_mutated_bytes(base: bytes, edits: list[tuple[int, int]], cut: int | None) -> None:
    data = bytearray(base)
    for at, value in edits:
        data[at % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 2)]
    check(bytes(data))


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(BASES), st.sampled_from(FIELDS[1:]), st.data(), st.booleans())
def test_mutated_header_fields(base: bytes, field: str, data: st.DataObject, consistent: bool) -> None:
    value = data.draw(I32 if field == "lock_slot" else U64 if field == "clone_flags" else U32)
    if not consistent:
        check(with_header(base, **{field: value}))
        return
    # The counts and lengths follow the field, within reason, so the checks
    # past the length check are reached too.
    p = Parts(base)
    if field == "nsteps" and value <= 5000:
        p.steps = (p.steps or [list(STEP.unpack(bytes(STEP.size)))]) * value
        p.steps = p.steps[:value]
    elif field in ("argc", "envc") and value <= 70000:
        vec = [0] * value
        setattr(p, "argv" if field == "argc" else "envp", vec)
    elif field == "strtab_len" and value <= 1 << 16:
        p.strtab = (p.strtab + bytes(value))[:value]
    else:
        check(p.bytes(**{field: value}))
        return
    check(p.bytes())


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(BASES), st.data())
def test_mutated_offsets(base: bytes, data: st.DataObject) -> None:
    p = Parts(base)
    n = len(p.strtab)
    value = data.draw(st.one_of(U32, st.sampled_from([n - 2, n - 1, n, n + 1])).map(lambda v: v % 2 ** 32))
    where = data.draw(st.sampled_from(["header", "step", "argv", "envp"]))
    if where == "header":
        p.h[data.draw(st.sampled_from(STRING_FIELDS))] = value
    elif where == "step" and p.steps:
        p.steps[data.draw(st.integers(0, len(p.steps) - 1))][-1 - data.draw(st.integers(0, 3))] = value
    elif where == "argv":
        p.argv[data.draw(st.integers(0, len(p.argv) - 1))] = value
    elif p.envp:
        p.envp[data.draw(st.integers(0, len(p.envp) - 1))] = value
    check(p.bytes())


# The same under a memory checker: tests/clone_request_fuzz_harness.c, built with
# AddressSanitizer and UndefinedBehaviorSanitizer, sees reads past the buffer
# and leaks that need not crash or show here.
CSRC = Path(__file__).resolve().parents[2] / "csrc"
HARNESS = Path(__file__).resolve().parents[1] / "clone_request_fuzz_harness.c"


def mutants(rng: random.Random, count: int) -> Iterator[bytes]:
    """Valid requests, each changed in one of the ways the tests above change them."""
    bases = [Parts(b) for b in accepted_requests().values()]
    for _ in range(count):
        p = Parts(rng.choice(bases).bytes())
        how = rng.randrange(5)
        if how == 0:
            data = bytearray(p.bytes())
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)
        elif how == 1:
            data = p.bytes()
            yield data[: rng.randrange(len(data) + 2)]
        elif how == 2:
            field = rng.choice(FIELDS[1:])
            value = rng.choice([0, 1, 2, 3, 4, 5, 4097, 65537, 0x7FFFFFFF, 0x80000000, NONE, rng.randrange(2 ** 32)])
            if field == "lock_slot":
                value = rng.choice([-(2 ** 31), -1, 0, 1, 2, 3, 4, 2 ** 31 - 1])
            elif field == "clone_flags":
                value = rng.choice([rng.randrange(2 ** 64),
                                    NAMESPACES | rng.choice(list(FOREIGN_CLONE_FLAGS.values()))])
            yield with_header(p.bytes(), **{field: value})
        elif how == 3:
            n = len(p.strtab)
            value = rng.choice([n - 2, n - 1, n, n + 1, NONE - 1, NONE, rng.randrange(2 ** 32)])
            vec = rng.choice([v for v in (p.argv, p.envp) if v])
            vec[rng.randrange(len(vec))] = value
            yield p.bytes()
        else:
            yield rng.randbytes(rng.randrange(HEADER.size * 2))


@pytest.mark.once  # the parser alone, built with sanitizers: no sandbox
@pytest.mark.timeout(60)
def test_unpack_under_a_memory_checker(tmp_path: Path) -> None:
    if not (CSRC / "common" / "clone_request.c").is_file():
        pytest.skip("needs the C sources (csrc/)")
    harness = tmp_path / "harness"
    cc = os.environ.get("CC") or "cc"
    build = subprocess.run(
        [*cc.split(), "-std=gnu11", "-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=all", f"-I{CSRC}", os.fspath(HARNESS), os.fspath(CSRC / "common" / "clone_request.c"), "-o",
         os.fspath(harness)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"cannot build with sanitizers: {build.stderr.strip()[-300:]}")
    inputs = [*mutants(random.Random(7), 20000), leaky_request(), pack(), b""]
    corpus = b"".join(OFFSET.pack(len(d)) + d for d in inputs)
    run = subprocess.run([harness], input=corpus, capture_output=True, timeout=50)
    if b"LeakSanitizer has encountered a fatal error" in run.stderr:  # no ptrace here: leaks go unchecked
        run = subprocess.run([harness], input=corpus, capture_output=True, timeout=50,
                             env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-3000:]
    counts = run.stdout.split()
    assert counts[0] == b"accepted" and int(counts[1]) > 100 and int(counts[3]) > 10000


# --- the zygote process --------------------------------------------------------------


def memfd_with(data: bytes, size: int | None = None) -> int:
    fd = os.memfd_create("nsbox-test-request", os.MFD_CLOEXEC)
    os.write(fd, data)
    if size is not None:
        os.ftruncate(fd, size)
    return fd


def send(zsock: socket.socket, fds: Sequence[int], payload: bytes = b"s") -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    zsock.sendmsg([payload], anc)


def answer(ours: socket.socket, timeout: float = 10) -> tuple[int, int, int, int] | None:
    """The zygote's reply on ours, or None if it closed it without one."""
    if not select.select([ours], [], [], timeout)[0]:
        raise TimeoutError("the zygote did not answer")
    data, fds, _, _ = socket.recv_fds(ours, zygote.REPLY.size + lib.NSBOX_ZYGOTE_MSG_MAX, 4)
    for fd in fds:
        os.close(fd)
    assert not fds, "a refusal carries no descriptor"
    return zygote.REPLY.unpack_from(data) if data else None


REFUSAL = (-1, errno.EINVAL, lib.NSBOX_ZYGOTE_REQUEST, 0)


def request(zsock: socket.socket, fds: Sequence[int], payload: bytes = b"s") -> tuple[int, int, int, int] | None:
    """Sends fds after a fresh reply socket; returns the reply."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with theirs:
            send(zsock, [theirs.fileno(), *fds], payload)
        return answer(ours)


def refused(zsock: socket.socket, packed: bytes | int, *more: int) -> None:
    """A request with this clone request (bytes for a memfd, or a descriptor) is refused."""
    fd = memfd_with(packed) if isinstance(packed, bytes) else packed
    try:
        assert request(zsock, [fd, *more]) == REFUSAL
    finally:
        if isinstance(packed, bytes):
            os.close(fd)


def idle_fds(pid: int) -> list[str]:
    """The zygote's descriptors once it is done with what it was sent. (It
    replies before it closes a request's descriptors, so a reply alone does
    not say they are closed.) Idle, it holds 0-2 and its socket, 3."""
    deadline = time.monotonic() + 5
    while True:
        fds = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
        if fds == ["0", "1", "2", "3"] or time.monotonic() > deadline:
            return fds
        time.sleep(0.01)


def malformed_request(zsock: socket.socket, rng: random.Random, good: bytes, leaky: bytes) -> None:
    """One malformed request of a random kind. None of them has the error
    pipe a well-formed request requires, so none can make the zygote clone."""
    kind = rng.randrange(13)
    if kind == 0:  # no descriptor: nowhere to reply, silence
        send(zsock, [], rng.randbytes(rng.randrange(1, 64)))
    elif kind == 1:  # a reply socket and no request
        assert request(zsock, []) == REFUSAL
    elif kind == 2:
        refused(zsock, rng.randbytes(rng.randrange(0, 300)))
    elif kind == 3:
        refused(zsock, good[: rng.randrange(len(good))])
    elif kind == 4:  # well-formed, but the descriptors it names are missing
        refused(zsock, good)
    elif kind == 5:
        data = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        refused(zsock, bytes(data))
    elif kind == 6:  # refused only after unpack allocated (see leaky_request)
        refused(zsock, leaky)
    elif kind == 7:  # not a regular file
        r, w = os.pipe()
        try:
            refused(zsock, r)
        finally:
            os.close(r)
            os.close(w)
    elif kind == 8:  # more descriptors than the zygote takes: silence
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            send(zsock, [null] * 20)
        finally:
            os.close(null)
    elif kind == 9:
        refused(zsock, with_header(good, nsteps=rng.choice([4097, 0xFFFFFFFF, 0x80000000])))
    elif kind == 10:  # more descriptors than the request names
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            refused(zsock, good, *[null] * 8)
        finally:
            os.close(null)
    elif kind == 11:  # the first descriptor is no socket: silence
        fd = memfd_with(good)
        try:
            send(zsock, [fd, fd])
        finally:
            os.close(fd)
    else:  # the reply socket's other end is gone: silence
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.close()
        with theirs:
            send(zsock, [theirs.fileno()])


@pytest.mark.timeout(60)
async def test_the_zygote_survives_malformed_requests() -> None:
    zsock = zygote._zygote_socket()
    pid = zygote.zygote_pid()
    assert pid is not None
    rng = random.Random(20240611)
    good, leaky = pack(), leaky_request()
    for _ in range(200):  # its allocator settles
        malformed_request(zsock, rng, good, leaky)
    assert request(zsock, []) == REFUSAL  # it has read everything sent so far
    assert idle_fds(pid) == ["0", "1", "2", "3"]
    rss, data = vm_kib(pid, "VmRSS"), vm_kib(pid, "VmData")
    for _ in range(2000):
        malformed_request(zsock, rng, good, leaky)
    assert request(zsock, []) == REFUSAL
    assert zygote.zygote_pid() == pid
    assert idle_fds(pid) == ["0", "1", "2", "3"]
    assert vm_kib(pid, "VmData") - data < 1024
    assert vm_kib(pid, "VmRSS") - rss < 1024
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["true"])).returncode == 0
    assert zygote.zygote_pid() == pid


# A zygote of our own, optionally under a seccomp filter.
SYSCALLS = {  # audit architecture, then system call numbers
    "x86_64": (0xC000003E, {"setsid": 112, "rt_sigprocmask": 14, "sendmsg": 46, "wait4": 61}),
    "aarch64": (0xC00000B7, {"setsid": 157, "rt_sigprocmask": 135, "sendmsg": 211, "wait4": 260}),
}
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
WRAPPER = textwrap.dedent("""
    import ctypes, json, os, struct, sys
    sock, status, arch, rules, program = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                          json.loads(sys.argv[4]), sys.argv[5])
    if rules:
        # ld arch; jeq arch ? next : allow; ld nr; (jeq nr ? next : skip; ret action)*; allow
        ALLOW = 0x7FFF0000
        code = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, ALLOW), (0x20, 0, 0, 0)]
        for nr, action in rules:
            code += [(0x15, 0, 1, nr), (0x06, 0, 0, action)]
        code.append((0x06, 0, 0, ALLOW))
        prog = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *c) for c in code))
        fprog = struct.pack("@HP", len(code), ctypes.addressof(prog))  # struct sock_fprog
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0):  # no_new_privs; seccomp
            os.write(status, os.strerror(ctypes.get_errno()).encode())
            sys.exit(1)
    os.write(status, b"ok")
    os.close(status)
    os.dup2(sock, 3)
    os.execv(program, ["nsbox-create"])
""")


@contextlib.contextmanager
def own_zygote(rules: dict[str, int] | None = None) -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    """An nsbox-create child of this process; `rules` maps system calls it
    makes to seccomp actions."""
    if rules and platform.machine() not in SYSCALLS:
        pytest.skip(f"no system call numbers for {platform.machine()}")
    arch, numbers = SYSCALLS.get(platform.machine(), (0, {}))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    status_r, status_w = os.pipe()  # the wrapper says "ok", or why not
    try:
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", WRAPPER, str(theirs.fileno()), str(status_w), str(arch),
                 json.dumps([(numbers[name], action) for name, action in (rules or {}).items()]),
                 os.fsdecode(zygote.CREATE_HELPER)],
                pass_fds=[theirs.fileno(), status_w], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    finally:
        os.close(status_w)
    with open(status_r, "rb") as f:
        status = f.read()
    if status != b"ok":
        ours.close()
        proc.wait()
        pytest.skip(f"cannot install a seccomp filter: {status.decode()}")
    try:
        yield ours, proc
    finally:
        ours.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn_true(zsock: socket.socket, *, idmaps: IdMaps = DIRECT_MAPS,
               new_session: bool = False) -> tuple[int, bytes]:
    """Has the zygote clone a child into a new user namespace that execs
    /bin/true; waits for it. Returns its exit status and its error report."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    memfd = -1
    try:
        memfd = zygote.request_memfd(clone_flags=zygote.CLONE_NEWUSER, steps=[], idmaps=idmaps, keep_fds=[],
                                     exec_fd=-1, argv=["/bin/true"], envp=[], keep_stdio=True,
                                     new_session=new_session)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        with ours:
            with theirs:
                send(zsock, [theirs.fileno(), memfd, err_w, go_r])
            os.close(err_w)
            os.close(go_r)
            err_w = -1
            try:
                if not select.select([ours], [], [], 10)[0]:
                    raise TimeoutError("the zygote did not answer")
                try:
                    pid, pidfd = zygote.read_spawn_reply(ours)
                except zygote.IdMapError as e:
                    os.waitpid(e.pid, 0)  # killed by the zygote; ours to reap
                    raise
                try:
                    os.write(go_w, b"g")
                except BrokenPipeError:
                    pass  # the child failed before it waited: its report says why
            finally:
                os.close(go_w)
            os.close(pidfd)
        report = b""
        while chunk := os.read(err_r, 64):
            report += chunk
        return os.waitpid(pid, 0)[1], report
    finally:
        if memfd >= 0:
            os.close(memfd)
        os.close(err_r)
        if err_w >= 0:
            os.close(err_w)


@pytest.mark.timeout(60)
def test_own_zygote_works() -> None:
    # What the tests below rely on: a zygote of our own clones, unfiltered
    # and filtered.
    with own_zygote() as (zsock, _):
        assert spawn_true(zsock) == (0, b"")
    with own_zygote({"setsid": SECCOMP_RET_ERRNO | errno.EPERM}) as (zsock, proc):
        assert spawn_true(zsock) == (0, b"")
    assert proc.returncode == 0


@pytest.mark.timeout(60)
def test_a_request_without_descriptors_gets_no_reply() -> None:
    # There is no socket to reply on: the zygote must not try (it used to
    # reply on an uninitialised descriptor number). Here sending anything
    # kills it.
    with own_zygote({"sendmsg": SECCOMP_RET_KILL_PROCESS}) as (zsock, proc):
        for payload in (b"s", b"x" * 100, b"\0"):
            send(zsock, [], payload)
        zsock.close()  # EOF: the zygote exits
        assert proc.wait(10) == 0


@pytest.mark.timeout(60)
def test_a_failed_wait_for_the_map_helper_is_an_error() -> None:
    # waitpid failing must not read an uninitialised status (which could
    # pass for the helper's success).
    helpers = IdMaps(UID_MAP, GID_MAP, "/bin/true", "/bin/true")
    with own_zygote({"wait4": SECCOMP_RET_ERRNO | errno.ECHILD}) as (zsock, _):
        with pytest.raises(zygote.IdMapError) as e:
            spawn_true(zsock, idmaps=helpers)
    assert e.value.errno == errno.ECHILD


@pytest.mark.timeout(60)
@pytest.mark.parametrize("syscall, err, stage, new_session", [
    ("setsid", errno.EPERM, "NSBOX_SETUP_SESSION", True),
    ("rt_sigprocmask", errno.EINVAL, "NSBOX_SETUP_SIGNALS", False),
])
def test_failed_setup_calls_are_reported(syscall: str, err: int, stage: str, new_session: bool) -> None:
    with own_zygote({syscall: SECCOMP_RET_ERRNO | err}) as (zsock, _):
        status, report = spawn_true(zsock, new_session=new_session)
    assert report, f"{syscall} failed and the child went on"
    assert struct.unpack("=ii", report) == (getattr(lib, stage), err)
    assert os.waitstatus_to_exitcode(status) == 1


@pytest.mark.timeout(60)
def test_a_reply_socket_that_is_full_does_not_block_the_zygote() -> None:
    with own_zygote() as (zsock, _):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs:
            theirs.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    theirs.send(b"x" * 1024)
            theirs.setblocking(True)  # O_NONBLOCK belongs to the file, which the zygote shares
            send(zsock, [theirs.fileno()])  # its refusal cannot be sent now
            assert request(zsock, [], b"s") == REFUSAL  # the next request is served all the same


@pytest.mark.timeout(60)
def test_an_oversized_request_is_refused_unread() -> None:
    with own_zygote() as (zsock, proc):
        fd = memfd_with(pack(), size=256 << 20)  # sparse: costs nothing until read
        try:
            assert request(zsock, [fd]) == REFUSAL
        finally:
            os.close(fd)
        assert vm_kib(proc.pid, "VmHWM") < 32 * 1024


# --- what the zygote and newuidmap/newgidmap inherit ---------------------------------


@pytest.mark.timeout(60)
def test_the_zygote_inherits_nothing_but_its_socket() -> None:
    # Python's own descriptors are close-on-exec, but a process may have
    # inherited others that are not.
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        zygote._zygote_socket(restart=True)
        pid = zygote.zygote_pid()
        assert pid is not None
        assert idle_fds(pid) == ["0", "1", "2", "3"]
    finally:
        os.close(r)
        os.close(w)


FAKE_HELPER = """#!{python} -I
import json, os, sys
fds = {{}}
for name in os.listdir("/proc/self/fd"):
    try:
        fds[name] = os.readlink("/proc/self/fd/" + name)
    except FileNotFoundError:  # the listing's own descriptor
        pass
with open({out!r}, "w") as f:
    json.dump({{"fds": fds, "argv": sys.argv[1:], "env": dict(os.environ)}}, f)
sys.stderr.write("fake helper refuses")
sys.exit(1)
"""


@pytest.mark.timeout(60)
def test_the_map_helper_gets_no_descriptor_of_the_zygote(tmp_path: Path) -> None:
    # newuidmap/newgidmap are setuid root: of the zygote's descriptors (its
    # own socket among them) they must get none, only /dev/null and the pipe
    # that carries their complaint.
    out = tmp_path / "seen.json"
    helper = tmp_path / "fake-newuidmap"
    helper.write_text(FAKE_HELPER.format(python=sys.executable, out=os.fspath(out)))
    helper.chmod(0o755)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        with pytest.raises(zygote.IdMapError) as e:
            zygote.spawn(clone_flags=zygote.CLONE_NEWUSER, steps=[], error_fd=err_w, keep_fds=[], exec_fd=-1,
                         idmaps=IdMaps(UID_MAP, GID_MAP, os.fspath(helper), os.fspath(helper)),
                         argv=["/bin/true"], envp=[], keep_stdio=True, new_session=False)
        os.waitpid(e.value.pid, 0)  # the pid is an attribute of its own, not smuggled in as a file name
        assert e.value.filename is None
    finally:
        os.close(err_r)
        os.close(err_w)
    assert e.value.message == "fake helper refuses"
    seen = json.loads(out.read_text())
    assert sorted(seen["fds"]) == ["0", "1", "2"], seen["fds"]
    assert seen["fds"]["0"] == seen["fds"]["1"] == "/dev/null"
    assert seen["fds"]["2"].startswith("pipe:")
    assert seen["argv"][1:] == UID_MAP.split()
    assert set(seen["env"]) <= {"LC_CTYPE"}  # Python's own locale coercion


# --- constants ---------------------------------------------------------------------------

CONSTANTS = ["CLONE_NEWNS", "CLONE_NEWCGROUP", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWUSER", "CLONE_NEWPID",
             "CLONE_NEWNET", "MS_RDONLY", "MS_NOSUID", "MS_NODEV", "MS_NOEXEC", "MS_BIND", "MS_REC", "MS_PRIVATE",
             "AT_RECURSIVE", "MOUNT_ATTR_RDONLY", "MOUNT_ATTR_NOSUID", "MOUNT_ATTR_NODEV", "MOUNT_ATTR_NOEXEC"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CONSTANTS)
def test_kernel_constants_come_from_the_c_headers(name: str) -> None:
    assert getattr(zygote, name) == getattr(lib, name)


@pytest.mark.timeout(60)
def test_kernel_constants_agree_with_pythons() -> None:
    assert (zygote.MS_RDONLY, zygote.MS_NOSUID, zygote.MS_NODEV, zygote.MS_NOEXEC) == (
        os.ST_RDONLY, os.ST_NOSUID, os.ST_NODEV, os.ST_NOEXEC)
    for name in ("CLONE_NEWNS", "CLONE_NEWUSER", "CLONE_NEWPID", "CLONE_NEWNET"):
        if hasattr(os, name):  # Python 3.12
            assert getattr(zygote, name) == getattr(os, name)
