"""The FP8 linear (`jaxserve.models.quant.linear` with an `Fp8Weight`) against bf16 at Llama-3.1-8B's projection
shapes, for decode and prefill row counts: wall time per call, checked against a float32 reference of its
dequantized operands, with the card's ceilings (copy, bf16 matmul) measured in the same process.

    python benchmarks/fp8_gemm.py [--rows 1 16 128 1024 8192]

Per (shape, rows): "bf16" is the einsum of bf16 operands; "fp8" is quant.linear (per-token activation
quantization, the e4m3 x e4m3 einsum with float32 accumulation, both scales); "fp8 weight-only" dequantizes the
FP8 weight to bf16 inside the jit and runs the bf16 einsum (what a fused dequantizing GEMM would beat). Bytes
count the weight once (1 byte a value for FP8, 2 for bf16) plus the activations in and out; a decode row count is
bound by the weight bytes, so FP8's floor is half of bf16's.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import time_calls

from jaxserve.models import quant

# (name, einsum, weight shape): Llama-3.1-8B's fused q/k/v, o, gate/up and down projections.
SHAPES = [
    ("qkv", "td,dkge->tkge", (4096, 8, 6, 128)),
    ("o", "the,hed->td", (32, 128, 4096)),
    ("gate_up", "td,dcf->tcf", (4096, 2, 14336)),
    ("down", "tf,fd->td", (14336, 4096)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 1024, 8192])
    args = parser.parse_args()
    from ceilings import ceilings as measure

    ceil = measure()
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul "
        f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print(
        "| shape | rows | bf16 µs | fp8 µs | fp8 weight-only µs | fp8 / bf16 | bf16 floor µs | fp8 floor µs | fp8 err |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    key = jax.random.key(0)
    for name, spec, w_shape in SHAPES:
        num_in = len(spec.split(",")[0]) - 1
        w = jax.random.normal(key, w_shape, jnp.float32) / np.sqrt(np.prod(w_shape[:num_in]))
        w_bf16, w_fp8 = w.astype(jnp.bfloat16), quant.quantize(w, num_in)
        del w
        for rows in args.rows:
            x_shape = (rows, *w_shape[:num_in])
            x = jax.random.normal(jax.random.fold_in(key, rows), x_shape, jnp.float32).astype(jnp.bfloat16)
            out = quant.linear(spec, x, w_fp8)
            xq, xs = quant.quantize_rows(x, num_in)
            want = jnp.einsum(
                spec,
                xq.astype(jnp.float32) * xs.reshape(xs.shape + (1,) * num_in),
                w_fp8.dequantize(),
                precision=jax.lax.Precision.HIGHEST,
            )
            err = float(jnp.abs(out.astype(jnp.float32) - want).max() / jnp.abs(want).max())
            reps = 20 if rows <= 1024 else 5
            t_bf16 = time_calls(lambda x, w, spec=spec: jnp.einsum(spec, x, w), [(x, w_bf16)], reps)
            t_fp8 = time_calls(lambda x, w, spec=spec: quant.linear(spec, x, w), [(x, w_fp8)], reps)
            t_wo = time_calls(
                lambda x, w, spec=spec: jnp.einsum(spec, x, w.dequantize(jnp.bfloat16)), [(x, w_fp8)], reps
            )
            n_w = int(np.prod(w_shape))
            act = rows * (int(np.prod(w_shape[:num_in])) + int(np.prod(w_shape[num_in:]))) * 2
            flops = 2 * rows * n_w
            floor_bf16 = max((2 * n_w + act) / ceil["copy_TBps"] / 1e12, flops / ceil["matmul_TFLOPs"] / 1e12)
            floor_fp8 = max((n_w + act) / ceil["copy_TBps"] / 1e12, flops / ceil["matmul_TFLOPs"] / 1e12 / 2)
            print(
                f"| {name} | {rows} | {t_bf16 * 1e6:.1f} | {t_fp8 * 1e6:.1f} | {t_wo * 1e6:.1f} | "
                f"{t_fp8 / t_bf16:.2f} | {floor_bf16 * 1e6:.1f} | {floor_fp8 * 1e6:.1f} | {err:.1e} |"
            )
    print("fp8 floor: half the weight bytes, and flops at twice the bf16 rate (Hopper's FP8 tensor cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
