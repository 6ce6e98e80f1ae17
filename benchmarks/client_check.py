"""Does the engine behave the same under this process's PjRt client? Run it once per client (e.g. with
XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=0, then =1) on the same card: greedy tokens of a random-weight model,
then the memory hand-back paths (sleep level 1 and wake_up: weights to host memory and back; sleep level 2
and update_weights: weights freed, placed again), each followed by the same generation, whose tokens must
not change; `--compare` checks them against another run's `--save`.

    XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=0 python benchmarks/client_check.py --save /tmp/tokens.npy
    XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 python benchmarks/client_check.py --compare /tmp/tokens.npy
    python benchmarks/client_check.py --shape tiny-llama --num-prompts 4 --max-tokens 8   # CPU check
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxserve import bench
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams


def tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> np.ndarray:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return np.array([out.outputs[0].token_ids for out in outputs], dtype=np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "xla"])
    parser.add_argument("--save", default=None, help="write the greedy tokens here")
    parser.add_argument("--compare", default=None, help="another run's --save: the tokens must be equal")
    args = parser.parse_args()
    device = jax.devices()[0]
    client = device.client.platform_version
    print(f"jax {jax.__version__}; {jax.device_count()} x {device.device_kind}; client {client!r}")
    model = bench.random_model(args.shape)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, model.config.vocab_size, size=(args.num_prompts, args.prompt_len)).tolist()
    llm = LLM(
        model,
        tokenizer=bench.IdTextTokenizer(),
        max_batch_size=args.num_prompts,
        max_seq_len=args.prompt_len + args.max_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        show_progress=False,
    )
    first = tokens(llm, prompts, args.max_tokens)
    checks = {}
    start = time.perf_counter()
    llm.sleep(1)
    llm.wake_up()
    checks["sleep(1) + wake_up"] = (tokens(llm, prompts, args.max_tokens), time.perf_counter() - start)
    start = time.perf_counter()
    llm.sleep(2)
    llm.update_weights(model.weights)
    llm.wake_up()
    checks["sleep(2) + update_weights + wake_up"] = (tokens(llm, prompts, args.max_tokens), time.perf_counter() - start)
    for name, (again, seconds) in checks.items():
        print(f"{name}: tokens {'equal' if np.array_equal(first, again) else 'DIFFER'} ({seconds:.2f} s)")
    if args.save:
        np.save(args.save, first)
    if args.compare:
        other = np.load(args.compare)
        same = (other == first).all(axis=1)
        print(f"against {args.compare}: {int(same.sum())} / {len(same)} sequences identical")


if __name__ == "__main__":
    main()
