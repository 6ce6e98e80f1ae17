"""Per-step device profile of one compiled engine step: every kernel's time against its byte/flop floor.

    python benchmarks/step_profile.py --batch 1 --context 128 --out out/profile_b1.csv
    python benchmarks/step_profile.py --batch 256 --context 192 --variant greedy,candidates --out out/b256.csv
    python benchmarks/step_profile.py --shape tiny --batch 4 --context 32 --backend xla   # CPU check

The runner is built as the engine builds it: an EngineConfig with one decode bucket of B = --batch rows
and one token bucket (--prefill, else B), StepConfig.from_config, RunnerSpec, `runner.start` over 1 + B x
ceil((C + 1) / 16) blocks, random --shape weights (warmup compiles the token bucket too). The decode
inputs come from `make_step_inputs` over a hand-made ScheduledBatch shaped like steady decode with
overlap: B requests with C-token prompts in the cache, each row at position C (kv_len C + 1) with its
input pending, block tables a seeded permutation of the pool, the previous batch the same batch (row b
carries row b's sample), so repeated `runner.run` calls chain tokens and keys as the engine does. The
pool holds zeros (kernel times do not depend on values). --prefill T adds a prefill step: min(B, T // C)
prompts of C tokens from an empty cache. Rows use --temperature (0: greedy, as benchmarks/engine.py).

Per (step, variant, layers): wall ms per call over --calls back-to-back calls, then --traced calls under
`jax.profiler.trace`, whose Chrome trace (plugins/profile/<run>/*.trace.json.gz, else the .xplane.pb via
jax.profiler.ProfileData) gives the device events:
- GPU: complete events ("ph": "X") of processes /device:GPU:<n> on threads named "Stream #..." (CUPTI's
  kernels, memcpys, memsets; one line per CUDA stream). Lines a converter may add ("XLA Ops", "Steps")
  repeat them and are skipped; an event on two lines (same name, start, duration) counts once.
- CPU (no device process): XLA:CPU records each HLO op's thunk on a host thread with an "hlo_op"
  argument; a while thunk encloses its body's, so only a thread's innermost events count.
Per kernel name: count and µs per step, share of the kernels' sum; "busy" is the union of their
intervals (streams may overlap), "span" first start to last end, per step.

Floors: bytes / --bandwidth + flops / --matmul-tflops (default on GPU: `attention.ceilings()`, a 2 GiB
copy and a bf16 8192^3 matmul). gemm: every layer matrix (13.96 GB for the 8B shape; the 16.1 GB of all
weights counts the whole embedding table, of which a step reads T rows) and lm_head (1.05 GB), 2 x T x
their parameters flops (2 x B x D x V for lm_head); attention: each row's K and V (kv_len x 2 x L x K x
Dh x bytes), 4 x L x H x Dh x visible pairs flops; write_kv: T tokens' K and V; step: all plus T embed rows.

From the step's two executables' HLO (the forward's and the sampler's `as_text()`): while loops,
conditionals, custom-calls by target, and the instructions outside fusions shaped like one layer's weight
matrix (e.g. bf16[4096,14336]) or a whole weight, by opcode (a fusion by what it fuses): copies of weights
show up there. --variant names sampler modes (greedy, candidates, sorted). Every kernel row goes to --out
(CSV), the summaries to the same name with .json, the traces to --trace-dir.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import csv
import glob
import gzip
import json
import math
import os
import re
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import LLAMA_3_1_8B, SMOLLM2_135M

from jaxserve.buckets import Bucket
from jaxserve.config import CompileConfig, EngineConfig, LoraConfig
from jaxserve.models import lora, quant, registry
from jaxserve.models.common import ParamSpec
from jaxserve.request import Request
from jaxserve.runner import Runner, resolve_backend
from jaxserve.sampling import MAX_LOGPROBS, SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow
from jaxserve.step import RunnerSpec
from jaxserve.step_inputs import StepInputs, make_step_inputs
from jaxserve.step_table import enable_compilation_cache
from jaxserve.variants import SamplerMode, StepConfig, StepVariant

SHAPES = {
    "llama8b": LLAMA_3_1_8B,
    "smollm2": SMOLLM2_135M,
    "tiny": {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 4096},  # CPU checks of this script
}
VARIANTS = {mode.value: StepVariant(mode) for mode in SamplerMode}
# First match wins, over the kernel name and its hlo_op: the Pallas kernels by their pallas_call names,
# cuBLAS / cuBLASLt (nvjet, sm90_xmma, cutlass, gemv) and XLA's Triton GEMM fusions, data movement (the
# scan's weight slices are dynamic-slice fusions; the xla backend's KV write is a scatter), the sampler's
# sorts, reductions.
GROUPS = (
    ("attention", r"ragged_paged_attention|paged_attention"),
    ("write_kv", r"write_kv"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitk|\bdot|_dot|dot_"),
    ("copy", r"copy|memcpy|memset|dynamic[-_]update[-_]slice|dynamic[-_]slice|transpose|concatenate|scatter"),
    ("sort", r"sort|top_?k"),
    ("reduce", r"reduc|argmax|argmin"),
    ("fusion", r"fusion"),
)
FLOORED = ("gemm", "attention", "write_kv")
HLO_FLOATS = ("bf16", "f16", "f32")  # weight shapes match in any: XLA:CPU slices float32 copies
_SKIPPED_OPCODES = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}


@dataclass(frozen=True, slots=True)
class Workload:
    """One profiled step: its inputs and bucket, and each real row's query and KV lengths (for the floors)."""

    name: str
    inputs: StepInputs
    bucket: Bucket
    q_lens: np.ndarray
    kv_lens: np.ndarray


@dataclass(frozen=True, slots=True)
class Event:
    """One complete trace event; times in µs."""

    process: str
    thread: str
    name: str
    ts: float
    dur: float
    hlo_op: str = ""


@dataclass(frozen=True, slots=True)
class Cost:
    bytes: float
    flops: float

    def floor_us(self, tbps: float, tflops: float) -> float:
        """Moving the bytes, then doing the flops (the floor this script reports)."""
        return (self.bytes / (tbps * 1e12) + self.flops / (tflops * 1e12)) * 1e6

    def roofline_us(self, tbps: float, tflops: float) -> float:
        """The slower of the two, as if perfectly overlapped: the tighter bound where both are large."""
        return max(self.bytes / (tbps * 1e12), self.flops / (tflops * 1e12)) * 1e6


@dataclass(slots=True)
class Profile:
    """What one (step, variant, layers) profile measured; per-step figures."""

    step: str
    variant: str
    layers: str
    wall_ms: float
    rule: str
    kernels: list[dict]
    busy_us: float
    span_us: float
    hlo: dict
    groups: dict = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--shape", choices=sorted(SHAPES), default="llama8b")
    add("--layers", type=int, default=None, help="override the shape's number of layers")
    add("--dtype", default="bfloat16")
    add("--batch", type=int, default=256, help="decode rows B (the decode bucket)")
    add("--context", type=int, default=192, help="tokens C already in each row's cache")
    add("--prefill", type=int, default=None, help="also profile a prefill step in a token bucket of this size")
    add("--max-seq-len", type=int, default=2048, help="fixes the block table width")
    add("--backend", choices=["pallas", "xla"], default="pallas")
    add("--variant", default="greedy", help="comma-separated sampler modes: greedy, candidates, sorted")
    add("--temperature", type=float, default=0.0)
    add("--calls", type=int, default=20, help="back-to-back calls timed by wall clock")
    add("--traced", type=int, default=5, help="calls under the profiler")
    add("--bandwidth", type=float, default=None, help="TB/s for the floors (default: measured on GPU)")
    add("--matmul-tflops", type=float, default=None, help="TFLOP/s for the floors (default: measured on GPU)")
    add("--lora-adapters", type=int, default=0, help="N adapter slots (tables of zeros); row i uses slot 1 + i % N")
    add("--max-lora-rank", type=int, default=16)
    add(
        "--lora-delta",
        choices=["library", "xla", "float32", "pallas", "shrink"],
        default="library",
        help="library: the engine's (a folded into the weights, lora.fold); xla: separate tables, XLA's products "
        "(lora.add_lora); float32: those written in float32 and cast after (lora.lora_delta's result_dtype), "
        "not in the step's dtype; pallas: the two Pallas kernels of jaxserve.kernels.lora (lora.add_lora_kernels; "
        "one device); shrink: its shrink kernel for x @ a, the rest XLA's (lora.add_lora_shrink_kernel)",
    )
    add("--quantization", choices=["fp8"], default=None, help="the linear weights in FP8 (EngineConfig.quantization)")
    add("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: the KV pool in float8_e4m3fn")
    add("--top", type=int, default=25)
    add("--out", default="step_profile.csv")
    add("--trace-dir", default=None, help="default: next to --out")
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    if not args.variants or set(args.variants) - set(VARIANTS):
        parser.error(f"--variant must name some of {sorted(VARIANTS)}, got {args.variant!r}")
    if args.context + 1 > args.max_seq_len:
        parser.error(f"--max-seq-len ({args.max_seq_len}) must hold --context + 1 ({args.context + 1}) tokens")
    if args.prefill is not None and args.prefill < args.context:
        parser.error(f"--prefill ({args.prefill}) must hold one prompt of --context ({args.context}) tokens")
    return args


# ---- the runner and the step inputs -------------------------------------------------------------


def build_runner(args: argparse.Namespace, family: Any, cfg: Any, weights: Any) -> Runner:
    """A started runner with one decode bucket of --batch rows and one token bucket, as the engine builds it."""
    tokens = args.prefill or args.batch
    compile_config = CompileConfig(
        decode_batch_sizes=(args.batch,),
        token_buckets=(tokens,),
        penalty_variants=False,
    )
    fold = args.lora_delta == "library"  # the other ways take separate tables
    lora = LoraConfig(args.lora_adapters, args.max_lora_rank, fold=fold) if args.lora_adapters else None
    config = EngineConfig(
        args.batch,
        tokens,
        args.max_seq_len,
        compile=compile_config,
        attention_backend=args.backend,
        dtype=args.dtype,
        lora=lora,
        quantization=args.quantization,
    )
    steps = StepConfig.from_config(config, cfg.vocab_size)
    backend = resolve_backend(config.attention_backend)
    spec = RunnerSpec(
        family,
        cfg,
        steps,
        jnp.dtype(args.dtype),
        backend,
        MAX_LOGPROBS,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        lora=lora,
    )
    runner = Runner(spec, weights)
    num_blocks = 1 + args.batch * -(-(args.context + 1) // steps.buckets.block_size)
    seconds = runner.start(num_blocks, show_progress=False)
    print(
        f"started: {runner.table.num_executables} executables compiled in {seconds:.1f} s, pool of {num_blocks} blocks"
    )
    return runner


def _rows(
    n: int, start: int, num_tokens: int, steps: StepConfig, params: SamplingParams, adapters: int = 0
) -> list[ScheduledRow]:
    """n rows over distinct blocks of a seeded permutation of the pool: decode rows (start = C, one
    token, input pending) of C-token prompts, or prefill rows (start 0) of num_tokens-token prompts. With
    `adapters` slots, row i uses slot 1 + i % adapters."""
    rng = np.random.default_rng(n * 1009 + start)
    decode = start > 0
    per_row = -(-(start + num_tokens) // steps.buckets.block_size)
    blocks = 1 + rng.permutation(n * per_row).reshape(n, per_row)
    rows = []
    for i in range(n):
        prompt = rng.integers(1, min(steps.vocab_size, 32000), start if decode else num_tokens).tolist()
        request = Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params)
        if adapters:
            request.lora_slot = 1 + i % adapters
        known = [] if decode else request.token_ids
        block_ids = array("i", blocks[i].tolist())
        row = dict(request=request, start=start, num_tokens=num_tokens, token_ids=known, block_ids=block_ids)
        flags = dict(samples=True, input_pending=decode, generation_index=int(decode), epoch=0, is_prefill=not decode)
        rows.append(ScheduledRow(**row, **flags))
    return rows


def decode_workload(steps: StepConfig, batch: int, context: int, params: SamplingParams, adapters: int) -> Workload:
    scheduled = ScheduledBatch(rows=_rows(batch, context, 1, steps, params, adapters))
    # The previous step sampled these same rows: row b's pending token is row b's sample.
    inputs, bucket, _ = make_step_inputs(scheduled, scheduled, steps)
    if (bucket.num_tokens, bucket.num_seqs, bucket.decode_only) != (batch, batch, True):
        raise RuntimeError(f"the decode batch landed in {bucket}, not the decode bucket of {batch} rows")
    return Workload(f"decode B={batch} C={context}", inputs, bucket, np.ones(batch), np.full(batch, context + 1))


def prefill_workload(
    steps: StepConfig, tokens: int, batch: int, context: int, params: SamplingParams, adapters: int
) -> Workload:
    n = min(batch, tokens // context)
    scheduled = ScheduledBatch(rows=_rows(n, 0, context, steps, params, adapters), num_prefill_rows=n)
    inputs, bucket, _ = make_step_inputs(scheduled, None, steps)
    lens = np.full(n, context)
    return Workload(f"prefill T={bucket.num_tokens} {n}x{context}", inputs, bucket, lens, lens)


# ---- timing and the trace -----------------------------------------------------------------------


def wall_ms(runner: Runner, work: Workload, variant: StepVariant, calls: int) -> float:
    """Milliseconds per call over `calls` back-to-back `runner.run` calls, after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(runner.run(work.inputs, work.bucket, variant))
    start = time.perf_counter()
    for _ in range(calls):
        out = runner.run(work.inputs, work.bucket, variant)
    jax.block_until_ready((out, runner.kv_cache))
    return (time.perf_counter() - start) / calls * 1e3


# The trace's processes of a device (its kernels, copies and memsets); every other process is the host's.
DEVICE_PROCESS = re.compile(r"/device:(GPU|TPU):\d+")


def traced_events(runner: Runner, work: Workload, variant: StepVariant, calls: int, log_dir: str) -> list[Event]:
    """The events of `calls` back-to-back steps run under jax.profiler.trace (python tracer off)."""
    jax.block_until_ready(runner.run(work.inputs, work.bucket, variant))

    def steps() -> None:
        for _ in range(calls):
            out = runner.run(work.inputs, work.bucket, variant)
        jax.block_until_ready((out, runner.kv_cache))

    return profiled_events(steps, log_dir)


def profiled_events(body: Callable[[], None], log_dir: str) -> list[Event]:
    """The events of body() run under jax.profiler.trace into log_dir (python tracer off)."""
    options = jax.profiler.ProfileOptions()
    if hasattr(options, "python_tracer_level"):
        options.python_tracer_level = 0
    with jax.profiler.trace(log_dir, profiler_options=options):
        body()
    runs = glob.glob(os.path.join(log_dir, "plugins", "profile", "*"))
    if not runs:
        raise RuntimeError(f"the profiler wrote no run under {log_dir}/plugins/profile")
    return read_trace(max(runs, key=os.path.getmtime))


def read_trace(run_dir: str) -> list[Event]:
    """Complete events of a profiler run: the Chrome trace JSON, else the XSpace protobuf."""
    paths = glob.glob(os.path.join(run_dir, "*.trace.json.gz"))
    if not paths:
        return [e for path in glob.glob(os.path.join(run_dir, "*.xplane.pb")) for e in _read_xplane(path)]
    events = []
    for path in paths:
        with gzip.open(path, "rt") as f:
            trace = json.load(f).get("traceEvents", [])
        meta = [e for e in trace if e.get("ph") == "M"]
        processes = {e.get("pid"): e["args"]["name"] for e in meta if e.get("name") == "process_name"}
        threads = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
        for e in trace:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            pid, tid, op = e.get("pid"), e.get("tid"), (e.get("args") or {}).get("hlo_op", "")
            where = (processes.get(pid, str(pid)), threads.get((pid, tid), str(tid)))
            events.append(Event(*where, e.get("name", ""), float(e["ts"]), float(e["dur"]), str(op)))
    return events


def _read_xplane(path: str) -> list[Event]:
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for e in line.events:
                op = next((str(v) for k, v in e.stats if k == "hlo_op"), "")
                events.append(Event(plane.name, line.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3, op))
    return events


def device_events(events: list[Event], platform: str) -> tuple[list[Event], str]:
    """The device's events and the rule that picked them (module docstring)."""
    on_device = [e for e in events if DEVICE_PROCESS.search(e.process)]
    streams = [e for e in on_device if e.thread.startswith("Stream")]
    if streams:
        unique = list({(e.process, e.name, e.ts, e.dur): e for e in streams}.values())
        return unique, "device processes /device:GPU:<n>, threads 'Stream #...'"
    if on_device:
        return on_device, "device processes /device:<kind>:<n>, every thread (no 'Stream' lines)"
    if platform != "cpu":  # a GPU host's thunk events are launches, not kernel times
        return [], f"none: the trace has no /device:<kind>:<n> process on {platform}"
    ops = [e for e in events if e.hlo_op and e.process.startswith("/host")]
    return _innermost(ops), "host thunk events with an hlo_op argument, innermost per thread (XLA:CPU)"


def _innermost(events: list[Event]) -> list[Event]:
    """Events of each thread that enclose no other event of that thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    kept = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.ts, -e.dur))
        starts = [e.ts for e in thread_events]
        for i, e in enumerate(thread_events):
            j = bisect.bisect_left(starts, e.ts, lo=i + 1)
            if j == len(thread_events) or thread_events[j].ts >= e.ts + e.dur:
                kept.append(e)
    return kept


def busy_and_span_us(events: list[Event]) -> tuple[float, float]:
    """The union of the events' intervals, and first start to last end (µs, all traced steps)."""
    busy, end = 0.0, -math.inf
    for e in sorted(events, key=lambda e: e.ts):
        busy += max(0.0, e.ts + e.dur - max(e.ts, end))
        end = max(end, e.ts + e.dur)
    return busy, (end - min(e.ts for e in events)) if events else 0.0


# ---- the kernel table and the floors ------------------------------------------------------------


def classify(name: str, hlo_op: str = "") -> str:
    text = f"{name} {hlo_op}".lower()
    return next((group for group, pattern in GROUPS if re.search(pattern, text)), "other")


def kernel_table(events: list[Event], steps: int) -> list[dict]:
    """One row per kernel name, largest first: count and µs per step, share of the kernels' sum."""
    durations, ops = collections.defaultdict(list), collections.defaultdict(dict)
    for e in events:
        durations[e.name].append(e.dur)
        ops[e.name][e.hlo_op] = None
    total = sum(sum(d) for d in durations.values()) or 1.0
    rows = []
    for name, d in durations.items():
        hlo_ops = ";".join(list(ops[name])[:3]) + (";..." if len(ops[name]) > 3 else "")
        row = dict(kernel=name, group=classify(name, hlo_ops), count_per_step=len(d) / steps)
        row.update(us_per_step=sum(d) / steps, share_pct=100 * sum(d) / total, us_per_call=sum(d) / len(d))
        rows.append({**row, "hlo_op": hlo_ops})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def step_costs(
    cfg: Any, specs: Any, work: Workload, itemsize: int, weight_itemsize: int, kv_itemsize: int
) -> dict[str, Cost]:
    """Bytes and flops each floored group must move and compute in one step (module docstring): the layers'
    weights of weight_itemsize bytes (1 in FP8), the KV cache's of kv_itemsize, the rest of itemsize."""
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    layer_params = sum(math.prod(s.shape) for s in leaves if s.logical_axes[0] == "layers" and len(s.shape) >= 3)
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    T, B = work.bucket.num_tokens, work.bucket.num_seqs
    kv_token = 2 * L * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    q, kv = work.q_lens.astype(np.float64), work.kv_lens.astype(np.float64)
    pairs = float(np.sum(q * (kv - q) + q * (q + 1) / 2))
    costs = {
        "layer_gemm": Cost(layer_params * weight_itemsize, 2 * T * layer_params),
        "lm_head": Cost(D * V * itemsize, 2 * B * D * V),
        "attention": Cost(float(kv.sum()) * kv_token, 4 * L * cfg.num_heads * cfg.head_dim * pairs),
        "write_kv": Cost(float(q.sum()) * kv_token, 0.0),
        "embed_rows": Cost(T * D * itemsize, 0.0),
    }
    parts = [costs[k] for k in ("layer_gemm", "lm_head")]
    costs["gemm"] = Cost(sum(c.bytes for c in parts), sum(c.flops for c in parts))
    parts = [costs[k] for k in ("gemm", "attention", "write_kv", "embed_rows")]
    costs["step"] = Cost(sum(c.bytes for c in parts), sum(c.flops for c in parts))
    return costs


def measure_rates(args: argparse.Namespace) -> tuple[float | None, float | None, str]:
    """(TB/s, TFLOP/s, where they came from): the flags, else `ceilings()` on GPU, else none."""
    if args.bandwidth and args.matmul_tflops:
        return args.bandwidth, args.matmul_tflops, "given"
    if jax.default_backend() != "gpu":
        return args.bandwidth, args.matmul_tflops, "not measured off GPU: pass --bandwidth and --matmul-tflops"
    from attention import ceilings

    measured = ceilings()
    tbps, tflops = args.bandwidth or measured["copy_TBps"], args.matmul_tflops or measured["matmul_TFLOPs"]
    return tbps, tflops, f"ceilings(): copy {measured['copy_TBps']:.2f} TB/s, matmul {measured['matmul_TFLOPs']:.1f}"


def floored_groups(profile: Profile, costs: dict[str, Cost], rates: tuple) -> dict[str, dict]:
    """Per kernel group and for the step: µs per step, and the floor and measured / floor where one exists."""
    tbps, tflops, _ = rates
    groups: dict[str, dict] = {}
    for row in profile.kernels:
        g = groups.setdefault(row["group"], dict.fromkeys(("count_per_step", "us_per_step", "share_pct"), 0.0))
        for key in g:
            g[key] += row[key]
    groups = dict(sorted(groups.items(), key=lambda kv: -kv[1]["us_per_step"]))
    for name in FLOORED:
        groups.setdefault(name, dict(count_per_step=0.0, us_per_step=0.0, share_pct=0.0))
    total = sum(r["us_per_step"] for r in profile.kernels)
    groups["step (kernels)"] = dict(count_per_step=sum(r["count_per_step"] for r in profile.kernels))
    groups["step (kernels)"].update(us_per_step=total, share_pct=100.0 if total else 0.0)
    groups["step (wall)"] = dict(count_per_step=None, us_per_step=profile.wall_ms * 1e3, share_pct=None)
    for name, group in groups.items():
        cost = costs.get(name.split()[0])
        if cost is None or not (tbps and tflops):
            continue
        for bound in ("floor", "roofline"):
            group[f"{bound}_us"] = us = getattr(cost, f"{bound}_us")(tbps, tflops)
            group[f"measured_over_{bound}"] = group["us_per_step"] / us if group["us_per_step"] and us else None
    return groups


# ---- the compiled step's HLO --------------------------------------------------------------------


def hlo_instructions(text: str) -> Iterator[tuple[str, str, str, str]]:
    """(computation, shape, opcode, line) of every instruction of an HLO module's text."""
    computation = ""
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        match = re.match(r"^\s+(?:ROOT\s+)?%?[^\s=]+\s*=\s*(.*)$", line)
        if match is None:
            continue
        rest = match.group(1)
        if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
            depth = end = 0
            while end < len(rest) and (depth := depth + {"(": 1, ")": -1}.get(rest[end], 0)) > 0:
                end += 1
            shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        opcode = re.match(r"([a-z][\w\-]*)\(", rest)
        if opcode:
            yield computation, shape, opcode.group(1), line


def weight_shapes(specs: Any) -> tuple[set[str], set[str]]:
    """Dimensions ("4096,14336") of one layer's weight matrices: as sliced (with or without the unit layer
    axis) and as a GEMM reads them, the model-dim axis on one side (wq: 4096,4096), either way round; and
    of whole weights (the stacked arrays, embed, lm_head)."""
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    per_layer, whole = set(), set()
    for spec in leaves:
        if len(spec.shape) >= 2:
            whole.add(",".join(map(str, spec.shape)))
        if spec.logical_axes[0] != "layers" or len(spec.shape) < 3:
            continue
        dims, axes = spec.shape[1:], spec.logical_axes[1:]
        forms = {dims, (1, *dims)}
        for split in {1 if axes[0] == "embed" else None, len(dims) - 1 if axes[-1] == "embed" else None} - {None}:
            flat = (math.prod(dims[:split]), math.prod(dims[split:]))
            forms |= {flat, flat[::-1]}
        per_layer |= {",".join(map(str, f)) for f in forms}
    return per_layer, whole - per_layer


def hlo_counts(text: str, per_layer: set[str], whole: set[str]) -> dict:
    """While loops, conditionals, custom-call targets and weight-shaped instructions outside fusions."""
    instructions = list(hlo_instructions(text))
    fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", text))
    fused_ops = collections.defaultdict(set)
    for computation, _, opcode, _ in instructions:
        if computation in fused and opcode not in _SKIPPED_OPCODES:
            fused_ops[computation].add(opcode)
    counts, targets = collections.Counter(), collections.Counter()
    slices, wholes = collections.Counter(), collections.Counter()
    for computation, shape, opcode, line in instructions:
        if opcode in ("while", "conditional"):
            counts[opcode] += 1
        if opcode == "custom-call":
            targets[next(iter(re.findall(r'custom_call_target="([^"]+)"', line)), "?")] += 1
        array = re.search(r"([a-z]+\d*)\[([\d,]*)\]", shape)
        if computation in fused or opcode in _SKIPPED_OPCODES or not array or array.group(1) not in HLO_FLOATS:
            continue
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        label = f"fusion{{{','.join(sorted(fused_ops[callee.group(1)]))}}}" if opcode == "fusion" and callee else opcode
        if array.group(2) in per_layer:
            slices[f"{label} {array.group(0)}"] += 1
        elif array.group(2) in whole and opcode in ("copy", "copy-start", "fusion", "transpose"):
            wholes[f"{label} {array.group(0)}"] += 1
    copies = sum(n for key, n in slices.items() if key.split()[0] in ("copy", "copy-start"))
    return dict(
        while_loops=counts["while"],
        conditionals=counts["conditional"],
        custom_calls=dict(targets),
        weight_slice_copies=copies,
        weight_slice_ops=dict(slices),
        whole_weight_copies=dict(wholes),
    )


# ---- one profile and the report -----------------------------------------------------------------


def profile_step(runner: Runner, work: Workload, variant: str, layers: str, args: argparse.Namespace) -> Profile:
    """Wall time, the traced kernel table and the HLO counts of one compiled (bucket, variant)."""
    step_variant = VARIANTS[variant]
    wall = wall_ms(runner, work, step_variant, args.calls)
    log_dir = os.path.join(args.trace_dir, re.sub(r"[^\w.=-]+", "_", f"{work.name}_{variant}_{layers}"))
    traced = traced_events(runner, work, step_variant, args.traced, log_dir)
    events, rule = device_events(traced, jax.default_backend())
    busy, span = busy_and_span_us(events)
    forward, sampler = runner.table.lookup(work.bucket, step_variant)
    texts = [executable.as_text() for executable in (forward, sampler) if executable is not None]  # greedy: no sampler
    hlo = hlo_counts("\n".join(texts), *args.weight_shapes)
    leading = {int(f.split(",")[0]) for f in args.weight_shapes[0] if f.count(",") == 1}
    if {work.bucket.num_tokens, work.bucket.num_seqs} & leading:
        hlo["note"] = f"T or B is a weight dimension ({sorted(leading)}): activations may be counted as slices"
    kernels = kernel_table(events, args.traced)
    return Profile(work.name, variant, layers, wall, rule, kernels, busy / args.traced, span / args.traced, hlo)


def print_table(header: list[str], rows: list[list[Any]], left: int = 1) -> None:
    """Rows under a header: the first `left` columns left-aligned; floats to one decimal, None as n/a."""
    cells = [[c if isinstance(c, str) else "n/a" if c is None else f"{c:.1f}" for c in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(header)]
    for row in [header, *cells]:
        aligned = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(aligned))


def print_profile(p: Profile, top: int) -> None:
    total, per_step = p.groups["step (kernels)"]["us_per_step"], p.groups["step (kernels)"]["count_per_step"]
    print(f"\n=== {p.step}, variant {p.variant}, layers {p.layers}")
    print(f"wall {p.wall_ms:.3f} ms/call; kernels {total / 1e3:.3f} ms/step (busy {p.busy_us / 1e3:.3f}, span ", end="")
    print(f"{p.span_us / 1e3:.3f}), {per_step:.0f} kernels/step; device events: {p.rule}")
    if not p.kernels:
        print("NO DEVICE EVENTS in the trace (was CUPTI available to this process?)")
    rows = [
        [str(i), r["kernel"][:70], r["group"], r["count_per_step"], r["us_per_step"], f"{r['share_pct']:.1f}%"]
        for i, r in enumerate(p.kernels[:top], 1)
    ]
    rest = p.kernels[top:]
    if rest:
        rows.append(["", f"({len(rest)} more kernel names)", "", "", sum(r["us_per_step"] for r in rest), ""])
    rows.append(["", f"total ({len(p.kernels)} kernel names)", "", per_step, total, "100.0%"])
    print_table(["#", "kernel", "group", "count/step", "us/step", "share"], rows, left=3)
    rows = []
    for name, g in p.groups.items():
        ratios = [g.get(f"measured_over_{b}") for b in ("floor", "roofline")]
        share = None if g["share_pct"] is None else f"{g['share_pct']:.1f}%"
        row = [name, g["count_per_step"], g["us_per_step"], share, g.get("floor_us"), g.get("roofline_us")]
        rows.append(row + [r and f"{r:.2f}" for r in ratios])
    header = ["group", "count/step", "us/step", "share", "floor us", "roofline us", "measured/floor", "/roofline"]
    print_table(header, rows)
    h = p.hlo
    print(f"HLO: {h['while_loops']} while, {h['conditionals']} conditional, {h['weight_slice_copies']} copy", end="")
    print(f" or copy-start of a layer weight's shape; custom-calls {h['custom_calls']}")
    print(f"  layer-weight-shaped instructions outside fusions: {h['weight_slice_ops'] or 'none'}")
    print(f"  whole-weight copies: {h['whole_weight_copies'] or 'none'}")


def print_costs(costs: dict[str, Cost], rates: tuple, name: str) -> None:
    tbps, tflops, source = rates
    print(f"\nfloors of {name} at {tbps or 'n/a'} TB/s and {tflops or 'n/a'} TFLOP/s ({source}):")
    rows = []
    for key, cost in costs.items():
        bounds = [
            f"{b(tbps, tflops) / 1e3:.3f}" if tbps and tflops else None for b in (cost.floor_us, cost.roofline_us)
        ]
        rows.append([key, f"{cost.bytes / 1e9:.3f}", f"{cost.flops / 1e12:.4f}", *bounds])
    print_table(["part", "GB", "TFLOP", "floor ms (bytes + flops)", "roofline ms (max)"], rows)


def print_summary(profiles: list[Profile]) -> None:
    def ratio(p: Profile, group: str, bound: str = "floor") -> str | None:
        value = p.groups[group].get(f"measured_over_{bound}")
        return None if value is None else f"{value:.2f}"

    rows = []
    for p in profiles:
        floor = p.groups["step (kernels)"].get("floor_us")
        kernels_ms = f"{p.groups['step (kernels)']['us_per_step'] / 1e3:.3f}"
        row = [p.step, p.variant, p.layers, f"{p.wall_ms:.3f}", kernels_ms, floor and f"{floor / 1e3:.3f}"]
        row += [ratio(p, "step (wall)"), ratio(p, "step (kernels)"), ratio(p, "gemm"), ratio(p, "attention")]
        row += [ratio(p, "step (kernels)", "roofline")]
        rows.append(row + [str(p.hlo["while_loops"]), str(sum(p.hlo["weight_slice_ops"].values()))])
    header = ["step", "variant", "layers", "wall ms", "kernels ms", "floor ms", "wall/floor", "kernels/floor"]
    print()
    print_table(header + ["gemm/floor", "attn/floor", "kernels/roofline", "while", "slice ops"], rows, left=3)


def write_outputs(out: str, profiles: list[Profile], extra: dict) -> None:
    columns = ["step", "variant", "layers", "rank", "kernel", "group", "count_per_step", "us_per_step"]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns + ["share_pct", "us_per_call", "hlo_op"])
        writer.writeheader()
        for p in profiles:
            for rank, row in enumerate(p.kernels, 1):
                writer.writerow({"step": p.step, "variant": p.variant, "layers": p.layers, "rank": rank, **row})
    summaries = [{k: v for k, v in asdict(p).items() if k != "kernels"} for p in profiles]
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({**extra, "profiles": summaries}, f, indent=1)
    print(f"\nwrote {out} and {os.path.splitext(out)[0]}.json")


def main() -> None:
    args = parse_args()
    # What quant.linear calls for an adapted linear, replaced before anything is traced.
    if args.lora_delta == "float32":
        quant.add_lora = lambda base, x, w: base + lora.lora_delta(x, w, result_dtype=jnp.float32)
    elif args.lora_delta == "pallas":
        quant.add_lora = lora.add_lora_kernels
    elif args.lora_delta == "shrink":
        quant.add_lora = lora.add_lora_shrink_kernel
    args.trace_dir = args.trace_dir or os.path.splitext(args.out)[0] + "_traces"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    enable_compilation_cache(None)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {' '.join(sys.argv[1:])}")
    rates = measure_rates(args)  # before the weights, so its buffers are gone when they land
    override = {"num_hidden_layers": args.layers} if args.layers else {}
    family, cfg = registry.resolve({**SHAPES[args.shape], **override})
    start = time.perf_counter()
    weights = jax.block_until_ready(family.init_weights(cfg, jax.random.key(0), jnp.dtype(args.dtype)))
    print(f"{args.shape} ({cfg.num_layers} layers) random {args.dtype} weights in {time.perf_counter() - start:.1f} s")
    runner = build_runner(args, family, cfg, weights)
    del weights  # the runner holds them
    steps, params = runner.spec.steps, SamplingParams(temperature=args.temperature)
    works = [decode_workload(steps, args.batch, args.context, params, args.lora_adapters)]
    if args.prefill:
        works.append(prefill_workload(steps, args.prefill, args.batch, args.context, params, args.lora_adapters))
    specs = family.param_specs(cfg)
    args.weight_shapes = weight_shapes(specs)
    itemsize = jnp.dtype(args.dtype).itemsize
    weight_itemsize = 1 if args.quantization else itemsize
    kv_itemsize = 1 if args.kv_cache_dtype == "fp8" else itemsize
    costs = {w.name: step_costs(cfg, specs, w, itemsize, weight_itemsize, kv_itemsize) for w in works}
    for w in works:
        print_costs(costs[w.name], rates, w.name)
    profiles = []
    for work in works:
        for variant in args.variants:
            profile = profile_step(runner, work, variant, "per-layer", args)
            profile.groups = floored_groups(profile, costs[work.name], rates)
            print_profile(profile, args.top)
            profiles.append(profile)
    print_summary(profiles)
    extra = {"argv": sys.argv[1:], "device": jax.devices()[0].device_kind, "rates": rates}
    extra["costs"] = {name: {part: asdict(cost) for part, cost in parts.items()} for name, parts in costs.items()}
    write_outputs(args.out, profiles, extra)


if __name__ == "__main__":
    main()
