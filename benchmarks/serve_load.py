"""Load on a running `jaxserve serve` (or any vLLM-compatible server): N concurrent streaming clients.

    jaxserve serve path/to/model --served-model-name m &
    python benchmarks/serve_load.py --model m --num-clients 256 --num-requests 1024 --input-len 128 \
        --output-len 128 --processes 4

Each client sends /v1/completions requests one after the other (streaming, greedy, random token-id prompts
of --input-len tokens, exactly --output-len new tokens through vLLM's ignore_eos) until --num-requests have
been sent in all. Reports the output tokens per second over the whole run, time to first token (the first
chunk with text) and time per output token ((last chunk - first chunk) / (tokens - 1)) at p50 and p99, on
the client's clock (the token counts are the server's usage). `--json` prints one JSON object instead.
--processes splits the clients (and the requests, round robin) over that many processes, each with its own
event loop: one Python process parsing every stream can be what limits the rate at hundreds of clients.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it: seconds to the first chunk, seconds per later token, tokens."""

    ttft: float
    tpot: float | None
    output_tokens: int


async def one_request(client, model: str, prompt: list[int], output_len: int) -> Sample:
    start = time.perf_counter()
    first = last = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first if first is not None else last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or last is None:
        raise RuntimeError("a request streamed no text")
    return Sample(first - start, (last - first) / (tokens - 1) if tokens > 1 else None, tokens)


async def clients(
    args: argparse.Namespace, prompts: list[list[int]], num_clients: int, start_at: float
) -> tuple[list[Sample], float]:
    """num_clients streaming clients sending `prompts` one request after another, from wall-clock time
    start_at; their samples and the time.time() the last one finished."""
    import openai

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    samples: list[Sample] = []
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600)

    async def worker() -> None:
        while not queue.empty():
            samples.append(await one_request(client, args.model, queue.get_nowait(), args.output_len))

    await asyncio.sleep(max(0.0, start_at - time.time()))
    async with client:
        await asyncio.gather(*(worker() for _ in range(num_clients)))
    return samples, time.time()


def client_process(
    args: argparse.Namespace, prompts: list[list[int]], num_clients: int, start_at: float
) -> tuple[list[Sample], float]:
    return asyncio.run(clients(args, prompts, num_clients, start_at))


def run(args: argparse.Namespace) -> dict[str, float]:
    """The clients split over --processes processes (one event loop each, so that parsing the streams is
    not what limits the rate), all starting at one wall-clock time; elapsed runs from it to the last finish."""
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, args.vocab_size, (args.num_requests, args.input_len)).tolist()
    shares = [
        (prompts[p :: args.processes], len(range(p, args.num_clients, args.processes))) for p in range(args.processes)
    ]
    start_at = time.time() + 1.0 + 0.5 * args.processes  # after every process has started and imported openai
    if args.processes == 1:
        results = [client_process(args, shares[0][0], shares[0][1], start_at)]
    else:
        with concurrent.futures.ProcessPoolExecutor(args.processes) as pool:
            futures = [pool.submit(client_process, args, share, n, start_at) for share, n in shares]
            results = [future.result() for future in futures]
    samples = [sample for share, _ in results for sample in share]
    elapsed = max(end for _, end in results) - start_at
    ttft = np.array([s.ttft for s in samples])
    tpot = np.array([s.tpot for s in samples if s.tpot is not None])
    output = sum(s.output_tokens for s in samples)
    return {
        "requests": len(samples),
        "clients": args.num_clients,
        "processes": args.processes,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "output_tokens": output,
        "output_tok_per_s": output / elapsed,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3) if tpot.size else float("nan"),
        "tpot_p99_ms": float(np.percentile(tpot, 99) * 1e3) if tpot.size else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")
    parser.add_argument("--num-clients", type=int, default=256, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=1024, help="requests in all (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    parser.add_argument(
        "--processes", type=int, default=1, help="client processes sharing the clients (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if min(args.num_clients, args.num_requests, args.input_len, args.output_len, args.processes) < 1:
        parser.error("--num-clients, --num-requests, --input-len, --output-len and --processes must be >= 1")
    if args.processes > args.num_clients:
        parser.error(f"--processes ({args.processes}) must be at most --num-clients ({args.num_clients})")
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>18}: {value:.2f}" if isinstance(value, float) else f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
