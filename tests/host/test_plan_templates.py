"""Plan templates (nsbox/plan/templates.py) with real sandboxes: a plan
copied from a template is the plan assembled for the sandbox, down to its
packed bytes. (The plan as plain data: tests/unit/plan/test_plan.py.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


async def test_a_plan_from_the_cache_is_the_plan_built_for_the_sandbox(tmp_path) -> None:
    """templates.build builds a plan once per set of inputs, which
    templates.copy copies with each sandbox's layer and hostname: the
    copy equals a plan built for that sandbox, and an input that changes
    the plan is not served the old one."""
    import nsbox
    from nsbox.plan import assemble, procmask, templates

    def fields(plan) -> list[tuple]:
        return [(s.kind, s.what, s.a, s.b, s.c, s.d, s.flags, s.mode, s.slot) for s in plan.steps()]

    def plan_of(sb):  # as Sandbox._create gets it
        inputs = sb._plan_inputs()
        return templates.copy(inputs, sb.id, sb.hostname) or templates.build(inputs, sb._layer, sb.id, sb.hostname)

    templates.cache.clear()
    async with nsbox.Sandbox():
        pass
    assert len(templates.cache) == 1
    async with nsbox.Sandbox(hostname="named") as sb:
        copied = templates.copy(sb._plan_inputs(), sb.id, sb.hostname)
        assert copied is not None
        built = assemble.build(sb._plan_inputs(), sb._layer, sb.id, sb.hostname)
        assert fields(copied) == fields(built)
        assert sb._layer is not None and any(st.a == f"{sb._layer}/upper" for st in copied.steps())
        assert (await sb.exec(["hostname"])).stdout == "named\n"
        # Another input, another plan: a bind, or the /proc masks switched off.
        bound = nsbox.Sandbox(mounts=[nsbox.spec.Bind(str(tmp_path), "/mnt/t")])
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
    from nsbox.plan import assemble, templates

    templates.cache.clear()
    async with nsbox.Sandbox():
        pass
    (template,) = templates.cache.values()
    shape = dict(clone_flags=zygote.clone_flags(template.namespaces), idmaps=template.idmap.how_to_write(),
                 keep_fds=[3, 4, -1, -1], exec_fd=5, envp=[], keep_stdio=False, new_session=True)

    def pack(p) -> bytes:
        return zygote.pack_request(steps=p.steps(), argv=["nsbox-init", p.sandbox_id, *p.init_args], **shape)

    for hostname in (None, "twelve-chars", "short", "a-much-longer-hostname"):
        async with nsbox.Sandbox(hostname=hostname) as sb:
            copy = templates.copy(sb._plan_inputs(), sb.id, sb.hostname)
            assert copy is not None and copy.sandbox_id == sb.id
            packed = copy.packed("key", pack)
            assert (packed is not None) == (len(sb.hostname) == len(sb.id)), sb.hostname
            whole = pack(assemble.build(sb._plan_inputs(), sb._layer, sb.id, sb.hostname))
            assert pack(copy) == whole  # the lazy copy's steps, asked for
            if packed is not None:
                assert packed == whole
                assert sb.id.encode() in packed and templates.ID_MARK.encode() not in packed
            assert (await sb.exec(["hostname"])).stdout == f"{sb.hostname}\n"
    assert "key" in template._packs and template._packs["key"]
