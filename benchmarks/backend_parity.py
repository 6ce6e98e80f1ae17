"""Greedy generation on the pallas and xla attention backends, compared token by token.

    python benchmarks/backend_parity.py --dtype float32 [--num-prompts 256 --prompt-len 128 --max-tokens 128]

Loads the default model (SmolLM2-135M-Instruct, real weights) once, builds one engine per backend in the
same process (each with a KV pool capped at what the workload needs, and two compiled buckets: a decode step of
--max-batch-size rows and a mixed step of --max-num-tokens tokens), runs the same prompts (random token
ids, fixed seed; or --text for natural-language prompts) greedily with ignore_eos and the top-2 logprobs
of every position, and reports: sequences identical, and for each one that differs, where, and the
xla backend's margin between its two most likely tokens at that position (a divergence at a margin near
zero is a near-tie broken differently by two correct kernels; a large margin would be a bug). Also the
largest difference of the sampled token's logprob over the positions where the two agree.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

TEXT_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "List three uses of a paper clip.",
    "Translate 'good morning' into Spanish, French and German.",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a recipe for pancakes.",
    "What are prime numbers? Give five examples.",
]


def run_backend(model, backend: str, prompts, args) -> tuple[list[list[int]], list[list[dict]], float]:
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import CompileConfig, KvCacheConfig

    need = len(prompts) * (max(len(p) if isinstance(p, list) else 64 for p in prompts) + args.max_tokens)
    llm = LLM(
        model,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        kv_cache_config=KvCacheConfig(max_tokens=need + 16 * len(prompts)),
        compile_config=CompileConfig(
            decode_batch_sizes=(args.max_batch_size,), token_buckets=(args.max_num_tokens,), penalty_variants=False
        ),
        attention_backend=backend,
        show_progress=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(f"{backend}: generated in {seconds:.1f}s", file=sys.stderr, flush=True)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    del llm
    return tokens, logprobs, seconds


def margin(position: dict) -> float:
    """Top-1 minus top-2 logprob at one position (the ranks say which is which)."""
    by_rank = sorted(position.values(), key=lambda lp: lp.rank)
    return by_rank[0].logprob - by_rank[1].logprob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--text", action="store_true", help="natural-language chat prompts instead of random ids")
    parser.add_argument("--backends", default="pallas,xla", help="the two backends compared (first, second)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    from jaxserve.models.loader import load_model

    model = load_model("smollm2-135m-instruct", dtype=args.dtype)
    if args.text:
        from jaxserve.tokenizer import Tokenizer

        tok = Tokenizer.from_source(model.tokenizer_source)
        chats = [[{"role": "user", "content": TEXT_PROMPTS[i % len(TEXT_PROMPTS)]}] for i in range(args.num_prompts)]
        prompts = [tok.apply_chat_template(c) for c in chats]
    else:
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]

    first, second = args.backends.split(",")
    (tp, lp_p, sec_p), (tx, lp_x, sec_x) = (run_backend(model, b, prompts, args) for b in (first, second))
    diverged = []
    agree_diff = 0.0
    for i, (a, b) in enumerate(zip(tp, tx, strict=True)):
        n = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        upto = len(a) if n is None else n
        for j in range(upto):
            agree_diff = max(agree_diff, abs(lp_p[i][j][a[j]].logprob - lp_x[i][j][b[j]].logprob))
        if n is not None:
            diverged.append(dict(prompt=i, position=n, xla_margin=margin(lp_x[i][n]), pallas_margin=margin(lp_p[i][n])))
    for d in diverged:
        print(
            f"prompt {d['prompt']:3d} diverges at token {d['position']:3d}: top-2 margin xla {d['xla_margin']:.2e}, "
            f"pallas {d['pallas_margin']:.2e}"
        )
    summary = dict(
        dtype=args.dtype,
        prompts="text" if args.text else f"random ids x {args.prompt_len}",
        identical=f"{len(tp) - len(diverged)}/{len(tp)}",
        largest_margin_at_divergence=max((d["xla_margin"] for d in diverged), default=None),
        max_logprob_diff_where_equal=agree_diff,
        backends=args.backends,
        seconds=[round(sec_p, 2), round(sec_x, 2)],
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
