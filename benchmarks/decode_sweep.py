"""Decode-kernel tilings at chosen shapes: every combination of the given split counts, key tiles, warps and
stages, timed as `attention.py` times (one jit of back-to-back calls over rotated cache copies, median of
five), each checked against the jnp reference. The default tiling (`pallas_kernels.tuning.decode_tiling`)
is timed first and marked.

    python benchmarks/decode_sweep.py --shapes 32x192,32x256 --splits 1,2,4,8 --block-n 32,64 \\
        --warps 2,4 --stages 2,3 --json out/decode_sweep.json

A shape BxC is B sequences of one query token at kv_len C (the block table C tokens wide, as in an engine
whose max_seq_len is C); the model shape is attention.py's (32 query heads, 8 kv heads, head_dim 128).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import DH, K, make_batch, ours, reference, rel_err, reps_for, time_calls  # noqa: E402

from pallas_kernels.tuning import decode_tiling  # noqa: E402


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        b, c = part.lower().split("x")
        shapes.append((int(b), int(c)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("32x192,32x256"))
    parser.add_argument("--splits", type=parse_ints, default=[1, 2, 4, 8])
    parser.add_argument("--block-n", type=parse_ints, default=[32, 64])
    parser.add_argument("--warps", type=parse_ints, default=[2, 4])
    parser.add_argument("--stages", type=parse_ints, default=[2, 3])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for b, ctx in args.shapes:
        batch = make_batch(f"decode {b}x{ctx}", [(1, ctx - 1)] * b, seed=b * 7 + ctx)
        ref = reference(*batch.args[0])
        default = decode_tiling(DH, b, K, ctx, {})
        candidates = [None] + list(itertools.product(args.splits, args.block_n, args.warps, args.stages))
        for candidate in candidates:
            if candidate is None:
                tuning, label = {}, f"default {default}"
            else:
                s, n, w, st = candidate
                tuning = dict(num_splits=s, decode_block_n=n, decode_num_warps=w, decode_num_stages=st)
                label = f"splits {s:2d} block_n {n:3d} warps {w} stages {st}"
            try:
                fn = ours(max_q_len=1, **tuning)
                err = rel_err(fn(*batch.args[0]), ref)
                t = time_calls(fn, batch.args, reps_for(batch))
            except Exception as e:  # a tiling that does not compile or fit
                print(f"{b}x{ctx} {label}: failed {e!r}"[:240], flush=True)
                continue
            rate = batch.kv_bytes / t / 1e12
            rows.append(dict(shape=f"{b}x{ctx}", tuning=tuning, us=t * 1e6, TBps=rate, err=err))
            print(f"{b}x{ctx} {label}: {t * 1e6:7.2f} us {rate:5.2f} TB/s err {err:.1e}", flush=True)
        best = min((r for r in rows if r["shape"] == f"{b}x{ctx}"), key=lambda r: r["us"])
        print(f"best {b}x{ctx}: {best['tuning']} {best['us']:.2f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
