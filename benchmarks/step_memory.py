"""Does the compiled step update the KV pool in place? Compiles one decode bucket over a large pool and
prints XLA's memory analysis and every copy of a pool-sized buffer in the optimised HLO.

    python benchmarks/step_memory.py --backend pallas --pool-gib 40

An in-place step has temp memory far below the pool size and no pool-shaped copy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import SMOLLM2_135M

from jaxserve.buckets import Bucket
from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.models import registry
from jaxserve.runner import Runner
from jaxserve.step import RunnerSpec
from jaxserve.variants import StepConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["pallas", "xla"], default="pallas")
    parser.add_argument("--pool-gib", type=float, default=40.0)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    family, cfg = registry.resolve(SMOLLM2_135M)
    weights = family.init_weights(cfg, jax.random.key(0), jnp.bfloat16)
    config = EngineConfig(
        max_batch_size=args.batch,
        max_num_tokens=512,
        max_seq_len=512,
        compile=CompileConfig(decode_batch_sizes=(args.batch,), token_buckets=(512,), penalty_variants=False),
    )
    steps = StepConfig.from_config(config, cfg.vocab_size)
    runner = Runner(RunnerSpec(family, cfg, steps, jnp.bfloat16, args.backend, num_top_logprobs=20), weights)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    num_blocks = int(args.pool_gib * 2**30 // per_block)
    pool_shape = f"bf16[{cfg.num_layers},{num_blocks},16,{cfg.num_kv_heads},{cfg.head_dim}]"
    flat_shape = f"bf16[{cfg.num_layers * num_blocks},16,{cfg.num_kv_heads},{cfg.head_dim}]"
    for bucket in (Bucket(args.batch, args.batch, decode_only=True), Bucket(512, args.batch)):
        compiled = runner.compile_forward(bucket, False, num_blocks)
        analysis = compiled.memory_analysis()
        pool_gib = num_blocks * per_block / 2**30
        print(
            f"backend={args.backend} T={bucket.num_tokens} B={bucket.num_seqs} pool (k+v)={pool_gib:.2f} GiB", end=" "
        )
        print(
            f"temp={analysis.temp_size_in_bytes / 2**30:.3f} GiB alias={analysis.alias_size_in_bytes / 2**30:.2f} GiB"
        )
        for line in compiled.as_text().splitlines():
            if (pool_shape in line or flat_shape in line) and " copy(" in line:
                print("  POOL COPY:", line.strip()[:220])


if __name__ == "__main__":
    main()
