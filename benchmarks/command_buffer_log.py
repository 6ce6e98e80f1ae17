"""What XLA's CUDA-graph updates cost in a run, from XLA's own log: per command buffer (named by its number of
commands), how often it ran, how often its recorded graph was updated because buffer addresses changed, how
many allocations had moved, how many commands were re-recorded and the microseconds the update took.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1 \\
        jaxserve bench throughput --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 \\
        --output-len 128 2> xla.log
    python benchmarks/command_buffer_log.py xla.log [--after "jaxserve.runner: warmup"]

`--after` counts only the lines after the first line holding that text (e.g. the steps after the warmup).
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

UPDATE = re.compile(r"Update command buffer .*num_commands=(\d+); updated_allocs=(\d+)")
UPDATED = re.compile(r"Updated (\d+) commands in (\d+) .s \(skipped (\d+) command updates\)")
EXECUTE = re.compile(r"Execute command buffer[ ;]")


def summarize(lines: list[str]) -> tuple[int, dict[int, dict[str, float]]]:
    """Command-buffer executions, and per command-buffer size: updates, mean moved allocations, mean
    re-recorded commands, mean and total update µs."""
    moved: dict[int, list[int]] = defaultdict(list)
    recorded: dict[int, list[int]] = defaultdict(list)
    micros: dict[int, list[int]] = defaultdict(list)
    executions = 0
    for line in lines:
        if EXECUTE.search(line):
            executions += 1
        if match := UPDATE.search(line):
            moved[int(match[1])].append(int(match[2]))
        elif match := UPDATED.search(line):
            size, took, skipped = int(match[1]), int(match[2]), int(match[3])
            recorded[size].append(size - skipped)
            micros[size].append(took)
    table = {}
    for size in sorted(set(moved) | set(recorded), reverse=True):
        table[size] = {
            "updates": len(moved[size]),
            "moved_allocs": statistics.mean(moved[size]) if moved[size] else float("nan"),
            "recorded": statistics.mean(recorded[size]) if recorded[size] else float("nan"),
            "update_us": statistics.mean(micros[size]) if micros[size] else float("nan"),
            "update_us_total": sum(micros[size]),
        }
    return executions, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--after", default=None, help="count only lines after the first holding this text")
    parser.add_argument("--top", type=int, default=12, help="the command buffers with the most update time")
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        lines = f.readlines()
    if args.after is not None:
        start = next((i for i, line in enumerate(lines) if args.after in line), len(lines))
        lines = lines[start + 1 :]
    executions, table = summarize(lines)
    print(f"command-buffer executions: {executions}")
    columns = (("commands", 9), ("updates", 8), ("moved allocs", 13), ("re-recorded", 12), ("us/update", 10))
    print(" ".join(f"{name:>{width}s}" for name, width in columns) + f" {'us total':>10s}")
    ranked = sorted(table.items(), key=lambda item: -item[1]["update_us_total"])[: args.top]
    for size, row in ranked:
        print(
            f"{size:9d} {row['updates']:8d} {row['moved_allocs']:13.1f} {row['recorded']:12.1f} "
            f"{row['update_us']:10.1f} {row['update_us_total']:10.0f}"
        )


if __name__ == "__main__":
    main()
