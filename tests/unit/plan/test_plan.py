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
from nsbox.plan import mounts, plan, rootfs, steps
from nsbox.plan.rootfs import Bind
mapping = idmap.detect()  # this user's: the cached layers the plan names are built for it
out = {}
for name, root in (("host", rootfs.HostRootfs()), ("dir", rootfs.DirectoryRootfs(Path("/srv/image")))):
    p = plan.Plan(mapping, root="")
    mounts.contribute(p, root, Path("/data/sandboxes/x"), Path("/data/mnt/owner"),
                      [Bind("/etc/hostname", "/mnt/hn", readonly=True)])
    plan.contribute_hostname(p, "box")
    plan.contribute_network(p, "none")
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
        assert b is None or b.startswith(("/proc/self/fd/", "/dev", "/tmp", "/run", "/usr", "/mnt")), (kind_, b)
        if kind_ == "MOUNT" and c == "overlay":
            assert "/data" not in d and "/srv" not in d and "userxattr" in d
    # The root is mounted through the mount directory's alias, then entered.
    assert p["root"].startswith("/proc/self/fd/") and p["root"].endswith("/root")
    assert p["steps"][pivot][2] == p["root"]
    proc = [s for s in p["steps"][:pivot] if s[0] == "MOUNT" and s[3] == "proc"]
    assert proc and sorted(proc[0][5]) == ["MS_NODEV", "MS_NOEXEC", "MS_NOSUID"]
    # Inside: hostname, loopback, and the bind attached last of the mounts.
    after = p["steps"][pivot + 1:]
    assert ["HOSTNAME", None, None, None, None, []] != after[-1]
    assert [s for s in after if s[0] == "HOSTNAME"][0][1] == "box"
    assert after[-1][0] == "LOOPBACK_UP"
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


async def test_a_plan_from_the_cache_is_the_plan_built_for_the_sandbox(tmp_path) -> None:
    """Sandbox._plan builds a plan once per set of inputs, which
    _plan_from_template copies with each sandbox's layer and hostname: the
    copy equals a plan built for that sandbox, and an input that changes
    the plan is not served the old one."""
    import nsbox
    from nsbox.plan import procmask
    from nsbox import sandbox as sandbox_mod

    def fields(plan) -> list[tuple]:
        return [(s.kind, s.what, s.a, s.b, s.c, s.d, s.flags, s.mode, s.slot) for s in plan.steps()]

    def plan_of(sb):  # as Sandbox._create gets it
        return sb._plan_from_template() or sb._plan()

    sandbox_mod._plan_templates.clear()
    async with nsbox.Sandbox() as first:
        pass
    assert len(sandbox_mod._plan_templates) == 1
    async with nsbox.Sandbox(hostname="named") as sb:
        copied = sb._plan_from_template()
        assert copied is not None
        mount_dir = nsbox.host.layers.mount_point(sb.idmap.host_root)
        built = sb._build_plan(mount_dir, sb._layer, sb.id, sb.hostname)
        assert fields(copied) == fields(built)
        assert sb._layer is not None and any(st.a == f"{sb._layer}/upper" for st in copied.steps())
        assert (await sb.exec(["hostname"])).stdout == "named\n"
        # Another input, another plan: a bind, or the /proc masks switched off.
        bound = nsbox.Sandbox(mounts=[nsbox.plan.rootfs.Bind(str(tmp_path), "/mnt/t")])
        bound.idmap, bound._layer, bound._rundir, bound.id, bound.hostname = (
            sb.idmap, sb._layer, sb._rundir, sb.id, sb.hostname)
        assert any(st.b == "/mnt/t" for st in plan_of(bound).steps())
        saved = procmask.enabled
        procmask.enabled = False
        try:
            assert not any("/proc/keys" in (st.b or "") for st in plan_of(sb).steps())
        finally:
            procmask.enabled = saved
        assert any("/proc/keys" in (st.b or "") for st in plan_of(sb).steps())


async def test_a_templated_spec_is_the_spec_packed_for_the_sandbox() -> None:
    """A copied plan's spec is its template's, packed once, with the id and
    hostname replaced in the bytes (Plan.packed): byte for byte what
    packing the sandbox's own plan gives. A hostname of another length
    than the id's packs the plan itself."""
    import nsbox
    from nsbox.create import zygote
    from nsbox import sandbox as sandbox_mod

    sandbox_mod._plan_templates.clear()
    async with nsbox.Sandbox():
        pass
    (template,) = sandbox_mod._plan_templates.values()
    shape = dict(clone_flags=zygote.clone_flags(template.namespaces), idmaps=template.idmap.how_to_write(),
                 keep_fds=[3, 4, -1, -1], exec_fd=5, envp=[], keep_stdio=False, new_session=True)

    def pack(p) -> bytes:
        return zygote.pack_spec(steps=p.steps(), argv=["nsbox-init", p.sandbox_id, *p.init_args], **shape)

    for hostname in (None, "twelve-chars", "short", "a-much-longer-hostname"):
        async with nsbox.Sandbox(hostname=hostname) as sb:
            copy = sb._plan_from_template()
            assert copy is not None and copy.sandbox_id == sb.id
            packed = copy.packed("key", pack)
            assert (packed is not None) == (len(sb.hostname) == len(sb.id)), sb.hostname
            whole = pack(sb._build_plan(nsbox.host.layers.mount_point(sb.idmap.host_root), sb._layer, sb.id, sb.hostname))
            assert pack(copy) == whole  # the lazy copy's steps, asked for
            if packed is not None:
                assert packed == whole
                assert sb.id.encode() in packed and sandbox_mod._ID_MARK.encode() not in packed
            assert (await sb.exec(["hostname"])).stdout == f"{sb.hostname}\n"
    assert "key" in template._packs and template._packs["key"]


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
