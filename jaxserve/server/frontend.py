"""The async front end: asyncio request handlers over an engine driver, which steps every replica.

    handler --backend.submit / abort--> EngineDriver (thread-safe): step() while anything runs
    EngineDriver --events ("step", "failed", "ended")--> AsyncEngine on the event loop --> RequestGroups

The driver runs in one of two places (the backend):
- `EngineThread`: a thread of the server process, over the `LLM` it was given (`make_server(llm, ...)`,
  notebooks, the tests). Its events reach the loop through `call_soon_threadsafe`. The driver and the event
  loop share one GIL: while many clients stream, the loop holds it most of the time and the steps stretch
  (docs/performance.md, "Serving under load"); while the thread runs, the switch interval is short
  (`jaxserve.gil`).
- `jaxserve.server.engine_process.EngineProcess`: a process of its own (what `jaxserve serve` runs, as
  vLLM's engine core), with requests and events over a pipe, so the HTTP front end and the engine each
  have a GIL.

Data parallelism: the engines are the LLM's replicas, which the driver routes to and steps as one
`jaxserve.replicas.ReplicaSet` (the offline API's too): a submission goes to the least loaded replica, an
abort to the replica serving the request, and each round steps every replica with work. The request ids
are the server's, unique across replicas. The metrics are summed over the replicas (KV usage: averaged),
from the `ReplicaStats` each round reports.

The driver (`jaxserve.server.driver`) sleeps while no replica has work, runs LoRA loads and unloads between
two rounds, and survives a failed step. An HTTP request's prompts are one RequestGroup: its outputs are
cumulative (the text so far), so the group keeps only the newest of each request and a slow reader gets one
bigger delta instead of a queue. Closing a group before its requests finish (a client gone, a cancelled handler)
aborts them; their blocks are freed at the next step.

A request the driver cannot serve fails with the driver's StepFailed (a 500: its step raised; the engine serves
on) or Unavailable (a 503: `shut_down` stops accepting and fails what is in flight; `stop` drains and ends the
driver; the driver ending on an error, or the engine process exiting, fails every request in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from jaxserve import gil
from jaxserve.replicas import ReplicaSet, ReplicaStats
from jaxserve.sampling import RequestOutput, SamplingParams
from jaxserve.server.driver import Adapters, EngineDriver, Event, StepFailed, Unavailable
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt); `outputs` yields their newest outputs
    as they change, until every one is finished. `close` aborts the unfinished ones.

    release: called once by `close` with the group and the ids of its unfinished requests."""

    def __init__(self, request_ids: list[str], release: Callable[[RequestGroup, list[str]], None]) -> None:
        self.request_ids = request_ids
        self._release = release
        self._unfinished = set(request_ids)
        self._latest: dict[str, RequestOutput] = {}
        self._changed: dict[str, None] = {}  # ids with an output not yet yielded, in arrival order
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self._closed = False

    @property
    def completed(self) -> bool:
        """Every request finished, and the group did not fail."""
        return not self._unfinished and self._error is None

    def deliver(self, output: RequestOutput) -> None:
        self._latest[output.request_id] = output
        self._changed[output.request_id] = None
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._event.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The newest output of each request that changed since the last one; raises the group's error."""
        while self._unfinished:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            changed, self._changed = list(self._changed), {}
            for request_id in changed:
                output = self._latest[request_id]
                if output.finished:
                    self._unfinished.discard(request_id)
                yield output

    async def finals(self) -> list[RequestOutput]:
        """Every request's final output, in the order of the prompts."""
        async for _ in self.outputs():
            pass
        return [self._latest[request_id] for request_id in self.request_ids]

    def close(self) -> None:
        """Aborts the unfinished requests and forgets the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release(self, [i for i in self.request_ids if i in self._unfinished])


class Backend(Protocol):
    """Where the driver runs, as the front end sees it (EngineThread, EngineProcess)."""

    def start(self, deliver: Callable[[Event], None]) -> None:
        """Starts (on the event loop); the driver's events reach `deliver` on that loop."""

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int,
        lora_name: str | None = None,
    ) -> Awaitable[object]:
        """Resolves once the engine took the request in; raises the ValueError / TypeError that refused it."""

    def abort(self, request_id: str) -> None: ...

    def load_lora(self, name: str, path: str) -> Awaitable[object]:
        """Resolves once the driver has loaded the adapter (`EngineDriver.load_lora`); raises what refused it."""

    def unload_lora(self, name: str) -> Awaitable[object]:
        """Resolves once the driver has unloaded the adapter (`EngineDriver.unload_lora`); raises what refused it."""

    @property
    def is_running(self) -> bool: ...

    async def stop(self) -> None:
        """Lets the driver apply the aborts, drain and end."""


class EngineThread:
    """The driver in a thread of this process, over the replicas of an `LLM` built here (and that LLM's LoRA
    adapters: `adapters`)."""

    def __init__(self, replicas: ReplicaSet, adapters: Adapters | None = None) -> None:
        self.driver = EngineDriver(replicas, self._emit, adapters)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[Event], None] | None = None
        self._thread: threading.Thread | None = None
        self._gil = contextlib.ExitStack()  # the short GIL switch interval while the thread runs

    def start(self, deliver: Callable[[Event], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._deliver = deliver
        self._gil.enter_context(gil.short_switch_interval())
        self._thread = threading.Thread(target=self.driver.run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int,
        lora_name: str | None = None,
    ) -> Awaitable[object]:
        future = self.driver.submit(
            prompt, params, request_id, stream=stream, stream_interval=stream_interval, lora_name=lora_name
        )
        return asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        self.driver.abort(request_id)

    def load_lora(self, name: str, path: str) -> Awaitable[object]:
        return asyncio.wrap_future(self.driver.load_lora(name, path))

    def unload_lora(self, name: str) -> Awaitable[object]:
        return asyncio.wrap_future(self.driver.unload_lora(name))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def stop(self) -> None:
        self.driver.request_stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._gil.close()

    def idle(self) -> bool:
        return self.driver.idle()

    def _emit(self, *event: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self._deliver is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop closed in between
            pass


class AsyncEngine:
    """The front end over one backend (the replicas' engines behind it), shared by the asyncio handlers of
    one event loop. Every method runs on the event loop thread, but `wait_idle`."""

    def __init__(self, backend: Backend, metrics: ServerMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self._groups: dict[str, RequestGroup] = {}  # each request's group
        self._arrivals: dict[str, float] = {}  # request id -> time.monotonic() it arrived
        self._failed: set[str] = set()  # ids failed by a step error: their final output counts as "error"
        self._num_groups = 0  # open groups (read by wait_idle in another thread)
        self._ended = False
        self.accepting = True

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.backend.start(self._on_event)

    @property
    def is_running(self) -> bool:
        return not self._ended and self.backend.is_running

    def shut_down(self) -> None:
        """Stops accepting requests and fails every one in flight with Unavailable (their engine requests
        are aborted)."""
        self.accepting = False
        for group in list(dict.fromkeys(self._groups.values())):
            group.fail(Unavailable("the server is shutting down"))
            group.close()

    async def stop(self) -> None:
        """shut_down, then lets the driver apply the aborts and end."""
        self.shut_down()
        await self.backend.stop()

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (in any thread but the event loop's) until no group is open and the engine thread sleeps
        with nothing to do; False on timeout. Only over an EngineThread (the tests look at its engines)."""
        backend = self.backend
        if not isinstance(backend, EngineThread):
            raise TypeError("wait_idle needs the engine in this process (EngineThread)")
        deadline = time.monotonic() + timeout
        while not (self._num_groups == 0 and backend.idle()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    # ---- requests --------------------------------------------------------------------------------

    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int = 1,
        lora_name: str | None = None,
    ) -> RequestGroup:
        """Queues one engine request per prompt and waits until the engine took them in; a prompt the
        engine refuses raises its ValueError / TypeError (prefixed with "prompt i: " among several) and
        withdraws the others. stream: changed outputs are delivered (the first token, then every
        stream_interval tokens, and the final one), else only the final ones. lora_name: the LoRA adapter
        the requests are served with (None: the base model)."""
        self._check_serving()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(ids, self._release)
        self._num_groups += 1
        now = time.monotonic()
        accepted = []
        for request, prompt in zip(ids, prompts, strict=True):
            self._groups[request] = group
            self._arrivals[request] = now
            accepted.append(
                self.backend.submit(
                    prompt, params, request, stream=stream, stream_interval=stream_interval, lora_name=lora_name
                )
            )
        try:
            for index, done in enumerate(accepted):
                try:
                    await done
                except (ValueError, TypeError) as error:
                    raise type(error)(f"prompt {index}: {error}" if len(ids) > 1 else str(error)) from error
        except BaseException:
            for request in ids:  # a refused request has no final output to take its arrival time
                self._arrivals.pop(request, None)
            group.close()
            raise
        return group

    async def load_lora(self, name: str, path: str) -> None:
        """Loads the PEFT adapter at `path` to serve under `name`, between two engine steps; raises what refused
        it (a ValueError for an adapter the model cannot take)."""
        self._check_serving()
        await self.backend.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        """Unloads an adapter once the requests in flight have finished (new ones wait for it)."""
        self._check_serving()
        await self.backend.unload_lora(name)

    def _check_serving(self) -> None:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if not self.is_running:
            raise Unavailable("the engine is not running")

    def _release(self, group: RequestGroup, unfinished: list[str]) -> None:
        for request_id in group.request_ids:
            self._groups.pop(request_id, None)
        for request_id in unfinished:  # one that finished, its final output not read yet, is not aborted
            self.backend.abort(request_id)
        self._num_groups -= 1

    # ---- the driver's events ---------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        kind = event[0]
        if kind == "step":
            self._on_step(event[1], event[2])
        elif kind == "failed":
            self._on_failed(event[1], event[2])
        elif kind == "ended":
            self._on_ended(event[1])
        else:
            raise ValueError(f"unknown engine event {kind!r}")

    def _on_step(self, outputs: list[RequestOutput], stats: list[ReplicaStats]) -> None:
        self.metrics.observe_step(stats)
        for output in outputs:
            if output.finished:
                reason = "error" if output.request_id in self._failed else None
                self._failed.discard(output.request_id)
                self.metrics.observe_finished(output, self._arrivals.pop(output.request_id, None), reason)
            group = self._groups.get(output.request_id)
            if group is not None:
                group.deliver(output)

    def _on_failed(self, request_ids: list[str], message: str) -> None:
        error = StepFailed(message)
        for request_id in request_ids:
            self._failed.add(request_id)
            group = self._groups.get(request_id)
            if group is not None:
                group.fail(error)

    def _on_ended(self, message: str) -> None:
        """The driver ended (or the engine process exited): every request in flight fails."""
        if self._ended:
            return
        self._ended = True
        error = Unavailable(message)
        for group in list(dict.fromkeys(self._groups.values())):
            group.fail(error)
