"""The services of one compose sample, running: one sandbox per service.

- Order: dependencies first (depends_on), else the project's order, whose
  first service is the default one.
- Network, as Docker's ("services"): each service has a network namespace
  of its own, and an address on each of its networks (nsbox.Network, one
  per compose network and sample: eth0, eth1...); it reaches the services
  that share a network with it by their names and aliases on that network,
  and no other. An `internal` network has no outbound access. Samples
  never see each other: their networks are their own (a network a sample
  emptied may serve a later one: _Spares).
- The pod mode (network "none", "nat" or "host", compose/support.py says
  when): the first sandbox created owns the sample's one network
  namespace; every other one joins it (network "container:ID",
  nsbox/plan/plan.py). The services then reach each other by name on
  127.0.0.1, as the containers of a pod do, and two of them cannot listen
  on the same port.
- Each service's main process (its command, or the image's
  Entrypoint/Cmd) runs in the background, as a container's does, and
  outlives this process where the sample is kept; nsbox's init is PID 1
  and reaps. Until the sample is up, the init reports its exit.
- depends_on conditions: service_started (the sandbox runs),
  service_healthy (its healthcheck passed), service_completed_successfully
  (its main process exited 0).
- Ready, as `docker compose up --wait` leaves a sample: start() returns
  once every service with a healthcheck (its own or its image's) passed
  it, and every other one's main process runs (or exited 0, which
  Inspect accepts). A service whose main process exits before it is
  healthy, or exits with another status, or whose probes keep failing,
  fails start() naming it and what its last probe said (or its exit
  status). Waiting has one deadline for the whole sample.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import shlex
import signal
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import anyio

from ..host import idmap
from ..init.client import Channel
from ..errors import NsboxError
from ..plan import netmodes
from ..init import streaming
from ..network import Network
from ..sandbox import Sandbox
from ..spec import Restart, SandboxSpec

# Docker's healthcheck defaults (seconds).
INTERVAL, TIMEOUT, RETRIES = 30.0, 30.0, 3
# How often a probe runs while a dependent waits: Docker waits a whole
# interval before the first probe; a sample should come up in milliseconds.
FAST_PROBE = 0.1
WAIT_LIMIT = 300.0  # default deadline for every dependency of a sample
# Inspect's docker provider gives `compose up --wait` this long without
# healthchecks, and this much beyond the longest healthcheck schedule.
COMPOSE_WAIT, COMPOSE_STARTUP_ALLOWANCE = 600.0, 60.0
# What the host keeps of an awaited main process's output: the tail an error quotes.
MAIN_OUTPUT_LIMIT = 64 * 1024


class ServicesError(NsboxError):
    pass


class Watched:
    """A main process started detached (it outlives this process, as a kept
    sample's services must), whose exit the init reports on `chan` while
    the sample comes up."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        """Its exit status, once it exited (128+N for signal N)."""
        if self._code is None and self.chan.fileno() >= 0:
            closed = self.chan.read_status()
            self._code = self.chan.returncode
            if closed and self._code is None:
                self._code = 128 + signal.SIGKILL  # the sandbox went away under it
        return self._code

    def close(self) -> None:
        self.chan.close()  # the command runs on


@dataclass(frozen=True)
class Healthcheck:
    test: list[str]  # argv to run
    interval: float = INTERVAL
    timeout: float = TIMEOUT
    retries: int = RETRIES
    start_period: float = 0.0

    @classmethod
    def from_test(cls, test: Sequence[str] | str, shell: Sequence[str] = (), **timing: float) -> "Healthcheck | None":
        """From Docker's forms: ["CMD", arg...], ["CMD-SHELL", "cmd"], a bare
        string (shell), or ["NONE"] (None: no healthcheck). A shell command
        runs in the image's SHELL, as Docker runs it, else /bin/sh -c."""
        shell = list(shell) or ["/bin/sh", "-c"]
        if isinstance(test, str):
            return cls([*shell, test], **timing)  # type: ignore[arg-type]
        test = list(test)
        if not test or test[0] == "NONE":
            return None
        if test[0] == "CMD":
            return cls(test[1:], **timing)  # type: ignore[arg-type]
        if test[0] == "CMD-SHELL":
            return cls([*shell, " ".join(test[1:])], **timing)  # type: ignore[arg-type]
        raise ServicesError(f"healthcheck test must start with CMD, CMD-SHELL or NONE, not {test[0]!r}")

    @classmethod
    def from_image(cls, doc: Mapping[str, object] | None, shell: Sequence[str] = ()) -> "Healthcheck | None":
        """From an image config's Healthcheck (durations in nanoseconds)."""
        if not doc or not doc.get("Test"):
            return None
        ns = 1e-9

        def seconds(key: str, default: float) -> float:
            value = doc.get(key)
            return float(value) * ns if isinstance(value, (int, float)) and value > 0 else default

        retries = doc.get("Retries")
        return cls.from_test(doc["Test"], shell, interval=seconds("Interval", INTERVAL),  # type: ignore[arg-type]
                             timeout=seconds("Timeout", TIMEOUT),
                             retries=int(retries) if isinstance(retries, int) and retries > 0 else RETRIES,
                             start_period=seconds("StartPeriod", 0.0))

    @classmethod
    def merged(cls, test: Sequence[str] | None, image: Mapping[str, object] | None, shell: Sequence[str] = (),
               **timing: float | int | None) -> "Healthcheck | None":
        """A compose healthcheck over its image's, field by field, as Docker
        merges them: the test and each timing the file leaves unset (None)
        come from the image's HEALTHCHECK, else Docker's defaults. `shell`:
        the image's SHELL."""
        base = cls.from_image(image, shell) if image else None
        given = {k: v for k, v in timing.items() if v is not None}
        if test:
            own = cls.from_test(test, shell, **given)  # type: ignore[arg-type]
            return own if own is None or base is None else dataclasses.replace(base, test=own.test, **given)
        return None if base is None else dataclasses.replace(base, **given)

    def schedule(self) -> float:
        """The longest a healthcheck can take to decide, as Inspect's docker
        provider reckons it (a probe that starts inside the start period is
        not counted, so one more `timeout` follows it)."""
        grace = self.timeout if self.start_period > 0 else 0.0
        return self.start_period + grace + self.retries * (self.interval + self.timeout)


def compose_deadline(checks: Sequence[Healthcheck]) -> float:
    """How long a sample may take to come up: what Inspect's docker provider
    gives `docker compose up --wait` for these healthchecks (the compose
    file's own; an image's do not count there)."""
    return COMPOSE_STARTUP_ALLOWANCE + max(c.schedule() for c in checks) if checks else COMPOSE_WAIT


@dataclass
class ServiceSpec:
    """One service, as the runtime needs it."""

    name: str
    spec: SandboxSpec
    command: list[str] | None = None  # None: the image's Entrypoint/Cmd
    depends_on: dict[str, str] = field(default_factory=dict)  # name -> condition
    healthcheck: Healthcheck | None = None  # None: the image's, if any
    no_healthcheck: bool = False  # not even the image's (compose's `disable: true`)
    names: list[str] = field(default_factory=list)  # pod mode: what it answers to besides its name (aliases)
    # "services" mode: its networks, each with the names it answers to there
    # (the first carries its outbound traffic); none: its spec's network.
    networks: dict[str, list[str]] = field(default_factory=dict)
    restart: Restart | None = None  # its main process's restart policy


def start_order(services: Sequence[ServiceSpec]) -> list[ServiceSpec]:
    """Dependencies first; otherwise the given order. A cycle or an unknown
    dependency is an error naming it."""
    by_name = {s.name: s for s in services}
    for s in services:
        for dep in s.depends_on:
            if dep not in by_name:
                raise ServicesError(f"service {s.name} depends on {dep}, which is not a service of this project")
    done: list[ServiceSpec] = []
    placed: set[str] = set()
    while len(done) < len(services):
        ready = [s for s in services if s.name not in placed and all(d in placed for d in s.depends_on)]
        if not ready:
            cycle = sorted(s.name for s in services if s.name not in placed)
            raise ServicesError(f"services depend on each other in a cycle: {', '.join(cycle)}")
        done.append(ready[0])
        placed.add(ready[0].name)
    return done


class Services:
    """The running sandboxes of one sample; `await start()`, then `close()`."""

    def __init__(self, services: Sequence[ServiceSpec], *, network: str = "none",
                 networks: Mapping[str, bool] | None = None, wait_limit: float = WAIT_LIMIT) -> None:
        """network: "services" (a namespace per service) or the pod mode's
        one mode; networks: the sample's networks, name -> internal."""
        self.order = start_order(services)
        self.network = network
        self.networks: dict[str, Network] = {}
        self._network_defs = dict(networks or {})
        self.wait_limit = wait_limit
        self.sandboxes: dict[str, Sandbox] = {}
        self._healthy: set[str] = set()
        self._probing: dict[str, anyio.Lock] = {}  # one prober per service, whoever waits for it
        self._started: dict[str, anyio.Event] = {}  # its command started (or it has none)
        # Main processes: with their output where a service waits for their exit.
        self._main: dict[str, "streaming.Process | Watched"] = {}
        self._given = [s.name for s in services]

    def _hosts(self) -> dict[str, str]:
        return {n: "127.0.0.1" for s in self.order for n in (s.name, *s.names)}

    async def start(self) -> dict[str, Sandbox]:
        """Creates every service's sandbox; on failure closes those made and raises.

        The first service's sandbox owns the shared namespaces, so it comes
        first; the others' are then created at once. Each service's command
        starts once its own sandbox exists and its own dependencies'
        conditions hold, whatever the other services wait for (as compose
        starts containers), and then it must get ready."""
        try:
            deadline = anyio.current_time() + self.wait_limit
            first, *rest = self.order
            if self.network == "services":  # nothing shared: every sandbox at once
                await self._start_networks()
                rest = self.order
            else:
                await self._create(first)
            created = {s.name: anyio.Event() for s in rest}
            self._started = {s.name: anyio.Event() for s in self.order}
            failed: list[Exception] = []

            async def create(service: ServiceSpec) -> None:
                await self._create(service)
                created[service.name].set()

            async def bring_up(service: ServiceSpec) -> None:
                if service.name in created:
                    await created[service.name].wait()
                for dep, condition in service.depends_on.items():
                    await self._wait_for(dep, condition, deadline)
                await self._run_command(service)
                self._started[service.name].set()
                await self._wait_ready(service.name, deadline)

            async def guarded(work: Callable[[], Awaitable[None]]) -> None:
                # The first failure is raised as itself, not in a group.
                try:
                    await work()
                except Exception as e:
                    failed.append(e)
                    tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                for service in rest:
                    tg.start_soon(guarded, functools.partial(create, service))
                for service in self.order:
                    tg.start_soon(guarded, functools.partial(bring_up, service))
            if failed:
                raise failed[0]
            # A main process that exited while the others got ready (after
            # its own check) fails the sample too: until start() returns.
            for name, process in self._main.items():
                if process.returncode not in (None, 0):
                    raise ServicesError(await self._exited(name, process))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close()
            raise
        self._stop_watching()
        # The project's order (the default service first), as Inspect wants it.
        return {name: self.sandboxes[name] for name in self._given}

    async def _start_networks(self) -> None:
        """The sample's networks (outbound access to the host's loopback
        where a member asks for it: host-gateway), spare ones first."""
        used = {net for s in self.order for net in s.networks}
        for name in (n for n in self._network_defs if n in used):
            internal = self._network_defs[name]
            host_access = not internal and any(
                netmodes.host_loopback(s.spec) for s in self.order if name in s.networks)
            self.networks[name] = await _spares.take(internal, host_access, self.order[0].spec.id_mapping)

    def _on_networks(self, service: ServiceSpec) -> SandboxSpec:
        """A service's spec in the "services" mode: on its networks, with
        its names on each, or its own mode (none, host) if it has none."""
        spec = service.spec
        if not service.networks:
            return spec
        (first, names), *more = [(self.networks[n], names) for n, names in service.networks.items()]
        # host_loopback: the network's host_access opens it (_start_networks).
        return spec.replace(network=first.spec_value, network_aliases=_aliases(spec, names), host_loopback=False,
                            more_networks={net.spec_value: _aliases(spec, names) for net, names in more})

    async def _create(self, service: ServiceSpec) -> None:
        spec = service.spec
        owner = next(iter(self.sandboxes.values()), None)
        hosts = {**self._hosts(), **spec.hosts}
        if self.network == "services":
            spec = self._on_networks(service)
        elif self.network == "host":
            spec = spec.replace(network="host", hosts=hosts, ports=())
        elif owner is None:
            # Every service's ports are ports of the one shared namespace:
            # the owner publishes them all.
            ports = tuple(p for s in self.order for p in s.spec.ports)
            # So is the host's loopback: open if any service asks for it.
            loopback = self.network == "nat" and any(netmodes.host_loopback(s.spec) for s in self.order)
            spec = spec.replace(network=self.network, hosts=hosts, ports=ports,
                                host_loopback=spec.host_loopback or loopback)
        else:
            spec = spec.replace(network=f"container:{owner.id}", hosts=hosts, ports=())
        sb = Sandbox(spec=spec)
        try:
            await sb.start()
        except NsboxError as e:
            await sb.close()
            raise ServicesError(f"service {service.name}: {e}") from None
        self.sandboxes[service.name] = sb

    async def _run_command(self, service: ServiceSpec) -> None:
        sb = self.sandboxes[service.name]
        command = service.command if service.command is not None else sb.image_command()
        if not command:
            return
        try:
            # With a restart policy the init starts it again as it exits;
            # the sample hears only of an exit after which it does not.
            if self._is_job(service.name):  # its exit status and output are wanted
                self._main[service.name] = await sb.start_process(command, output_limit=MAIN_OUTPUT_LIMIT,
                                                                  restart=service.restart)
            else:  # on its own, but watched until the sample is up
                chan = await sb.spawn(command, watch=True, restart=service.restart)
                assert chan is not None
                self._main[service.name] = Watched(chan)
        except (NsboxError, OSError) as e:
            raise ServicesError(f"service {service.name}: its command {shlex.join(command)} "
                                f"could not start: {e}") from None

    def _service(self, name: str) -> ServiceSpec:
        return next(s for s in self.order if s.name == name)

    def _is_job(self, name: str) -> bool:
        """Another service waits for it to complete (service_completed_successfully)."""
        return any(s.depends_on.get(name) == "service_completed_successfully" for s in self.order)

    async def _wait_for(self, name: str, condition: str, deadline: float) -> None:
        await self._started[name].wait()  # its command started (every condition implies it)
        if condition == "service_started":
            return
        sb = self.sandboxes[name]
        if condition == "service_completed_successfully":
            await self._wait_completed(name, sb, deadline)
        elif condition == "service_healthy":
            await self._wait_healthy(name, sb, deadline)
        else:
            raise ServicesError(f"depends_on {name}: unknown condition {condition!r}")

    async def _wait_completed(self, name: str, sb: Sandbox, deadline: float) -> None:
        process = self._main.get(name)
        if process is None:
            raise ServicesError(f"service {name} has no command to complete (depends_on: "
                                f"service_completed_successfully)")
        assert isinstance(process, streaming.Process)  # started so (_run_command)
        result = None
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            result = await process.wait()
        if result is None:
            raise ServicesError(f"service {name} did not complete within {self.wait_limit:g}s "
                                f"(depends_on: service_completed_successfully)")
        if not result.success:
            tail = (result.stderr or result.stdout).strip()[-200:]
            raise ServicesError(f"service {name} did not complete successfully (exit status "
                                f"{result.returncode}){': ' + tail if tail else ''}")

    def _healthcheck(self, name: str) -> Healthcheck | None:
        """The service's healthcheck: its own, else its image's."""
        service = self._service(name)
        check = service.healthcheck
        image = self.sandboxes[name].image
        if check is None and image is not None and not service.no_healthcheck:
            check = Healthcheck.from_image(image.config.healthcheck, image.config.shell)
        return check

    async def _wait_ready(self, name: str, deadline: float) -> None:
        """As `docker compose up --wait`: healthy if it has a healthcheck,
        else its main process runs (or exited 0)."""
        if self._healthcheck(name) is not None:
            await self._wait_healthy(name, self.sandboxes[name], deadline)
            return
        if self._is_job(name):
            return  # who waits for it says how it ended (_wait_completed)
        process = self._main.get(name)
        if process is not None and process.returncode not in (None, 0):
            raise ServicesError(await self._exited(name, process))

    async def _exited(self, name: str, process: "streaming.Process | Watched") -> str:
        """What a failure says of a service whose main process exited."""
        result = None
        if isinstance(process, streaming.Process):
            with anyio.move_on_after(1):
                result = await process.wait()
        tail = (result.stderr or result.stdout).strip()[-200:] if result is not None else ""
        return f"service {name} exited with status {process.returncode}{': ' + tail if tail else ''}"

    async def _wait_healthy(self, name: str, sb: Sandbox, deadline: float) -> None:
        async with self._probing.setdefault(name, anyio.Lock()):  # the others wait for its verdict
            if name not in self._healthy:
                await self._probe_until_healthy(name, sb, deadline)

    async def _probe_until_healthy(self, name: str, sb: Sandbox, deadline: float) -> None:
        check = self._healthcheck(name)
        process = self._main.get(name)
        if check is None:
            raise ServicesError(f"service {name} has no healthcheck, but another service depends on it with "
                                f"condition service_healthy")
        # Healthy at the first passing probe. Unhealthy, as in Docker, once
        # `retries` probes started after the start period failed, and no
        # sooner than the start period and `retries` intervals (probes run
        # more often than every interval, to be healthy sooner); or at the
        # sample's deadline.
        started = anyio.current_time()
        last, delay, failures = "", FAST_PROBE, 0
        period_end = started + check.start_period
        give_up = min(deadline, period_end + check.retries * check.interval)
        while True:
            probe_start = anyio.current_time()
            try:
                r = await sb.exec(check.test, timeout=check.timeout)
                if r.success:
                    self._healthy.add(name)
                    return
                last = f"exit status {r.returncode}: {(r.stderr or r.stdout).strip()[-200:]}"
            except TimeoutError:
                last = f"the probe timed out after {check.timeout:g}s"
            except NsboxError as e:
                last = str(e)
            if process is not None and process.returncode is not None:  # it will never be healthy
                raise ServicesError(f"{await self._exited(name, process)} before it was healthy "
                                    f"(last probe: {last})")
            failures += probe_start >= period_end
            now = anyio.current_time()
            if now >= deadline or (now >= give_up and failures >= check.retries):
                raise ServicesError(f"service {name} is unhealthy after {now - started:.1f}s: "
                                    f"{shlex.join(check.test)} failed ({last})")
            await anyio.sleep(min(delay, (give_up if now < give_up else deadline) - now))
            delay = min(delay * 1.5, max(check.interval, FAST_PROBE))

    def _stop_watching(self) -> None:
        """The sample is up (or going): the detached main processes run on, unwatched."""
        for name, process in list(self._main.items()):
            if isinstance(process, Watched):
                process.close()
                del self._main[name]

    async def close(self) -> None:
        """Closes every sandbox (in the pod mode the joiners first, the
        network's owner last; else all at once), then the sample's networks."""
        self._stop_watching()
        with anyio.CancelScope(shield=True):
            if self.network == "services":
                async with anyio.create_task_group() as tg:
                    # The sample's networks are its own: its members leave
                    # them at once, in one request each, no one told.
                    for net in self.networks.values():
                        tg.start_soon(net.forget, net.release())
                    for name in list(self.sandboxes):
                        tg.start_soon(self.sandboxes.pop(name).close)
            for name in reversed(list(self.sandboxes)):
                await self.sandboxes.pop(name).close()
        for name in list(self.networks):
            net = self.networks.pop(name)
            with anyio.CancelScope(shield=True):
                await _spares.give(net)


class _Spares:
    """Networks samples emptied, kept for the next samples: making one (a
    network namespace, a bridge, a worker process) costs tens of ms, more
    than the rest of a sample, and an emptied one is as good as new. Kept
    for one event loop at a time (their worker channels wait in it), at
    most LIMIT (they are never more than the most networks in use at once);
    a network with members left (a kept sample's), or whose worker is gone,
    is not. An idle network holds ~1.8 MiB (its namespace, bridge and worker
    process): 64 hold about what 16 did when a worker held ~7.4 MiB."""

    LIMIT = 64

    def __init__(self) -> None:
        self.loop: object = None
        self.nets: list[Network] = []

    async def _this_loop(self) -> None:
        loop = _current_loop()
        if loop is not self.loop:
            nets, self.nets, self.loop = self.nets, [], loop
            for net in nets:
                await net.close()

    async def take(self, internal: bool, host_access: bool, id_mapping: str) -> Network:
        await self._this_loop()
        key = (internal, host_access, idmap.detect(id_mapping))  # type: ignore[arg-type]
        for net in [n for n in self.nets if (n.internal, n.host_access, n.mapping) == key]:
            self.nets.remove(net)
            if net.idle():
                return net
            await net.close()
        net = Network(f"sample-{secrets.token_hex(6)}", internal=internal, host_access=host_access,
                      id_mapping=id_mapping)  # type: ignore[arg-type]
        return await net.start()

    async def give(self, net: Network) -> None:
        await self._this_loop()
        if len(self.nets) < self.LIMIT and net.idle():
            self.nets.append(net)
        else:
            await net.close()


def _current_loop() -> object:
    try:
        import asyncio

        return asyncio.get_running_loop()
    except RuntimeError:  # trio
        import trio

        return trio.lowlevel.current_trio_token()


_spares = _Spares()


def _aliases(spec: SandboxSpec, names: Sequence[str]) -> tuple[str, ...]:
    """The names a member answers to besides its hostname."""
    return tuple(n for n in names if n != spec.hostname)

