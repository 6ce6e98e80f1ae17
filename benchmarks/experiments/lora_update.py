"""Where `LLM.update_lora` of one adapter spends its time, with LoRA's a folded into the weights and with separate
tables, in one process: the whole update (float32 PEFT tensors from host memory, and bfloat16 arrays on the
device), and its parts: reading the adapter (`read_adapter`: names, shapes, the cast plan), the slot's writes
(`ServingWeights.write_adapter`, until the device is done), and one module's write repeated (the largest: is a
folded write's time the module's own bytes, or its whole weight's?).

    python benchmarks/experiments/lora_update.py --model llama-3.1-8b --rank 64
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve.llm
from jaxserve.bench import TokenIdTokenizer, random_adapter_tensors, random_model
from jaxserve.config import CompileConfig, LoraConfig
from jaxserve.lora import read_adapter


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def measure(loaded, fold: bool, rank: int, repeats: int) -> tuple:
    """One engine's row: the update's times, the number of modules and the largest module's write."""
    jaxserve.llm.LoraConfig = functools.partial(LoraConfig, fold=fold)
    llm = jaxserve.llm.LLM(
        loaded,
        tokenizer=TokenIdTokenizer(),
        enable_lora=True,
        max_loras=4,
        max_lora_rank=rank,
        max_seq_len=256,
        compile_config=CompileConfig(lazy=True),
        show_progress=False,
    )
    weights = llm.engine.runner.weights
    config = {"r": rank, "lora_alpha": 2 * rank}
    host = random_adapter_tensors(llm, rank, 1)
    llm.load_lora("a", host, config)
    slots = llm.engine.scheduler.lora_slots  # the slot a request of the adapter would take
    slot = slots.acquire("a")
    slots.release("a")
    slots.pending.clear()

    def done() -> None:
        jax.block_until_ready(weights.step_weights)

    adapter = read_adapter("a", host, config)
    weights.write_adapter(slot, adapter)  # the slot the update rewrites
    done()
    device = {k: jnp.asarray(v, jnp.bfloat16) for k, v in host.items()}
    jax.block_until_ready(device)
    llm.update_lora("a", device)  # compiles the bfloat16 writes
    done()
    whole_host = median_ms(lambda: (llm.update_lora("a", host), done()), repeats)
    whole_device = median_ms(lambda: (llm.update_lora("a", device), done()), repeats)
    read = median_ms(lambda: read_adapter("a", host, config), repeats)
    write = median_ms(lambda: (weights.write_adapter(slot, adapter), done()), repeats)
    writer = weights._lora_writer
    key = max(writer.sites, key=lambda k: int(np.prod(writer.sites[k].in_shape)) * writer.sites[k].out_width)
    pair = adapter.weights[key]

    def one_module() -> None:
        weights.arrays, weights.lora = writer._write(
            (weights.arrays, weights.lora), key, slot, pair, adapter.scaling, adapter.transposed
        )
        done()

    one_module()
    one = median_ms(one_module, 3 * repeats)
    llm.close()
    return fold, whole_host, whole_device, read, write, len(adapter.weights), key, one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = random_model(args.model, "auto")
    rows = [measure(loaded, fold, args.rank, args.repeats) for fold in (True, False)]
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}, {args.model}, rank {args.rank}, all seven projections")
    print("| a | update_lora, f32 host | update_lora, bf16 device | read_adapter | slot writes | modules | one write |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for fold, h, d, r, w, n, key, one in rows:
        name = "folded" if fold else "separate"
        module = f"{one:.3f} ms ({key[1]}, layer {key[0]})"
        print(f"| {name} | {h:.1f} ms | {d:.1f} ms | {r:.1f} ms | {w:.1f} ms | {n} | {module} |")


if __name__ == "__main__":
    main()
