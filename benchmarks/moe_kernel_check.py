"""The MoE grouped GEMMs (jaxserve/kernels/moe.py) compiled for the GPU: checked against their references, then
timed against `jax.lax.ragged_dot` and a dense GEMM of the same flops, at Qwen3-30B-A3B's expert shapes
(E=128, D=2048, F=768, top-8; bf16) for 8 to 8,192 tokens (rows = 8 x tokens).

    python benchmarks/moe_kernel_check.py                      # checks, then one table; exit 1 on a mismatch
    python benchmarks/moe_kernel_check.py --tiling block_m=128,block_n=128,num_warps=8   # another tiling
    python benchmarks/moe_kernel_check.py --interpret --small  # a CPU smoke run: small shapes, checks only
    python benchmarks/moe_kernel_check.py --tokens 512 4096 --sweep block_m=64 block_m=128,num_warps=8
                                                               # the kernels' time under each tiling, no checks

Routing: each token picks top_k distinct experts uniformly at random; the group sizes are the experts' counts.
Checks, per size and kernel (gate_up: grouped_gate_up, down: grouped_matmul):
  - bf16, every size: a sample of experts (the largest, the smallest non-empty, four at random) against a
    float32 dot of exactly their rows; the full reference too where ragged_dot's dense lowering stays small
    (<= 8,192 rows); relative error <= 1e-2. Then the same compiled kernel with the last eighth of the rows
    unrouted (group sizes are data: no recompile) writes exact zeros there and keeps the routed rows.
  - float32 at the two smallest sizes: integer-valued inputs, every sum exact: down bit for bit with the
    reference, gate_up within 1e-6 (the same exact products; silu's exponential differs between Triton and XLA).
Timing (not with --interpret): wall time per call, `time_calls` (calls inside one jit, median of five runs) of
the kernel, of the reference (ragged_dot, as the XLA path runs it) and of a dense bf16 [R, Din] x [Din, Dout]
GEMM. TFLOP/s count 2 R Din Dout (Dout = 2F for gate_up); "% mm" is of the bf16 matmul rate and "% copy" of
the copy bandwidth measured at the start (benchmarks/ceilings.py); GB are the bytes that must move: the
weights of the experts that receive rows (the "hit" column), lhs and the output. A dash: that call failed (its
error is printed above the table; ragged_dot's dense lowering may not fit the card at the largest sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from common import time_calls

from jaxserve import kernels as pk
from jaxserve.kernels.moe import default_moe_tiling

HIGHEST = jax.lax.Precision.HIGHEST


@dataclass(frozen=True, slots=True)
class MoeShape:
    experts: int
    dim: int  # D
    hidden: int  # F
    top_k: int
    tokens: tuple[int, ...]


QWEN3_30B_A3B = MoeShape(experts=128, dim=2048, hidden=768, top_k=8, tokens=(8, 64, 1024, 4096, 8192))
SMALL = MoeShape(experts=8, dim=64, hidden=48, top_k=2, tokens=(1, 5, 40, 300))  # block_m 16, 16, 16, 128


@dataclass(frozen=True, slots=True)
class Case:
    """One kernel at one size: its arguments, what it computes, and its row groups (host copies)."""

    name: str  # gate_up or down
    kernel: object
    reference: object
    lhs: jax.Array
    rhs: jax.Array
    sizes: np.ndarray

    @property
    def dims(self) -> tuple[int, int]:
        """(Din, Dout) of the product; gate_up's Dout counts gate and up."""
        return self.rhs.shape[1], int(np.prod(self.rhs.shape[2:]))


def routing(rng: np.random.Generator, tokens: int, shape: MoeShape) -> np.ndarray:
    """int32 [E]: rows per expert when each token picks top_k distinct experts at random."""
    picks = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, : shape.top_k]
    return np.bincount(picks.ravel(), minlength=shape.experts).astype(np.int32)


def cases(rng, tokens: int, shape: MoeShape, dtype, tiling, interpret: bool) -> list[Case]:
    """gate_up and down at this size: random values in bf16, small integers in float32 (exact sums)."""
    rows, e, d, f = tokens * shape.top_k, shape.experts, shape.dim, shape.hidden

    def draw(dims, scale):
        if dtype == jnp.float32:
            return jnp.asarray(rng.integers(-2, 3, dims), jnp.float32)
        return jnp.asarray(rng.standard_normal(dims, np.float32) * scale, dtype)

    opts = dict(interpret=interpret, tiling=tiling)
    sizes = routing(rng, tokens, shape)
    return [
        Case(
            "gate_up",
            lambda x, w, g: pk.grouped_gate_up(x, w, g, **opts),
            pk.grouped_gate_up_reference,
            draw((rows, d), 1.0),
            draw((e, d, 2, f), d**-0.5),
            sizes,
        ),
        Case(
            "down",
            lambda x, w, g: pk.grouped_matmul(x, w, g, **opts),
            pk.grouped_matmul_reference,
            draw((rows, f), 1.0),
            draw((e, f, d), f**-0.5),
            sizes,
        ),
    ]


def group_product(case: Case, expert: int, start: int, stop: int) -> jax.Array:
    """float32 product of rows [start, stop) by their expert's weights, from the same bf16 / f32 values."""
    x = case.lhs[start:stop].astype(jnp.float32)
    w = case.rhs[expert].astype(jnp.float32)
    if case.name == "down":
        return jnp.dot(x, w, precision=HIGHEST)
    gate, up = (jnp.dot(x, w[:, i], precision=HIGHEST) for i in (0, 1))
    return jax.nn.silu(gate) * up


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def unrouted_tail(sizes: np.ndarray) -> np.ndarray:
    """sizes with the last eighth of the rows (at least one) taken off the last experts: padding rows."""
    sizes, drop = sizes.copy(), max(1, int(sizes.sum()) // 8)
    for g in range(len(sizes) - 1, -1, -1):
        take = min(drop, int(sizes[g]))
        sizes[g] -= take
        drop -= take
    return sizes


def check_bf16(case: Case, rng) -> list[str]:
    """Failures of the sampled experts, the full reference (small sizes) and the padding rows."""
    fn = jax.jit(case.kernel)
    out = fn(case.lhs, case.rhs, jnp.asarray(case.sizes))
    ends = np.cumsum(case.sizes)
    live = np.flatnonzero(case.sizes)
    sample = {int(live[np.argmax(case.sizes[live])]), int(live[np.argmin(case.sizes[live])])}
    sample |= set(rng.choice(live, min(4, len(live)), replace=False).tolist())
    errors = {}
    for g in sorted(sample):
        start, stop = int(ends[g] - case.sizes[g]), int(ends[g])
        errors[f"expert {g} ({stop - start} rows)"] = rel_err(out[start:stop], group_product(case, g, start, stop))
    if case.lhs.shape[0] <= 8192:
        want = case.reference(case.lhs.astype(jnp.float32), case.rhs.astype(jnp.float32), jnp.asarray(case.sizes))
        errors["full reference"] = rel_err(out, want)
    failures = [f"{name}: relative error {err:.2e}" for name, err in errors.items() if not err <= 1e-2]
    padded = unrouted_tail(case.sizes)
    used = int(padded.sum())
    out_padded = np.asarray(fn(case.lhs, case.rhs, jnp.asarray(padded)), np.float32)
    if out_padded[used:].any():
        failures.append(f"padding rows {used}.. not zero")
    # Each row's tiles start where its expert's rows start either way: the routed rows are the same sums.
    if not np.array_equal(out_padded[:used], np.asarray(out[:used], np.float32)):
        failures.append("routed rows changed when padding rows followed them")
    return failures


def check_f32(case: Case) -> list[str]:
    """down bit for bit; gate_up's products are exact too, its silu (Triton's exp against XLA's logistic)
    within a few float32 ulps."""
    sizes = jnp.asarray(case.sizes)
    out = np.asarray(case.kernel(case.lhs, case.rhs, sizes))
    want = np.asarray(case.reference(case.lhs, case.rhs, sizes))
    if case.name == "down":
        mismatched = int((out != want).sum())
        return [f"{mismatched} values differ from the exact reference"] if mismatched else []
    worst = float(np.max(np.abs(out - want) / np.maximum(np.abs(want), 1e-30), initial=0.0))
    return [] if worst <= 1e-6 else [f"relative difference up to {worst:.2e} (bound 1e-6)"]


def timings(case: Case, ceilings: dict[str, float]) -> dict[str, object]:
    """One table row: wall time per call of the kernel, the reference and a dense GEMM, and their rates."""
    rows, (din, dout) = case.lhs.shape[0], case.dims
    sizes = jnp.asarray(case.sizes)
    reps = 20 if rows <= 8192 else 5
    dense_rhs = case.rhs[0].reshape(din, dout)
    times = {}
    for name, fn, args in (
        ("kernel", case.kernel, (case.lhs, case.rhs, sizes)),
        ("ragged_dot", case.reference, (case.lhs, case.rhs, sizes)),
        ("dense", lambda a, b: a @ b, (case.lhs, dense_rhs)),
    ):
        try:
            times[name] = time_calls(fn, [args], reps)
        except Exception as error:  # ragged_dot's dense lowering can exceed the card's memory
            times[name] = None
            print(f"  {case.name} {rows} rows, {name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    hit = int((case.sizes > 0).sum())
    item = case.lhs.dtype.itemsize
    moved = (hit * din * dout + rows * din + rows * (dout // 2 if case.name == "gate_up" else dout)) * item
    flops = 2 * rows * din * dout
    tflops = {k: None if t is None else flops / t / 1e12 for k, t in times.items()}
    kernel = times["kernel"]
    return {
        "kernel": case.name,
        "rows": rows,
        "experts_hit": hit,
        **{f"{k}_us": None if t is None else t * 1e6 for k, t in times.items()},
        **{f"{k}_TFLOPs": v for k, v in tflops.items()},
        "kernel_pct_matmul": 100 * tflops["kernel"] / ceilings["matmul_TFLOPs"],
        "dense_pct_matmul": None if tflops["dense"] is None else 100 * tflops["dense"] / ceilings["matmul_TFLOPs"],
        "GB_moved": moved / 1e9,
        "kernel_pct_copy": 100 * moved / kernel / 1e12 / ceilings["copy_TBps"],
    }


def print_table(rows: list[dict], ceilings: dict[str, float], tiling) -> None:
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}: copy {ceilings['copy_TBps']:.2f} TB/s, ", end="")
    print(f"bf16 matmul {ceilings['matmul_TFLOPs']:.1f} TFLOP/s; tiling {tiling or 'default_moe_tiling'}")
    columns = ("kernel", "tokens", "rows", "hit", "kernel µs", "ragged_dot µs", "dense µs", "kernel TFLOP/s")
    columns += ("ragged_dot TFLOP/s", "kernel % mm", "dense % mm", "GB moved", "kernel % copy")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(columns) - 2))

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        cells = (r["kernel"], r["tokens"], r["rows"], r["experts_hit"], fmt(r["kernel_us"], ".1f"))
        cells += (fmt(r["ragged_dot_us"], ".1f"), fmt(r["dense_us"], ".1f"), fmt(r["kernel_TFLOPs"], ".1f"))
        cells += (fmt(r["ragged_dot_TFLOPs"], ".1f"), fmt(r["kernel_pct_matmul"], ".0f"))
        cells += (fmt(r["dense_pct_matmul"], ".0f"), fmt(r["GB_moved"], ".3f"), fmt(r["kernel_pct_copy"], ".0f"))
        print("| " + " | ".join(str(c) for c in cells) + " |")


def sweep(shape: MoeShape, tilings: list[str], ceilings: dict[str, float]) -> None:
    """The kernels' wall time per call (bf16) under each tiling at each size, one table; a tiling that fails to
    compile or run (e.g. more shared memory than the card has) prints its error and a dash."""
    rng = np.random.default_rng(0)
    print(f"copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['matmul_TFLOPs']:.1f} TFLOP/s (% mm is of it)")
    print("| kernel | tokens | rows | tiling | µs | TFLOP/s | % mm |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for tokens in shape.tokens:
        for text in tilings:
            tiling = parse_tiling(text)
            for case in cases(rng, tokens, shape, jnp.bfloat16, tiling, False):
                rows, (din, dout) = case.lhs.shape[0], case.dims
                try:
                    t = time_calls(case.kernel, [(case.lhs, case.rhs, jnp.asarray(case.sizes))], 20)
                except Exception as error:
                    print(f"  {case.name} {text}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                    print(f"| {case.name} | {tokens} | {rows} | {text} | - | - | - |")
                    continue
                tflops = 2 * rows * din * dout / t / 1e12
                pct = 100 * tflops / ceilings["matmul_TFLOPs"]
                print(f"| {case.name} | {tokens} | {rows} | {text} | {t * 1e6:.1f} | {tflops:.1f} | {pct:.0f} |")


def parse_tiling(text: str | None):
    """'block_m=128,block_n=128' -> MoeTiling with those fields (the others at their defaults); None: per size."""
    if text is None:
        return None
    fields = dict(item.split("=") for item in text.split(","))
    return pk.MoeTiling(**{k: int(v) for k, v in fields.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="run the kernels on the CPU: checks only")
    parser.add_argument("--small", action="store_true", help=f"small shapes: {SMALL}")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default: the shape's)")
    parser.add_argument("--tiling", help="MoeTiling fields, e.g. block_m=128,block_n=128 (default: per size)")
    parser.add_argument("--sweep", nargs="+", metavar="TILING", help="time each tiling at each size (no checks)")
    args = parser.parse_args()
    if args.interpret:
        jax.config.update("jax_platforms", "cpu")
    shape = SMALL if args.small else QWEN3_30B_A3B
    shape = dataclasses.replace(shape, tokens=tuple(args.tokens)) if args.tokens else shape
    tiling = parse_tiling(args.tiling)
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, shape)
    ceilings = None
    if not args.interpret:
        from ceilings import ceilings as measure

        ceilings = measure()
    if args.sweep:
        sweep(shape, args.sweep, ceilings)
        return 0
    rng = np.random.default_rng(0)
    failures, table, checked = [], [], 0
    for i, tokens in enumerate(shape.tokens):
        for dtype in (jnp.bfloat16, jnp.float32) if i < 2 else (jnp.bfloat16,):
            for case in cases(rng, tokens, shape, dtype, tiling, args.interpret):
                found = check_bf16(case, rng) if dtype == jnp.bfloat16 else check_f32(case)
                name = f"{case.name} {tokens} tokens {jnp.dtype(dtype).name}"
                used = tiling or default_moe_tiling(case.lhs.shape[0], shape.experts, case.name == "gate_up")
                print(f"{'FAIL' if found else 'ok  '} {name} ({used}){': ' if found else ''}{'; '.join(found)}")
                failures += [f"{name}: {f}" for f in found]
                checked += 1
                if ceilings is not None and dtype == jnp.bfloat16:
                    table.append({"tokens": tokens, **timings(case, ceilings)})
    if table:
        print_table(table, ceilings, args.tiling)
    print(json.dumps({"cases": checked, "failures": failures, "ceilings": ceilings, "table": table}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
