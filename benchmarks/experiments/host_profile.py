"""Where the engine's host time goes per step at a large batch: one `LLM.generate` of many short requests on
a tiny random-weight model (its device step is small, so the host's share shows), under cProfile.

    python benchmarks/host_profile.py --num-requests 1024 --output-len 32 [--temperature 0.8 --top-k 50]

Prints the steps, the engine's host and dispatch time per step (`StepStats`), the wall time per step, and
the functions with the most own time per step. Runs on any backend (the CPU is the point: host policy is
plain Python/numpy).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from jaxserve import bench, workload
from jaxserve.config import CompileConfig
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top", type=int, default=20, help="functions listed")
    args = parser.parse_args()
    model, tokenizer = bench.load_model(None, "tiny-llama")
    rows = args.num_requests
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_batch_size=rows,
        max_num_tokens=max(rows * 2, 256),
        max_seq_len=args.input_len + args.output_len + 16,
        compile_config=CompileConfig(decode_batch_sizes=(rows,), token_buckets=(max(rows * 2, 256),)),
        attention_backend="xla",
        show_progress=False,
    )
    prompts = workload.random_prompts(rows, args.input_len, model.config.vocab_size, seed=0)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, top_k=args.top_k, ignore_eos=True, seed=0
    )
    llm.generate(prompts[:8], params, use_tqdm=False)
    first = len(llm.step_stats)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    elapsed = time.perf_counter() - start
    stats = llm.step_stats[first:]
    n = len(stats)
    host = sum(s.host_seconds for s in stats) / n * 1e3
    dispatch = sum(s.dispatch_seconds for s in stats) / n * 1e3
    print(f"{rows} requests x {args.input_len}/{args.output_len}: {n} steps in {elapsed:.2f} s", end=", ")
    print(f"{elapsed / n * 1e3:.1f} ms per step; host (inputs + dispatch) {host:.2f} ms, dispatch {dispatch:.2f} ms")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print(f"own time per step (the profiled calls over {n} steps):")
    for line in text.getvalue().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[1].replace(".", "", 1).isdigit():
            print(f"  {float(parts[1]) / n * 1e3:8.3f} ms  {parts[0]:>8} calls  {parts[5][-90:]}")


if __name__ == "__main__":
    main()
