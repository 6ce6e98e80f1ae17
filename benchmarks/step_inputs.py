"""Host time of `make_step_inputs` on a steady-decode batch: B decode rows with C-token contexts, each
row's input pending (overlap: the previous step has the same rows), block tables a seeded permutation
of the pool, as benchmarks/step_profile.py builds its decode step; each request holds its own copy of the
SamplingParams, as in the engine. No device, no jax.

    python benchmarks/step_inputs.py --batch 1024 --context 192 [--temperature 0.8 --top-k 50 --seed 0]
    python benchmarks/step_inputs.py --batch 1024 --penalty 1.1     # the penalties variant (token history)

Prints the median, min and max milliseconds per call over --repeats rounds of --calls calls each, for a
steady decode step (the same rows one token further: built from the previous step's inputs) and for the
same rows built in full (interleaved rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from array import array

import numpy as np

from jaxserve.config import CompileConfig, EngineConfig
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow
from jaxserve.step_inputs import make_step_inputs
from jaxserve.variants import StepConfig

VOCAB = 32000


def decode_batch(steps: StepConfig, batch: int, context: int, params: SamplingParams) -> ScheduledBatch:
    """B decode rows at position C (kv_len C + 1), input pending, over distinct blocks of the pool."""
    rng = np.random.default_rng(batch * 1009 + context)
    per_row = -(-(context + 1) // steps.buckets.block_size)
    blocks = 1 + rng.permutation(batch * per_row).reshape(batch, per_row)
    rows = []
    for i in range(batch):
        prompt = rng.integers(1, VOCAB, context).tolist()
        # Each request its own copy of the parameters, as the engine's add_request validates them.
        request = Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=dataclasses.replace(params))
        request.num_computed_tokens, request.num_pending_tokens = context + 1, 1
        request.block_ids = array("i", blocks[i].tolist())
        rows.append(
            ScheduledRow(
                request=request,
                start=context,
                num_tokens=1,
                token_ids=[],
                block_ids=request.block_ids,
                samples=True,
                input_pending=True,
                generation_index=1,
                epoch=0,
                is_prefill=False,
            )
        )
    return ScheduledBatch(rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--batch", type=int, default=1024)
    add("--context", type=int, default=192)
    add("--max-seq-len", type=int, default=2048)
    add("--temperature", type=float, default=0.0)
    add("--top-k", type=int, default=None)
    add("--seed", type=int, default=None)
    add("--penalty", type=float, default=1.0, help="repetition_penalty (not 1: the penalties variant)")
    add("--calls", type=int, default=50)
    add("--repeats", type=int, default=7)
    args = parser.parse_args()
    penalties = args.penalty != 1.0
    config = EngineConfig(
        args.batch,
        args.batch,
        args.max_seq_len,
        compile=CompileConfig(
            decode_batch_sizes=(args.batch,), token_buckets=(args.batch,), penalty_variants=penalties
        ),
        attention_backend="xla",
    )
    steps = StepConfig.from_config(config, VOCAB)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, seed=args.seed, repetition_penalty=args.penalty
    )
    previous = decode_batch(steps, args.batch, args.context, params)
    _, bucket, variant = make_step_inputs(previous, previous, steps)  # `previous` now holds its inputs
    # "steady": the next step of the same rows, built from the previous step's inputs; "full": a batch of
    # the previous step's rows again (not one token further), which make_step_inputs builds in full.
    following = [
        dataclasses.replace(r, start=r.start + 1, generation_index=r.generation_index + 1) for r in previous.rows
    ]
    cases = {"steady": following, "full": previous.rows}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, rows in cases.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                # A batch of its own each call, as each step's is (a batch keeps what was built for it).
                make_step_inputs(ScheduledBatch(rows=rows), previous, steps)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    for name, values in times.items():
        print(
            f"make_step_inputs ({name}), {args.batch} decode rows, context {args.context}, {bucket}, {variant}: "
            f"median {statistics.median(values):.3f} ms (min {min(values):.3f}, max {max(values):.3f}) "
            f"over {args.repeats} x {args.calls} calls"
        )


if __name__ == "__main__":
    main()
