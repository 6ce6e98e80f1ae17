"""The replica set over fake engines (plain Python): a request goes to the replica with the fewest unfinished
sequences routed to it (the lowest index among equals), counted from routing until its final output or its
abort; a refused submission leaves the load; a round steps every replica with work, a failing replica is
reported while the others step on, and an interrupted round loses no output."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from jaxserve.replicas import ReplicaSet, least_loaded
from jaxserve.request import RequestStatus
from jaxserve.sampling import RequestOutput, SamplingParams


@dataclass
class FakeScheduler:
    waiting: list = field(default_factory=list)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    num_running = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting)


@dataclass
class FakeEngine:
    """Finishes each request one step after it was added; `fail` / `interrupt` make the next step raise."""

    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    added: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # ids whose final output the next step returns
    stats: list = field(default_factory=list)
    fail: BaseException | None = None
    refuse: bool = False
    names: int = 0

    def add_request(self, prompt, params, request_id=None, *, stream=False, stream_interval=1, lora_name=None) -> str:
        if self.refuse:
            raise ValueError("refused")
        if request_id is None:
            request_id, self.names = str(self.names), self.names + 1
        self.added.append(request_id)
        self.pending.append(request_id)
        return request_id

    def submit(self, prompt, params, request_id=None, *, stream=True, stream_interval=1, lora_name=None) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.add_request(prompt, params, request_id))
        except ValueError as error:
            future.set_exception(error)
        return future

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    submit_abort = abort

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.fail is not None

    def step(self) -> list[RequestOutput]:
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        done, self.pending = self.pending, []
        return [RequestOutput(i, None, [1], [], finished=True, metrics=None) for i in done]

    def close(self) -> None:
        self.pending.clear()


def test_least_loaded_takes_the_fewest_then_the_lowest_index():
    assert least_loaded([0, 0, 0]) == 0
    assert least_loaded([2, 1, 1]) == 1
    assert least_loaded([3, 4, 0]) == 2


def test_requests_go_to_the_least_loaded_replica_counting_their_sequences():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    replicas.add([1], SamplingParams(n=3))  # replica 0: 3 sequences
    replicas.add([1], None)  # replica 1
    replicas.add([1], SamplingParams(n=1))  # replica 1 (1 < 3)
    replicas.add([1], None)  # replica 1 (2 < 3)
    assert replicas.loads == [3, 3]
    assert [len(e.added) for e in engines] == [1, 3]
    ids = [i for e in engines for i in e.added]
    assert len(set(ids)) == 4, "the set names requests uniquely across replicas"
    assert replicas.routes == {ids[0]: 0, ids[1]: 1, ids[2]: 1, ids[3]: 1}


def test_a_request_leaves_the_load_when_it_finishes_or_is_aborted():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    first, second = replicas.add([1], None), replicas.add([1], None)
    replicas.abort(second)
    assert engines[1].aborted == [second] and replicas.loads == [1, 0]
    replicas.abort(second)  # already forgotten: nothing reaches the engine
    assert engines[1].aborted == [second]
    outputs = replicas.step().outputs
    assert {o.request_id for o in outputs} == {first, second}
    assert replicas.loads == [0, 0] and replicas.routes == {}
    replicas.abort(first)  # finished: nothing to abort
    assert engines[0].aborted == []


def test_submissions_route_by_what_was_submitted_and_a_refused_one_leaves_the_load():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    futures = [replicas.submit([1], SamplingParams(), f"r{i}", stream=True, stream_interval=1) for i in range(4)]
    assert [f.result() for f in futures] == ["r0", "r1", "r2", "r3"]
    assert [e.added for e in engines] == [["r0", "r2"], ["r1", "r3"]]
    engines[0].refuse = True
    refused = replicas.submit([1], SamplingParams(n=2), "bad", stream=False, stream_interval=1)
    with pytest.raises(ValueError, match="refused"):
        refused.result()
    assert replicas.loads == [2, 2] and "bad" not in replicas.routes
    replicas.submit_abort("r1")
    assert engines[1].aborted == ["r1"] and replicas.loads == [2, 1]


def test_a_failing_replica_is_reported_and_the_others_step_on():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    first, second = replicas.add([1], None), replicas.add([1], None)
    engines[0].fail = RuntimeError("injected")
    stepped = replicas.step()
    assert [o.request_id for o in stepped.outputs] == [second]
    [failure] = stepped.failures
    assert failure.replica == 0 and str(failure.error) == "injected"
    assert replicas.loads == [1, 0]  # the failed replica's request is still routed there
    assert [o.request_id for o in replicas.step().outputs] == [first]


def test_an_interrupted_round_keeps_the_outputs_of_the_replicas_stepped_before():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    first, second = replicas.add([1], None), replicas.add([1], None)
    engines[1].fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        replicas.step()
    assert [o.request_id for o in replicas.step().outputs] == [first, second]


def test_abort_admitted_aborts_the_requests_a_failed_step_had_started():
    engine = FakeEngine()
    replicas = ReplicaSet([engine])
    started, waiting = replicas.add([1], None), replicas.add([1], None)
    engine.scheduler.waiting = [
        _Waiting(started, RequestStatus.PREEMPTED),
        _Waiting(started, RequestStatus.PREEMPTED),  # its second sample
        _Waiting(waiting, RequestStatus.WAITING),
    ]
    assert replicas.abort_admitted(0) == [started]
    assert engine.aborted == [started] and replicas.routes == {waiting: 0}


def test_work_on_every_replica_is_refused_while_any_has_work():
    engines = [FakeEngine(), FakeEngine()]
    replicas = ReplicaSet(engines)
    replicas.add([1], None)
    called = []
    with pytest.raises(RuntimeError, match="sleep while"):
        replicas.on_every_replica("sleep", called.append)
    assert called == []
    replicas.step()
    replicas.on_every_replica("sleep", called.append)
    assert called == engines


def test_a_replica_set_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        ReplicaSet([])


@dataclass
class _Waiting:
    request_id: str
    status: RequestStatus
