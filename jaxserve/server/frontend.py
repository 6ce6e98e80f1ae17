"""The async front end: asyncio request handlers over one engine thread, which drives every replica.

    handler --Engine.submit / submit_abort (thread-safe inbox)--> engine thread: step() while anything runs
    engine thread --loop.call_soon_threadsafe(outputs)--> the RequestGroup of each output (asyncio)

Data parallelism: the engines are the LLM's replicas (`llm.engines`). A new request goes to the replica with
the fewest unfinished sequences, the LLM's rule (`least_loaded`), counted here on the event loop thread from
what was submitted and has not finished yet (a replica's scheduler does not see a submission before its next
step, so its own counts would send a burst of requests to one replica); an abort goes to the replica that
owns the request. The request ids are the server's, unique across replicas. Each round of the engine thread
steps every replica with work: a step dispatches its device work before it reads back the previous one's
tokens, so the replicas' devices run at once. The metrics are summed over the replicas (KV usage: averaged).

The engine thread sleeps on a condition while no replica has anything to do (no busy loop) and is woken by
every submission and abort. An HTTP request's prompts are one RequestGroup: its outputs are cumulative
(the text so far), so the group keeps only the newest of each request and a slow reader gets one bigger
delta instead of a queue. Closing a group before its requests finish (a client gone, a cancelled
handler) aborts them; their blocks are freed at the next step.

A step that raises does not end the thread: the engine recovers (its `_recover`), the requests it had
admitted fail with a StepFailed error (a 500) and are aborted, and the engine serves on; the other replicas'
requests are not touched. `shut_down` stops accepting and fails what is in flight with Unavailable (a 503);
`stop` drains and ends the thread. Should the thread itself end on an error, every request in flight fails
with Unavailable too.

The GIL: the engine thread gives the GIL up several times a step (each dispatch, each wait for the device)
and takes it back from the event loop thread, which is busy while many clients stream; while the engine
thread runs, the switch interval is short (`jaxserve.gil`; restored by `stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from jaxserve import gil
from jaxserve.llm import least_loaded
from jaxserve.request import RequestStatus
from jaxserve.sampling import RequestOutput, SamplingParams
from jaxserve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from jaxserve.engine import Engine

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """An engine step raised while the request was running in it."""


class Unavailable(RuntimeError):
    """The server does not serve requests any more: it is shutting down (the ones in flight are aborted), or
    its engine thread ended."""


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


class AsyncEngine:
    """The replicas' engines (one without data parallelism), stepped by one thread, shared by the asyncio
    handlers of one event loop."""

    def __init__(self, engines: Sequence[Engine], metrics: ServerMetrics) -> None:
        if not engines:
            raise ValueError("AsyncEngine needs at least one engine")
        self.engines = list(engines)
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gil = contextlib.ExitStack()  # the short GIL switch interval while the thread runs
        # Event loop thread only: each request's group; the replica serving each unfinished request and its
        # sequences; each replica's unfinished sequences (what `least_loaded` balances).
        self._groups: dict[str, RequestGroup] = {}
        self._owners: dict[str, tuple[int, int]] = {}
        self._loads = [0] * len(self.engines)
        self._arrivals: dict[str, float] = {}  # request id -> time.monotonic() it arrived
        self._failed: set[str] = set()  # ids failed by a step error: their final output counts as "error"
        self._cond = threading.Condition()
        # Guarded by _cond: work was submitted, the thread must stop, it sleeps, the open groups.
        self._work = False
        self._stopping = False
        self._idle = False
        self._num_groups = 0
        self.accepting = True

    # ---- lifecycle (event loop thread) -----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._gil.enter_context(gil.short_switch_interval())
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shut_down(self) -> None:
        """Stops accepting requests and fails every one in flight with Unavailable (their engine requests
        are aborted)."""
        self.accepting = False
        for group in list(dict.fromkeys(self._groups.values())):
            group.fail(Unavailable("the server is shutting down"))
            group.close()

    async def stop(self) -> None:
        """shut_down, then lets the engine thread apply the aborts and end."""
        self.shut_down()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._gil.close()

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (in any thread but the engine's) until no group is open and the engine thread sleeps
        with nothing to do; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._idle and not self._work and not self._num_groups, timeout)

    # ---- requests (event loop thread) ------------------------------------------------------------

    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int = 1,
    ) -> RequestGroup:
        """Queues one engine request per prompt and waits until the engine took them in; a prompt the
        engine refuses raises its ValueError / TypeError (prefixed with "prompt i: " among several) and
        withdraws the others. stream: changed outputs are delivered (the first token, then every
        stream_interval tokens, and the final one), else only the final ones."""
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if not self.is_running:
            raise Unavailable("the engine thread is not running")
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(ids, self._release)
        with self._cond:
            self._num_groups += 1
        now = time.monotonic()
        futures = []
        for request, prompt in zip(ids, prompts, strict=True):
            self._groups[request] = group
            self._arrivals[request] = now
            replica = least_loaded(self._loads)
            self._owners[request] = (replica, params.n)
            self._loads[replica] += params.n
            futures.append(
                self.engines[replica].submit(prompt, params, request, stream=stream, stream_interval=stream_interval)
            )
        self._wake()
        try:
            for index, future in enumerate(futures):
                try:
                    await asyncio.wrap_future(future)
                except (ValueError, TypeError) as error:
                    raise type(error)(f"prompt {index}: {error}" if len(ids) > 1 else str(error)) from error
        except BaseException:
            for request in ids:  # a refused request has no final output to take its arrival time
                self._arrivals.pop(request, None)
            group.close()
            raise
        return group

    def _release(self, group: RequestGroup, unfinished: list[str]) -> None:
        for request_id in group.request_ids:
            self._groups.pop(request_id, None)
        for request_id in unfinished:
            replica = self._disown(request_id)
            if replica is not None:  # else: it finished, its final output not read yet
                self.engines[replica].submit_abort(request_id)
        with self._cond:
            self._num_groups -= 1
            self._work = self._work or bool(unfinished)
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._work = True
            self._cond.notify_all()

    def _disown(self, request_id: str) -> int | None:
        """Forgets which replica serves the request (its sequences leave that replica's load); that replica,
        None if the request was already forgotten."""
        owner = self._owners.pop(request_id, None)
        if owner is None:
            return None
        replica, sequences = owner
        self._loads[replica] -= sequences
        return replica

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._disown(output.request_id)
            group = self._groups.get(output.request_id)
            if group is not None:
                group.deliver(output)

    def _fail_all(self, error: BaseException) -> None:
        for group in list(dict.fromkeys(self._groups.values())):
            group.fail(error)

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is not None:
                group.fail(error)

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._next_step():
                self._step()
        except BaseException:
            logger.critical("the engine thread ended: the server answers 503 from now on", exc_info=True)
            self._call_in_loop(self._fail_all, Unavailable("the engine thread ended on an error"))
            raise

    def _step(self) -> None:
        """One step of every replica with work; a replica whose step raises recovers alone."""
        outputs: list[RequestOutput] = []
        for engine in self.engines:
            if not engine.has_unfinished():
                continue
            try:
                outputs += engine.step()
            except Exception as error:
                self._recover(engine, error)
        self.metrics.observe_step(self.engines)
        for output in outputs:
            if output.finished:
                reason = "error" if output.request_id in self._failed else None
                self._failed.discard(output.request_id)
                self.metrics.observe_finished(output, self._arrivals.pop(output.request_id, None), reason)
        if outputs:
            self._call_in_loop(self._dispatch, outputs)

    def _next_step(self) -> bool:
        """Sleeps until there is work; False once stopping with nothing left to run."""
        with self._cond:
            while not (self._work or self._stopping or self._has_unfinished()):
                self._idle = True
                self._cond.notify_all()
                self._cond.wait()
            self._idle = False
            self._work = False
            return not self._stopping or self._has_unfinished()

    def _has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.engines)

    def _recover(self, engine: Engine, error: Exception) -> None:
        """After a step of `engine` raised (it has requeued every unfinished request): the requests it had
        admitted fail and are aborted; the ones still waiting to start are served."""
        logger.exception("an engine step failed: its requests get an error, the engine serves on")
        admitted = [r.request_id for r in engine.scheduler.waiting if r.status is not RequestStatus.WAITING]
        failed = list(dict.fromkeys(admitted))
        for request_id in failed:
            self._failed.add(request_id)
            engine.abort(request_id)
        failure = StepFailed(f"an engine step failed: {type(error).__name__}: {error}")
        self._call_in_loop(self._fail_requests, failed, failure)

    def _call_in_loop(self, callback: object, *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)  # type: ignore[arg-type]
        except RuntimeError:  # the loop closed in between
            pass
