"""Quality of quantized serving against the unquantized engine on a real model: perplexity of a held text and the
accuracy of the batch_eval notebook's 16 multiple-choice questions (capitals and sums, two-shot), both through the
engine's scoring API (`SamplingParams(prompt_logprobs=0)`), for each configuration named.

    python benchmarks/quality.py                                   # smollm2-135m-instruct: every configuration
    python benchmarks/quality.py --model gemma-3-270m --dtype float32
    python benchmarks/quality.py --configs base fp8 --json

Configurations: "base" (weights in --dtype), "fp8" (`quantization="fp8"`), "fp8_kv" (`kv_cache_dtype="fp8"`),
"fp8+fp8_kv" (both). The data (benchmarks/data/
quality.json): a ~330-token English text written for it, and the questions with their two-shot prefix. A
question counts as right when its right choice has the highest log-likelihood (lm-eval's `acc`). Perplexity is
exp of the mean negative log-likelihood of the text's tokens after the first. On a CPU the default dtype is
float32 (bfloat16 on a GPU); tests/engine/test_quality.py bounds the same figures on the default model.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "quality.json"
CONFIGS = {
    "base": {},
    "fp8": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8+fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


@dataclass(frozen=True, slots=True)
class Quality:
    config: str
    perplexity: float
    accuracy: float
    choice_logprobs: np.ndarray  # [questions, choices]


def load_data() -> dict[str, Any]:
    return json.loads(DATA.read_text())


def scoring_llm(model: Any, dtype: str, **engine_kwargs: Any) -> Any:
    """A small engine that scores prompts (prompt logprobs) of up to 512 tokens."""
    from jaxserve import LLM, CompileConfig

    return LLM(
        model,
        dtype=dtype,
        max_seq_len=512,
        max_batch_size=8,
        max_num_tokens=512,
        compile_config=CompileConfig(
            decode_batch_sizes=(8,), token_buckets=(512,), penalty_variants=False, prompt_logprobs=True
        ),
        show_progress=False,
        **engine_kwargs,
    )


def measure(llm: Any, config: str, data: dict[str, Any] | None = None) -> Quality:
    """Perplexity of the held text and the multiple-choice accuracy, by `llm`'s prompt logprobs."""
    from jaxserve import SamplingParams

    data = load_data() if data is None else data
    tokenizer = llm.tokenizer
    text = tokenizer.encode(data["text"])
    prompts, starts = [text], [1]
    for question, choices, _ in data["questions"]:
        context = data["examples"] + f"Question: {question}\nAnswer:"
        context_ids = tokenizer.encode(context)
        for choice in choices:
            prompts.append(tokenizer.encode(context + " " + choice))
            starts.append(len(context_ids))
    params = [SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start) for start in starts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sums = [
        sum(out.prompt_logprobs[p][token].logprob for p, token in enumerate(prompt) if p >= start)
        for prompt, start, out in zip(prompts, starts, outputs, strict=True)
    ]
    choice_logprobs = np.asarray(sums[1:]).reshape(len(data["questions"]), -1)
    answers = np.asarray([answer for *_, answer in data["questions"]])
    accuracy = float((choice_logprobs.argmax(axis=1) == answers).mean())
    return Quality(config, _perplexity(sums[0], text), accuracy, choice_logprobs)


def perplexity(llm: Any, data: dict[str, Any] | None = None) -> float:
    """Perplexity of the held text alone (`measure`'s first figure, without the questions' prompts)."""
    from jaxserve import SamplingParams

    text = llm.tokenizer.encode((load_data() if data is None else data)["text"])
    (out,) = llm.generate(
        [text], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=1), use_tqdm=False
    )
    return _perplexity(sum(out.prompt_logprobs[p][token].logprob for p, token in enumerate(text) if p >= 1), text)


def _perplexity(logprob_sum: float, text: list[int]) -> float:
    return math.exp(-logprob_sum / (len(text) - 1))


def main() -> int:
    from jaxserve.models.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="the weights' and activations' dtype (default: auto)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    args = parser.parse_args()
    from jaxserve.llm import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    loaded = load_model(args.model, dtype=dtype, on_device=False)
    data = load_data()
    results = []
    for config in args.configs:
        llm = scoring_llm(loaded, dtype, **CONFIGS[config])
        results.append(measure(llm, config, data))
        llm.close()
    base = results[0]
    for r in results:
        gap = np.abs(r.choice_logprobs - base.choice_logprobs).max()
        row = {"model": args.model, "dtype": dtype, "config": r.config, "perplexity": round(r.perplexity, 4)}
        row |= {"accuracy": r.accuracy, f"max_choice_logprob_gap_vs_{base.config}": round(float(gap), 4)}
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{args.model} {dtype} {r.config:6} perplexity {r.perplexity:8.4f}  accuracy {r.accuracy:.4f}  "
                f"largest choice log-likelihood change vs {base.config}: {gap:.4f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
