"""The `jaxserve` command line: generate, chat, serve, bench throughput | latency.

stdout carries only the generated text (or the benchmark's report), so the output can be piped; progress
and logs go to stderr. The benchmarks' logic is `jaxserve.bench`'s and the server's `jaxserve.server`'s
(imported only by `serve`, so the other commands need neither fastapi nor uvicorn); this module parses
and calls.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from typing import Any


def _add_generation_args(parser: argparse.ArgumentParser) -> None:
    from jaxserve.config import DTYPES
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


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")


def run(args: argparse.Namespace) -> str:
    """Load the model, build the prompt, generate with the engine; returns the generated text."""
    from jaxserve import capacity, gpu_client
    from jaxserve.config import CompileConfig, model_max_seq_len
    from jaxserve.llm import LLM, resolve_dtype
    from jaxserve.models.loader import load_model
    from jaxserve.sampling import SamplingParams
    from jaxserve.tokenizer import Tokenizer

    capacity.raise_memory_fraction_default()  # before anything starts a jax backend
    gpu_client.use_tfrt_client_default(num_devices=1)
    model = load_model(args.model, dtype=resolve_dtype(args.dtype), on_device=False)  # LLM places it
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


# ---- jaxserve bench throughput | latency --------------------------------------------------------


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
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    output.add_argument(
        "--iteration-log",
        metavar="PATH",
        help="write one JSON line per timed step: its rows, tokens, compiled shape, KV usage, host time and the "
        "time to the next step's launch",
    )
    output.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")


def _add_engine_options(
    group: Any,
    *,
    max_batch_size_help: str = "sequences per step (default: 8 on CPU; on a GPU the largest of 1024, 512, 256 whose "
    "sequences of 256 tokens the KV pool holds; latency: --batch-size)",
    max_seq_len_help: str = "default: the longest request's prompt + output",
) -> None:
    from jaxserve.config import ATTENTION_BACKENDS, DTYPES, CapacityPolicy

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
    group.add_argument("--max-batch-size", type=positive, metavar="N", help=max_batch_size_help)
    group.add_argument("--max-num-tokens", type=positive, metavar="N", help="tokens per step (default: 8192)")
    group.add_argument("--max-seq-len", type=_int_at_least(2), metavar="N", help=max_seq_len_help)
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


def _validate_bench(args: argparse.Namespace) -> None:
    """Checks that need several flags, and fills the throughput workload's defaults."""
    if args.iteration_log is not None:
        try:  # before the model loads: a run should not end on a path it cannot write
            open(args.iteration_log, "w").close()
        except OSError as error:
            args.subparser.error(f"--iteration-log: cannot write {args.iteration_log!r}: {error.strerror}")
    if args.benchmark != "throughput":
        return
    if args.dataset is not None and args.input_len is not None:
        args.subparser.error("--input-len does not apply with --dataset: the dataset gives the prompts")
    if args.dataset is None:
        args.num_requests = 256 if args.num_requests is None else args.num_requests
        args.input_len = 128 if args.input_len is None else args.input_len
    args.output_len = 128 if args.output_len is None else args.output_len


def run_bench(args: argparse.Namespace) -> str:
    """Runs `jaxserve bench throughput | latency`; returns the report (a table, or one JSON object)."""
    from jaxserve import bench, capacity, gpu_client, workload
    from jaxserve.config import model_max_seq_len

    capacity.raise_memory_fraction_default()  # before anything starts a jax backend
    gpu_client.use_tfrt_client_default(_engine_devices(args))
    is_throughput = args.benchmark == "throughput"
    entries = workload.read_dataset(args.dataset, args.num_requests) if is_throughput and args.dataset else None
    start = time.perf_counter()
    model, tokenizer = bench.load_model(args.model, args.random_weights, args.dtype, getattr(args, "tokenizer", None))
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    batches = _bench_workloads(args, entries, tokenizer, vocab)
    limit = model_max_seq_len(model.hf_config)
    max_seq_len = workload.engine_max_seq_len(max(b.max_seq_len for b in batches), args.max_seq_len, limit)
    start = time.perf_counter()
    llm = _bench_llm(args, model, tokenizer, max_seq_len)
    engine = bench.engine_summary(llm, load_s, time.perf_counter() - start)
    sampling = workload.SamplingOptions(
        args.temperature, args.top_p, args.top_k, args.seed if args.seed_per_request else None
    )
    if is_throughput:
        warmup = workload.warmup_workload(batches[0], vocab, args.seed)
        result = bench.run_throughput(
            llm, batches[0], sampling, engine, warmup, args.max_concurrency, args.iteration_log
        )
    else:
        result = bench.run_latency(llm, batches, sampling, engine, args.num_warmup, args.iteration_log)
    return bench.report(result, as_json=args.json)


def _bench_workloads(args: argparse.Namespace, entries: Any, tokenizer: Any, vocab: int) -> list[Any]:
    """The latency benchmark's batches (warm-up ones first), or the throughput benchmark's one workload."""
    from jaxserve import workload

    if args.benchmark == "latency":
        count = args.num_warmup + args.num_iters
        return workload.latency_batches(args.batch_size, args.input_len, args.output_len, vocab, args.seed, count)
    if entries is not None:
        return [workload.dataset_workload(entries, tokenizer, vocab, args.output_len)]
    return [workload.random_workload(args.num_requests, args.input_len, args.output_len, vocab, args.seed)]


def _bench_llm(args: argparse.Namespace, model: Any, tokenizer: Any, max_seq_len: int) -> Any:
    from jaxserve.llm import LLM

    max_batch_size = args.max_batch_size
    if max_batch_size is None and args.benchmark == "latency":
        max_batch_size = args.batch_size
    return LLM(
        model,
        tokenizer=tokenizer,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        # penalty_variants: the benchmark's requests have none; lazy=False: the whole table at start, as a
        # server compiles it, so no timed step waits for a compile.
        **_engine_keywords(args, penalty_variants=False, lazy=False),
        seed=args.seed,
        show_progress=args.verbose,
    )


def _engine_keywords(args: argparse.Namespace, **compile_options: Any) -> dict[str, Any]:
    """The `LLM` keywords of `_add_engine_options`' flags (but max_batch_size and max_seq_len, which each
    command defaults in its own way); compile_options: more CompileConfig fields."""
    from jaxserve.config import CapacityPolicy, CompileConfig, KvCacheConfig, SchedulerConfig

    return {
        "max_num_tokens": args.max_num_tokens,
        "kv_cache_config": KvCacheConfig(
            free_memory_fraction=args.kv_cache_free_memory_fraction,
            max_tokens=args.kv_cache_max_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        "scheduler_config": SchedulerConfig(
            capacity_policy=CapacityPolicy(args.capacity_policy),
            bucket_aware_admission=not args.no_bucket_aware_admission,
        ),
        "compile_config": CompileConfig(
            decode_batch_sizes=args.decode_batch_sizes,
            token_buckets=args.token_buckets,
            cache_dir=args.cache_dir,
            compile_threads=args.compile_threads,
            **compile_options,
        ),
        "attention_backend": args.attention_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
    }


def _engine_devices(args: argparse.Namespace) -> int:
    """The devices one engine of these flags spans (a multi-process run counts every process's)."""
    processes = getattr(args, "num_processes", None) or 1
    return (args.tensor_parallel_size or 1) * args.data_parallel_size * processes


# ---- jaxserve serve -----------------------------------------------------------------------------


def _add_serve_parser(commands: Any) -> None:
    from jaxserve.config import LOGPROBS_MODES
    from jaxserve.models.hub import DEFAULT_MODEL
    from jaxserve.models.shapes import SHAPES
    from jaxserve.server.config import DEFAULT_MAX_REQUEST_BYTES

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
    server = parser.add_argument_group("server")
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
    multihost = parser.add_argument_group(
        "multi-host (every process runs the same command; process 0 serves HTTP, the others follow it)"
    )
    multihost.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address and a free port, where the processes meet"
    )
    multihost.add_argument("--num-processes", type=_int_at_least(1), metavar="N", help="processes in the run")
    multihost.add_argument("--process-id", type=_int_at_least(0), metavar="I", help="this process, 0 to N - 1")
    engine = parser.add_argument_group("engine")
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engine's progress to stderr")


def run_serve(args: argparse.Namespace) -> None:
    """Builds the engine, serves until SIGINT / SIGTERM, frees the engine. The engine runs in a process of
    its own (EngineProcess) unless --engine-thread, or in a multi-process run, where every process builds it
    in-process and the processes but 0 follow process 0's steps until it stops."""
    from jaxserve import distributed
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.launch import serve

    config = ServerConfig(
        args.served_model_name or served_name(args), args.api_key, args.max_request_bytes, args.stream_interval
    )
    if args.coordinator is None and not args.engine_thread:
        from jaxserve.server.engine_process import EngineProcess

        with EngineProcess(served_engine, args, log_level=logging.getLogger().getEffectiveLevel()) as engine:
            serve(engine, args.host, args.port, config)
        return
    if args.coordinator is not None:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    llm, _ = served_llm(args)
    if not distributed.is_leader():
        llm.follow()
        return
    try:
        serve(llm, args.host, args.port, config)
    finally:
        llm.close()


def _validate_multihost(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from jaxserve.distributed import DistributedConfig

    flags = (args.coordinator, args.num_processes, args.process_id)
    if all(flag is None for flag in flags):
        return
    if any(flag is None for flag in flags):
        parser.error("--coordinator, --num-processes and --process-id go together: give all three or none")
    try:
        DistributedConfig(*flags)
    except ValueError as error:
        names = {
            "coordinator_address": "--coordinator",
            "num_processes": "--num-processes",
            "process_id": "--process-id",
        }
        parser.error(re.sub("|".join(names), lambda match: names[match.group(0)], str(error)))


def served_name(args: argparse.Namespace) -> str:
    """The model's name, what clients send as 'model' unless --served-model-name."""
    return args.random_weights if args.random_weights is not None else args.model


def served_engine(args: argparse.Namespace) -> Any:
    """The LLM `jaxserve serve` serves (what the engine process builds)."""
    return served_llm(args)[0]


def served_llm(args: argparse.Namespace) -> tuple[Any, str]:
    """The LLM `jaxserve serve` serves, and the model's name (what clients send unless --served-model-name)."""
    from jaxserve import capacity, gpu_client
    from jaxserve.llm import LLM

    capacity.raise_memory_fraction_default()  # before anything starts a jax backend
    gpu_client.use_tfrt_client_default(_engine_devices(args))
    model, tokenizer = args.model, None
    if args.random_weights is not None:
        from jaxserve import bench

        model, tokenizer = bench.random_model(args.random_weights, args.dtype), bench.IdTextTokenizer()
    llm = LLM(
        model,
        tokenizer=tokenizer,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        **_engine_keywords(
            args, prompt_logprobs=args.enable_prompt_logprobs, penalty_variants=not args.no_penalty_variants
        ),
        logprobs_mode=args.logprobs_mode,
        seed=args.seed,
        show_progress=args.verbose,
    )
    return llm, served_name(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        _validate_bench(args)
    elif args.command == "serve":
        from jaxserve.models.hub import DEFAULT_MODEL

        if args.random_weights is not None and args.model != DEFAULT_MODEL:
            parser.error(f"give MODEL or --random-weights, not both (got {args.model!r} and {args.random_weights!r})")
        _validate_multihost(args, parser)
    else:
        _validate(args, parser)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            run_serve(args)
            return 0
        text = run_bench(args) if args.command == "bench" else run(args)
    except (FileNotFoundError, ValueError, TypeError, RuntimeError) as error:
        print(f"jaxserve: error: {error}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
