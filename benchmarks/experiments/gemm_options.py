"""XLA's GEMM choices per step size: each forward compiled with XLA's default (Triton GEMMs autotuned
against cuBLAS), with Triton GEMMs off (cuBLAS only, its algorithms autotuned) and with Triton GEMMs and
autotuning off (cuBLAS's own heuristic choice), its compile time and its step time.

    python benchmarks/experiments/gemm_options.py --decode 1,8,32,64,128,256,512,1024 --prefill 256,2048,8192
    python benchmarks/experiments/gemm_options.py --shape tiny --decode 1,4 --prefill 32 --backend xla   # CPU check

The runner is built as benchmarks/step_profile.py builds it (an EngineConfig whose step table holds every
size asked for, started lazily over a pool that holds the largest decode batch), with random --shape
weights and the compilation caches off. Per size and option set: `runner.table.compile_forward` with those
compiler options (seconds: tracing, lowering and XLA's compile of one executable, one at a time), then
wall ms per step over --calls back-to-back `runner.run` calls of steady decode at --context tokens (the
step_profile workload), or of a prefill of --context-token prompts filling the token bucket. The
engine's own choice (`runner.forward_compiler_options`) is printed beside each size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: step_profile

import jax
import jax.numpy as jnp
from step_profile import SHAPES, VARIANTS, decode_workload, prefill_workload, wall_ms

from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.models import registry
from jaxserve.runner import Runner, resolve_backend
from jaxserve.sampling import MAX_LOGPROBS, SamplingParams
from jaxserve.step import RunnerSpec
from jaxserve.step_table import TRITON_GEMM_OPTION, enable_compilation_cache, forward_compiler_options
from jaxserve.variants import StepConfig

OPTION_SETS = {
    "xla default": {},
    "cublas only": {TRITON_GEMM_OPTION: False},
    "cublas untuned": {TRITON_GEMM_OPTION: False, "xla_gpu_autotune_level": 0},
    "exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
}


def sizes(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--shape", choices=sorted(SHAPES), default="llama8b")
    add("--dtype", default="bfloat16")
    add("--decode", type=sizes, default=sizes("1,8,32,64,128,256,512,1024"), help="decode batch sizes")
    add("--prefill", type=sizes, default=sizes("256,2048,8192"), help="token buckets (prefill steps)")
    add("--context", type=int, default=128, help="tokens in each decode row's cache; each prefill prompt's length")
    add("--max-seq-len", type=int, default=2048)
    add("--backend", choices=["pallas", "xla"], default="pallas")
    add("--calls", type=int, default=20)
    add("--json", default=None, help="also write the rows to this file")
    add("--options", default="xla default,cublas only,cublas untuned", help=f"option sets, of {list(OPTION_SETS)}")
    args = parser.parse_args()
    enable_compilation_cache(None)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {' '.join(sys.argv[1:])}")

    family, cfg = registry.resolve(SHAPES[args.shape])
    weights = jax.block_until_ready(family.init_weights(cfg, jax.random.key(0), jnp.dtype(args.dtype)))
    max_batch = max(args.decode)
    max_tokens = max([*args.prefill, max_batch])
    compile_config = CompileConfig(
        decode_batch_sizes=tuple(args.decode), token_buckets=tuple(args.prefill) or (max_batch,), penalty_variants=False
    )
    config = EngineConfig(max_batch, max_tokens, args.max_seq_len, compile=compile_config, dtype=args.dtype)
    steps = StepConfig.from_config(config, cfg.vocab_size)
    spec = RunnerSpec(family, cfg, steps, jnp.dtype(args.dtype), resolve_backend(args.backend), MAX_LOGPROBS)
    runner = Runner(spec, weights)
    del weights
    blocks_per_row = -(-(args.context + 1) // steps.buckets.block_size)
    runner.start(1 + max_batch * blocks_per_row, show_progress=False, lazy=True)
    params, variant = SamplingParams(temperature=0.0), VARIANTS["greedy"]
    works = [decode_workload(steps, b, args.context, params) for b in args.decode]
    works += [prefill_workload(steps, t, max_batch, min(args.context, t), params) for t in args.prefill]
    platform = runner.mesh.devices.flat[0].platform

    rows = []
    print(f"{'step':<28} {'engine uses':<14} {'options':<14} {'compile s':>9} {'ms/step':>8}")
    for work in works:
        if not variant.greedy_in_forward:
            runner.table.samplers[(work.bucket.num_seqs, variant.sampler, variant.penalties)] = (
                runner.table.compile_sampler(work.bucket.num_seqs, variant.sampler, variant.penalties)
            )
        chosen = forward_compiler_options(platform, work.bucket)
        engine_uses = next((name for name, options in OPTION_SETS.items() if options == chosen), repr(chosen))
        for name in args.options.split(","):
            options = OPTION_SETS[name]
            start = time.perf_counter()
            runner.table.forwards[(work.bucket, False)] = runner.table.compile_forward(
                work.bucket, False, runner.table.num_blocks, compiler_options=options
            )
            seconds = time.perf_counter() - start
            ms = wall_ms(runner, work, variant, args.calls)
            rows.append(dict(step=work.name, tokens=work.bucket.num_tokens, options=name, compile_s=seconds, ms=ms))
            print(f"{work.name:<28} {engine_uses:<14} {name:<14} {seconds:>9.2f} {ms:>8.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=sys.argv[1:], device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
