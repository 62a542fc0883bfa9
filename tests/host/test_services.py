"""The services of one sample (nsbox/compose/services.py), on real sandboxes:
dependency order, the shared network by service name, healthchecks,
completion, and failures that leave nothing behind."""

from __future__ import annotations

import os

import anyio
import psutil
import pytest

import nsbox
from nsbox.spec import Restart
from nsbox.storage.config import ImageConfig
from nsbox.host import live
from nsbox.compose.services import (
    Healthcheck,
    ServiceSpec,
    Services,
    ServicesError,
    compose_deadline,
    start_order,
)

pytestmark = pytest.mark.timeout(90)

SERVER = ["python3", "-c", "import http.server as h, time; time.sleep(0.5); "
          "h.HTTPServer(('127.0.0.1', 8000), h.SimpleHTTPRequestHandler).serve_forever()"]
GET = "import urllib.request as u; print(u.urlopen('http://{}:8000/', timeout=5).status)"


def _leftovers(before: set[str]) -> set[str]:
    """This process's sandboxes made since `before` (others may run tests as the same user)."""
    return {i.id for i in live.entries() if i.owner_pid == os.getpid()} - before


def _spec(**kw: object) -> nsbox.SandboxSpec:
    return nsbox.SandboxSpec(workdir="/tmp", **kw)  # type: ignore[arg-type]


async def test_dependent_waits_for_health_and_reaches_by_name() -> None:
    target = ServiceSpec("target", _spec(), command=SERVER, names=["victim"],
                         healthcheck=Healthcheck.from_test(["CMD-SHELL", "python3 -c \"" + GET.format("127.0.0.1")
                                                             + "\""], interval=1, retries=30))
    attacker = ServiceSpec("default", _spec(), command=["sleep", "infinity"],
                           depends_on={"target": "service_healthy"})
    services = Services([attacker, target])
    assert [s.name for s in services.order] == ["target", "default"]
    sandboxes = await services.start()
    try:
        assert list(sandboxes) == ["default", "target"]  # the project's order: default first
        for name in ("target", "victim"):
            r = await sandboxes["default"].exec(["python3", "-c", GET.format(name)])
            assert r.stdout == "200\n", r
        ps = await sandboxes["default"].exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
        assert "sleep infinity" in ps.stdout and "http.server" not in ps.stdout
    finally:
        await services.close()
    assert not services.sandboxes


async def test_completed_successfully_and_failure() -> None:
    before = {i.id for i in live.entries()}
    ok = Services([ServiceSpec("default", _spec(), command=["true"], depends_on={"setup": "service_completed_successfully"}),
                   ServiceSpec("setup", _spec(), command=["sh", "-c", "sleep 0.2; exit 0"])])
    await ok.start()
    await ok.close()
    bad = Services([ServiceSpec("default", _spec(), depends_on={"setup": "service_completed_successfully"}),
                    ServiceSpec("setup", _spec(), command=["sh", "-c", "echo broken >&2; exit 3"])])
    with pytest.raises(ServicesError, match=r"setup did not complete successfully \(exit status 3\): broken"):
        await bad.start()
    assert not _leftovers(before)


async def test_unhealthy_fails_in_time_and_leaves_nothing() -> None:
    before = {i.id for i in live.entries()}
    children = {p.pid for p in psutil.Process().children()}
    check = Healthcheck.from_test(["CMD", "false"], interval=0.2, retries=2)
    services = Services([ServiceSpec("default", _spec(), depends_on={"db": "service_healthy"}),
                         ServiceSpec("db", _spec(), command=["sleep", "infinity"], healthcheck=check)])
    with pytest.raises(ServicesError, match="service db is unhealthy.*false failed"):
        await services.start()
    assert not _leftovers(before)
    assert {p.pid for p in psutil.Process().children()} <= children
    no_check = Services([ServiceSpec("default", _spec(), depends_on={"db": "service_healthy"}),
                         ServiceSpec("db", _spec())])
    with pytest.raises(ServicesError, match="db has no healthcheck"):
        await no_check.start()
    assert not _leftovers(before)


def test_order_errors() -> None:
    a = ServiceSpec("a", _spec(), depends_on={"b": "service_started"})
    b = ServiceSpec("b", _spec(), depends_on={"a": "service_started"})
    with pytest.raises(ServicesError, match="cycle: a, b"):
        start_order([a, b])
    with pytest.raises(ServicesError, match="depends on c"):
        start_order([ServiceSpec("a", _spec(), depends_on={"c": "service_started"})])
    assert Healthcheck.from_test(["NONE"]) is None
    assert Healthcheck.from_test(["CMD-SHELL", "curl -f x"]).test == ["/bin/sh", "-c", "curl -f x"]  # type: ignore[union-attr]
    assert Healthcheck.from_image({"Test": ["CMD", "true"], "Interval": 2_000_000_000}).interval == 2.0  # type: ignore[union-attr]
    with pytest.raises(ServicesError, match="CMD, CMD-SHELL or NONE"):
        Healthcheck.from_test(["SHELL", "x"])


# ---- ready as `docker compose up --wait` leaves a sample -----------------------

SLOW_SERVER = ["python3", "-c", "import http.server as h, time; time.sleep(0.6); "
               "h.HTTPServer(('127.0.0.1', 8000), h.SimpleHTTPRequestHandler).serve_forever()"]
PROBE = Healthcheck.from_test(["CMD-SHELL", "python3 -c \"" + GET.format("127.0.0.1") + "\""], interval=1, retries=30)


@pytest.mark.once  # the host's wait for healthchecks
@pytest.mark.timeout(180)
async def test_start_waits_for_every_healthcheck_not_only_service_healthy() -> None:
    """The short form `depends_on: [web]` (service_started): start() still
    returns only once web's healthcheck passed, every time."""
    for _ in range(6):
        services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"],
                                         depends_on={"web": "service_started"}),
                             ServiceSpec("web", _spec(), command=SLOW_SERVER, healthcheck=PROBE)])
        sandboxes = await services.start()
        try:
            r = await sandboxes["default"].exec(["python3", "-c", GET.format("web")])
            assert r.stdout == "200\n", r
        finally:
            await services.close()


async def test_a_service_nobody_depends_on_must_get_healthy() -> None:
    before = {i.id for i in live.entries()}
    children = {p.pid for p in psutil.Process().children()}
    check = Healthcheck.from_test(["CMD-SHELL", "echo not yet; exit 1"], interval=0.2, retries=2)
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"]),
                         ServiceSpec("db", _spec(), command=["sleep", "infinity"], healthcheck=check)])
    with pytest.raises(ServicesError, match=r"service db is unhealthy.*exit 1' failed \(exit status 1: not yet\)"):
        await services.start()
    assert not _leftovers(before)
    assert {p.pid for p in psutil.Process().children()} <= children


async def test_a_main_process_that_exits_fails_the_sample() -> None:
    before = {i.id for i in live.entries()}
    crash = ["sh", "-c", "echo cannot listen >&2; exit 4"]
    # The sample takes a second to come up (its default service's probe):
    # the crash is seen at its own check or at the end, however loaded the
    # machine is.
    ready_in_a_second = Healthcheck.from_test(["CMD", "sleep", "1"])
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"], healthcheck=ready_in_a_second),
                         ServiceSpec("web", _spec(), command=crash)])
    with pytest.raises(ServicesError, match=r"service web exited with status 4$"):
        await services.start()
    assert not _leftovers(before)
    # With a healthcheck: at once, not after its retries.
    slow = Healthcheck.from_test(["CMD", "false"], interval=30, retries=3)
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"]),
                         ServiceSpec("web", _spec(), command=crash, healthcheck=slow)])
    with anyio.fail_after(10):
        with pytest.raises(ServicesError, match=r"service web exited with status 4 before it was "
                                                r"healthy \(last probe: exit status 1"):
            await services.start()
    assert not _leftovers(before)
    # A main process that exits 0 is fine (Inspect accepts it), as is none at all.
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"]),
                         ServiceSpec("setup", _spec(), command=["true"]), ServiceSpec("idle", _spec(), command=[])])
    await services.start()
    await services.close()


async def test_a_service_with_a_restart_policy_comes_up_and_back() -> None:
    """A main process that fails twice before it serves brings its sample up
    under `restart: on-failure` (its exits are not the sample's failure, as
    `docker compose up --wait` waits through them), and comes back when a
    sandbox process kills it; on-failure:N gives up after N restarts."""
    flaky = ["sh", "-c", "n=$(( $(cat /tmp/n 2>/dev/null || echo 0) + 1 )); echo $n > /tmp/n; "
                         "[ $n -ge 3 ] || exit 1; exec sleep 1000"]
    ready = Healthcheck.from_test(["CMD-SHELL", "[ $(cat /tmp/n) -ge 3 ]"], interval=0.2, retries=50)
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"]),
                         ServiceSpec("web", _spec(), command=flaky, healthcheck=ready, restart=Restart(on_failure=True))])
    sandboxes = await services.start()
    try:
        web = sandboxes["web"]
        await web.exec(["pkill", "-x", "sleep"])  # exits 143: a failure
        with anyio.fail_after(10):
            while (await web.exec(["cat", "/tmp/n"])).stdout != "4\n":
                await anyio.sleep(0.05)
        assert (await web.exec(["pgrep", "-x", "sleep"])).success
    finally:
        await services.close()
    before = {i.id for i in live.entries()}
    services = Services([ServiceSpec("default", _spec(), command=["sleep", "infinity"]),
                         ServiceSpec("web", _spec(), command=flaky, healthcheck=ready,
                                     restart=Restart(on_failure=True, limit=1))])
    with pytest.raises(ServicesError, match=r"service web exited with status 1 before it was healthy"):
        await services.start()
    assert not _leftovers(before)


def test_compose_deadline_is_inspects() -> None:
    assert compose_deadline([]) == 600
    # Docker's defaults: 3 * (30 + 30), plus Inspect's allowance of 60.
    assert compose_deadline([Healthcheck(["true"])]) == 60 + 180
    check = Healthcheck(["true"], interval=1, timeout=2, retries=5, start_period=10)
    assert compose_deadline([check, Healthcheck(["true"], interval=1, timeout=1, retries=1)]) == 60 + 10 + 2 + 5 * 3


KEEP = """
import anyio, json
from nsbox.compose.services import ServiceSpec, Services
import nsbox

async def main():
    web = ServiceSpec("web", nsbox.SandboxSpec(workdir="/tmp"), command=["sleep", "infinity"])
    services = Services([ServiceSpec("default", nsbox.SandboxSpec(workdir="/tmp"), command=["sleep", "infinity"]), web])
    sandboxes = await services.start()
    for sb in sandboxes.values():
        await sb.detach()
    print(json.dumps({name: sb.id for name, sb in sandboxes.items()}), flush=True)

anyio.run(main)
"""


def test_a_kept_samples_main_processes_outlive_its_process() -> None:
    """Kept (--no-sandbox-cleanup, detached) services still run their main
    process once the process that started them is gone."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", KEEP], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)
    try:
        for sandbox_id in ids.values():
            info = live.read(sandbox_id)
            assert info is not None and info.init_alive
            names = [p.name() for p in psutil.Process(info.init_pid).children(recursive=True)]
            assert "sleep" in names, (sandbox_id, names)
    finally:
        from nsbox import manage

        for sandbox_id in ids.values():
            info = live.read(sandbox_id)
            if info is not None:
                manage.remove(info, force=True)


async def test_a_service_starts_without_waiting_for_unrelated_ones() -> None:
    """default waits for web's health; web's healthcheck needs db, which
    nothing orders: db starts at once, as in Docker (services had started
    one after another, db after default: web never got healthy)."""
    web = ServiceSpec("web", _spec(), command=["sleep", "infinity"], healthcheck=PROBE)
    default = ServiceSpec("default", _spec(), command=["sleep", "infinity"], depends_on={"web": "service_healthy"})
    db = ServiceSpec("db", _spec(), command=SERVER)
    services = Services([default, web, db], wait_limit=30)
    try:
        sandboxes = await services.start()
        r = await sandboxes["default"].exec(["python3", "-c", GET.format("db")])
        assert r.stdout == "200\n", r
    finally:
        await services.close()


@pytest.mark.once  # the host's wait for healthchecks
async def test_a_slow_probe_gets_its_retries() -> None:
    """A probe that takes longer than its interval fails `retries` times
    before the service is unhealthy, as in Docker (the retries had been a
    time budget: one slow probe used it up)."""
    check = Healthcheck.from_test(["CMD-SHELL", "sleep 2; test -f /tmp/ready"], interval=0.5, timeout=10, retries=2)
    ready = ["sh", "-c", "sleep 3; touch /tmp/ready; exec sleep infinity"]
    services = Services([ServiceSpec("default", _spec(), command=ready, healthcheck=check)], wait_limit=30)
    try:
        await services.start()
    finally:
        await services.close()


def test_a_compose_healthcheck_is_merged_over_the_images() -> None:
    """Field by field, as Docker: what the file leaves unset comes from the
    image's HEALTHCHECK, else Docker's defaults."""
    image = {"Test": ["CMD", "test", "-f", "/ready"], "Interval": 1_000_000_000, "Retries": 1}
    check = Healthcheck.merged(None, image, interval=None, timeout=None, retries=20, start_period=None)
    assert check is not None and (check.test, check.interval, check.retries, check.timeout) == (
        ["test", "-f", "/ready"], 1.0, 20, 30.0)
    check = Healthcheck.merged(["CMD", "true"], image, interval=2.0, timeout=None, retries=None, start_period=None)
    assert check is not None and (check.test, check.interval, check.retries) == (["true"], 2.0, 1)
    check = Healthcheck.merged(["CMD", "true"], None, interval=None, timeout=None, retries=None, start_period=None)
    assert check is not None and (check.interval, check.timeout, check.retries, check.start_period) == (30.0, 30.0, 3, 0.0)
    assert Healthcheck.merged(None, None, interval=5.0, timeout=None, retries=None, start_period=None) is None
    # A shell command runs in the image's SHELL, as Docker runs it.
    bash = ["/bin/bash", "-o", "pipefail", "-c"]
    check = Healthcheck.merged(["CMD-SHELL", "curl -f localhost | grep ok"], None, bash, interval=None, timeout=None,
                               retries=None, start_period=None)
    assert check is not None and check.test == [*bash, "curl -f localhost | grep ok"]
    check = Healthcheck.from_image({"Test": ["CMD-SHELL", "true"]}, bash)
    assert check is not None and check.test == [*bash, "true"]
    assert ImageConfig.parse({"config": {"Shell": bash}, "rootfs": {"diff_ids": []}}).shell == bash
