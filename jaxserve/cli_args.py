"""The `jaxserve` command's argument parsers: `build_parser`, each command's flags and the flag types that
check their ranges. Building the parser imports no jax (the config and model modules it reads defaults from
are jax-free), so `--help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
from typing import Any


def _add_generation_args(parser: argparse.ArgumentParser) -> None:
    from jaxserve.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
    from jaxserve.models.hub import DEFAULT_MODEL

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
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=None, help="fp8: FP8 linear weights (default: none)"
    )
    parser.add_argument(
        "--quantize-lm-head", action="store_true", help="with --quantization: an untied lm_head in FP8 too"
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="fp8: an FP8 KV cache (default: auto)"
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
    _add_serve_parser(commands)
    _add_bench_parsers(commands)
    return parser


# ---- jaxserve bench ------------------------------------------------------------------------------


def _add_bench_parsers(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmark the engine: throughput or latency")
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    for parser in (_add_throughput_parser(kinds), _add_latency_parser(kinds)):
        _add_bench_options(parser)
        parser.set_defaults(subparser=parser)  # for the errors that need several flags


def _add_throughput_parser(kinds: Any) -> argparse.ArgumentParser:
    parser = kinds.add_parser(
        "throughput",
        help="one timed generate of many requests: tok/s, req/s, TTFT / TPOT percentiles, step times",
        description="Generates a workload (random token ids, or a JSONL dataset) in one timed LLM.generate after a "
        "small warm-up one; every request makes exactly its output length of tokens (ignore_eos).",
    )
    count = _int_at_least(1)
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--num-requests", type=count, metavar="N", help="requests (default: 256; with --dataset: all)"
    )
    workload.add_argument(
        "--input-len", type=count, metavar="N", help="prompt tokens (random ids) per request (default: 128)"
    )
    workload.add_argument(
        "--output-len",
        type=count,
        metavar="N",
        help="tokens per request (default: 128; with --dataset: where a line has none)",
    )
    workload.add_argument(
        "--max-concurrency",
        type=count,
        metavar="N",
        help="at most N requests in the engine at once, the next submitted as one finishes (N clients that "
        "send their next request at once; default: every request at the start)",
    )
    workload.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help='requests from a file: one JSON object per line with "prompt" (text) or "prompt_token_ids", '
        'optionally "output_len" or "max_tokens"',
    )
    workload.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer of text prompts: a model directory or .gguf (default: the model's)",
    )
    return parser


def _add_latency_parser(kinds: Any) -> argparse.ArgumentParser:
    parser = kinds.add_parser(
        "latency",
        help="end-to-end latency of one batch, repeated: latency, TTFT and TPOT percentiles",
        description="Generates one batch of random-id requests --num-iters times after --num-warmup untimed times "
        "(fresh prompts each time); every request makes exactly --output-len tokens (ignore_eos).",
    )
    count = _int_at_least(1)
    workload = parser.add_argument_group("workload")
    workload.add_argument("--batch-size", type=count, default=1, metavar="N", help="requests per batch (default: 1)")
    workload.add_argument("--input-len", type=count, default=128, metavar="N", help="prompt tokens (default: 128)")
    workload.add_argument(
        "--output-len", type=count, default=128, metavar="N", help="tokens per request (default: 128)"
    )
    workload.add_argument("--num-iters", type=count, default=5, metavar="N", help="timed iterations (default: 5)")
    workload.add_argument(
        "--num-warmup", type=_int_at_least(0), default=1, metavar="N", help="untimed iterations first (default: 1)"
    )
    return parser


def _add_bench_options(parser: argparse.ArgumentParser) -> None:
    """The model, sampling, engine and output options both benchmarks take."""
    from jaxserve.models.hub import DEFAULT_MODEL
    from jaxserve.models.shapes import SHAPES

    source = parser.add_argument_group("model").add_mutually_exclusive_group()
    source.add_argument("--model", help=f"model name, HF directory, GGUF file or hub id (default: {DEFAULT_MODEL})")
    source.add_argument(
        "--random-weights",
        metavar="NAME",
        choices=list(SHAPES),
        help=f"random weights of a known shape, no checkpoint: {', '.join(SHAPES)} (tiny-llama: a 2-layer test shape)",
    )
    sampling = parser.add_argument_group("sampling (greedy by default)")
    sampling.add_argument(
        "--temperature", type=_float_in(0.0, None), default=0.0, metavar="X", help="0 is greedy (default: 0)"
    )
    sampling.add_argument(
        "--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0, metavar="X", help="in (0, 1] (default: 1)"
    )
    sampling.add_argument(
        "--top-k", type=_top_k, default=None, metavar="N", help="an int >= 1; -1 or 0 disable it (default: off)"
    )
    sampling.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="seed of the random prompts and the engine (default: 0)",
    )
    sampling.add_argument(
        "--seed-per-request", action="store_true", help="request i samples with seed + i (the same whatever the batch)"
    )
    _add_engine_options(parser.add_argument_group("engine"))
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora-adapters",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="N random adapters on all seven projections (rank --max-lora-rank), N slots, request i served with "
        "adapter i mod N; the report adds the time of one adapter's update (default: none, the base model)",
    )
    lora.add_argument(
        "--max-lora-rank", type=_int_at_least(1), default=16, metavar="R", help="the adapters' rank (default: 16)"
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    output.add_argument(
        "--iteration-log",
        metavar="PATH",
        help="write one JSON line per timed step: its rows, tokens, compiled shape, KV usage, host time and the "
        "time to the next step's launch",
    )
    output.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


# ---- the engine's flags (bench and serve) and the flag types -------------------------------------


def _add_engine_options(
    group: Any,
    *,
    max_batch_size_help: str = "sequences per step (default: 8 on CPU; on a GPU the largest of 1024, 512, 256 whose "
    "sequences of 256 tokens the KV pool holds; latency: --batch-size)",
    max_seq_len_help: str = "default: the longest request's prompt + output",
) -> None:
    from jaxserve.config import ATTENTION_BACKENDS, DTYPES, QUANTIZATIONS

    positive = _int_at_least(1)
    group.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto (default) = bfloat16 on GPU, float32 on CPU"
    )
    group.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto (default) = pallas on GPU, xla elsewhere",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=positive,
        metavar="N",
        help="devices the model is split over (default: 1; in a multi-host run, every device of every process)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=positive,
        default=1,
        metavar="N",
        help="replicas of the model, each on its own tensor-parallel-size devices, sharing the requests by "
        "load (default: 1)",
    )
    group.add_argument(
        "-ep",
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a mixture of experts' layout under tensor parallelism: whole experts split over the devices "
        "(--enable-expert-parallel) or each expert's hidden (--no-enable-expert-parallel); default: whole experts "
        "where they divide over the devices (measured: docs/performance.md, 'MoE: expert layout'); a dense model "
        "ignores it",
    )
    group.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the linear layers' weights in float8_e4m3fn with per-output-channel scales, activations "
        "quantized per token (default: none, weights in --dtype)",
    )
    group.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --quantization: an untied lm_head quantized too, a scale per vocabulary entry (default: off)",
    )
    group.add_argument("--max-batch-size", type=positive, metavar="N", help=max_batch_size_help)
    group.add_argument("--max-num-tokens", type=positive, metavar="N", help="tokens per step (default: 8192)")
    group.add_argument("--max-seq-len", type=_int_at_least(2), metavar="N", help=max_seq_len_help)
    _add_capacity_options(group)
    _add_compile_options(group)


def _add_capacity_options(group: Any) -> None:
    """The KV pool's size and the scheduler's admission."""
    from jaxserve.config import KV_CACHE_DTYPES, CapacityPolicy

    positive = _int_at_least(1)
    group.add_argument(
        "--kv-cache-free-memory-fraction",
        type=_float_in(0.0, 1.0, low_open=True),
        default=0.9,
        metavar="X",
        help="share of the free device memory the KV cache takes, in (0, 1] (default: 0.9)",
    )
    group.add_argument("--kv-cache-max-tokens", type=positive, metavar="N", help="cap on the KV pool, in tokens")
    group.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV of shared prompt prefixes")
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: K and V stored as float8_e4m3fn, half bf16's bytes (default: auto, the engine's dtype)",
    )
    group.add_argument(
        "--no-sliding-window-kv",
        action="store_true",
        help="keep every token's KV in sliding-window layers too (by default they keep only their window)",
    )
    group.add_argument(
        "--capacity-policy",
        choices=[p.value for p in CapacityPolicy],
        default=CapacityPolicy.GUARANTEED_NO_EVICT.value,
        help="admission policy (default: guaranteed_no_evict)",
    )
    group.add_argument(
        "--no-bucket-aware-admission",
        action="store_true",
        help="admit up to max_batch_size even when batches of a smaller decode size would serve the queue sooner",
    )


def _add_compile_options(group: Any) -> None:
    """The compiled step table and where it is stored."""
    group.add_argument(
        "--decode-batch-sizes", type=_sizes, metavar="N,N,...", help="comma-separated decode step sizes to compile"
    )
    group.add_argument(
        "--token-buckets",
        type=_sizes,
        metavar="N,N,...",
        help="comma-separated token counts of prefill steps to compile",
    )
    group.add_argument(
        "--cache-dir", metavar="DIR", help="compiled-step store directory (default: ~/.cache/jaxserve/xla)"
    )
    group.add_argument(
        "--compile-threads",
        type=_int_at_least(1),
        metavar="N",
        help="executables compiled at once (default: min(8, CPUs))",
    )


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float | None, low_open: bool = False) -> Any:
    if high is None:
        allowed = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        if not above_low or (high is not None and not value <= high):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


def _top_k(text: str) -> int | None:
    value = _int_at_least(-1)(text)
    return None if value in (-1, 0) else value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1, got {text!r}")
    return sizes


# ---- jaxserve serve -----------------------------------------------------------------------------


def _add_serve_parser(commands: Any) -> None:
    from jaxserve.models.hub import DEFAULT_MODEL
    from jaxserve.models.shapes import SHAPES

    parser = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, tokenizer endpoints, metrics)",
        description="Serves the model over vLLM's OpenAI-compatible API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /tokenizer_info, /health, /version and /metrics. SIGINT or SIGTERM "
        "aborts the requests in flight and exits.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"model name, HF directory, GGUF file, orbax directory or hub id (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--random-weights",
        metavar="NAME",
        choices=list(SHAPES),
        help=f"serve random weights of a known shape instead of MODEL ({', '.join(SHAPES)}), to load-test a "
        "model size without its checkpoint: prompts are token ids, and the text of a completion is its ids",
    )
    _add_server_options(parser.add_argument_group("server"))
    _add_multihost_options(
        parser.add_argument_group(
            "multi-host (every process runs the same command; process 0 serves HTTP, the others follow it)"
        )
    )
    _add_serve_engine_options(parser.add_argument_group("engine"))
    _add_lora_options(
        parser.add_argument_group("LoRA adapters (a request's 'model' names the adapter it is served with)")
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engine's progress to stderr")


def _add_server_options(server: Any) -> None:
    from jaxserve.server.config import DEFAULT_MAX_REQUEST_BYTES

    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    server.add_argument(
        "--port", type=_int_at_least(0), default=8000, help="port to bind; 0 picks a free one (default: 8000)"
    )
    server.add_argument(
        "--served-model-name", metavar="NAME", help="the name clients send as 'model' (default: MODEL as given)"
    )
    server.add_argument(
        "--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on the /v1 routes (default: none)"
    )
    server.add_argument(
        "--max-request-bytes",
        type=_int_at_least(1),
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"larger request bodies get a 413 (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    server.add_argument(
        "--stream-interval",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="a stream sends its first token at once, then a chunk every N tokens (and the last one): "
        "larger N costs the server less per token at many concurrent streams (default: 1)",
    )
    server.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine in a thread of the server process, sharing its GIL with the HTTP front end "
        "(default: in a process of its own; multi-host runs always use the thread)",
    )


def _add_lora_options(lora: Any) -> None:
    positive = _int_at_least(1)
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model, and the routes /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter that load and unload them at runtime",
    )
    lora.add_argument(
        "--max-loras", type=positive, default=1, metavar="N", help="adapters on the device at once (default: 1)"
    )
    lora.add_argument(
        "--max-lora-rank", type=positive, default=16, metavar="R", help="the largest adapter rank served (default: 16)"
    )
    lora.add_argument(
        "--lora-modules",
        type=_lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter directories loaded at start, each served as the model NAME; also vLLM's JSON form "
        '\'{"name": NAME, "path": PATH}\' (needs --enable-lora)',
    )


def _lora_module(text: str) -> Any:
    """NAME=PATH, or vLLM's JSON {"name": ..., "path": ...}, as a `LoraModule`."""
    import json

    from jaxserve.server.config import LoraModule

    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"is not valid JSON ({error}): {text!r}") from None
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields):
            raise argparse.ArgumentTypeError(f'must be NAME=PATH or {{"name": ..., "path": ...}}, got {text!r}')
        name, path = fields["name"], fields["path"]
    else:
        name, _, path = text.partition("=")
    try:
        return LoraModule(name, path)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be NAME=PATH (both non-empty), got {text!r}") from None


def _add_multihost_options(multihost: Any) -> None:
    multihost.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address and a free port, where the processes meet"
    )
    multihost.add_argument("--num-processes", type=_int_at_least(1), metavar="N", help="processes in the run")
    multihost.add_argument("--process-id", type=_int_at_least(0), metavar="I", help="this process, 0 to N - 1")


def _add_serve_engine_options(engine: Any) -> None:
    from jaxserve.config import LOGPROBS_MODES

    _add_engine_options(
        engine,
        max_batch_size_help="sequences per step (default: 8 on CPU; on a GPU the largest of 1024, 512, 256 "
        "whose sequences of 256 tokens the KV pool holds)",
        max_seq_len_help="prompt + generated tokens of one sequence (default: the model's)",
    )
    engine.add_argument(
        "--enable-prompt-logprobs",
        action="store_true",
        help="compile the prompt-logprobs steps: prompt_logprobs, and echo with logprobs (what lm-eval's "
        "local-completions scores with), are refused without it",
    )
    engine.add_argument(
        "--no-penalty-variants",
        action="store_true",
        help="do not compile the penalty steps: repetition / presence / frequency penalties are then refused",
    )
    engine.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what sampled tokens' logprobs are taken over: the model's distribution (raw_logprobs, the default) "
        "or the one the token is drawn from, after penalties, temperature and filters (processed_logprobs)",
    )
    engine.add_argument("--seed", type=int, default=0, help="the engine's seed for unseeded sampling (default: 0)")
