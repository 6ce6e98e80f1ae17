"""The FP8 linear's products against bf16 at Llama-3.1-8B's projection shapes (as 2-D GEMMs, K x N), for decode
and prefill row counts: wall time per call, each checked against a float32 reference of its operands, with the
card's ceilings (copy, bf16 and FP8 matmul) measured in the same process.

    python benchmarks/fp8_gemm.py [--rows 1 16 64 256 1024 8192]

Per (shape, rows), microseconds:
- "bf16": x [M, K] @ w [K, N] in bf16.
- "fp8 [K,N]" / "fp8 [N,K]": the FP8 x FP8 product (rows quantized per token, e4m3 x e4m3 with float32
  accumulation, both scales) with the weight stored [K, N] or output-major [N, K] (cuBLASLt's FP8 GEMM wants
  its second operand K-major: the [K, N] weight is transposed on every call).
- "fp8 [N,K] bf16 out": the same product with the GEMM's result in bfloat16 before the scales (the float32
  [rows, N] intermediate is what the large row counts pay for beyond their floor).
- "xla w-only": bf16 x times the [N, K] FP8 weight converted to bf16 inside the jit (whether XLA fuses the
  conversion into its GEMM's loads decides the bytes it reads).
Floors: the weight's bytes (2 a value bf16, 1 FP8) and the activations at the measured copy rate, or the flops at
the matmul rate (FP8's measured rate for the FP8 floor), whichever is longer. Then what XLA lowered the FP8
products to, and `quant.linear`'s multi-axis einsums (the serving weights' shapes) against the 2-D products.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from common import time_calls

from jaxserve.models import quant

# (name, K, N): Llama-3.1-8B's fused q/k/v, o, gate/up and down projections.
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def fp8_product(x, values, scale, layout: str, acc_out=jnp.float32):
    """The FP8 x FP8 product with the weight [K, N] ("kn") or [N, K] ("nk"); acc_out: the GEMM's output type
    before the scales (float32 as `quant.linear`; bfloat16 halves the bytes of that intermediate)."""
    xq, xs = quant.quantize_rows(x, 1)
    dims = (((1,), (0,)), ((), ())) if layout == "kn" else (((1,), (1,)), ((), ()))
    out = jax.lax.dot_general(xq, values, dims, preferred_element_type=acc_out)
    return (out.astype(jnp.float32) * xs[:, None] * scale).astype(x.dtype)


def weight_only(x, values, scale):
    out = jax.lax.dot_general(x, values.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(x.dtype)


def lowering(fn, *args) -> str:
    """What XLA made of fn: the GEMM it calls ('cublasLt fp8' for cuBLASLt's FP8 GEMM) and its transposes/copies."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    if "$f8" in text:
        gemm = "cublasLt fp8"
    elif "cublas$lt" in text:
        gemm = "cublasLt"
    elif "cublas" in text:
        gemm = "cublas"
    elif "triton" in text or "__triton" in text:
        gemm = "triton gemm fusion"
    else:
        gemm = "other"
    moves = len(re.findall(r"= \S+ (?:transpose|copy)\(", text))
    return f"{gemm}, {moves} transpose/copy"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 8192])
    args = parser.parse_args()
    from ceilings import ceilings as measure

    ceil = measure()
    fp8_rate = ceil.get("fp8_matmul_TFLOPs", 2 * ceil["matmul_TFLOPs"])  # emulated off GPUs: a nominal 2x
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul "
        f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s, FP8 matmul {fp8_rate:.0f} TFLOP/s"
    )
    print(
        "| shape | rows | bf16 | fp8 [K,N] | fp8 [N,K] | fp8 [N,K] bf16 out | xla w-only | fp8 [N,K] / bf16 "
        "| bf16 floor | fp8 floor "
        "| fp8 err | bf16-out err |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    key = jax.random.key(0)
    for name, k_dim, n_dim in SHAPES:
        w = jax.random.normal(key, (k_dim, n_dim), jnp.float32) / np.sqrt(k_dim)
        q = quant.quantize(w, 1)  # values [N, K]
        w_bf16, values_kn = w.astype(jnp.bfloat16), q.values.T.copy()
        del w
        for rows in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k_dim), jnp.float32).astype(jnp.bfloat16)
            reps = 20 if rows <= 1024 else 5
            t = {
                "bf16": time_calls(lambda x, w: x @ w, [(x, w_bf16)], reps),
                "kn": time_calls(lambda x, v, s: fp8_product(x, v, s, "kn"), [(x, values_kn, q.scale)], reps),
                "nk": time_calls(lambda x, v, s: fp8_product(x, v, s, "nk"), [(x, q.values, q.scale)], reps),
                "wo": time_calls(weight_only, [(x, q.values, q.scale)], reps),
                "nk16": time_calls(
                    lambda x, v, s: fp8_product(x, v, s, "nk", jnp.bfloat16), [(x, q.values, q.scale)], reps
                ),
            }
            got = fp8_product(x, q.values, q.scale, "nk").astype(jnp.float32)
            xq, xs = quant.quantize_rows(x, 1)
            want = (xq.astype(jnp.float32) * xs[:, None]) @ q.dequantize()
            err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
            got16 = fp8_product(x, q.values, q.scale, "nk", jnp.bfloat16).astype(jnp.float32)
            err16 = float(jnp.abs(got16 - want).max() / jnp.abs(want).max())
            n_w = k_dim * n_dim
            act = rows * (k_dim + n_dim) * 2
            flops = 2 * rows * n_w
            floor_bf16 = max((2 * n_w + act) / ceil["copy_TBps"] / 1e12, flops / ceil["matmul_TFLOPs"] / 1e12)
            floor_fp8 = max((n_w + act) / ceil["copy_TBps"] / 1e12, flops / fp8_rate / 1e12)
            us = {k: f"{v * 1e6:.1f}" for k, v in t.items()}
            print(
                f"| {name} | {rows} | {us['bf16']} | {us['kn']} | {us['nk']} | {us['nk16']} | {us['wo']} | "
                f"{t['nk'] / t['bf16']:.2f} | {floor_bf16 * 1e6:.1f} | {floor_fp8 * 1e6:.1f} | {err:.1e} | "
                f"{err16:.1e} |",
                flush=True,
            )
        kn = [lowering(lambda x, v, s: fp8_product(x, v, s, "kn"), _x(r, k_dim), values_kn, q.scale) for r in (1, 1024)]
        nk = [lowering(lambda x, v, s: fp8_product(x, v, s, "nk"), _x(r, k_dim), q.values, q.scale) for r in (1, 1024)]
        wo = [lowering(weight_only, _x(r, k_dim), q.values, q.scale) for r in (1, 1024)]
        print(f"  {name} lowering at 1 / 1024 rows: fp8 [K,N]: {' / '.join(kn)}; fp8 [N,K]: {' / '.join(nk)}; "
              f"xla w-only: {' / '.join(wo)}", flush=True)  # fmt: skip
    einsums(key)
    return 0


def _x(rows: int, k_dim: int):
    return jnp.zeros((rows, k_dim), jnp.bfloat16)


def einsums(key) -> None:
    """quant.linear's multi-axis einsums of the serving shapes (the FP8 x FP8 path, no kernel) against bf16."""
    print("\n| einsum | weight | rows | bf16 µs | quant.linear fp8 µs | lowering |")
    print("|---|---|---:|---:|---:|---|")
    for spec, shape in [("td,dkge->tkge", (4096, 8, 6, 128)), ("the,hed->td", (32, 128, 4096)),
                        ("td,dcf->tcf", (4096, 2, 14336)), ("tf,fd->td", (14336, 4096))]:  # fmt: skip
        num_in = len(spec.split(",")[0]) - 1
        w = jax.random.normal(key, shape, jnp.float32) / np.sqrt(np.prod(shape[:num_in]))
        w_bf16, w_fp8 = w.astype(jnp.bfloat16), quant.quantize(w, num_in)
        del w
        for rows in (64, 1024, 8192):
            x = jnp.ones((rows, *shape[:num_in]), jnp.bfloat16)
            reps = 20 if rows <= 1024 else 5
            tb = time_calls(lambda x, w, spec=spec: jnp.einsum(spec, x, w), [(x, w_bf16)], reps)
            tf = time_calls(lambda x, w, spec=spec: quant.linear(spec, x, w), [(x, w_fp8)], reps)
            low = lowering(lambda x, w, spec=spec: quant.linear(spec, x, w), x, w_fp8)
            print(f"| {spec} | {shape} | {rows} | {tb * 1e6:.1f} | {tf * 1e6:.1f} | {low} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
