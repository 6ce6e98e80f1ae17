"""Host time of `Scheduler.update` per steady decode step: B requests of I prompt and O output tokens on a
scheduler with fake tokens (no model, no device, no overlap), timed around each step's `update` that has
B decode rows; also the `{id(request): row}` dict over the batch (and a look-up per received request)
that `Engine._process` built every step before it paired rows by position.

    python benchmarks/scheduler_update.py --batch 1024 --input-len 16 --output-len 32

Prints the median ms per decode step of each run's steps, the minimum over --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig, KvCacheConfig
from jaxserve.request import make_requests
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import Scheduler


def run(batch: int, input_len: int, output_len: int, block_size: int) -> tuple[float, float]:
    """Median seconds per full decode step: `update`, and the row dict."""
    config = EngineConfig(
        max_batch_size=batch,
        max_num_tokens=batch * input_len,
        max_seq_len=input_len + output_len + block_size,
        kv_cache=KvCacheConfig(block_size=block_size),
    )
    per_row = -(-(input_len + output_len) // block_size)
    scheduler = Scheduler(config, BlockManager(batch * per_row + 1, block_size), clock=lambda: 0.0)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        for request in make_requests(f"r{i}", rng.integers(1, 32000, input_len).tolist(), params):
            scheduler.add(request)
    update_times, dict_times = [], []
    while scheduler.has_unfinished():
        scheduled = scheduler.schedule()
        tokens = np.full(len(scheduled.rows), 7, np.int32)
        start = time.perf_counter()
        received = scheduler.update(scheduled, tokens)
        updated = time.perf_counter()
        row_of = {id(row.request): i for i, row in enumerate(scheduled.rows)}
        _ = [row_of[id(request)] for request in received]
        done = time.perf_counter()
        if scheduled.num_prefill_rows == 0 and len(scheduled.rows) == batch:
            update_times.append(updated - start)
            dict_times.append(done - updated)
    return statistics.median(update_times), statistics.median(dict_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--batch", type=int, default=1024)
    add("--input-len", type=int, default=16)
    add("--output-len", type=int, default=32)
    add("--block-size", type=int, default=16)
    add("--repeats", type=int, default=9)
    args = parser.parse_args()
    runs = [run(args.batch, args.input_len, args.output_len, args.block_size) for _ in range(args.repeats)]
    update = min(u for u, _ in runs) * 1e3
    row_dict = min(d for _, d in runs) * 1e3
    print(
        f"{args.batch} decode rows ({args.input_len}/{args.output_len}): Scheduler.update {update:.3f} ms per step, "
        f"the row dict {row_dict:.3f} ms (min over {args.repeats} runs of the per-step median)"
    )


if __name__ == "__main__":
    main()
