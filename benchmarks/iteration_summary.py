"""Host time per step from a `jaxserve bench --iteration-log` file, by kind of step: every step, the
decode-only steps, and the decode-only steps of the largest decode bucket (the issue's "host time per step
at the largest decode bucket"). Host is input preparation + dispatch (StepStats.host_seconds), inputs is host
less dispatch; the gap is the time from the step's launch to the next one's (about the device step once
the queue is full).

    jaxserve bench throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 \\
        --output-len 128 --iteration-log steps.jsonl
    python benchmarks/iteration_summary.py steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics


def summarize(records: list[dict]) -> list[tuple[str, int, dict[str, float]]]:
    decode = [r for r in records if r["num_prefill_rows"] == 0]
    largest = max((r["bucket_seqs"] for r in decode), default=0)
    largest_decode = [r for r in decode if r["bucket_seqs"] == largest]
    groups = [("all steps", records), ("decode-only", decode), (f"decode, {largest}-row bucket", largest_decode)]
    rows = []
    for name, group in groups:
        if not group:
            rows.append((name, 0, {}))
            continue
        host = [r["host_ms"] for r in group]
        dispatch = [r["dispatch_ms"] for r in group]
        gaps = [r["gap_ms"] for r in group if r["gap_ms"] is not None]  # None: the last step
        stats = {
            "host_ms": statistics.mean(host),
            "dispatch_ms": statistics.mean(dispatch),
            "inputs_ms": statistics.mean(h - d for h, d in zip(host, dispatch, strict=True)),
            "max_dispatch_ms": max(dispatch),
            "gap_ms": statistics.median(gaps),
        }
        stats["host_share"] = stats["host_ms"] / stats["gap_ms"]
        rows.append((name, len(group), stats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a --iteration-log file (one JSON object per step)")
    args = parser.parse_args()
    with open(args.log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    columns = ("n", "host", "dispatch", "inputs", "max disp", "gap p50", "host/gap")
    print(f"{'steps':28s} " + " ".join(f"{c:>9s}" for c in columns))
    for name, n, s in summarize(records):
        if not n:
            print(f"{name:28s} {0:9d}")
            continue
        print(
            f"{name:28s} {n:9d} {s['host_ms']:9.3f} {s['dispatch_ms']:9.3f} {s['inputs_ms']:9.3f} "
            f"{s['max_dispatch_ms']:9.2f} {s['gap_ms']:9.2f} {s['host_share']:9.1%}"
        )


if __name__ == "__main__":
    main()
