"""Inspect's exec_remote, natively: NsboxExecRemoteProcess streams a
command's output as it is written (no tool server, no polling), and
forward_exec_remote makes Inspect's sandbox proxy reach it."""

from __future__ import annotations

from typing import Any, Protocol

import anyio

from inspect_ai.util import (
    ExecCompleted,
    ExecOutput,
    ExecRemoteAwaitableOptions,
    ExecRemoteProcess,
    ExecRemoteStreamingOptions,
    ExecStderr,
    ExecStdout,
    SandboxEnvironment,
)

from ..init.streaming import Exit, Output, Process, decoder
from .errors import as_inspect_errors


class _Environment(Protocol):
    """What the process needs of its NsboxSandboxEnvironment (not imported:
    the provider imports this module)."""

    def _note_truncation(self, cmd: list[str], stdout_dropped: int, stderr_dropped: int) -> None: ...


class NsboxExecRemoteProcess(ExecRemoteProcess):
    """Inspect's ExecRemoteProcess on an nsbox streaming Process: events come
    as the command writes its output (no tool server, no polling).

    Behaves as Inspect's own: iterable once; ExecStdout/ExecStderr, then
    ExecCompleted; kill() ends iteration after the output written before it,
    without ExecCompleted; cancelling the iteration kills the process;
    write_stdin/close_stdin need stdin_open=True. `pid` is nsbox's number
    for the process (the init does not report the command's pid).
    """

    def __init__(self, env: _Environment, process: Process,
                 options: ExecRemoteStreamingOptions | ExecRemoteAwaitableOptions, cmd: list[str]) -> None:
        # Not ExecRemoteProcess.__init__: it sets up the JSON-RPC transport
        # to the injected tool server that this class does without.
        self._env = env
        self._sandbox = env
        self._process = process
        self._options = options
        self._cmd = cmd
        self._pid = process.id
        self._killed = False
        self._completed = False
        self._iteration_started = False
        self._pending_events: list[ExecOutput] = []
        self._decoders = {"stdout": decoder(), "stderr": decoder()}

    @property
    def pid(self) -> int:
        return self._process.id

    @property
    def process(self) -> Process:
        """The nsbox Process underneath (truncation counts, signal())."""
        return self._process

    def __aiter__(self) -> "NsboxExecRemoteProcess":
        if self._iteration_started:
            raise RuntimeError("ExecRemoteProcess can only be iterated once")
        self._iteration_started = True
        return self

    def _convert(self, event: Output) -> ExecOutput | None:
        if event.dropped:
            p = self._process
            self._env._note_truncation(self._cmd, p.stdout_truncated, p.stderr_truncated)
        text = self._decoders[event.stream].decode(event.data)
        if not text:
            return None
        return ExecStdout(data=text) if event.stream == "stdout" else ExecStderr(data=text)

    def _flush(self) -> list[ExecOutput]:
        """What the decoders held back (an incomplete character at the end)."""
        out: list[ExecOutput] = []
        for stream, dec in self._decoders.items():
            text = dec.decode(b"", final=True)
            if text:
                out.append(ExecStdout(data=text) if stream == "stdout" else ExecStderr(data=text))
        return out

    async def __anext__(self) -> ExecOutput:
        if self._pending_events:
            return self._pending_events.pop(0)
        if self._completed or self._killed:
            raise StopAsyncIteration
        try:
            with as_inspect_errors():
                while True:
                    event = await self._process.__anext__()
                    if isinstance(event, Output):
                        converted = self._convert(event)
                        if converted is not None:
                            return converted
                        continue
                    assert isinstance(event, Exit)
                    if self._killed:  # kill() was called while we waited
                        if self._pending_events:
                            return self._pending_events.pop(0)
                        raise StopAsyncIteration
                    self._completed = True
                    self._pending_events += [*self._flush(), ExecCompleted(exit_code=event.returncode)]
                    return self._pending_events.pop(0)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self.kill()
            raise

    def _check_stdin(self, method: str) -> None:
        if not (isinstance(self._options, ExecRemoteStreamingOptions) and self._options.stdin_open):
            raise RuntimeError(f"{method}() requires stdin_open=True in ExecRemoteStreamingOptions")

    async def write_stdin(self, data: str | bytes) -> None:
        self._check_stdin("write_stdin")
        if self._completed or self._killed:
            raise RuntimeError("Cannot write to stdin: process has terminated")
        try:
            await self._process.write_stdin(data)
        except BrokenPipeError:
            raise RuntimeError("Cannot write to stdin: process has terminated") from None

    async def close_stdin(self) -> None:
        self._check_stdin("close_stdin")
        if self._completed or self._killed:
            return
        await self._process.close_stdin()

    async def kill(self) -> None:
        if self._completed or self._killed:
            return
        self._killed = True
        await self._process.kill()
        for event in self._process.take_output():
            converted = self._convert(event)
            if converted is not None:
                self._pending_events.append(converted)
        self._pending_events += self._flush()


def forward_exec_remote(provider: type[SandboxEnvironment]) -> None:
    """Makes sample code reach `provider`'s own exec_remote (NsboxSandboxEnvironment's).

    Inspect hands samples each environment wrapped in SandboxEnvironmentProxy
    (which records exec events), and the proxy of this Inspect version does
    not forward exec_remote: it runs the base class's, which injects Inspect's
    tool server into the sandbox and polls it. For environments of this
    provider only, the proxy's exec_remote now forwards to the native one;
    every other provider keeps the original. Nothing is changed if the
    proxy defines exec_remote itself (a later Inspect that forwards it).
    """
    try:
        from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy
    except ImportError:
        return
    if "exec_remote" in vars(SandboxEnvironmentProxy):
        return
    original = SandboxEnvironment.exec_remote

    async def exec_remote(self: Any, cmd: list[str], options: Any = None, *, stream: bool = True) -> Any:
        inner = getattr(self, "_sandbox", None)
        if isinstance(inner, provider):
            return await inner.exec_remote(cmd, options, stream=stream)  # type: ignore[call-overload]
        return await original(self, cmd, options, stream=stream)  # type: ignore[call-overload]

    exec_remote.__doc__ = original.__doc__
    exec_remote.__nsbox_forward__ = True  # type: ignore[attr-defined]
    SandboxEnvironmentProxy.exec_remote = exec_remote  # type: ignore[method-assign,assignment]
