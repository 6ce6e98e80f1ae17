"""The data-parallel replicas as one: where a new request goes, and one round of steps over all of them.

Each replica is an `Engine` on its own devices, with its own KV pool, scheduler and prefix cache. Both
drivers use this set: the offline `LLM` (synchronous: `add`, `abort`) and the server's engine driver
(`submit`, `submit_abort` from other threads, applied at the replica's next step).

Routing: a new request goes to the replica with the fewest unfinished sequences routed to it, the lowest
index among equals (`least_loaded`). The set counts what it routed and has not seen finish (a request's
n sequences, from its routing until its final output leaves a step or it is aborted) rather than asking
the replicas' schedulers, which see a submission only at their next step: their counts would send a burst
of submissions to one replica. With several replicas the set names the requests it is not given a name
for, so that ids are unique across them.

Stepping: each round steps every replica with work, in order. A step dispatches its device work before it
reads back the previous one's tokens, so the replicas' devices run at once. A replica whose step raises an
Exception has recovered by itself (`Engine.step` requeues its unfinished requests) and is reported in the
round's failures; the other replicas step on and the driver decides what the failure means (the `LLM`
raises it, the server fails the requests that step had admitted: `abort_admitted`). Anything else (a
KeyboardInterrupt) propagates at once; the outputs of the replicas stepped before it come with the next
round, so that no final output is lost.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxserve.request import RequestStatus
from jaxserve.sampling import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine import Engine, StepStats
    from jaxserve.prompts import Prompt


def least_loaded(loads: Sequence[int]) -> int:
    """The replica a new request goes to, given each replica's unfinished sequences: the fewest, the lowest
    index among equals."""
    return min(range(len(loads)), key=loads.__getitem__)


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's scheduler and KV pool after a round of steps (what the server's metrics read)."""

    running: int
    waiting: int
    kv_usage: float
    queried_tokens: int
    hit_tokens: int
    preemptions: int

    @classmethod
    def of(cls, engine: Engine) -> ReplicaStats:
        scheduler, blocks = engine.scheduler, engine.block_manager
        return cls(
            scheduler.num_running,
            scheduler.num_waiting,
            blocks.usage,
            blocks.stats.queried_tokens,
            blocks.stats.hit_tokens,
            scheduler.num_preemptions,
        )


@dataclass(frozen=True, slots=True)
class StepFailure:
    """A replica whose step raised in a round (it has recovered: its unfinished requests wait to run again)."""

    replica: int
    error: Exception


@dataclass(slots=True)
class Round:
    """What one round of steps gave: the replicas' outputs in replica order, and the steps that raised."""

    outputs: list[RequestOutput]
    failures: list[StepFailure]


@dataclass(frozen=True, slots=True)
class _Route:
    replica: int
    sequences: int


class ReplicaSet:
    """The replicas' engines, routed to and stepped as one (see the module docstring).

    Routing (`add`, `submit`, `abort`, `submit_abort`) is thread-safe; one thread steps (`step`, `drain`)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.engines = list(engines)
        # Reentrant: a stream's finaliser may abort from inside this thread's own routing work.
        self._lock = threading.RLock()
        self._routes: dict[str, _Route] = {}  # every request routed and not yet finished
        self._loads = [0] * len(self.engines)  # each replica's sequences among them
        self._names = itertools.count() if len(self.engines) > 1 else None
        self._carried: list[RequestOutput] = []  # outputs of a round a KeyboardInterrupt cut short

    def __len__(self) -> int:
        return len(self.engines)

    @property
    def loads(self) -> list[int]:
        """Each replica's unfinished sequences routed to it."""
        with self._lock:
            return list(self._loads)

    @property
    def routes(self) -> dict[str, int]:
        """The replica of every request routed and not yet finished."""
        with self._lock:
            return {request_id: route.replica for request_id, route in self._routes.items()}

    # ---- routing --------------------------------------------------------------------------------

    def add(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None = None,
        *,
        stream: bool = False,
        lora_name: str | None = None,
    ) -> str:
        """Queues the request on the least loaded replica now (`Engine.add_request`, whose errors it raises);
        returns its id."""
        with self._lock:
            replica = least_loaded(self._loads)
            if request_id is None and self._names is not None:
                request_id = str(next(self._names))
            request_id = self.engines[replica].add_request(
                prompt, params, request_id, stream=stream, lora_name=lora_name
            )
            self._route(request_id, replica, params)
        return request_id

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
        """Thread-safe `add`, applied at the replica's next step (`Engine.submit`); a submission the engine
        refuses, or one cancelled before that step, leaves the replica's load."""
        with self._lock:
            replica = least_loaded(self._loads)
            self._route(request_id, replica, params)
            future = self.engines[replica].submit(
                prompt, params, request_id, stream=stream, stream_interval=stream_interval, lora_name=lora_name
            )
        future.add_done_callback(lambda done: self._forget_refused(request_id, done))
        return future

    def abort(self, request_id: str) -> None:
        """Aborts the request on its replica now (`Engine.abort`); nothing if it finished already."""
        replica = self._forget(request_id)
        if replica is not None:
            self.engines[replica].abort(request_id)

    def submit_abort(self, request_id: str) -> None:
        """Thread-safe `abort`, applied at the replica's next step (`Engine.submit_abort`)."""
        replica = self._forget(request_id)
        if replica is not None:
            self.engines[replica].submit_abort(request_id)

    def abort_admitted(self, replica: int) -> list[str]:
        """After a step of `replica` failed: aborts the requests it had admitted (the ones that never started
        are served as usual); returns their ids."""
        engine = self.engines[replica]
        admitted = [r.request_id for r in engine.scheduler.waiting if r.status is not RequestStatus.WAITING]
        failed = list(dict.fromkeys(admitted))
        for request_id in failed:
            self._forget(request_id)
            engine.abort(request_id)
        return failed

    def _route(self, request_id: str, replica: int, params: SamplingParams | None) -> None:
        route = _Route(replica, 1 if params is None else params.n)
        self._routes[request_id] = route
        self._loads[replica] += route.sequences

    def _forget(self, request_id: str) -> int | None:
        """Takes the request's sequences off its replica's load; that replica, None if already forgotten."""
        with self._lock:
            route = self._routes.pop(request_id, None)
            if route is None:
                return None
            self._loads[route.replica] -= route.sequences
            return route.replica

    def _forget_refused(self, request_id: str, submitted: Future[str]) -> None:
        if submitted.cancelled() or submitted.exception() is not None:
            self._forget(request_id)

    # ---- stepping -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether any replica has a request or a step in flight."""
        return any(engine.has_unfinished() for engine in self.engines)

    def step(self) -> Round:
        """One step of every replica with work."""
        return self._step([r for r, engine in enumerate(self.engines) if engine.has_unfinished()])

    def drain(self) -> Round:
        """Reads back the steps still in flight on the replicas where no request runs, until they are idle."""
        drained = Round([], [])
        while idle := [
            r for r, e in enumerate(self.engines) if e.has_unfinished() and not e.scheduler.has_unfinished()
        ]:
            round_ = self._step(idle)
            drained.outputs += round_.outputs
            drained.failures += round_.failures
        return drained

    def _step(self, replicas: list[int]) -> Round:
        outputs, self._carried = self._carried, []
        failures = []
        for replica in replicas:
            try:
                stepped = self.engines[replica].step()
            except Exception as error:
                failures.append(StepFailure(replica, error))
                continue
            except BaseException:
                self._carried = outputs
                raise
            outputs += stepped
            for output in stepped:
                if output.finished:
                    self._forget(output.request_id)
        return Round(outputs, failures)

    # ---- every replica --------------------------------------------------------------------------

    def stats(self) -> list[ReplicaStats]:
        return [ReplicaStats.of(engine) for engine in self.engines]

    def step_stats(self) -> list[StepStats]:
        """Every replica's steps in the order they were launched."""
        if len(self.engines) == 1:
            return list(self.engines[0].stats)
        return sorted((s for engine in self.engines for s in engine.stats), key=lambda s: s.launched_at)

    def on_every_replica(self, action: str, call: Callable[[Engine], None]) -> None:
        """`call` on every replica; with several, refused first while any has unfinished work, so that a
        refusal leaves every replica as it was (one engine refuses by itself)."""
        if len(self.engines) > 1 and self.has_unfinished():
            unfinished = sum(e.scheduler.num_waiting + e.scheduler.num_running for e in self.engines)
            raise RuntimeError(
                f"{action} while {unfinished} requests are unfinished (or steps in flight) on the replicas: "
                "let them finish or abort them first"
            )
        for engine in self.engines:
            call(engine)

    def close(self) -> None:
        """Closes every engine (what is unfinished is aborted); the set routes nothing any more."""
        for engine in self.engines:
            engine.close()
        with self._lock:
            self._routes.clear()
            self._loads = [0] * len(self.engines)
        self._carried = []
