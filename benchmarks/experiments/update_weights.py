"""How long `LLM.update_weights` takes, and the device memory it peaks at (run on the GPU).

    python benchmarks/update_weights.py --random-weights llama-3.1-8b [--kv-fraction 0.4 --repeats 2]

Builds an LLM over random weights of the shape (held on the host, as a checkpoint loader returns them)
with a small step table and a KV pool of --kv-fraction of the free memory, so a trainer's device copy of
the weights fits beside it. Then, --repeats times each: update_weights from host numpy arrays (a
checkpoint, or a trainer on another host), and from device arrays in the checkpoint layout (a trainer on
the same device); a greedy generate after each update checks the engine still serves. The device's
bytes in use are sampled every 0.5 ms on a thread while each update runs (the allocator's own peak
never resets); the table gives the time, the peak, and the peak over what was in use before the update
(the engine's weights and pool, and the caller's arrays), against weights + pool + 10%.
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import numpy as np

from jaxserve import LLM, SamplingParams, bench, capacity, gpu_client
from jaxserve.config import CompileConfig, KvCacheConfig


def in_use(device: jax.Device) -> int:
    """The device's bytes in use (0 where it reports none, as on CPU)."""
    memory = capacity.device_memory(device)
    return 0 if memory is None else memory[1]


class PeakSampler:
    """bytes_in_use of a device, sampled on a thread between start() and stop()."""

    def __init__(self, device: jax.Device, interval_s: float = 5e-4) -> None:
        self.device, self.interval_s, self.peak = device, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, in_use(self.device))
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, in_use(self.device))


def nbytes(tree: object) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random-weights", default="llama-3.1-8b")
    parser.add_argument("--kv-fraction", type=float, default=0.4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    capacity.raise_memory_fraction_default()
    gpu_client.use_tfrt_client_default(1)
    model = bench.random_model(args.random_weights)
    device = jax.devices()[0]
    llm = LLM(
        model,
        tokenizer=bench.TokenIdTokenizer(),
        max_batch_size=8,
        max_seq_len=256,
        max_num_tokens=256,
        kv_cache_config=KvCacheConfig(free_memory_fraction=args.kv_fraction),
        compile_config=CompileConfig(decode_batch_sizes=(8,), token_buckets=(256,), penalty_variants=False),
        show_progress=False,
    )
    weights_bytes = nbytes(llm.engine.runner.weights.arrays)
    pool_bytes = nbytes(llm.engine.runner.kv_cache)
    prompt = [list(range(1, 33))]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    host = model.weights
    on_device = jax.device_put(host, device)
    jax.block_until_ready(on_device)
    print(f"weights {weights_bytes / 2**30:.2f} GiB, KV pool {pool_bytes / 2**30:.2f} GiB, device {device}")
    print("| source | run | seconds | GB/s | peak GiB | peak over before GiB | bound: weights + pool + 10% GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for source, params in (("host numpy", host), ("device arrays", on_device)):
        for run in range(args.repeats):
            before = in_use(device)
            with PeakSampler(device) as sampler:
                start = time.perf_counter()
                llm.update_weights(params)
                jax.block_until_ready(llm.engine.runner.weights.arrays)
                seconds = time.perf_counter() - start
            tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
            if tokens != reference:
                raise RuntimeError(f"after the update from {source} the tokens changed: {tokens} != {reference}")
            bound = 1.1 * (weights_bytes + pool_bytes)
            held = before - weights_bytes - pool_bytes  # the caller's arrays and the rest in use
            print(
                f"| {source} | {run} | {seconds:.2f} | {weights_bytes / seconds / 1e9:.1f} | "
                f"{sampler.peak / 2**30:.2f} | {(sampler.peak - before) / 2**30:.2f} | "
                f"{(bound + held) / 2**30:.2f} (of which held by the caller / other: {held / 2**30:.2f}) |"
            )
    np.testing.assert_array_equal(tokens, reference)
    llm.close()


if __name__ == "__main__":
    main()
