"""The provider's exec throttle: Inspect's own subprocess limit
(max_subprocesses), entered without Inspect's event-loop round trip when a
slot is free, and through Inspect's queue when none is."""

from __future__ import annotations

from typing import Iterator

import anyio
import pytest
from inspect_ai.util._concurrency import concurrency_status_display, init_concurrency, subprocess_limiter
from inspect_ai.util._subprocess import max_subprocesses_context_var

from nsbox.inspect import throttle
from nsbox.inspect.throttle import KEY, subprocess_slot

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Inspect's limiter is anyio's, so the free-slot path must hold on
    either backend."""
    return request.param


@pytest.fixture
def limit_of_two() -> Iterator[None]:
    """A fresh Inspect registry (as each eval starts with) and a limit of 2."""
    init_concurrency()
    token = max_subprocesses_context_var.set(2)
    yield
    max_subprocesses_context_var.reset(token)
    init_concurrency()


def in_use() -> int:
    return concurrency_status_display().get(KEY, (0, 0))[0]


async def holder(entered: list[str], name: str, leave: anyio.Event) -> None:
    async with subprocess_slot():
        entered.append(name)
        await leave.wait()


async def start_in_turn(tg: anyio.abc.TaskGroup, entered: list[str], leave: dict[str, anyio.Event],
                        names: str) -> None:
    """A holder for each name, each given time to enter (or queue) before the next."""
    for n in names:
        tg.start_soon(holder, entered, n, leave[n])
        await anyio.sleep(0.01)


async def until_entered(entered: list[str], count: int) -> None:
    with anyio.fail_after(5):
        while len(entered) < count:
            await anyio.sleep(0.005)


@pytest.mark.parametrize("registry_doors", [True, False], ids=["free-slot-path", "without-registry-doors"])
async def test_a_third_command_waits_for_one_of_two_slots(limit_of_two: None, registry_doors: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Also where an Inspect version lacks the registry's private doors:
    every entry then goes through Inspect's concurrency()."""
    if not registry_doors:
        monkeypatch.setattr(throttle, "get_or_create_semaphore", None)
    entered: list[str] = []
    leave = {n: anyio.Event() for n in "abc"}
    async with anyio.create_task_group() as tg:
        await start_in_turn(tg, entered, leave, "abc")
        assert entered == ["a", "b"], "the limit of 2 let a third command in"
        assert in_use() == 2  # Inspect's status display counts them
        leave["a"].set()
        await until_entered(entered, 3)
        assert entered == ["a", "b", "c"]
        leave["b"].set()
        leave["c"].set()
    assert in_use() == 0


async def test_a_free_slot_goes_to_who_queued_first(limit_of_two: None) -> None:
    """A slot freed while a command waits is the waiter's: a command that
    comes just then does not take it first."""
    entered: list[str] = []
    leave = {n: anyio.Event() for n in "abcd"}
    async with anyio.create_task_group() as tg:
        await start_in_turn(tg, entered, leave, "abc")
        leave["a"].set()  # c, queued, is owed a's slot ...
        await anyio.sleep(0)  # ... a leaves
        tg.start_soon(holder, entered, "d", leave["d"])  # d comes before c has run again
        await until_entered(entered, 3)
        await anyio.sleep(0.02)
        assert entered == ["a", "b", "c"], "a newcomer took the slot of a command that queued before it"
        for n in "bcd":
            leave[n].set()
    assert entered == ["a", "b", "c", "d"]
    assert in_use() == 0


async def test_a_slot_is_given_back_when_the_block_raises(limit_of_two: None) -> None:
    for _ in range(3):
        with pytest.raises(RuntimeError):
            async with subprocess_slot():
                assert in_use() == 1
                raise RuntimeError("the command failed")
    assert in_use() == 0


async def test_unthrottled_takes_no_slot(limit_of_two: None) -> None:
    async with subprocess_slot(False), subprocess_slot(False), subprocess_slot(False):
        assert in_use() == 0


async def test_the_control_channel_finds_and_retunes_the_limit(limit_of_two: None) -> None:
    """As after Inspect's own subprocess(): the limiter is registered, and a
    limit lowered to 1 keeps a second command out."""
    async with subprocess_slot():
        pass
    limiter = subprocess_limiter()
    assert limiter is not None and limiter.concurrency == 2
    limiter.concurrency = 1
    entered: list[str] = []
    leave = {n: anyio.Event() for n in "ab"}
    async with anyio.create_task_group() as tg:
        await start_in_turn(tg, entered, leave, "ab")
        assert entered == ["a"], "the retuned limit of 1 let a second command in"
        leave["a"].set()
        leave["b"].set()
    assert entered == ["a", "b"]


async def test_a_free_slot_is_taken_without_a_trip_through_the_event_loop(limit_of_two: None) -> None:
    """What the module is for: Inspect's own entry lets every other ready
    task run first (~0.1 ms of an exec); a free slot here does not."""
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        async with subprocess_slot():
            assert ran == [], "taking a free slot went through the event loop"
        await anyio.sleep(0)
    assert ran == ["other"]
