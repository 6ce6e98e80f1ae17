"""The `jaxserve` command line: generate, chat.

stdout carries only the generated text, so the output can be piped; progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _add_generation_args(parser: argparse.ArgumentParser) -> None:
    from jaxserve.config import DTYPES
    from models.hub import DEFAULT_MODEL

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name, HF directory, GGUF file or hub id (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens to generate at most (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="weights dtype; auto = bfloat16 on GPU, float32 on CPU"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX-native LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a raw prompt")
    generate.add_argument("prompt", help="the text to continue")
    _add_generation_args(generate)
    chat = commands.add_parser("chat", help="answer one message with the model's chat template")
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--system", default=None, help="an optional system message")
    _add_generation_args(chat)
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")


def run(args: argparse.Namespace) -> str:
    """Load the model, build the prompt, generate with the engine; returns the generated text."""
    from jaxserve import capacity
    from jaxserve.config import CompileConfig, model_max_seq_len
    from jaxserve.llm import LLM, resolve_dtype
    from jaxserve.sampling import SamplingParams
    from jaxserve.tokenizer import Tokenizer
    from models.loader import load_model

    capacity.raise_memory_fraction_default()  # before anything starts a jax backend
    model = load_model(args.model, dtype=resolve_dtype(args.dtype))
    if model.tokenizer_source is None:
        raise ValueError(f"{args.model} has no tokenizer files")
    tokenizer = Tokenizer.from_source(model.tokenizer_source)
    if args.command == "chat":
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.message})
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    # One request of known length: compile exactly its two step shapes (its prompt, then decode).
    max_seq_len = min(len(prompt_ids) + args.max_tokens, model_max_seq_len(model.hf_config))
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_batch_size=1,
        max_seq_len=max_seq_len,
        max_num_tokens=max(len(prompt_ids), 1),
        compile_config=CompileConfig(
            decode_batch_sizes=(1,), token_buckets=(max(len(prompt_ids), 1),), penalty_variants=False
        ),
        seed=args.seed,
        show_progress=args.verbose,
    )
    params = SamplingParams(
        max_tokens=max(1, min(args.max_tokens, max_seq_len - len(prompt_ids))),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    [output] = llm.generate([prompt_ids], params, use_tqdm=False)
    if output.error:
        raise ValueError(output.error)
    return output.outputs[0].text


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        text = run(args)
    except (FileNotFoundError, ValueError, TypeError, RuntimeError) as error:
        print(f"jaxserve: error: {error}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
