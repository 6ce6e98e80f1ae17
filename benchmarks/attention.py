"""Attention benchmark on one GPU, by wall clock: ceilings, decode, prefill, mixed batch and write_kv, each
checked against the jnp reference in the same run. The kernel table of docs/performance.md comes from
`attention_kernels.py` (device time per kernel under Nsight Compute, wall time and error beside it; run
by `gpu_attention.sh`), which builds its batches and the built-in op's call with this module.

    PYTHONUNBUFFERED=1 python benchmarks/attention.py [--sweep] [--quick] [--json PATH]

Model shape: 32 query heads, 8 kv heads, head_dim 128, block size 16, bfloat16, block tables drawn as a
random permutation of the cache's blocks. Times are device throughput: one jit runs `reps` independent
calls back to back (different queries and, for small footprints, different cache regions so the 60 MB L2
cannot serve repeats), the wall time of the whole is divided by `reps`; median of five such runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from ceilings import ceilings
from common import time_calls

from jaxserve import kernels as pk

H, K, DH, BS = 32, 8, 128, 16
DTYPE = jnp.bfloat16
SM_SCALE = DH**-0.5
# A footprint under this many bytes gets several cache copies, rotated across the timed calls.
ROTATE_BELOW = 1 << 30


@dataclass
class Batch:
    """Argument tuples of several equal-shaped calls (one per cache copy) and their cost."""

    name: str
    args: list[tuple] = field(default_factory=list)
    kv_bytes: int = 0  # bytes of K and V read: sum of kv_lens x K x Dh x 2 bytes x 2
    flops: int = 0  # causal attention flops: 4 x visible (query, key) pairs x H x Dh


def make_batch(name: str, seqs: list[tuple[int, int]], *, seed: int, pad_seqs: int = 0, pad_tokens: int = 0) -> Batch:
    """seqs: (query tokens, cached tokens before them) per sequence; padding rows/tokens appended."""
    rng = np.random.default_rng(seed)
    ns = len(seqs)
    b = ns + pad_seqs
    q_lens = np.array([s[0] for s in seqs])
    kv_lens = np.array([s[0] + s[1] for s in seqs])
    width = int(-(-kv_lens.max() // BS))
    t = int(q_lens.sum()) + pad_tokens
    footprint = int(kv_lens.sum()) * K * DH * 2 * 2
    copies = 4 if footprint < ROTATE_BELOW else 1
    n = 1 + copies * ns * width
    key = jax.random.key(seed)
    kk, kv, kq = jax.random.split(key, 3)
    k_cache = jax.random.normal(kk, (n, BS, K, DH), DTYPE)
    v_cache = jax.random.normal(kv, (n, BS, K, DH), DTYPE)
    perm = rng.permutation(np.arange(1, n, dtype=np.int32))
    cu = np.zeros(b + 1, np.int32)
    cu[1 : ns + 1] = np.cumsum(q_lens)
    cu[ns + 1 :] = cu[ns]
    lens = np.zeros(b, np.int32)
    lens[:ns] = kv_lens
    batch = Batch(name)
    for c in range(copies):
        table = np.zeros((b, width), np.int32)
        table[:ns] = perm[c * ns * width : (c + 1) * ns * width].reshape(ns, width)
        q = jax.random.normal(jax.random.fold_in(kq, c), (t, H, DH), DTYPE)
        batch.args.append((q, k_cache, v_cache, jnp.asarray(table), jnp.asarray(lens), jnp.asarray(cu), jnp.int32(ns)))
    batch.kv_bytes = footprint
    pairs = sum(ql * ctx + ql * (ql + 1) // 2 for ql, ctx in seqs)
    batch.flops = 4 * pairs * H * DH
    return batch


def reps_for(batch: Batch) -> int:
    return 4 if batch.kv_bytes > (4 << 30) else 10


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def ours(**tuning):
    return lambda *a: pk.ragged_paged_attention(*a, sm_scale=SM_SCALE, **tuning)


def reference(*a):
    return pk.ragged_paged_attention_reference(*a, sm_scale=SM_SCALE)


def builtin_decode(batch: Batch):
    """JAX's pallas.ops.gpu.paged_attention at the same shape: kv-head-major cache, q pre-scaled."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    _, kc, vc, _, lens, _, _ = batch.args[0]
    kt, vt = jnp.transpose(kc, (2, 0, 1, 3)), jnp.transpose(vc, (2, 0, 1, 3))
    sets = [((a[0] * SM_SCALE).astype(DTYPE), kt, vt, a[3], lens) for a in batch.args]
    return paged_attention, sets


def bench_decode(shapes: list[tuple[int, int]], results: dict, baselines: bool = True) -> None:
    """Our time and bandwidth per shape; with `baselines`, also JAX's built-in op and the XLA reference."""
    for b, ctx in shapes:
        batch = make_batch(f"decode {b}x{ctx}", [(1, ctx - 1)] * b, seed=b * 7 + ctx)
        ref = reference(*batch.args[0])
        # As an engine's decode step calls it: max_q_len=1 (a decode-only batch, no mixed launch).
        err = rel_err(ours(max_q_len=1)(*batch.args[0]), ref)
        t_ours = time_calls(ours(max_q_len=1), batch.args, reps_for(batch))
        err_builtin = t_builtin = t_ref = float("nan")
        try:
            if not baselines:
                raise RuntimeError("baselines skipped")
            fn, sets = builtin_decode(batch)
            err_builtin = rel_err(fn(*sets[0]), ref)
            t_builtin = time_calls(fn, sets, reps_for(batch))
            del sets
        except Exception as e:  # the built-in op is a baseline only; keep our numbers
            print(f"builtin not timed at {b}x{ctx}: {e!r}"[:500], flush=True)
        if baselines:
            t_ref = time_calls(reference, batch.args, max(2, reps_for(batch) // 4))
        row = dict(
            batch=b,
            context=ctx,
            us=t_ours * 1e6,
            TBps=batch.kv_bytes / t_ours / 1e12,
            err=err,
            builtin_us=t_builtin * 1e6,
            builtin_TBps=batch.kv_bytes / t_builtin / 1e12,
            builtin_err=err_builtin,
            xla_ref_us=t_ref * 1e6,
            speedup_vs_builtin=t_builtin / t_ours,
        )
        results.setdefault("decode", []).append(row)
        print(
            f"decode B={b:4d} ctx={ctx:6d}  ours {row['us']:9.1f} us {row['TBps']:5.2f} TB/s err {err:.1e} | "
            f"builtin {row['builtin_us']:9.1f} us {row['builtin_TBps']:5.2f} TB/s err {err_builtin:.1e} | "
            f"xla ref {row['xla_ref_us']:9.1f} us | x{row['speedup_vs_builtin']:.2f}",
            flush=True,
        )
        del batch, ref


PREFILL_CASES = {
    "1 x 512": [(512, 0)],
    "1 x 2048": [(2048, 0)],
    "1 x 8192": [(8192, 0)],
    "8 x 2048": [(2048, 0)] * 8,
    "512 after 4096 cached": [(512, 4096)],
}


def bench_prefill(results: dict, cases=PREFILL_CASES) -> None:
    rows = []
    for name, seqs in cases.items():
        batch = make_batch(f"prefill {name}", seqs, seed=len(name))
        err = rel_err(ours()(*batch.args[0]), reference(*batch.args[0]))
        t = time_calls(ours(), batch.args, 10)
        rows.append(dict(case=name, us=t * 1e6, TFLOPs=batch.flops / t / 1e12, err=err))
        print(f"prefill {name:24s} {t * 1e6:9.1f} us {batch.flops / t / 1e12:6.1f} TFLOP/s err {err:.1e}", flush=True)
    results["prefill"] = rows


def bench_mixed(results: dict) -> None:
    """4 prefill chunks of 512 + 128 decode rows at context 2048, against its two parts alone."""
    prefill, decode = [(512, 0)] * 4, [(1, 2047)] * 128
    mixed = make_batch("mixed", prefill + decode, seed=11)
    err = rel_err(ours()(*mixed.args[0]), reference(*mixed.args[0]))
    t_mixed = time_calls(ours(), mixed.args, 10)
    t_prefill = time_calls(ours(), make_batch("p", prefill, seed=12).args, 10)
    t_decode = time_calls(ours(), make_batch("d", decode, seed=13).args, 10)
    ratio = t_mixed / (t_prefill + t_decode)
    results["mixed"] = dict(
        us=t_mixed * 1e6, prefill_us=t_prefill * 1e6, decode_us=t_decode * 1e6, ratio=ratio, err=err
    )
    print(
        f"mixed 4x512 + 128x2048: {t_mixed * 1e6:.1f} us; parts {t_prefill * 1e6:.1f} + {t_decode * 1e6:.1f} us; "
        f"ratio {ratio:.3f}; err {err:.1e}",
        flush=True,
    )


def bench_write_kv(results: dict) -> None:
    rows = []
    for t in (256, 8192):
        n = 1 + 4 * t // BS + 4
        kc = jax.random.normal(jax.random.key(1), (n, BS, K, DH), DTYPE)
        vc = jax.random.normal(jax.random.key(2), (n, BS, K, DH), DTYPE)
        kn = jax.random.normal(jax.random.key(3), (t, K, DH), DTYPE)
        vn = jax.random.normal(jax.random.key(4), (t, K, DH), DTYPE)
        slots = jnp.asarray(np.random.default_rng(t).permutation(np.arange(BS, n * BS))[:t].astype(np.int32))
        got, want = pk.write_kv(kc, vc, kn, vn, slots), pk.write_kv_reference(kc, vc, kn, vn, slots)
        ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want, strict=True))
        times = {}
        for name, fn in (("pallas", pk.write_kv), ("xla", pk.write_kv_reference)):
            step = jax.jit(fn, donate_argnames=("k_cache", "v_cache"))
            kc2, vc2 = step(kc + 0, vc + 0, kn, vn, slots)
            jax.block_until_ready(kc2)
            runs = []
            for _ in range(20):
                start = time.perf_counter()
                kc2, vc2 = step(kc2, vc2, kn, vn, slots)
                jax.block_until_ready(kc2)
                runs.append(time.perf_counter() - start)
            times[name] = statistics.median(runs) * 1e6
        rows.append(dict(tokens=t, pallas_us=times["pallas"], xla_us=times["xla"], exact=ok))
        print(f"write_kv T={t:5d}: pallas {times['pallas']:.1f} us, xla scatter {times['xla']:.1f} us, exact {ok}")
    results["write_kv"] = rows


def sweep(results: dict) -> None:
    """Tiling candidates at the target shapes; the winners go into jaxserve/kernels/tuning.py."""
    decode_variants = {
        (16, 1024): [
            dict(num_splits=4),
            dict(num_splits=16),
            dict(num_splits=8, decode_num_stages=2),
            dict(num_splits=8, decode_block_n=32),
            dict(decode_kernel=False),
        ],
        (64, 1024): [
            dict(num_splits=1),
            dict(num_splits=4),
            dict(num_splits=2, decode_num_stages=2),
            dict(num_splits=2, decode_block_n=128),
            dict(decode_kernel=False),
        ],
        (256, 4096): [
            dict(num_splits=1, decode_block_n=128),
            dict(num_splits=1, decode_num_stages=2),
            dict(num_splits=1, decode_block_n=128, decode_num_stages=2),
        ],
    }
    rows = []
    for (b, ctx), variants in decode_variants.items():
        batch = make_batch(f"decode {b}x{ctx}", [(1, ctx - 1)] * b, seed=b + ctx)
        for v in variants:
            try:
                t = time_calls(ours(**v), batch.args, reps_for(batch))
            except Exception as e:  # e.g. a tile that does not fit in shared memory
                print(f"sweep {b}x{ctx} {v} failed: {e!r}"[:300], flush=True)
                continue
            rows.append(dict(shape=f"decode {b}x{ctx}", tuning=v, us=t * 1e6, TBps=batch.kv_bytes / t / 1e12))
            results["sweep"] = rows
            print(f"sweep decode {b}x{ctx} {v}: {t * 1e6:.1f} us {batch.kv_bytes / t / 1e12:.2f} TB/s", flush=True)
    batch = make_batch("prefill 1 x 8192", [(8192, 0)], seed=3)
    candidates = ((128, 64, 4, 3), (128, 128, 8, 2), (256, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2))
    for bm, bn, w, s in candidates:
        v = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        try:
            t = time_calls(ours(**v), batch.args, 10)
        except Exception as e:
            print(f"sweep prefill {v} failed: {e!r}"[:300], flush=True)
            continue
        rows.append(dict(shape="prefill 1x8192", tuning=v, us=t * 1e6, TFLOPs=batch.flops / t / 1e12))
        print(f"sweep prefill 8192 {v}: {t * 1e6:.1f} us {batch.flops / t / 1e12:.1f} TFLOP/s", flush=True)
    results["sweep"] = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the tiling candidates at the target shapes")
    parser.add_argument("--quick", action="store_true", help="decode at the three target shapes only")
    parser.add_argument("--json", default=None, help="write all numbers to this file")
    parser.add_argument("--skip-baselines", action="store_true", help="do not time the built-in op and reference")
    args = parser.parse_args()
    results: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    targets = [(16, 1024), (64, 1024), (256, 4096)]
    rest = [(b, c) for b in (1, 16, 64, 256) for c in (1024, 4096, 16384) if (b, c) not in targets]
    # Most important first: a run cut short by its time limit still has the target shapes.
    sections = [
        ("ceilings", lambda r: r.update(ceilings=ceilings())),
        ("decode", lambda r: bench_decode(targets, r, not args.skip_baselines)),
        ("prefill", bench_prefill),
        ("mixed", bench_mixed),
    ]
    if args.sweep:
        sections.append(("sweep", sweep))
    if not args.quick:
        sections.append(("decode_rest", lambda r: bench_decode(rest, r, not args.skip_baselines)))
    sections.append(("write_kv", bench_write_kv))
    for name, run in sections:
        try:
            run(results)
        except Exception as e:  # keep the other sections' numbers when one fails
            results[f"{name}_error"] = repr(e)
            print(f"{name} FAILED: {e!r}"[:2000], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(f"ceilings: {results.get('ceilings')}")


if __name__ == "__main__":
    main()
