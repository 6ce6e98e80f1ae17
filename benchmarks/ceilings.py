"""The card's ceilings, measured now: copy bandwidth and bf16 matmul rate through XLA. Every GPU figure of
docs/performance.md is quoted next to the ceilings of the same machine start, because one card moves from
start to start.

    python benchmarks/ceilings.py [--json]

copy: a 2 GiB bf16 array negated elementwise (2 GiB read + 2 GiB written), TB/s. matmul: a bf16 8192³
product, TFLOP/s; on a GPU also the e4m3 8192³ product (float32 accumulation, bf16 out). Each is wall time per
call of 10 calls inside one jit, median of five runs (`time_calls`).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from common import time_calls


def ceilings() -> dict[str, float]:
    """{"copy_TBps": ..., "matmul_TFLOPs": ..., "fp8_matmul_TFLOPs": ...} on jax's default device (the FP8 rate
    on GPUs only: elsewhere the FP8 product is emulated)."""
    x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)  # 2 GiB
    copy = time_calls(lambda x: -x, [(x,)], 10)
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    matmul = time_calls(lambda a, b: a @ b, [(a, b)], 10)
    measured = {"copy_TBps": 2 * x.nbytes / copy / 1e12, "matmul_TFLOPs": 2 * 8192**3 / matmul / 1e12}
    if jax.devices()[0].platform == "gpu":
        # e4m3 x e4m3 with float32 accumulation, the second operand K-major (cuBLASLt's FP8 GEMM layout)
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        dims = (((1,), (1,)), ((), ()))
        fp8 = time_calls(
            lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16), [(a8, b8)], 10
        )
        measured["fp8_matmul_TFLOPs"] = 2 * 8192**3 / fp8 / 1e12
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    measured = ceilings()
    device = jax.devices()[0].device_kind
    if args.json:
        print(json.dumps({"device": device, "jax": jax.__version__, **measured}))
    else:
        print(f"{device}, jax {jax.__version__}: copy {measured['copy_TBps']:.2f} TB/s, ", end="")
        print(f"bf16 matmul {measured['matmul_TFLOPs']:.1f} TFLOP/s", end="")
        fp8 = measured.get("fp8_matmul_TFLOPs")
        print(f", fp8 matmul {fp8:.1f} TFLOP/s" if fp8 else "")


if __name__ == "__main__":
    main()
