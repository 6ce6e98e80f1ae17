"""The `jaxserve` command line: generate, chat, serve, bench throughput | latency.

stdout carries only the generated text (or the benchmark's report), so the output can be piped; progress
and logs go to stderr. The benchmarks' logic is `jaxserve.bench`'s and the server's `jaxserve.server`'s
(imported only by `serve`, so the other commands need neither fastapi nor uvicorn), the flags
`jaxserve.cli_args`'; this module checks what needs several flags, and calls.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxserve.cli_args import build_parser


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
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        quantize_lm_head=args.quantize_lm_head,
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
    adapters = bench.random_adapters(llm, args.lora_adapters, args.seed) if args.lora_adapters else []
    if is_throughput:
        warmup = workload.warmup_workload(batches[0], vocab, args.seed)
        result = bench.run_throughput(
            llm, batches[0], sampling, engine, warmup, args.max_concurrency, args.iteration_log, adapters, args.seed
        )
    else:
        result = bench.run_latency(
            llm, batches, sampling, engine, args.num_warmup, args.iteration_log, adapters, args.seed
        )
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
        **_bench_lora_keywords(args),
        seed=args.seed,
        show_progress=args.verbose,
    )


def _bench_lora_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """--lora-adapters N: an engine with N adapter slots of rank --max-lora-rank."""
    if not args.lora_adapters:
        return {}
    return {"enable_lora": True, "max_loras": args.lora_adapters, "max_lora_rank": args.max_lora_rank}


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
            sliding_window_kv=not args.no_sliding_window_kv,
            dtype=args.kv_cache_dtype,
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
        "enable_expert_parallel": args.enable_expert_parallel,
        "quantization": args.quantization,
        "quantize_lm_head": args.quantize_lm_head,
    }


def _engine_devices(args: argparse.Namespace) -> int:
    """The devices one engine of these flags spans (a multi-process run counts every process's)."""
    processes = getattr(args, "num_processes", None) or 1
    return (args.tensor_parallel_size or 1) * args.data_parallel_size * processes


# ---- jaxserve serve -----------------------------------------------------------------------------


def run_serve(args: argparse.Namespace) -> None:
    """Builds the engine, serves until SIGINT / SIGTERM, frees the engine. The engine runs in a process of
    its own (EngineProcess) unless --engine-thread, or in a multi-process run, where every process builds it
    in-process and the processes but 0 follow process 0's steps until it stops."""
    from jaxserve import distributed
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.launch import serve

    config = ServerConfig(
        args.served_model_name or served_name(args),
        args.api_key,
        args.max_request_bytes,
        args.stream_interval,
        tuple(args.lora_modules),
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


def _validate_lora(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    names = [module.name for module in args.lora_modules]
    served = args.served_model_name or served_name(args)
    if len(set(names)) != len(names) or served in names:
        parser.error(f"--lora-modules: each NAME must be unique and differ from the served model name {served!r}")


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
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
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
        _validate_lora(args, parser)
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
