"""`jaxserve bench throughput | latency`: the workloads (random prompts, dataset files and their errors), the
metrics against hand-computed values, the reports and their JSON keys, the flags' errors, and one run of
each benchmark on the tiny random-weight Llama (CPU timings mean nothing: only shapes and counts are
checked)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve import bench, workload
from jaxserve.cli import _validate_bench, build_parser, main
from jaxserve.models import registry, shapes
from jaxserve.sampling import CompletionOutput, RequestMetrics, RequestOutput

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

VOCAB = shapes.TINY_LLAMA["vocab_size"]
# Two decode and two prefill shapes: each engine of these tests compiles 4 steps.
TINY_ENGINE = ["--random-weights", "tiny-llama", "--max-batch-size", "4", "--max-num-tokens", "32"]
TINY_ENGINE += ["--decode-batch-sizes", "2,4", "--token-buckets", "16,32"]

ENGINE_KEYS = {
    "model",
    "backend",
    "dtype",
    "tensor_parallel_size",
    "data_parallel_size",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "kv_blocks",
    "kv_tokens",
    "kv_gib",
    "load_s",
    "init_s",
    "warmup_s",
    "compiled_executables",
    "lowering_s",
    "xla_compile_s",
    "gpu_client",
    "experts",
    "quantization",
    "quantize_lm_head",
    "kv_cache_dtype",
}
STEP_KEYS = {"num_steps", "mean_host_ms", "mean_dispatch_ms", "decode_step_ms", "peak_kv_usage", "num_preempted"}
PERCENTILE_KEYS = {"mean", "p50", "p90", "p99"}
ITERATION_KEYS = {"iteration", "step", "launched_s", "gap_ms", "num_tokens", "num_seqs", "num_prefill_rows"}
ITERATION_KEYS |= {"bucket_tokens", "bucket_seqs", "kv_usage", "num_preempted", "prefix_hit_rate", "host_ms"}
ITERATION_KEYS |= {"dispatch_ms"}
COMMON_KEYS = {"benchmark", "engine", "output_tok_per_s", "ttft_ms", "tpot_ms", "steps", "lora"}
THROUGHPUT_KEYS = COMMON_KEYS | {
    "num_requests",
    "max_concurrency",
    "input_tokens",
    "output_tokens",
    "elapsed_s",
    "total_tok_per_s",
    "requests_per_s",
    "latency_ms",
}
LATENCY_KEYS = COMMON_KEYS | {
    "batch_size",
    "input_len",
    "output_len",
    "num_iters",
    "num_warmup",
    "latency_s",
    "iteration_latencies_s",
}


# ---- shapes and workloads -----------------------------------------------------------------------


def test_every_shape_resolves_and_shape_returns_a_copy():
    for name in shapes.SHAPES:
        _, cfg = registry.resolve(shapes.shape(name))
        assert cfg.vocab_size == shapes.SHAPES[name]["vocab_size"]
    tiny = shapes.shape("tiny-llama")
    tiny["vocab_size"] = 1
    assert shapes.shape("tiny-llama")["vocab_size"] == VOCAB
    with pytest.raises(
        ValueError,
        match="unknown model shape .nope.; known shapes: llama-3.1-8b, gemma-3-12b, gemma-2-9b, qwen3-30b-a3b, "
        "mixtral-8x7b, smollm2-135m",
    ):
        shapes.shape("nope")


def test_building_workloads_and_parsing_flags_load_no_jax():
    code = "import sys, jaxserve.workload, jaxserve.bench, jaxserve.cli; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_random_workload_has_the_lengths_and_is_fixed_by_the_seed():
    load = workload.random_workload(5, 7, 3, VOCAB, seed=1)
    assert load.num_requests == 5 and [len(p) for p in load.prompts] == [7] * 5 and load.output_lens == [3] * 5
    assert load.input_tokens == 35 and load.max_seq_len == 10
    ids = np.array(load.prompts)
    assert ids.min() >= 100 and ids.max() < VOCAB  # clear of the low ids
    assert workload.random_workload(5, 7, 3, VOCAB, seed=1) == load
    assert workload.random_workload(5, 7, 3, VOCAB, seed=2).prompts != load.prompts
    # The draw of the removed benchmarks/engine.py (the log's early runs), so that a seed gives their prompts.
    rng = np.random.default_rng(1)
    assert load.prompts == [rng.integers(100, VOCAB, 7).tolist() for _ in range(5)]


def test_the_warmup_and_latency_batches_have_prompts_of_their_own():
    load = workload.Workload([[101] * 3, [102] * 9] + [[103] * 2] * 10, [1, 50] + [6] * 10)
    warmup = workload.warmup_workload(load, VOCAB, seed=0)
    assert warmup.num_requests == workload.WARMUP_REQUESTS
    assert [len(p) for p in warmup.prompts] == [len(p) for p in load.prompts[:8]]
    assert warmup.output_lens == [1, 4, 4, 4, 4, 4, 4, 4]
    batches = workload.latency_batches(2, 5, 3, VOCAB, seed=0, count=3)
    assert [b.num_requests for b in batches] == [2, 2, 2] and all(b.output_lens == [3, 3] for b in batches)
    prompts = [tuple(p) for b in batches for p in b.prompts]
    assert len(set(prompts)) == 6


def test_sampling_options_make_exact_length_requests():
    greedy = workload.SamplingOptions().params([3, 5])
    assert [p.max_tokens for p in greedy] == [3, 5]
    assert all(p.ignore_eos and p.is_greedy and p.seed is None for p in greedy)
    seeded = workload.SamplingOptions(temperature=0.7, top_p=0.9, top_k=5, seed=10).params([2, 2, 2])
    assert [p.seed for p in seeded] == [10, 11, 12]
    assert all(p.temperature == 0.7 and p.top_p == 0.9 and p.top_k == 5 for p in seeded)


def test_engine_max_seq_len_is_the_longest_request_unless_given():
    assert workload.engine_max_seq_len(12, None, 256) == 12
    assert workload.engine_max_seq_len(12, 64, 256) == 64
    with pytest.raises(ValueError, match="--max-seq-len 10 is shorter than the longest request"):
        workload.engine_max_seq_len(12, 10, 256)
    with pytest.raises(ValueError, match="needs 300 tokens .* the model allows 256"):
        workload.engine_max_seq_len(300, None, 256)


# ---- dataset files ------------------------------------------------------------------------------


class _CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def test_a_dataset_gives_text_and_token_prompts_with_their_lengths(tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [
        json.dumps({"prompt": "abc", "output_len": 5, "task_id": 7}),
        "",
        json.dumps({"prompt_token_ids": [1, 2, 3, 4]}),
        json.dumps({"prompt_token_ids": [9], "max_tokens": 2}),
    ]
    path.write_text("\n".join(lines) + "\n")
    entries = workload.read_dataset(path)
    assert [e.where for e in entries] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    load = workload.dataset_workload(entries, _CharTokenizer(), VOCAB, output_len=7)
    assert load.prompts == [[97 % VOCAB, 98 % VOCAB, 99 % VOCAB], [1, 2, 3, 4], [9]]
    assert load.output_lens == [5, 7, 2]
    assert [e.where for e in workload.read_dataset(path, num_requests=2)] == [f"{path}:1", f"{path}:3"]
    with pytest.raises(ValueError, match=r"--num-requests 4 is more than the 3 requests in .*requests.jsonl"):
        workload.read_dataset(path, num_requests=4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', 'exactly one of "prompt"'),
        ('{"output_len": 3}', 'exactly one of "prompt"'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt": 5}', '"prompt" must be a non-empty string'),
        ('{"prompt_token_ids": []}', '"prompt_token_ids" must be a non-empty list of ints >= 0'),
        ('{"prompt_token_ids": [1, -2]}', '"prompt_token_ids" must be a non-empty list of ints >= 0'),
        ('{"prompt_token_ids": [1, true]}', '"prompt_token_ids" must be a non-empty list of ints >= 0'),
        ('{"prompt_token_ids": "12"}', '"prompt_token_ids" must be a non-empty list of ints >= 0'),
        ('{"prompt": "a", "output_len": 0}', '"output_len" must be an int >= 1, got 0'),
        ('{"prompt": "a", "max_tokens": 2.5}', '"max_tokens" must be an int >= 1, got 2.5'),
        ('{"prompt": "a", "output_len": 2, "max_tokens": 2}', 'one of "output_len" and "max_tokens"'),
    ],
)
def test_a_malformed_dataset_line_names_the_file_and_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_token_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: .*") as error:
        workload.read_dataset(path)
    assert message in str(error.value)


def test_unreadable_datasets_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file .*missing.jsonl does not exist"):
        workload.read_dataset(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.jsonl: no requests"):
        workload.read_dataset(empty)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "a"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match="binary.jsonl: not UTF-8 text"):
        workload.read_dataset(binary)


def test_dataset_prompts_outside_the_vocabulary_or_without_a_tokenizer_name_the_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3, 170]}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: token ids \[170\] are outside the vocabulary \[0, 159\]"):
        workload.dataset_workload(workload.read_dataset(path), None, VOCAB, 4)
    path.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ValueError, match=f"{path}:1: a text prompt needs a tokenizer"):
        workload.dataset_workload(workload.read_dataset(path), bench.TokenIdTokenizer(), VOCAB, 4)


# ---- metrics ------------------------------------------------------------------------------------


def test_percentiles_interpolate_between_samples():
    p = bench.percentiles([4.0, 1.0, 3.0, 2.0])
    assert (p.mean, p.p50, p.p90, p.p99) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    ms = bench.percentiles([0.001, 0.003], scale=1e3)
    assert (ms.mean, ms.p50, ms.p90, ms.p99) == pytest.approx((2.0, 2.0, 2.8, 2.98))
    assert bench.percentiles([]) is None


def _output(arrival: float, first: float | None, finished: float | None, num_tokens: int) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_token_time=first, finished_time=finished)
    completion = CompletionOutput(0, "", list(range(num_tokens)), finish_reason="length")
    return RequestOutput("0", None, [1, 2], [completion], True, metrics)


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert bench.time_per_output_token(RequestMetrics(10.0, None, 10.5, 12.5), 5) == pytest.approx(0.5)
    assert bench.time_per_output_token(RequestMetrics(10.0, None, 10.5, 10.5), 1) is None
    times = bench.request_times([_output(0.0, 0.1, 0.5, 5), _output(0.0, 0.3, 0.3, 1), _output(1.0, 1.2, 2.2, 3)])
    assert times.ttft_ms.mean == pytest.approx(200.0) and times.ttft_ms.p50 == pytest.approx(200.0)
    assert times.tpot_ms.mean == pytest.approx((100.0 + 500.0) / 2)  # the one-token request has no TPOT
    assert times.latency_ms.p50 == pytest.approx(500.0) and times.latency_ms.mean == pytest.approx(1000.0 / 3 * 2)


def _stats(launched_at: float, prefill_rows: int, kv_usage: float = 0.5, preempted: int = 0):
    from jaxserve.engine import StepStats

    return StepStats(
        num_tokens=4,
        num_seqs=2,
        num_prefill_rows=prefill_rows,
        bucket_tokens=4,
        bucket_seqs=2,
        kv_usage=kv_usage,
        num_preempted=preempted,
        prefix_hit_rate=0.0,
        host_seconds=0.002,
        dispatch_seconds=0.001,
        launched_at=launched_at,
    )


def test_the_step_summary_takes_the_median_gap_between_decode_steps():
    stats = [_stats(0.0, 2), _stats(1.0, 0), _stats(1.01, 0), _stats(1.05, 1, 0.75, 1), _stats(2.0, 0)]
    stats += [_stats(2.02, 0, 0.25), _stats(2.05, 0)]
    # Decode pairs: 1.0 -> 1.01 (10 ms), 2.0 -> 2.02 (20 ms), 2.02 -> 2.05 (30 ms).
    assert bench.decode_step_ms(stats) == pytest.approx(20.0)
    summary = bench.step_summary(stats)
    assert summary.num_steps == 7 and summary.num_preempted == 1 and summary.peak_kv_usage == 0.75
    assert summary.mean_host_ms == pytest.approx(2.0) and summary.mean_dispatch_ms == pytest.approx(1.0)
    assert bench.decode_step_ms([_stats(0.0, 1), _stats(1.0, 0)]) is None
    empty = bench.step_summary([])
    assert empty.num_steps == 0 and empty.mean_host_ms is None and empty.peak_kv_usage is None


# ---- reports ------------------------------------------------------------------------------------


def _engine() -> bench.EngineSummary:
    return bench.EngineSummary("tiny", "xla", "float32", 1, 1, 4, 32, 12, 5, 64, 0.0001, 1.0, 2.0, 1.5, 4, 0.25, 2.5)


def _percentiles(scale: float) -> bench.Percentiles:
    return bench.Percentiles(1.0 * scale, 2.0 * scale, 3.0 * scale, 4.0 * scale)


def test_the_throughput_report_and_its_json_keys():
    steps = bench.StepSummary(10, 0.5, 0.25, 1.25, 0.5, 0)
    p = _percentiles(1.0)
    result = bench.ThroughputResult(_engine(), 6, None, 48, 24, 0.5, 48.0, 144.0, 12.0, p, None, p, steps)
    table = bench.report(result)
    for line in ["requests            6", "output tokens       24 (4.0 per request)", "elapsed             0.500 s"]:
        assert line in table
    assert "output throughput   48.0 tok/s" in table and "request throughput  12.00 req/s" in table
    assert "peak usage 50.0%" in table and "(compiling 4 executables: 1.50 s; summed over those not loaded" in table
    assert "tracing and lowering 0.25 s, XLA 2.50 s)" in table
    tpot_row = next(line for line in table.splitlines() if line.startswith("TPOT (ms)"))
    assert tpot_row.split() == ["TPOT", "(ms)", "-", "-", "-", "-"]
    record = json.loads(bench.report(result, as_json=True))
    assert set(record) == THROUGHPUT_KEYS and record["benchmark"] == "throughput"
    assert set(record["engine"]) == ENGINE_KEYS and set(record["steps"]) == STEP_KEYS
    assert set(record["ttft_ms"]) == PERCENTILE_KEYS and record["tpot_ms"] is None


def test_the_latency_report_and_its_json_keys():
    steps = bench.StepSummary(12, 0.5, 0.25, None, 1.0, 0)
    latencies = [0.123456789, 0.2, 0.3]
    result = bench.LatencyResult(_engine(), 1, 8, 4, 3, 1, _percentiles(0.1), latencies, 20.0, None, None, steps)
    table = bench.report(result)
    assert "batch               1 x 8 prompt tokens -> 4 output tokens" in table
    assert "iterations          3 timed after 1 warm-up" in table and "decode step         - median" in table
    record = json.loads(bench.to_json(result))
    assert set(record) == LATENCY_KEYS and record["benchmark"] == "latency"
    assert record["iteration_latencies_s"] == [0.123457, 0.2, 0.3]  # 6 significant digits
    assert set(record["latency_s"]) == PERCENTILE_KEYS and set(record["engine"]) == ENGINE_KEYS
    assert record["lora"] is None
    with_lora = dataclasses.replace(result, lora=bench.LoraSummary(4, 16, 12.5, 7.25))
    assert "LoRA adapters       4 of rank 16" in bench.report(with_lora)
    assert "12.5 ms" in bench.report(with_lora) and "7.2 ms" in bench.report(with_lora)
    assert json.loads(bench.to_json(with_lora))["lora"] == {
        "adapters": 4,
        "rank": 16,
        "update_ms": 12.5,
        "update_device_bf16_ms": 7.25,
    }


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["throughput", "--num-requests", "0"], "argument --num-requests: must be an int >= 1, got 0"),
        (["throughput", "--input-len", "x"], "argument --input-len: must be an int >= 1, got 'x'"),
        (["throughput", "--temperature", "-1"], "argument --temperature: must be a number >= 0, got -1"),
        (["throughput", "--top-p", "0"], "argument --top-p: must be a number in (0, 1], got 0"),
        (["throughput", "--top-p", "nan"], "argument --top-p: must be a number in (0, 1], got nan"),
        (["throughput", "--top-k", "-2"], "argument --top-k: must be an int >= -1, got -2"),
        (["throughput", "--random-weights", "llama-9b"], "argument --random-weights: invalid choice: 'llama-9b'"),
        (["throughput", "--model", "m", "--random-weights", "tiny-llama"], "not allowed with argument --model"),
        (["throughput", "--dataset", "d.jsonl", "--input-len", "8"], "--input-len does not apply with --dataset"),
        (["throughput", "--decode-batch-sizes", "2,x"], "argument --decode-batch-sizes: must be comma-separated"),
        (["throughput", "--token-buckets", "0"], "argument --token-buckets: must be comma-separated ints >= 1"),
        (["throughput", "--kv-cache-free-memory-fraction", "1.5"], "must be a number in (0, 1], got 1.5"),
        (["throughput", "--max-seq-len", "1"], "argument --max-seq-len: must be an int >= 2, got 1"),
        (["throughput", "--max-concurrency", "0"], "argument --max-concurrency: must be an int >= 1, got 0"),
        (["latency", "--num-warmup", "-1"], "argument --num-warmup: must be an int >= 0, got -1"),
        (["latency", "--num-iters", "0"], "argument --num-iters: must be an int >= 1, got 0"),
        (["latency", "--lora-adapters", "0"], "argument --lora-adapters: must be an int >= 1, got 0"),
        (["latency", "--dataset", "d.jsonl"], "unrecognized arguments: --dataset"),
        ([], "the following arguments are required: benchmark"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_readme_commands_parse():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    block = readme.split("## Benchmarking", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.replace("\\\n", " ").splitlines() if line.startswith("jaxserve bench")]
    assert len(commands) == 3
    for command in commands:
        _validate_bench(build_parser().parse_args(shlex.split(command)[1:]))


def test_an_unwritable_iteration_log_is_an_error_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "no_dir" / "steps.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--model", str(tmp_path / "no_model"), "--iteration-log", str(path)])
    assert exit_info.value.code == 2
    assert f"--iteration-log: cannot write {str(path)!r}: No such file or directory" in capsys.readouterr().err


def test_a_bad_dataset_is_an_error_before_the_model_loads(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert main(["bench", "throughput", "--dataset", str(missing), "--model", str(tmp_path / "no_model")]) == 1
    assert f"jaxserve: error: dataset file {missing} does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1]}\n{"prompt_token_ids": [1],}\n')
    assert main(["bench", "throughput", "--dataset", str(bad), "--random-weights", "tiny-llama"]) == 1
    assert f"jaxserve: error: {bad}:2: not valid JSON" in capsys.readouterr().err


def test_a_max_seq_len_shorter_than_the_workload_is_an_error(capsys):
    args = ["bench", "latency", "--random-weights", "tiny-llama", "--input-len", "8", "--output-len", "4"]
    assert main([*args, "--max-seq-len", "11"]) == 1
    assert "--max-seq-len 11 is shorter than the longest request (12 tokens)" in capsys.readouterr().err


def _iteration_log(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(set(r) == ITERATION_KEYS for r in records)
    return records


def test_throughput_end_to_end_on_random_weights(capsys, tmp_path):
    args = ["bench", "throughput", *TINY_ENGINE, "--num-requests", "6", "--input-len", "8", "--output-len", "4"]
    assert main([*args, "--json", "--iteration-log", str(tmp_path / "steps.jsonl")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record) == THROUGHPUT_KEYS and set(record["engine"]) == ENGINE_KEYS
    assert (record["num_requests"], record["input_tokens"], record["output_tokens"]) == (6, 48, 24)
    engine = record["engine"]
    assert engine["model"] == "tiny-llama (random weights)" and engine["backend"] == "xla"
    assert (engine["tensor_parallel_size"], engine["data_parallel_size"]) == (1, 1)
    assert (engine["max_batch_size"], engine["max_num_tokens"], engine["max_seq_len"]) == (4, 32, 12)
    # 4 forwards (decode 2, 4; tokens 16, 32) and a sampler per row count (2, 4) and mode (3) but greedy,
    # which the forwards sample
    assert engine["compiled_executables"] == 4 + 2 * 2 and engine["kv_tokens"] >= 4 * 12
    steps = record["steps"]
    # 6 requests over 4 rows: at least two prefill steps and 3 decode steps for the tokens after the first.
    assert steps["num_steps"] >= 5 and steps["decode_step_ms"] is not None and 0 < steps["peak_kv_usage"] <= 1
    assert set(record["ttft_ms"]) == set(record["tpot_ms"]) == set(record["latency_ms"]) == PERCENTILE_KEYS
    # The iteration log: the timed generate's steps, in order; every prompt and output token but the last of
    # each request (never fed back) went through one.
    log = _iteration_log(tmp_path / "steps.jsonl")
    assert [r["step"] for r in log] == list(range(steps["num_steps"])) and {r["iteration"] for r in log} == {0}
    assert sum(r["num_tokens"] for r in log) == 48 + 24 - 6
    assert all(r["num_seqs"] <= r["bucket_seqs"] <= 4 and r["num_tokens"] <= r["bucket_tokens"] for r in log)
    assert log[-1]["gap_ms"] is None and all(r["gap_ms"] >= 0 for r in log[:-1])
    assert 0 <= log[0]["launched_s"] < log[-1]["launched_s"] < record["elapsed_s"]
    assert max(r["kv_usage"] for r in log) == pytest.approx(steps["peak_kv_usage"], rel=1e-5)


def test_throughput_at_a_max_concurrency_keeps_that_many_requests_in_the_engine(capsys, monkeypatch):
    """--max-concurrency 2 over 4-row steps: never more than 2 sequences in a step, every request served,
    the same greedy tokens as all at once."""
    runs = []  # (max_concurrency, run): each main() runs a warm-up generate, then the timed one
    real = bench.timed_generate

    def timed(llm, workload, sampling, max_concurrency=None, adapters=()):
        runs.append((max_concurrency, real(llm, workload, sampling, max_concurrency, adapters)))
        return runs[-1][1]

    monkeypatch.setattr(bench, "timed_generate", timed)
    args = ["bench", "throughput", *TINY_ENGINE, "--num-requests", "6", "--input-len", "8", "--output-len", "4"]
    assert main([*args, "--json"]) == 0
    assert main([*args, "--json", "--max-concurrency", "2"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["max_concurrency"] == 2 and record["num_requests"] == 6 and record["output_tokens"] == 24
    assert [limit for limit, _ in runs] == [None, None, None, 2]
    at_once, closed = runs[1][1], runs[3][1]
    assert [o.outputs[0].token_ids for o in closed.outputs] == [o.outputs[0].token_ids for o in at_once.outputs]
    assert max(s.num_seqs for s in closed.stats) == 2 and max(s.num_seqs for s in at_once.stats) == 4
    with pytest.raises(ValueError, match="max_concurrency must be an int >= 1"):
        bench.closed_loop_generate(None, [[1]], [None], 0)


def test_throughput_of_a_dataset_prints_the_table(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    lines = [{"prompt_token_ids": [5] * n, "output_len": k} for n, k in ((3, 2), (9, 3), (6, 1))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["bench", "throughput", *TINY_ENGINE, "--dataset", str(path), "--seed-per-request"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("jaxserve bench throughput: tiny-llama (random weights)\n")
    assert "requests            3\n" in table and "input tokens        18 (6.0 per request)" in table
    assert "output tokens       6 (2.0 per request)" in table and "max_seq_len 12" in table


def test_latency_end_to_end_on_random_weights(capsys, tmp_path):
    args = ["bench", "latency", "--random-weights", "tiny-llama", "--input-len", "8", "--output-len", "4"]
    args += ["--num-iters", "3", "--decode-batch-sizes", "1", "--token-buckets", "8", "--json"]
    assert main([*args, "--iteration-log", str(tmp_path / "steps.jsonl")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record) == LATENCY_KEYS and record["engine"]["max_batch_size"] == 1
    assert record["engine"]["gpu_client"] is None  # a CPU run
    assert record["engine"]["experts"] is None  # a dense model
    assert record["engine"]["quantization"] is None
    assert (record["batch_size"], record["input_len"], record["output_len"]) == (1, 8, 4)
    assert (record["num_iters"], record["num_warmup"], len(record["iteration_latencies_s"])) == (3, 1, 3)
    # forwards: decode 1, prefill 8, and max_num_tokens = 12; samplers: 1 row in 2 modes (greedy
    # is sampled inside the forward)
    assert record["engine"]["compiled_executables"] == 3 + 2
    # Each iteration: one prefill step, then a decode step for each of the 3 tokens after the first.
    assert record["steps"]["num_steps"] >= 3 * 4
    assert set(record["ttft_ms"]) == set(record["tpot_ms"]) == set(record["latency_s"]) == PERCENTILE_KEYS
    log = _iteration_log(tmp_path / "steps.jsonl")
    assert len(log) == record["steps"]["num_steps"] and [r["iteration"] for r in log[:1]] == [0]
    for iteration in range(3):  # each timed iteration's steps, numbered from 0: 8 prompt + 3 fed-back tokens
        steps = [r for r in log if r["iteration"] == iteration]
        assert [r["step"] for r in steps] == list(range(len(steps))) and steps[-1]["gap_ms"] is None
        assert sum(r["num_tokens"] for r in steps) == 8 + 3


def test_random_weights_are_handed_over_on_the_host():
    """As a checkpoint loader's: the engine places its serving copy, and no second copy stays on the device."""
    import jax

    model = bench.random_model("tiny-llama")
    leaves = jax.tree.leaves(model.weights)
    assert leaves and all(isinstance(leaf, np.ndarray) for leaf in leaves)


def test_iteration_summary_splits_host_time_by_kind_of_step(tmp_path):
    """benchmarks/iteration_summary.py over a made-up log: means per group, the largest decode bucket alone,
    the last step's missing gap left out."""
    step = {"num_prefill_rows": 0, "bucket_seqs": 8, "host_ms": 3.0, "dispatch_ms": 2.0, "gap_ms": 30.0}
    log = [
        {**step, "num_prefill_rows": 2, "host_ms": 9.0, "dispatch_ms": 4.0, "gap_ms": 100.0},
        {**step, "bucket_seqs": 4, "host_ms": 2.0, "dispatch_ms": 1.0, "gap_ms": 10.0},
        step,
        {**step, "host_ms": 5.0, "dispatch_ms": 3.0, "gap_ms": None},
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    script = Path(__file__).parents[1] / "benchmarks" / "iteration_summary.py"
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True).stdout
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()[1:]}
    assert rows["all steps"] == ["4", "4.750", "2.500", "2.250", "4.00", "30.00", "15.8%"]
    assert rows["decode-only"] == ["3", "3.333", "2.000", "1.333", "3.00", "20.00", "16.7%"]
    assert rows["decode, 8-row bucket"] == ["2", "4.000", "2.500", "1.500", "3.00", "30.00", "13.3%"]


def test_expert_layout_is_named_for_a_mixture_of_experts_only():
    from jaxserve.bench import expert_layout
    from jaxserve.models import llama, llama_moe, shapes

    moe = llama_moe.MoeConfig.from_hf(shapes.shape("qwen3-30b-a3b"))
    assert expert_layout(moe, False, 1) == "one_device"
    assert expert_layout(moe, True, 4) == "expert_parallel"
    assert expert_layout(moe, False, 4) == "tensor_parallel"
    assert expert_layout(llama.LlamaConfig.from_hf(shapes.shape("llama-3.1-8b")), False, 4) is None


def test_fp8_random_weights_bench(capsys):
    args = ["bench", "latency", "--random-weights", "tiny-llama", "--input-len", "8", "--output-len", "4"]
    args += ["--num-iters", "1", "--decode-batch-sizes", "1", "--token-buckets", "8", "--quantization", "fp8"]
    assert main([*args, "--kv-cache-dtype", "fp8", "--quantize-lm-head", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["engine"]["quantization"] == "fp8" and record["engine"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert record["engine"]["quantize_lm_head"] is True
