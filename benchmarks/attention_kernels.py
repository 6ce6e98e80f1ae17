"""Where an attention call's time goes: per-kernel device time under Nsight Compute, next to wall time.

    python benchmarks/attention_kernels.py --mode time                      # wall time per call (jit of 10)
    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python benchmarks/attention_kernels.py --mode ncu > kernels.csv     # every kernel's duration
    python benchmarks/attention_kernels.py --summarize kernels.csv          # per case: kernels and their sum

In `ncu` mode each case runs one warm-up call and `--reps` timed calls, one at a time, between two marker
kernels (`mark_start_<i>`, `mark_end_<i>`), so the summary can cut the kernel list into cases. The cases:
the ceilings (a 2 GiB copy and a bf16 8192^3 matmul, so every run carries its own), an empty Pallas
kernel (the floor of a launch), the decode grid of benchmarks/attention.py as an engine's decode step
calls it (max_q_len=1) next to JAX's built-in op, the target decode shapes without the hint, the tiling
sweeps behind jaxserve/kernels/tuning.py, the prefill cases, and the mixed batch with its parts. Shapes as
in benchmarks/attention.py; `--only` picks cases by name.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
from collections import defaultdict

CASES: list[tuple[str, str, list[tuple[int, int]], dict]] = []  # (name, kind, seqs, options)


def _add(name: str, kind: str, seqs: list[tuple[int, int]], **options) -> None:
    CASES.append((name, kind, seqs, options))


_add("ceiling: copy 2 GiB", "copy", [])  # device-to-device bandwidth (read + write) in the same run
_add("ceiling: bf16 matmul 8192", "matmul", [])  # bf16 matrix rate in the same run
_add("empty pallas_call", "empty", [])
# Decode as an engine's decode step calls it (max_q_len=1: no mixed launch) and JAX's built-in op.
for b in (1, 16, 64, 256):
    for ctx in (1024, 4096, 16384):
        _add(f"decode {b}x{ctx}", "ours", [(1, ctx - 1)] * b, max_q_len=1)
        _add(f"builtin decode {b}x{ctx}", "builtin", [(1, ctx - 1)] * b)
# The target shapes without the hint: the mixed launch runs first and exits early.
for b, ctx in ((16, 1024), (64, 1024), (256, 4096)):
    _add(f"decode {b}x{ctx} generic", "ours", [(1, ctx - 1)] * b)
for name, seqs in {
    "1 x 512": [(512, 0)],
    "1 x 2048": [(2048, 0)],
    "1 x 8192": [(8192, 0)],
    "8 x 2048": [(2048, 0)] * 8,
    "512 after 4096 cached": [(512, 4096)],
}.items():
    _add(f"prefill {name}", "ours", seqs)
# Tiling sweeps behind jaxserve/kernels/tuning.py: split counts for one long sequence, prefill stages.
for ctx, split_counts in ((1024, (1, 2, 4)), (4096, (4, 8, 16)), (16384, (16, 32, 128))):
    for n in split_counts:
        _add(f"sweep decode 1x{ctx} splits {n}", "ours", [(1, ctx - 1)], max_q_len=1, num_splits=n)
_add("sweep decode 16x16384 splits 8", "ours", [(1, 16383)] * 16, max_q_len=1, num_splits=8)
# Small batches: one key tile per split (more splits) against two (the heuristic's floor).
for b, ctx, tilings in (
    (1, 1024, ((16, 64), (8, 128), (32, 32))),
    (1, 4096, ((64, 64), (32, 128))),
    (1, 16384, ((128, 64), (64, 128), (128, 128))),
    (16, 1024, ((8, 64), (4, 128), (16, 64))),
    (16, 4096, ((8, 64), (16, 64))),
):
    for n, bn in tilings:
        _add(
            f"sweep decode {b}x{ctx} splits {n} block_n {bn}",
            "ours",
            [(1, ctx - 1)] * b,
            max_q_len=1,
            num_splits=n,
            decode_block_n=bn,
        )
# One-tile splits with page ids read through the loop, after kv_len (the default reads them at once).
for b, ctx in ((1, 1024), (1, 4096), (1, 16384)):
    _add(f"sweep decode {b}x{ctx} eager pages off", "ours", [(1, ctx - 1)] * b, max_q_len=1, decode_eager_pages=False)
# Key tile 128 (the 256 x 4096 table entry's) where the heuristic takes 64, and a deeper pipeline.
for b, ctx, splits in ((16, 4096, 4), (16, 16384, 4), (64, 4096, 1), (64, 16384, 1), (256, 1024, 1), (256, 16384, 1)):
    for block_n, stages in ((64, 3), (128, 3), (128, 4)):
        tiling = dict(num_splits=splits, decode_block_n=block_n, decode_num_stages=stages)
        _add(
            f"sweep decode {b}x{ctx} block_n {block_n} stages {stages}",
            "ours",
            [(1, ctx - 1)] * b,
            max_q_len=1,
            **tiling,
        )
# Short contexts at 32 rows (the decode step of 32 requests of 128 + 128 tokens): the default tiling (2 splits
# of 64 keys, 4 warps, 3 stages) against the neighbours.
for ctx in (192, 256):
    _add(f"decode 32x{ctx}", "ours", [(1, ctx - 1)] * 32, max_q_len=1)
    for n, bn, warps, stages in itertools.product((1, 2, 4), (32, 64), (2, 4), (2, 3)):
        tiling = dict(num_splits=n, decode_block_n=bn, decode_num_warps=warps, decode_num_stages=stages)
        name = f"sweep decode 32x{ctx} splits {n} block_n {bn} warps {warps} stages {stages}"
        _add(name, "ours", [(1, ctx - 1)] * 32, max_q_len=1, **tiling)
# Prefill tilings (block_m, block_n, num_warps, num_stages) for the 8192-token causal prompt.
for bm, bn, warps, stages in (
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 128, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (256, 64, 8, 3),
    (128, 32, 4, 3),
    (256, 128, 8, 2),
):
    tiling = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
    _add(f"sweep prefill 1 x 8192 tiling {bm},{bn},{warps},{stages}", "ours", [(8192, 0)], **tiling)
_add("mixed 4x512 + 128x2048", "ours", [(512, 0)] * 4 + [(1, 2047)] * 128)
_add("mixed part: prefill 4x512", "ours", [(512, 0)] * 4)
_add("mixed part: decode 128x2048", "ours", [(1, 2047)] * 128)


def _marker(tag: str):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((16,), jnp.float32)
    return jax.block_until_ready(pl.pallas_call(kernel, out_shape=x, name=tag)(x))


def _case_fn(kind: str, seqs, options):
    """(function, list of argument tuples, one per cache copy) for one case."""
    import jax
    import jax.numpy as jnp
    from attention import builtin_decode, make_batch, ours
    from jax.experimental import pallas as pl

    if kind == "copy":
        x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)
        return (lambda x: -x), [(x,)]
    if kind == "matmul":
        a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
        return (lambda a, b: a @ b), [(a, b)]
    if kind == "empty":

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        x = jnp.zeros((16,), jnp.float32)
        return (lambda x: pl.pallas_call(kernel, out_shape=x, name="empty")(x)), [(x,)]
    batch = make_batch("case", seqs, seed=len(seqs) * 31 + seqs[0][1])
    if kind == "builtin":
        return builtin_decode(batch)
    return ours(**options), batch.args


def _selected(name: str, only: list[str] | None, skip: list[str] | None = None) -> bool:
    return (only is None or any(o in name for o in only)) and not (skip and any(k in name for k in skip))


def run_ncu(reps: int, only: list[str] | None, skip: list[str] | None) -> None:
    import jax

    for i, (name, kind, seqs, options) in enumerate(CASES):
        if not _selected(name, only, skip):
            continue
        try:
            fn, sets = _case_fn(kind, seqs, options)
            one = jax.jit(fn)
            jax.block_until_ready(one(*sets[0]))  # compile outside the markers
            _marker(f"mark_start_{i}")
            for r in range(reps):
                jax.block_until_ready(one(*sets[r % len(sets)]))
            _marker(f"mark_end_{i}")
            print(f"case {i}: {name}", file=sys.stderr, flush=True)
            del fn, sets
        except Exception as e:  # keep the other cases
            print(f"case {i}: {name} FAILED {e!r}"[:400], file=sys.stderr, flush=True)


def run_time(only: list[str] | None, skip: list[str] | None) -> None:
    """Wall time per call; for our kernels also the error against the jnp reference (‖out − ref‖ / ‖ref‖)."""
    import jax
    from attention import reference, rel_err
    from common import time_calls

    for name, kind, seqs, options in CASES:
        if not _selected(name, only, skip):
            continue
        try:
            fn, sets = _case_fn(kind, seqs, options)
            err = ""
            if kind == "ours":
                err = f"  err {rel_err(jax.jit(fn)(*sets[0]), jax.jit(reference)(*sets[0])):.1e}"
            t = time_calls(fn, sets, 10)
            print(f"{name:44s} wall {t * 1e6:9.1f} us/call{_rate(name, t * 1e6)}{err}", flush=True)
        except Exception as e:
            print(f"{name:44s} FAILED {e!r}"[:300], flush=True)


def _rate(name: str, us: float) -> str:
    """The ceiling cases as rates: copy bandwidth (2 GiB read + 2 GiB written) and matmul TFLOP/s."""
    if name.startswith("ceiling: copy"):
        return f" = {2 * 2**31 / us / 1e6:.2f} TB/s"
    if name.startswith("ceiling: bf16 matmul"):
        return f" = {2 * 8192**3 / us / 1e6:.1f} TFLOP/s"
    return ""


UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def summarize(path: str) -> None:
    """Per case: the kernels of one call (in launch order), each one's median duration, and their sum."""
    rows = []
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r["Metric Unit"]
            scale = UNIT_US.get(unit, float("nan"))
            rows.append((r["Kernel Name"], r["Grid Size"], float(r["Metric Value"].replace(",", "")) * scale))
    i = 0
    while i < len(rows):
        name = rows[i][0]
        if "mark_start_" not in name:
            i += 1
            continue
        case = int(name.split("mark_start_")[1].split("_")[0].split("(")[0])
        j = next(k for k in range(i + 1, len(rows)) if "mark_end_" in rows[k][0])
        # The end marker's own input (a broadcast) lands inside the segment, last: drop it.
        kernels = rows[i + 1 : j]
        if kernels and kernels[-1][0].startswith("wrapped_broadcast"):
            kernels = kernels[:-1]
        reps = 0
        by_pos: dict[int, list[float]] = defaultdict(list)
        per_call = None
        for n in range(1, len(kernels) + 1):  # the shortest period that tiles the list of kernel names
            if len(kernels) % n == 0 and all(kernels[k][0] == kernels[k % n][0] for k in range(len(kernels))):
                per_call, reps = n, len(kernels) // n
                break
        if per_call is None:
            per_call, reps = len(kernels), 1
        for k, (_, _, us) in enumerate(kernels):
            by_pos[k % per_call].append(us)
        med = [statistics.median(by_pos[k]) for k in range(per_call)]
        name = CASES[case][0]
        print(f"\n{name}  ({reps} calls, {per_call} kernels each): sum {sum(med):.1f} us{_rate(name, sum(med))}")
        for k in range(per_call):
            print(f"    {kernels[k][0][:60]:60s} grid {kernels[k][1]:>16s} {med[k]:9.1f} us")
        i = j + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ncu", "time"), default="time")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--summarize", default=None, help="an ncu --csv file of an --mode ncu run")
    parser.add_argument("--only", default=None, help="comma-separated substrings: run the cases whose name has one")
    parser.add_argument(
        "--skip", default=None, help="comma-separated substrings: leave out the cases whose name has one"
    )
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    only = args.only.split(",") if args.only else None
    skip = args.skip.split(",") if args.skip else None
    if args.mode == "ncu":
        run_ncu(args.reps, only, skip)
    else:
        run_time(only, skip)


if __name__ == "__main__":
    main()
