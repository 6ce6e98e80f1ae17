"""Engine benchmark: warmup time, KV capacity (with its log breakdown) and offline generation throughput.

    python benchmarks/engine.py --model smollm2 --backend pallas --save-tokens out/pallas.npy
    python benchmarks/engine.py --model smollm2 --backend xla --compare-tokens out/pallas.npy
    python benchmarks/engine.py --model llama8b --backend pallas

`smollm2` is the default model (real weights); `llama8b` is a Llama-3.1-8B-shaped model with random
bf16 weights (no checkpoint needed). Prompts are random token ids (fixed seed), decoding is greedy
with ignore_eos, so every request generates exactly --max-tokens tokens. Prints one JSON line of
results last; the capacity log (every term of the KV budget) goes to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import sys
import time

import numpy as np

# The random-weight models: this script's names for the shapes of jaxserve/models/shapes.py.
RANDOM_MODELS = {"llama8b": "llama-3.1-8b", "smollm2-random": "smollm2-135m"}


def load(args: argparse.Namespace):
    from jaxserve import bench
    from jaxserve.models.loader import load_model
    from jaxserve.tokenizer import Tokenizer

    if args.model == "smollm2":
        model = load_model("smollm2-135m-instruct", dtype=args.dtype)
        return model, Tokenizer.from_source(model.tokenizer_source)
    return bench.random_model(RANDOM_MODELS[args.model], args.dtype), bench.TokenIdTokenizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", *RANDOM_MODELS], default="smollm2")
    parser.add_argument("--backend", choices=["pallas", "xla"], default="pallas")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--decode-sizes", default=None, help="comma-separated decode buckets (default: TensorRT-LLM's)")
    parser.add_argument("--token-buckets", default=None, help="comma-separated token buckets (default: powers of 2)")
    parser.add_argument("--cache-dir", default=None, help="persistent compilation cache directory")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed generate; top functions to stderr")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size: GPUs the model is split over")
    parser.add_argument("--save-tokens", default=None)
    parser.add_argument("--compare-tokens", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("jax", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from jaxserve import bench, capacity, gpu_client, workload

    capacity.raise_memory_fraction_default()
    gpu_client.use_tfrt_client_default(args.tp)

    from jaxserve.config import CompileConfig
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams

    def sizes(text: str | None) -> tuple[int, ...] | None:
        return tuple(int(x) for x in text.split(",")) if text else None

    t0 = time.perf_counter()
    model, tokenizer = load(args)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        compile_config=CompileConfig(
            decode_batch_sizes=sizes(args.decode_sizes),
            token_buckets=sizes(args.token_buckets),
            cache_dir=args.cache_dir,
            penalty_variants=False,
        ),
        attention_backend=args.backend,
        tensor_parallel_size=args.tp,
        show_progress=False,
    )
    engine_s = time.perf_counter() - t0
    prompts = workload.random_prompts(args.num_prompts, args.prompt_len, model.config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    first_stat = len(llm.step_stats)
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    tokens = np.array([o.outputs[0].token_ids for o in outputs], dtype=np.int32)
    stats = llm.step_stats[first_stat:]
    step_ms = bench.decode_step_ms(stats)
    result = {
        "model": args.model,
        "backend": args.backend,
        "tp": args.tp,
        "dtype": args.dtype,
        "load_s": round(load_s, 2),
        "engine_init_s": round(engine_s, 2),
        "warmup_s": round(llm.engine.warmup_seconds, 2),
        "num_buckets": len(llm.engine.buckets.buckets),
        "kv_blocks": llm.engine.kv_budget.num_blocks,
        "kv_tokens": llm.engine.kv_budget.tokens(llm.config.kv_cache.block_size),
        "kv_gib": round(llm.engine.kv_budget.num_blocks * llm.engine.kv_budget.bytes_per_block / 2**30, 2),
        "generate_s": round(gen_s, 3),
        "output_tok_per_s": round(tokens.size / gen_s, 1),
        "total_tok_per_s": round((tokens.size + args.num_prompts * args.prompt_len) / gen_s, 1),
        "steps": len(stats),
        "mean_host_ms": round(1e3 * float(np.mean([s.host_seconds for s in stats])), 3) if stats else None,
        "mean_dispatch_ms": round(1e3 * float(np.mean([s.dispatch_seconds for s in stats])), 3) if stats else None,
        "decode_step_ms": None if step_ms is None else round(step_ms, 3),
    }
    if args.save_tokens:
        np.save(args.save_tokens, tokens)
    if args.compare_tokens:
        other = np.load(args.compare_tokens)
        same_rows = (other == tokens).all(axis=1)
        first_diff = [int(np.argmax(a != b)) for a, b in zip(other, tokens, strict=True) if (a != b).any()]
        result["identical_rows"] = f"{int(same_rows.sum())}/{len(same_rows)}"
        result["first_divergence_positions"] = sorted(first_diff)[:20]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
