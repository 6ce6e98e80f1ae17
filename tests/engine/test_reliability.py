"""No request can break the engine: streams consumed in any order, abandoned or aborted; exceptions and
KeyboardInterrupts inside a step; a request whose inputs cannot be built; submissions from other threads.
After each, every valid greedy request gets the tokens it gets alone and nothing leaks.

A tiny random Llama on the xla backend; the reference tokens are the engine's own, one request at a time.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import CompileConfig
from jaxserve.engine import Engine
from jaxserve.runner import Runner
from jaxserve.sampling import SamplingParams

VOCAB = 160
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [np.random.default_rng(seed).integers(0, VOCAB, 3 + 5 * seed % 37).tolist() for seed in range(10)]


@pytest.fixture(scope="module")
def llm(tiny_model, make_llm):
    buckets = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False)
    return make_llm(tiny_model("llama"), kv_tokens=192, compile_config=buckets)


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    """Each prompt's greedy tokens, generated with nothing else in the engine."""
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture
def idle_after(llm, alone, assert_engine_idle):
    """After the test, a greedy request gets its tokens and leaves the engine idle, leaking nothing."""
    yield
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0]
    assert_engine_idle(llm)


def test_streams_consumed_interleaved_and_a_generate_while_they_are_open(llm, alone, idle_after):
    first, second = llm.stream(PROMPTS[1], GREEDY), llm.stream(PROMPTS[2], GREEDY)
    a, b = next(first), next(second)
    [middle] = llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    rest_a, rest_b = list(first), list(second)
    assert middle.outputs[0].token_ids == alone[3]
    assert (rest_a or [a])[-1].outputs[0].token_ids == alone[1] and (rest_a or [a])[-1].finished
    assert (rest_b or [b])[-1].outputs[0].token_ids == alone[2] and (rest_b or [b])[-1].finished
    for outputs in ([a, *rest_a], [b, *rest_b]):
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        assert counts == sorted(counts) and all(not o.finished for o in outputs[:-1])


def test_an_abandoned_stream_frees_its_blocks_at_once(llm, alone, idle_after):
    manager = llm.engine.block_manager
    streams = [llm.stream(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)) for p in PROMPTS[4:8]]
    for stream in streams:
        next(stream)
    del stream
    assert manager.num_free_blocks < manager.num_usable_blocks
    streams[0].close()
    for _ in streams[1]:
        break  # leaving the loop keeps the iterator alive: closed when dropped below
    del streams
    gc.collect()
    assert manager.num_free_blocks == manager.num_usable_blocks, "every abandoned stream frees its blocks now"
    before = len(llm.step_stats)
    [out] = llm.generate([PROMPTS[8]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == alone[8]
    assert len(llm.step_stats) - before <= NEW_TOKENS + 2, "the abandoned requests still ran"


def test_a_stream_that_is_never_iterated_aborts_when_dropped(llm, idle_after):
    stream = llm.stream(PROMPTS[5], GREEDY)
    del stream
    gc.collect()
    assert llm.engine.scheduler.num_waiting == 0 and llm.engine.scheduler.num_running == 0


def _raise_once(monkeypatch, cls, name, exception, after_calls=2):
    """Makes cls.name raise `exception` on its (after_calls + 1)-th call, once."""
    original = getattr(cls, name)
    calls = {"n": 0}

    def wrapper(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == after_calls + 1:
            raise exception
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.mark.parametrize(
    ("cls", "name"), [(Engine, "_process"), (Runner, "run"), (Engine, "_launch")], ids=["read-back", "run", "launch"]
)
@pytest.mark.parametrize("exception", [KeyboardInterrupt(), RuntimeError("device lost")], ids=["sigint", "error"])
def test_an_exception_inside_a_step_leaves_an_engine_whose_next_generate_is_correct(
    llm, alone, idle_after, monkeypatch, cls, name, exception
):
    """As a Ctrl-C would: raised from inside a step, mid-generate, with a stream open beside it."""
    stream = llm.stream(PROMPTS[9], GREEDY)
    next(stream)
    _raise_once(monkeypatch, cls, name, exception)
    with pytest.raises(type(exception)):
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)[1].outputs[0].token_ids == alone[1]
    *_, last = stream
    assert last.finished and last.outputs[0].token_ids == alone[9], "the open stream was recomputed and served"


def test_a_request_whose_inputs_cannot_be_built_fails_alone(llm, alone, idle_after, monkeypatch):
    import jaxserve.step_inputs as inputs

    poisoned = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, min_tokens=1)
    original = inputs._fill_banned

    def fill_banned(step_inputs, columns):
        if any(request.sampling_params.min_tokens == 1 for request in columns.requests):  # the poisoned one
            raise OverflowError("Python int too large to convert to C int")
        original(step_inputs, columns)

    monkeypatch.setattr(inputs, "_fill_banned", fill_banned)
    outputs = llm.generate(PROMPTS[:4], [GREEDY, poisoned, GREEDY, GREEDY], use_tqdm=False)
    assert outputs[1].error is not None and "OverflowError" in outputs[1].error
    assert outputs[1].outputs[0].finish_reason == "error"
    assert [outputs[i].outputs[0].token_ids for i in (0, 2, 3)] == [alone[0], alone[2], alone[3]]


def test_submissions_from_other_threads(llm, alone, idle_after):
    engine = llm.engine
    futures = {}

    def submit(i):
        futures[i] = engine.submit(PROMPTS[i], GREEDY)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = engine.submit([VOCAB + 5], GREEDY)
    doomed = engine.submit(PROMPTS[7], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.step()  # the submissions are applied at the start of a step
    aborter = threading.Thread(target=engine.submit_abort, args=(doomed.result(),))
    aborter.start()
    aborter.join()
    finals = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert isinstance(bad.exception(), ValueError) and "token ids" in str(bad.exception())
    for i, future in futures.items():
        assert finals[future.result()].outputs[0].token_ids == alone[i]
    aborted = finals[doomed.result()].outputs[0]
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 100


def test_a_submission_without_streaming_reports_only_its_final_output(llm, alone, idle_after):
    engine = llm.engine
    quiet, streamed = engine.submit(PROMPTS[4], GREEDY, stream=False), engine.submit(PROMPTS[5], GREEDY)
    reported: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            reported.setdefault(output.request_id, []).append(output)
    [final] = reported[quiet.result()]
    assert final.finished and final.outputs[0].token_ids == alone[4]
    assert len(reported[streamed.result()]) > 1 and reported[streamed.result()][-1].outputs[0].token_ids == alone[5]


def test_min_tokens_holds_stop_strings_back(llm, alone, idle_after):
    """vLLM's rule: a stop string counts only once min_tokens tokens are out."""
    text = llm.tokenizer.decode(alone[0])
    stop = text[1]  # the second generated character: a one-token stop string
    early = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,))
    late = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop,), min_tokens=3)
    first, second = (o.outputs[0] for o in llm.generate([PROMPTS[0]] * 2, [early, late], use_tqdm=False))
    assert first.text == text[: text.index(stop)] and first.finish_reason == "stop"
    later = text.find(stop, 3)
    assert second.text == (text if later < 0 else text[:later])
    assert second.finish_reason == ("length" if later < 0 else "stop")


_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["generate", "stream-all", "stream-abandon", "stream-abort", "invalid", "interrupt"]),
        st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=_ACTIONS, interleave=st.booleans())
def test_random_mixes_serve_every_valid_request_its_tokens(llm, alone, assert_engine_idle, actions, interleave):
    open_streams = []
    for kind, picks in actions:
        if kind == "generate":
            outputs = llm.generate([PROMPTS[i] for i in picks], GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == [alone[i] for i in picks]
        elif kind == "invalid":
            with pytest.raises((ValueError, TypeError)):
                llm.generate([PROMPTS[picks[0]], [VOCAB + 1], None][: len(picks) + 1], GREEDY, use_tqdm=False)
        elif kind == "interrupt":
            original = Engine._process
            Engine._process = lambda self, flight: (_ for _ in ()).throw(KeyboardInterrupt())
            try:
                with pytest.raises(KeyboardInterrupt):
                    llm.generate([PROMPTS[i] for i in picks], GREEDY, use_tqdm=False)
            finally:
                Engine._process = original
        else:
            streams = [(i, llm.stream(PROMPTS[i], GREEDY)) for i in picks]
            if kind == "stream-abort":
                llm.engine.abort(streams[0][1].request_id)
            if kind == "stream-abandon":
                next(streams[0][1])
                streams = streams[1:]
            open_streams += streams
            if interleave and len(open_streams) > 1:
                next(open_streams[0][1], None)
    for i, stream in open_streams:
        outputs = list(stream)
        final = outputs[-1] if outputs else None
        if final is not None and final.outputs[0].finish_reason != "abort":
            assert final.outputs[0].token_ids == alone[i]
    del open_streams
    gc.collect()
    llm._drain()
    assert_engine_idle(llm)


LONG_RUN = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to max_seq_len


@pytest.fixture(scope="module")
def long_generate_seconds(llm, alone) -> float:
    """The shortest of two uninterrupted runs of the workload below."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(PROMPTS, LONG_RUN, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return min(times)


def _interrupted_generate(llm, delay: float) -> bool:
    """Sends SIGINT `delay` seconds into a generate; whether it interrupted it (not: the generate won).

    The timer thread is joined inside the try, so a signal sent just as the generate returned is
    raised, and caught, here rather than in the test runner.
    """
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        try:
            llm.generate(PROMPTS, LONG_RUN, use_tqdm=False)
        finally:
            timer.cancel()
            timer.join()
    except KeyboardInterrupt:
        return True
    return False


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, as in an interactive Python or a notebook: pytest-xdist's workers
    start with SIGINT ignored (whether a test before this one reset it depended on which worker ran it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("moment", [0.05, 0.2, 0.4, 0.6, 0.8])
def test_a_real_sigint_during_generate(llm, alone, idle_after, long_generate_seconds, moment, sigint_raises):
    """Ctrl-C as a notebook user presses it: a SIGINT lands wherever the engine is at that moment of a
    generate (a fraction of its uninterrupted duration; halved and tried again when the machine ran the
    generate faster than that)."""
    delay = moment * long_generate_seconds
    for _ in range(5):
        if _interrupted_generate(llm, delay):
            break
        delay /= 2
    else:
        pytest.fail(f"no generate was interrupted ({long_generate_seconds:.3f} s uninterrupted)")
    assert llm.generate(PROMPTS[2:4], GREEDY, use_tqdm=False)[1].outputs[0].token_ids == alone[3]


def test_an_abort_from_inside_a_step_waits_for_the_next_step(llm, alone, idle_after, monkeypatch):
    """A stream's finaliser may run while the engine is mid-step (garbage collection): its abort must not
    change the scheduler under the step's feet, and takes effect at the next step."""
    from jaxserve.block_manager import BlockManager

    engine = llm.engine
    victim = engine.add_request(PROMPTS[6], GREEDY)
    other = engine.add_request(PROMPTS[7], GREEDY)
    seen = {}
    original = BlockManager.append_slots

    def append_slots(self, request, num_tokens):
        if not seen:
            engine.abort(victim)  # as from a finaliser, inside schedule()
            samples = [r for r in engine.scheduler.running + list(engine.scheduler.waiting) if r.request_id == victim]
            seen["unfinished"] = bool(samples) and not any(r.is_finished for r in samples)
        return original(self, request, num_tokens)

    monkeypatch.setattr(BlockManager, "append_slots", append_slots)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step()})
    assert seen["unfinished"], "the abort changed the scheduler inside the step"
    assert finals[victim].outputs[0].finish_reason == "abort"
    assert finals[other].outputs[0].token_ids == alone[7]


def test_a_step_that_consumed_the_donated_pool_and_failed_leaves_a_working_engine(llm, alone, idle_after, monkeypatch):
    """A compiled call that took the KV pool (donated) and raised: recovery allocates a new pool."""
    original = Runner.run
    calls = {"n": 0}

    def run(self, inputs, bucket, variant):
        calls["n"] += 1
        if calls["n"] == 3:
            self.kv_cache.k.delete()
            self.kv_cache.v.delete()
            raise RuntimeError("the device failed inside the step")
        return original(self, inputs, bucket, variant)

    monkeypatch.setattr(Runner, "run", run)
    with pytest.raises(RuntimeError, match="inside the step"):
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.runner.kv_cache.k.is_deleted()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == alone[:3]
