"""The engine driver: one thread's loop that steps every replica of a `ReplicaSet` while any has work, and reports
each round as events (the front end, `jaxserve.server.frontend`, turns them into HTTP responses).

    submit / abort / call (thread-safe) --> EngineDriver.run: step() while anything runs --> emit(*event)

The driver sleeps on a condition while no replica has anything to do (no busy loop) and is woken by every
submission, abort and call.

LoRA adapters are loaded and unloaded on the driver's side, between two rounds (`EngineDriver.call`, through the
`LLM`'s own methods, so its bookkeeping stays whole). The engines change adapters that requests may be using only
when idle (an unload, a load with several replicas): such a call, once refused, waits until the requests in flight
have finished, and the submissions and aborts that arrive meanwhile are held back until it has run, so that a
steady stream of requests cannot keep it waiting.

A step that raises does not end the driver: the engine recovers (its `_recover`), the requests it had
admitted fail with a StepFailed error (a 500) and are aborted (`ReplicaSet.abort_admitted`), and the engine
serves on; the other replicas' requests are not touched. The front end's `shut_down` stops accepting and fails
what is in flight with Unavailable (a 503); `stop` drains and ends the driver. Should the driver itself end on an
error (or the engine process exit), every request in flight fails with Unavailable too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from jaxserve.bench import step_summary
from jaxserve.replicas import ReplicaSet, StepFailure
from jaxserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An event of the driver, as the front end receives it: ("step", outputs, stats), ("failed", request_ids,
# message) or ("ended", message).
Event = tuple[Any, ...]


class StepFailed(RuntimeError):
    """An engine step raised while the request was running in it."""


class Unavailable(RuntimeError):
    """The server does not serve requests any more: it is shutting down (the ones in flight are aborted), or
    its engine thread ended."""


class Adapters(Protocol):
    """Where the driver loads and unloads LoRA adapters: the `LLM` whose replicas it steps."""

    def load_lora(self, name: str, source: Any, config: Any = None) -> None: ...

    def unload_lora(self, name: str) -> None: ...


@dataclass(slots=True)
class _Call:
    """An action queued for the driver's thread (`EngineDriver.call`) and the future of its result."""

    action: Callable[[], Any]
    future: Future[Any]


class EngineDriver:
    """Steps the replicas' engines while any has work, and reports each round through `emit(*event)`.

    submit / abort / call / request_stop are thread-safe; `run` is the loop (one thread). emit is called from
    the driver's thread, in order: ("step", outputs, stats) after each round with outputs, ("failed",
    request_ids, message) when a step failed and those requests were aborted, ("ended", message) when the
    loop ends on an error. adapters: what `load_lora` / `unload_lora` go through (None: no adapters)."""

    def __init__(self, replicas: ReplicaSet, emit: Callable[..., None], adapters: Adapters | None = None) -> None:
        self.replicas = replicas
        self._emit = emit
        self._adapters = adapters
        self._cond = threading.Condition()
        # Guarded by _cond: work was submitted, the loop must stop, it sleeps.
        self._work = False
        self._stopping = False
        self._idle = False
        # Guarded by _cond: the calls to run between two rounds (the first may be waiting for the replicas to be
        # idle), and while it waits, the submissions and aborts held back until it has run (else None), each
        # with the future a held submission fails with if the loop ends first.
        self._calls: collections.deque[_Call] = collections.deque()
        self._held: list[tuple[Callable[[], None], Future[Any] | None]] | None = None
        # The loop's own time, for the summary it logs when it ends: rounds, seconds stepping and emitting.
        self._rounds = 0
        self._step_seconds = 0.0
        self._emit_seconds = 0.0

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int,
        lora_name: str | None = None,
    ) -> Future[str]:
        """Queues the request on the least loaded replica (see `ReplicaSet.submit`), or holds it back while a
        call waits for the replicas to be idle (see `call`)."""

        def send() -> Future[str]:
            return self.replicas.submit(
                prompt, params, request_id, stream=stream, stream_interval=stream_interval, lora_name=lora_name
            )

        with self._cond:
            if self._held is None:
                future = send()
            else:
                future = Future()
                self._held.append((lambda: _forward(send, future), future))
            self._wake()
        return future

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._held is None:
                self.replicas.submit_abort(request_id)
            else:  # after the submission it may follow, which is held too
                self._held.append((lambda: self.replicas.submit_abort(request_id), None))
            self._wake()

    def call(self, action: Callable[[], T]) -> Future[T]:
        """Runs `action` on the driver's thread between two rounds, in the order of the calls; the future holds
        its result or its error. An action that raises a RuntimeError while requests are unfinished (the
        engines refuse what they do only when idle) runs again once they have finished, and the submissions
        and aborts that arrive meanwhile are held back until it has run."""
        future: Future[T] = Future()
        with self._cond:
            self._calls.append(_Call(action, future))
            self._wake()
        return future

    def _wake(self) -> None:
        """Marks work to do and wakes the loop; the caller holds `_cond`."""
        self._work = True
        self._cond.notify_all()

    def load_lora(self, name: str, path: str) -> Future[None]:
        """Loads the PEFT adapter at `path` to serve under `name` (`LLM.load_lora`), between two rounds."""
        adapters = self._adapters_or_refuse()
        return self.call(lambda: adapters.load_lora(name, path))

    def unload_lora(self, name: str) -> Future[None]:
        """Unloads an adapter (`LLM.unload_lora`) once no request is unfinished."""
        adapters = self._adapters_or_refuse()
        return self.call(lambda: adapters.unload_lora(name))

    def _adapters_or_refuse(self) -> Adapters:
        if self._adapters is None:
            raise ValueError("this engine driver serves no LoRA adapters")
        return self._adapters

    def request_stop(self) -> None:
        """The loop ends once nothing is left to run."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def idle(self) -> bool:
        """Asleep with nothing to do."""
        with self._cond:
            return self._idle and not self._work and not self.replicas.has_unfinished()

    def run(self) -> None:
        try:
            while self._next_step():
                self._run_calls()
                self._step()
        except BaseException as error:
            logger.critical("the engine loop ended: the server answers 503 from now on", exc_info=True)
            self._emit("ended", f"the engine loop ended on an error: {type(error).__name__}: {error}")
            raise
        finally:
            self._fail_calls()
        logger.info("%s", self.summary())

    def summary(self) -> str:
        """The loop's rounds and the steps of each replica since it started, in one line (logged at its end)."""

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        rounds = max(self._rounds, 1)
        parts = [
            f"engine loop: {self._rounds} rounds, per round {1e3 * self._step_seconds / rounds:.2f} ms stepping "
            f"and {1e3 * self._emit_seconds / rounds:.2f} ms sending outputs"
        ]
        for replica, engine in enumerate(self.replicas.engines):
            stats = list(engine.stats)
            steps = step_summary(stats)
            decode_rows = [s.num_seqs for s in stats if s.num_prefill_rows == 0]
            parts.append(
                f"replica {replica}: {steps.num_steps} steps, host {ms(steps.mean_host_ms)} ms "
                f"(dispatch {ms(steps.mean_dispatch_ms)}), decode step {ms(steps.decode_step_ms)} ms, "
                f"{sum(decode_rows) / len(decode_rows) if decode_rows else 0:.1f} rows per decode step"
            )
        return "; ".join(parts)

    def _step(self) -> None:
        """One step of every replica with work; a replica whose step raises recovers alone."""
        start = time.perf_counter()
        stepped = self.replicas.step()
        for failure in stepped.failures:
            self._fail(failure)
        emitting = time.perf_counter()
        self._emit("step", stepped.outputs, self.replicas.stats())
        self._rounds += 1
        self._step_seconds += emitting - start
        self._emit_seconds += time.perf_counter() - emitting

    def _run_calls(self) -> None:
        """The calls queued, in order (see `call`); returns early while the first waits for the replicas to be
        idle. Once none is left, the submissions and aborts held back go to the replicas, in order."""
        while True:
            with self._cond:
                if not self._calls:
                    held, self._held = self._held or [], None
                    for send, _ in held:  # under the lock: an abort that arrives now comes after its submission
                        send()
                    return
                call, waiting = self._calls[0], self._held is not None
            busy = self.replicas.has_unfinished()
            if waiting and busy:
                return
            try:
                result = call.action()
            except RuntimeError as error:
                if busy:  # refused while requests run: tried again once they have finished
                    with self._cond:
                        self._held = [] if self._held is None else self._held
                    return
                call.future.set_exception(error)
            except Exception as error:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)
            with self._cond:
                self._calls.popleft()

    def _fail_calls(self) -> None:
        """When the loop ends: the calls not run and the submissions held back fail with Unavailable."""
        with self._cond:
            calls, self._calls = list(self._calls), collections.deque()
            held, self._held = self._held or [], None
        error = Unavailable("the engine loop ended")
        for call in calls:
            call.future.set_exception(error)
        for _, future in held:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _next_step(self) -> bool:
        """Sleeps until there is work; False once stopping with nothing left to run."""
        with self._cond:
            while not (self._work or self._stopping or self._calls or self.replicas.has_unfinished()):
                self._idle = True
                self._cond.wait()
            self._idle = False
            self._work = False
            return not self._stopping or self.replicas.has_unfinished()

    def _fail(self, failure: StepFailure) -> None:
        """After a replica's step raised (it has requeued every unfinished request): the requests it had
        admitted fail and are aborted; the ones still waiting to start are served."""
        error = failure.error
        logger.error("an engine step failed: its requests get an error, the engine serves on", exc_info=error)
        failed = self.replicas.abort_admitted(failure.replica)
        self._emit("failed", failed, f"an engine step failed: {type(error).__name__}: {error}")


def _forward(send: Callable[[], Future[T]], future: Future[T]) -> None:
    """Sends a held submission and hands its outcome to the future its caller holds; nothing is sent if that
    future was cancelled meanwhile (as the engine adds nothing for a cancelled submission)."""
    if not future.set_running_or_notify_cancel():
        return

    def copy(done: Future[T]) -> None:
        error = done.exception()
        if error is None:
            future.set_result(done.result())
        else:
            future.set_exception(error)

    send().add_done_callback(copy)
