"""The engine's scheduler on a throughput workload without a model: which steps it makes, and what they would
cost on a GPU under a bytes-and-flops model. For comparing policies and bucket tables before spending device
time; the model's figures are estimates, not measurements.

    python benchmarks/schedule_sim.py --num-requests 512 --input-len 1000 --output-len 1000 --kv-tokens 830752
    python benchmarks/schedule_sim.py ... --capacity-policy max_utilization --decode-batch-sizes 256,320,384,448,512

The real `Scheduler` and `BlockManager` run the workload (every request makes exactly --output-len tokens);
each step is looked up in the real `BucketTable` and costed as
    max(weights / bandwidth, gemm flops of the bucket's tokens / matmul rate)
    + KV bytes every row reads / bandwidth + prefill attention flops / (matmul rate / 2) + --overhead-ms
with the Llama-3.1-8B shape's figures (7.0 G layer parameters per token, 0.53 G of lm_head per row, 128 KiB
of K/V per token). Prints the steps by kind (decode-only, mixed), the rows and padding of the decode steps,
preemptions, and the estimated elapsed time and output tok/s.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from jaxserve.block_manager import BlockManager
from jaxserve.buckets import BucketTable
from jaxserve.config import CapacityPolicy, CompileConfig, EngineConfig, SchedulerConfig
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import Scheduler

LAYER_PARAMS = 6.98e9  # Llama-3.1-8B: 32 layers of attention and MLP matrices
HEAD_PARAMS = 0.525e9  # lm_head, 4096 x 128256
WEIGHT_BYTES = 16.06e9
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
ATTENTION_FLOPS_PER_PAIR = 4 * 32 * 32 * 128


def step_cost_ms(num_tokens: int, num_rows: int, kv_read_tokens: int, prefill_pairs: int, args) -> float:
    bw, mm = args.bandwidth * 1e12, args.matmul_tflops * 1e12
    gemm = max(WEIGHT_BYTES / bw, (2 * LAYER_PARAMS * num_tokens + 2 * HEAD_PARAMS * num_rows) / mm)
    attention = kv_read_tokens * KV_BYTES_PER_TOKEN / bw + prefill_pairs * ATTENTION_FLOPS_PER_PAIR / (mm / 2)
    return 1e3 * (gemm + attention) + args.overhead_ms


def simulate(args) -> dict:
    policy = CapacityPolicy(args.capacity_policy)
    compile_config = CompileConfig(decode_batch_sizes=args.decode_batch_sizes)
    config = EngineConfig(
        args.max_batch_size,
        args.max_num_tokens,
        args.max_seq_len,
        scheduler=SchedulerConfig(capacity_policy=policy),
        compile=compile_config,
    )
    buckets = BucketTable.from_config(config, "pallas")
    block_size = config.kv_cache.block_size
    # Bucket-aware admission as the engine does it, with this model's cost of each decode size on padding.
    costs = {size: step_cost_ms(size, size, 0, 0, args) for size in buckets.decode_batch_sizes}
    manager = BlockManager(1 + args.kv_tokens // block_size, block_size)
    scheduler = Scheduler(config, manager, decode_costs=None if args.no_bucket_aware_admission else costs)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = rng.integers(1, 32000, args.input_len).tolist()
        scheduler.add(Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    decode_rows, decode_padded = [], []
    steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        if batch.is_empty:
            raise RuntimeError("the scheduler made an empty step with requests unfinished")
        rows = batch.rows
        num_tokens = sum(row.num_tokens for row in rows)
        decode_only = batch.is_decode_only
        bucket = buckets.lookup(num_tokens, len(rows), decode_only)
        kv_read = sum(row.start + row.num_tokens for row in rows if row.num_tokens == 1)
        pairs = sum(row.num_tokens * row.start + row.num_tokens * (row.num_tokens + 1) // 2 for row in rows)
        cost = step_cost_ms(bucket.num_tokens, bucket.num_seqs, kv_read, pairs if not decode_only else 0, args)
        kinds["decode" if decode_only else "mixed"].append(cost)
        if decode_only:
            decode_rows.append(len(rows))
            decode_padded.append(bucket.num_seqs)
        scheduler.update(batch, np.ones(len(rows), np.int64))
        steps += 1
    elapsed = sum(sum(costs) for costs in kinds.values()) / 1e3
    return {
        "steps": steps,
        "kinds": {k: (len(v), sum(v) / 1e3) for k, v in kinds.items()},
        "decode_rows_mean": float(np.mean(decode_rows)) if decode_rows else 0.0,
        "decode_padding": 1 - sum(decode_rows) / sum(decode_padded) if decode_padded else 0.0,
        "preemptions": scheduler.num_preemptions,
        "elapsed_s": elapsed,
        "output_tok_per_s": args.num_requests * args.output_len / elapsed,
    }


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--kv-tokens", type=int, default=830_752, help="the KV pool (default: the 8B on an H200)")
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=2176)
    parser.add_argument("--capacity-policy", choices=[p.value for p in CapacityPolicy], default="guaranteed_no_evict")
    parser.add_argument(
        "--no-bucket-aware-admission", action="store_true", help="admit up to max_batch_size (SchedulerConfig)"
    )
    parser.add_argument("--decode-batch-sizes", type=parse_sizes, default=None, help="default: the engine's")
    parser.add_argument("--bandwidth", type=float, default=4.3, help="TB/s")
    parser.add_argument("--matmul-tflops", type=float, default=640.0, help="the GEMMs' rate, TFLOP/s")
    parser.add_argument("--overhead-ms", type=float, default=0.6, help="per step: small kernels, launch gaps")
    args = parser.parse_args()
    start = time.perf_counter()
    result = simulate(args)
    print(f"simulated in {time.perf_counter() - start:.1f} s")
    for kind, (count, seconds) in result["kinds"].items():
        print(f"{kind:>8} steps {count:6d}  {seconds:7.2f} s  ({1e3 * seconds / count:.2f} ms each)")
    print(
        f"decode rows mean {result['decode_rows_mean']:.1f}, padding {100 * result['decode_padding']:.1f}%; "
        f"preemptions {result['preemptions']}"
    )
    print(f"estimated {result['elapsed_s']:.2f} s, {result['output_tok_per_s']:.0f} output tok/s")


if __name__ == "__main__":
    main()
