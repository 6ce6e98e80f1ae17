"""Cost of the sampler's pieces at a large vocabulary: argmax, log_softmax, lax.top_k(20), the whole
greedy `sample`, and the sampled tokens' logprobs with the top 20.

    python benchmarks/sampler_topk.py --batch 256 --vocab 128256
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import timed_ms

from jaxserve.logprobs import token_logprobs
from jaxserve.sampler import sample
from jaxserve.step_inputs import SamplingInputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    logits = jax.random.normal(jax.random.key(0), (args.batch, args.vocab), jnp.float32)
    params = SamplingInputs.neutral(args.batch)
    key = jax.random.PRNGKey(0)
    rows = [
        ("argmax", jax.jit(lambda x: jnp.argmax(x, -1))),
        ("log_softmax", jax.jit(lambda x: jax.nn.log_softmax(x, -1))),
        ("top_k 20", jax.jit(lambda x: jax.lax.top_k(x, 20))),
        ("top_k 1", jax.jit(lambda x: jax.lax.top_k(x, 1))),
        ("sample greedy", jax.jit(lambda x: sample(x, params, key))),
        ("sample greedy + 20 logprobs", jax.jit(lambda x: token_logprobs(x, sample(x, params, key), 20))),
    ]
    for name, fn in rows:
        print(f"{name:32s} B={args.batch} V={args.vocab}: {timed_ms(fn, logits):8.3f} ms")


if __name__ == "__main__":
    main()
