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
import re

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
    layouts(key, args.rows)
    return 0


def lowering(fn, *args) -> str:
    """What XLA made of fn: 'cublasLt fp8' when the optimized HLO calls cuBLASLt's FP8 GEMM, else the GEMM it
    calls; with the number of transposes and copies around it (a weight transposed per call reads it twice)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    gemm = (
        "cublasLt fp8"
        if "$f8" in text
        else (
            "cublasLt"
            if "cublas$lt" in text
            else ("cublas" if "cublas" in text else ("triton" if "triton" in text else "other"))
        )
    )
    moves = len(re.findall(r"= \S+ (?:transpose|copy)\(", text))
    return f"{gemm}, {moves} transpose/copy"


def layouts(key, rows_list: list[int]) -> None:
    """The FP8 product as one 2-D GEMM with the weight stored [K, N] (the serving layout's order) or [N, K]
    (cuBLASLt's FP8 GEMM wants the second operand K-major), per-token activation scales either way."""
    print("\n| weight layout | K x N | rows | fp8 µs | bf16 µs | fp8 / bf16 | lowering |")
    print("|---|---|---:|---:|---:|---:|---|")
    for k_dim, n_dim in [(4096, 28672), (14336, 4096)]:
        w = jax.random.normal(key, (k_dim, n_dim), jnp.float32) / np.sqrt(k_dim)
        w_kn, w_bf16 = quant.quantize(w, 1), w.astype(jnp.bfloat16)
        w_nk = quant.Fp8Weight(values=w_kn.values.T.copy(), scale=w_kn.scale)
        del w

        def kn(x, w):
            xq, xs = quant.quantize_rows(x, 1)
            out = jax.lax.dot_general(xq, w.values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return (out * xs[:, None] * w.scale).astype(x.dtype)

        def nk(x, w):
            xq, xs = quant.quantize_rows(x, 1)
            out = jax.lax.dot_general(xq, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return (out * xs[:, None] * w.scale).astype(x.dtype)

        for rows in rows_list:
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k_dim), jnp.float32).astype(jnp.bfloat16)
            reps = 20 if rows <= 1024 else 5
            t_bf16 = time_calls(lambda x, w: x @ w, [(x, w_bf16)], reps)
            for name, fn, w8 in [("[K, N]", kn, w_kn), ("[N, K]", nk, w_nk)]:
                t = time_calls(fn, [(x, w8)], reps)
                print(
                    f"| {name} | {k_dim} x {n_dim} | {rows} | {t * 1e6:.1f} | {t_bf16 * 1e6:.1f} | "
                    f"{t / t_bf16:.2f} | {lowering(fn, x, w8)} |"
                )


if __name__ == "__main__":
    raise SystemExit(main())
