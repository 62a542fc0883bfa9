"""A sandbox's plan, checked as plain data: built in a process where the
compiled extension cannot be imported, so the plan modules must not need it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

BUILD = r"""
import json, sys
sys.modules["nsbox._native"] = None  # importing it now fails
from pathlib import Path
from nsbox.host import idmap
from nsbox.plan import assemble, rootfs
from nsbox.spec import SandboxSpec
mapping = idmap.detect()  # this user's: the cached layers the plan names are built for it
spec = SandboxSpec(mounts=("/etc/hostname:/mnt/hn:ro",))
out = {}
for name, root in (("host", rootfs.HostRootfs()), ("dir", rootfs.DirectoryRootfs(Path("/srv/image")))):
    inputs = assemble.Inputs(spec, root, mapping, Path("/data/mnt/owner"), Path("/run/nsbox/x"))
    p = assemble.build(inputs, Path("/data/sandboxes/x"), "x", "box")
    out[name] = {"namespaces": sorted(p.namespaces), "root": p.root,
                 "steps": [[s.kind.name, s.a, s.b, s.c, s.d, sorted(s.flags)] for s in p.steps()]}
print(json.dumps(out))
"""

@pytest.fixture(scope="module")
def plans() -> dict:
    r = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("kind", ["host", "dir"])
def test_plan_order(plans: dict, kind: str) -> None:
    p = plans[kind]
    kinds = [s[0] for s in p["steps"]]
    become, pivot = kinds.index("BECOME_ROOT"), kinds.index("PIVOT")
    # Host paths are opened and cloned before the child becomes sandbox root...
    assert all(k in ("MOUNT", "TREE_CLONE", "PATH_FD") for k in kinds[:become])
    assert kinds.count("BECOME_ROOT") == 1 and become < pivot
    # ...and no later step names a host path: only /proc/self/fd aliases
    # before the pivot, only sandbox paths after it.
    for kind_, a, b, c, d, flags in p["steps"][become + 1:]:
        assert kind_ not in ("PATH_FD", "TREE_CLONE"), kind_
        assert b is None or b.startswith(("/proc/", "/dev", "/tmp", "/run", "/usr", "/mnt")), (kind_, b)
        if kind_ == "MOUNT" and c == "overlay":
            assert "/data" not in d and "/srv" not in d and "userxattr" in d
    # The root is mounted through the mount directory's alias, then entered.
    assert p["root"].startswith("/proc/self/fd/") and p["root"].endswith("/root")
    assert p["steps"][pivot][2] == p["root"]
    proc = [s for s in p["steps"][:pivot] if s[0] == "MOUNT" and s[3] == "proc"]
    assert proc and sorted(proc[0][5]) == ["MS_NODEV", "MS_NOEXEC", "MS_NOSUID"]
    # Inside: the bind attached last of the mounts (over what they made),
    # then the hostname, loopback, and last the masks over /proc.
    after = p["steps"][pivot + 1:]
    named = [s[0] for s in after].index("HOSTNAME")
    mounts_inside = [s for s in after[:named] if s[0] in ("MOUNT", "TREE_ATTACH")]
    assert mounts_inside[-1][:3] == ["TREE_ATTACH", None, "/mnt/hn"], mounts_inside[-1]
    assert after[named][1] == "box" and after[named + 1][0] == "LOOPBACK_UP"
    masks = after[named + 2:]
    assert masks and all(s[0] in ("MOUNT", "REMOUNT") and s[2].startswith("/proc/") for s in masks), masks
    assert "CLONE_NEWNET" in p["namespaces"] and "CLONE_NEWUTS" in p["namespaces"]


def test_host_root_is_nosuid_and_read_only(plans: dict) -> None:
    r = subprocess.run([sys.executable, "-c", BUILD.replace(
        '"steps": [[s.kind.name, s.a, s.b, s.c, s.d, sorted(s.flags)] for s in p.steps()]',
        '"steps": [[s.kind.name, s.a, sorted(s.attr_set)] for s in p.steps() if s.kind.name == "TREE_CLONE"]')],
        capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    clones = {a: attrs for _, a, attrs in json.loads(r.stdout)["host"]["steps"]}
    assert clones["/usr"] == ["MOUNT_ATTR_NOSUID", "MOUNT_ATTR_RDONLY"]
    assert clones["/etc/hostname"] == ["MOUNT_ATTR_RDONLY"]


def test_marks_found_elsewhere_in_a_spec_are_never_patched() -> None:
    """Plan.packed checks once that the marks are all its replacements may
    touch: a packing with bytes that depend on the strings but are not
    them (here, a checksum of them) is refused, and the copy is packed
    whole."""
    import zlib

    from nsbox.host import idmap
    from nsbox.plan import plan as plan_mod, steps

    template = plan_mod.Plan(idmap.detect(), root="", sandbox_id="@aaaaaaaaaa@")
    template.add(plan_mod.Phase.INSIDE, steps.hostname("%bbbbbbbbbb%"), steps.mkdir("/x/@aaaaaaaaaa@"))

    def faithful(p) -> bytes:
        return "\0".join(filter(None, (f for st in p.steps() for f in (st.a, st.b)))).encode()

    def summed(p) -> bytes:
        data = faithful(p)
        return zlib.crc32(data).to_bytes(4, "little") + data

    texts = {"@aaaaaaaaaa@": "0123456789ab", "%bbbbbbbbbb%": "zzzzzzzzzzzz"}
    assert template.replacing(texts, lazy=True).packed("f", faithful) == faithful(template.replacing(texts))
    assert template.replacing(texts, lazy=True).packed("s", summed) is None
    assert template._packs["s"] == b""  # refused once, for good
