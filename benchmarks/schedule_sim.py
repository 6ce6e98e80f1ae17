"""The engine's scheduler on a throughput workload without a model: which steps it makes, and what they would
cost on a GPU under a bytes-and-flops model. For comparing policies and bucket tables before spending device
time; the model's figures are estimates, not measurements.

    python benchmarks/schedule_sim.py --num-requests 512 --input-len 1000 --output-len 1000 --kv-tokens 830752
    python benchmarks/schedule_sim.py ... --capacity-policy max_utilization --decode-batch-sizes 256,320,384,448,512
    python benchmarks/schedule_sim.py --shape gemma-3-12b --num-requests 256 --input-len 8192 --output-len 256 \
        --max-seq-len 8448 --kv-gib 38 [--no-sliding-window-kv]

The real `Scheduler` and `BlockManager` (with the model's KV layout: sliding layers' groups keep their window
unless --no-sliding-window-kv) run the workload (every request makes exactly --output-len tokens); each step
is looked up in the real `BucketTable` and costed as
    max(weights the step reads / bandwidth, gemm flops of the bucket's tokens / matmul rate)
    + KV bytes every row reads / bandwidth + prefill attention flops / (matmul rate / 2) + --overhead-ms
with the figures of the --shape (`jaxserve/models/shapes.py`, default llama-3.1-8b): its layers' matrix
parameters per token, lm_head per row, every parameter's bytes, and per layer the K/V bytes of a token and
the keys a query reads (all before it, or its window). Prints the steps by kind (decode-only, mixed), the
rows and padding of the decode steps, preemptions, and the estimated elapsed time and output tok/s.

The estimated output tok/s is the job's ceiling (docs/performance.md, "Ceilings"): the real scheduler's steps,
each as fast as its bytes or its GEMMs allow at the given rates (--overhead-ms 0: nothing else).

A mixture of experts (qwen3-30b-a3b, mixtral-8x7b) is costed by its active parameters and the experts its steps
hit. Flops per token: 2 x (attention + router + top_k experts + shared expert, over the layers; a dense layer's
MLP in full), and 2 x lm_head per row. Bytes of a step of T tokens (the bucket's, padding included: padding
tokens are routed too, to at most top_k more experts):
    attention, router, shared expert, dense layers, embedding and lm_head (as a dense model counts them)
    + E * (1 - (1 - k/E)^T) * one expert's bytes, in every expert layer
where E * (1 - (1 - k/E)^T) is the expected number of a layer's E experts that receive a row when each token
takes k of them uniformly and independently (a token misses a given expert with probability 1 - k/E): 8 of
Qwen3-30B-A3B's 128 at T = 1, 51.6 at T = 8, 125.9 at T = 64. Real routing is not uniform: a skewed router hits
fewer experts, so this overstates a small step's bytes.

    python benchmarks/schedule_sim.py --shape qwen3-30b-a3b --num-requests 1024 --input-len 128 --output-len 128 \
        --max-seq-len 256 --kv-gib 60 --bandwidth 2.85 --matmul-tflops 700 --overhead-ms 0
"""

from __future__ import annotations

import argparse
import collections
import time
from dataclasses import dataclass

import numpy as np

from jaxserve.block_manager import BlockManager
from jaxserve.buckets import BucketTable
from jaxserve.config import CapacityPolicy, CompileConfig, EngineConfig, SchedulerConfig
from jaxserve.kv_layout import kv_layout
from jaxserve.models import registry, shapes
from jaxserve.models.layers import LayerMlp
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import Scheduler


@dataclass(frozen=True)
class ModelCosts:
    """What one token costs a model of this shape, in bf16. A mixture of experts' routed experts are counted apart:
    a token is multiplied by its top_k of each expert layer (`layer_params`), and a step reads the experts its
    tokens hit (`step_weight_bytes`)."""

    layer_params: float  # the matrices a token goes through over every layer: 2x this many flops per token
    head_params: float  # lm_head (the tied embedding when tied): 2x this many flops per sampled row
    weight_bytes: float  # every parameter's bytes but the routed experts' (an untied embedding counted, though a
    # step reads a few rows)
    kv_bytes: int  # K and V of one token in one layer
    pair_flops: float  # one query against one key in one layer: QK and PV
    windows: tuple[int | None, ...]  # each layer's window (None: every key before the query)
    expert_bytes: float = 0.0  # one routed expert's bytes in every expert layer together
    num_experts: int = 0  # routed experts of an expert layer (0: a dense model)
    top_k: int = 0  # experts a token is routed to

    def experts_hit(self, num_tokens: int) -> float:
        """Expected experts of a layer that receive a row when each of num_tokens tokens takes top_k of the E
        experts, uniformly and independently: E * (1 - (1 - k/E)^T)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)

    def step_weight_bytes(self, num_tokens: int) -> float:
        """The weights a step of num_tokens tokens reads: all but the routed experts, and the experts hit."""
        return self.weight_bytes + self.experts_hit(num_tokens) * self.expert_bytes


def model_costs(name: str, fp8_weights: bool = False, fp8_kv: bool = False) -> ModelCosts:
    """The shape's costs: per layer the attention's q/k/v/o matrices and its MLP (a dense SwiGLU; or the router,
    top_k routed experts and the shared expert, of which every step reads all but the routed experts). fp8_weights:
    the layers' matrices at one byte a value (`--quantization fp8`: embedding and lm_head stay bf16); fp8_kv: K and
    V at one byte a value."""
    _, cfg = registry.resolve(shapes.shape(name))
    hidden, q_width, kv_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = hidden * (2 * q_width + 2 * kv_width) * cfg.num_layers
    mlps = getattr(cfg, "mlp_layers", None) or (LayerMlp(cfg.intermediate_size),) * cfg.num_layers
    active = read = expert = 0  # per token over the layers; read by every step; one expert of every expert layer
    num_experts = top_k = 0
    for mlp in mlps:
        gated = 3 * hidden * mlp.intermediate_size  # gate, up and down
        if mlp.num_experts is None:
            active, read = active + gated, read + gated
            continue
        fs = mlp.shared_intermediate_size
        always = hidden * mlp.num_experts + (3 * hidden * fs + hidden if fs is not None else 0)  # router, shared
        active, read, expert = active + always + mlp.top_k * gated, read + always, expert + gated
        num_experts, top_k = mlp.num_experts, mlp.top_k
    head = cfg.vocab_size * hidden
    embedding = 0 if cfg.tie_word_embeddings else head
    linear_bytes, kv_value_bytes = (1 if fp8_weights else 2), (1 if fp8_kv else 2)
    return ModelCosts(
        layer_params=attention + active,
        head_params=head,
        weight_bytes=linear_bytes * (attention + read) + 2 * (head + embedding),
        kv_bytes=2 * kv_width * kv_value_bytes,
        pair_flops=4 * q_width,
        windows=tuple(layer.sliding_window for layer in cfg.attention_layers),
        expert_bytes=linear_bytes * expert,
        num_experts=num_experts,
        top_k=top_k,
    )


def keys_read(start: int, num_tokens: int, window: int | None) -> int:
    """Query-key pairs of queries at positions [start, start + num_tokens), each reading the keys up to its own
    position, or its last `window` of them."""
    end = start + num_tokens
    total = (end * (end + 1) - start * (start + 1)) // 2  # sum of p + 1 over the chunk
    if window is None or end <= window:
        return total
    capped_from = max(start, window - 1)  # positions p >= window - 1 read exactly `window` keys
    over = (end * (end + 1) - capped_from * (capped_from + 1)) // 2 - window * (end - capped_from)
    return total - over


def step_cost_ms(costs: ModelCosts, num_tokens: int, num_rows: int, decode_rows, prefill_rows, args) -> float:
    """One step: the bucket's GEMMs or its weights' bytes, each decode row's keys in every layer, each prefill
    chunk's query-key pairs in every layer. Rows are (start, num_tokens)."""
    bw, mm = args.bandwidth * 1e12, args.matmul_tflops * 1e12
    layer_mm = (args.fp8_tflops if args.quantization == "fp8" else args.matmul_tflops) * 1e12
    gemm = max(
        costs.step_weight_bytes(num_tokens) / bw,
        2 * costs.layer_params * num_tokens / layer_mm + 2 * costs.head_params * num_rows / mm,
    )
    kv_read = sum(keys_read(start, 1, w) for start, _ in decode_rows for w in costs.windows)
    pairs = sum(keys_read(start, n, w) for start, n in prefill_rows for w in costs.windows)
    attention = kv_read * costs.kv_bytes / bw + pairs * costs.pair_flops / (mm / 2)
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
    model = model_costs(args.shape, args.quantization == "fp8", args.kv_cache_dtype == "fp8")
    layout = kv_layout(model.windows, keep_window_only=not args.no_sliding_window_kv)
    page_bytes = block_size * layout.layers_per_page * model.kv_bytes
    if args.kv_gib is not None:
        num_pages = int(args.kv_gib * 2**30 // page_bytes)
    else:  # --kv-tokens: a pool of that many tokens of every layer
        num_pages = 1 + args.kv_tokens * len(model.windows) // (layout.layers_per_page * block_size)
    # Bucket-aware admission as the engine does it, with this model's cost of each decode size on padding.
    costs = {size: step_cost_ms(model, size, size, [], [], args) for size in buckets.decode_batch_sizes}
    manager = BlockManager(num_pages, block_size, layout=layout)
    scheduler = Scheduler(config, manager, decode_costs=None if args.no_bucket_aware_admission else costs)
    print(
        f"{args.shape}: KV pool {num_pages} pages of {block_size} tokens x {layout.layers_per_page} layers "
        f"({num_pages * page_bytes / 2**30:.2f} GiB, {layout.num_groups} layer group(s))"
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = rng.integers(1, 32000, args.input_len).tolist()
        scheduler.add(Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    decode_rows, decode_padded = [], []
    steps = most_running = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        if batch.is_empty:
            raise RuntimeError("the scheduler made an empty step with requests unfinished")
        rows = batch.rows
        num_tokens = sum(row.num_tokens for row in rows)
        decode_only = batch.is_decode_only
        bucket = buckets.lookup(num_tokens, len(rows), decode_only)
        decodes = [(row.start, 1) for row in rows if row.num_tokens == 1]
        prefills = [(row.start, row.num_tokens) for row in rows if row.num_tokens > 1]
        cost = step_cost_ms(model, bucket.num_tokens, bucket.num_seqs, decodes, prefills, args)
        kinds["decode" if decode_only else "mixed"].append(cost)
        most_running = max(most_running, len(scheduler.running))
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
        "most_running": most_running,
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
    parser.add_argument("--shape", default="llama-3.1-8b", choices=list(shapes.SHAPES), help="the model's shape")
    parser.add_argument(
        "--kv-tokens", type=int, default=830_752, help="the KV pool in tokens of every layer (default: the 8B, H200)"
    )
    parser.add_argument("--kv-gib", type=float, default=None, help="the KV pool in GiB (instead of --kv-tokens)")
    parser.add_argument(
        "--no-sliding-window-kv", action="store_true", help="every layer keeps every token's KV (KvCacheConfig)"
    )
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
    parser.add_argument(
        "--quantization", choices=["fp8"], default=None, help="the layers' linear weights in FP8 (one byte a value)"
    )
    parser.add_argument("--fp8-tflops", type=float, default=None, help="with --quantization fp8: the layers' GEMM rate")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: one byte a K/V value")
    args = parser.parse_args()
    if args.quantization == "fp8" and args.fp8_tflops is None:
        parser.error("--quantization fp8 needs --fp8-tflops (the card's FP8 matmul rate)")
    start = time.perf_counter()
    result = simulate(args)
    print(f"simulated in {time.perf_counter() - start:.1f} s")
    for kind, (count, seconds) in result["kinds"].items():
        print(f"{kind:>8} steps {count:6d}  {seconds:7.2f} s  ({1e3 * seconds / count:.2f} ms each)")
    print(
        f"decode rows mean {result['decode_rows_mean']:.1f}, padding {100 * result['decode_padding']:.1f}%; "
        f"preemptions {result['preemptions']}; at most {result['most_running']} requests running"
    )
    print(f"estimated {result['elapsed_s']:.2f} s, {result['output_tok_per_s']:.0f} output tok/s")


if __name__ == "__main__":
    main()
