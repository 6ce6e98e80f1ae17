"""`jaxserve bench throughput | latency`: offline benchmarks of the engine through the `LLM` API, as plain
functions (workloads, metrics, reports); `jaxserve.cli` parses the flags and calls them.

throughput: a workload (random token ids of fixed lengths, or a JSONL dataset) goes to one timed
`LLM.generate`, after a small warm-up generate; with max_concurrency N, at most N requests are in the
engine at once and the next one is submitted as soon as one finishes (N closed-loop clients that answer
at once, as `benchmarks/serve_load.py` puts on a server). The report: token and request rates, per-request TTFT,
TPOT and latency percentiles (from `RequestOutput.metrics`), the step-time breakdown (from
`LLM.step_stats`), the KV pool and its peak usage, start-up and compile times.
latency: `num_warmup`, then `num_iters` timed generates of one batch of `batch_size` requests; the report:
the end-to-end latency of an iteration, TTFT, TPOT and output tok/s.
Both can write an iteration log (trtllm-bench's `--iteration_log`): one JSON object per timed step
(`iteration_records`), to see where a run's time went step by step.

The workloads (random prompts, dataset files, warm-up and latency batches) are `jaxserve.workload`'s:
every request makes exactly its output length of tokens (ignore_eos); greedy unless a temperature is given.

Per request: TTFT = first_token_time - arrival_time; TPOT = (finished_time - first_token_time) /
(output tokens - 1), for requests of two tokens or more; latency = finished_time - arrival_time. All
requests of a generate arrive when it starts (with max_concurrency: when submitted), so TTFT includes the
time a request waits for a batch slot.
Percentiles interpolate linearly between samples (numpy's default). decode_step_ms is the median time
between the launches of consecutive decode-only steps: the steady decode step time.

JSON (`to_json`): one object; a time's key ends in its unit (`_s`, `_ms`); floats are rounded to 6
significant digits.
  both:       "benchmark" ("throughput" | "latency"),
              "engine": {"model", "backend", "dtype", "tensor_parallel_size", "data_parallel_size",
                         "max_batch_size" (per replica), "max_num_tokens", "max_seq_len", "kv_blocks",
                         "kv_tokens", "kv_gib" (over every replica), "load_s", "init_s" (engine
                         construction: profile, KV pool, compiling), "warmup_s" (of which compiling),
                         "compiled_executables" (forwards and samplers, over every replica),
                         "experts" (a mixture of experts' layout: "expert_parallel" | "tensor_parallel" |
                         "one_device"; null for a dense model), "quantization" (null | "fp8"), "quantize_lm_head",
                         "kv_cache_dtype" (the KV pool's element type, e.g. "bfloat16", "float8_e4m3fn"),
                         "lowering_s", "xla_compile_s" (of the executables compiled at warmup rather than
                         loaded from the step store: tracing and lowering them, which holds the GIL, and
                         XLA's compile, which the compile threads overlap; summed over executables),
                         "gpu_client" ("tfrt" | "stream_executor": XLA's GPU client, jaxserve/gpu_client.py;
                         null off a GPU)},
              "output_tok_per_s", "ttft_ms", "tpot_ms": {"mean", "p50", "p90", "p99"} (null without samples),
              "steps": {"num_steps", "mean_host_ms", "mean_dispatch_ms", "decode_step_ms",
                        "peak_kv_usage" (a fraction of the pool), "num_preempted"}
  throughput: "num_requests", "max_concurrency" (null: all at once), "input_tokens", "output_tokens",
              "elapsed_s", "total_tok_per_s", "requests_per_s", "latency_ms": {"mean", "p50", "p90", "p99"}
  latency:    "batch_size", "input_len", "output_len", "num_iters", "num_warmup",
              "latency_s": {"mean", "p50", "p90", "p99"}, "iteration_latencies_s": [...]
  both, with --lora-adapters N: "lora": {"adapters" (N random adapters on all seven projections, request i served
              with adapter i mod N), "rank", "update_ms" (the median of three `update_lora`s of one adapter with
              new random float32 weights in host memory, the tables awaited), "update_device_bf16_ms" (the same
              from bfloat16 arrays on the device, a trainer's, after one untimed update of that kind)}; null
              without adapters
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.models import shapes
from jaxserve.sampling import RequestMetrics, RequestOutput, SamplingParams
from jaxserve.workload import SamplingOptions, Workload

if TYPE_CHECKING:
    from jaxserve.engine import StepStats
    from jaxserve.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.models.loader import LoadedModel


# ---- models -------------------------------------------------------------------------------------


class TokenIdTokenizer:
    """Token ids in, no text out: for a model without a tokenizer (random weights have no vocabulary)."""

    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(
            "a text prompt needs a tokenizer, and this model has none (give prompt_token_ids or --tokenizer)"
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, chat_template: Any = None) -> Any:
        raise ValueError("a conversation needs a tokenizer with a chat template, and this model has none")


class IdTextTokenizer(TokenIdTokenizer):
    """A `TokenIdTokenizer` whose text is the ids themselves (" 17 42 ..."): what `jaxserve serve
    --random-weights` streams, so a load test sees text arrive as it would with a real vocabulary."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)


def random_model(name: str, dtype: str = "auto", seed: int = 0) -> LoadedModel:
    """A model of a known shape (`jaxserve.models.shapes`) with random weights; dtype "auto" as `LLM` resolves it.

    Drawn on the device one tensor at a time (each a compiled call of the family's `init_weights` that keeps
    only that tensor), then held on the host (numpy), as a checkpoint loader returns them: the engine places
    its serving layout layer by layer, so the device never holds more than the serving weights and one tensor
    (a 30B mixture of experts drawn whole would not fit beside its own float32 draws on an 80 GB card)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.llm import resolve_dtype
    from jaxserve.models import registry
    from jaxserve.models.loader import LoadedModel

    hf_config = shapes.shape(name)
    family, cfg = registry.resolve(hf_config)
    key, dt = jax.random.key(seed), jnp.dtype(resolve_dtype(dtype))
    treedef = jax.tree.structure(jax.eval_shape(lambda k: family.init_weights(cfg, k, dt), key))
    leaves = []
    for i in range(treedef.num_leaves):
        draw = jax.jit(lambda k, i=i: jax.tree.leaves(family.init_weights(cfg, k, dt))[i])
        leaves.append(np.asarray(jax.device_get(draw(key))))
    weights = jax.tree.unflatten(treedef, leaves)
    return LoadedModel(family, cfg, weights, hf_config, None, f"{name} (random weights)")


def load_model(
    model: str | None, random_weights: str | None, dtype: str = "auto", tokenizer: str | None = None
) -> tuple[LoadedModel, Any]:
    """The model (a checkpoint, or random weights of a named shape) and its tokenizer: `tokenizer` when
    given, else the checkpoint's, else a `TokenIdTokenizer` (token-id prompts only)."""
    from jaxserve.llm import resolve_dtype
    from jaxserve.models.loader import load_model as load_checkpoint
    from jaxserve.tokenizer import Tokenizer

    if random_weights is not None:
        loaded = random_model(random_weights, dtype)
    else:
        from jaxserve.models.hub import DEFAULT_MODEL

        loaded = load_checkpoint(model or DEFAULT_MODEL, dtype=resolve_dtype(dtype), on_device=False)
    source = tokenizer if tokenizer is not None else loaded.tokenizer_source
    return loaded, TokenIdTokenizer() if source is None else Tokenizer.from_source(source)


# ---- metrics ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Percentiles:
    """The mean and three percentiles of a set of samples."""

    mean: float
    p50: float
    p90: float
    p99: float


def percentiles(values: Sequence[float], scale: float = 1.0) -> Percentiles | None:
    """Mean and p50 / p90 / p99 of the values times `scale`; None without values."""
    if len(values) == 0:
        return None
    array = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return Percentiles(float(array.mean()), float(p50), float(p90), float(p99))


def time_per_output_token(metrics: RequestMetrics, num_output_tokens: int) -> float | None:
    """Seconds per output token after the first; None for a request of fewer than two tokens."""
    if num_output_tokens < 2 or metrics.first_token_time is None or metrics.finished_time is None:
        return None
    return (metrics.finished_time - metrics.first_token_time) / (num_output_tokens - 1)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Per-request times of a set of outputs, in milliseconds."""

    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    latency_ms: Percentiles | None


def request_times(outputs: Sequence[RequestOutput]) -> RequestTimes:
    ttft = [o.metrics.time_to_first_token for o in outputs]
    tpot = [time_per_output_token(o.metrics, len(o.outputs[0].token_ids)) for o in outputs]
    latency = [o.metrics.latency for o in outputs]
    return RequestTimes(*(percentiles([v for v in values if v is not None], 1e3) for values in (ttft, tpot, latency)))


@dataclass(frozen=True, slots=True)
class StepSummary:
    """What the engine's steps did during the timed generates (see the module docstring)."""

    num_steps: int
    mean_host_ms: float | None
    mean_dispatch_ms: float | None
    decode_step_ms: float | None
    peak_kv_usage: float | None
    num_preempted: int


def decode_step_ms(stats: Sequence[StepStats]) -> float | None:
    """Median milliseconds between the launches of consecutive decode-only steps; None without such pairs."""
    pairs = zip(stats[:-1], stats[1:], strict=True)
    gaps = [b.launched_at - a.launched_at for a, b in pairs if a.num_prefill_rows == b.num_prefill_rows == 0]
    return 1e3 * float(np.median(gaps)) if gaps else None


def step_summary(stats: Sequence[StepStats]) -> StepSummary:
    def mean_ms(values: list[float]) -> float | None:
        return 1e3 * float(np.mean(values)) if values else None

    return StepSummary(
        num_steps=len(stats),
        mean_host_ms=mean_ms([s.host_seconds for s in stats]),
        mean_dispatch_ms=mean_ms([s.dispatch_seconds for s in stats]),
        decode_step_ms=decode_step_ms(stats),
        peak_kv_usage=max((s.kv_usage for s in stats), default=None),
        num_preempted=sum(s.num_preempted for s in stats),
    )


@dataclass(frozen=True, slots=True)
class EngineSummary:
    """The engine a benchmark ran on (see the module docstring for the fields)."""

    model: str
    backend: str
    dtype: str
    tensor_parallel_size: int
    data_parallel_size: int
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    kv_blocks: int
    kv_tokens: int
    kv_gib: float
    load_s: float
    init_s: float
    warmup_s: float
    compiled_executables: int
    lowering_s: float
    xla_compile_s: float
    gpu_client: str | None = None  # gpu_client.active_client: "tfrt" | "stream_executor"; None off a GPU
    experts: str | None = None  # expert_layout; None for a dense model
    quantization: str | None = None  # EngineConfig.quantization
    quantize_lm_head: bool = False  # EngineConfig.quantize_lm_head
    kv_cache_dtype: str | None = None  # the KV pool's element type


def expert_layout(cfg: Any, expert_parallel: bool, tensor_parallel_size: int) -> str | None:
    """How a mixture of experts' experts lie on the devices: "expert_parallel" (E / tp whole experts a device),
    "tensor_parallel" (each expert's hidden split), "one_device"; None for a dense model."""
    if not any(mlp.num_experts is not None for mlp in getattr(cfg, "mlp_layers", ())):
        return None
    if tensor_parallel_size == 1:
        return "one_device"
    return "expert_parallel" if expert_parallel else "tensor_parallel"


def engine_summary(llm: LLM, load_s: float, init_s: float) -> EngineSummary:
    """The engine's configuration and start-up; the KV pool, warmup and executables summed over replicas."""
    from jaxserve import gpu_client
    from jaxserve.sharding.mesh import MODEL_AXIS

    engines, config, spec = llm.engines, llm.config, llm.engine.runner.spec
    tp = int(llm.engine.runner.mesh.shape[MODEL_AXIS])
    return EngineSummary(
        model=llm.model.source,
        backend=spec.backend,
        dtype=np.dtype(spec.dtype).name,
        tensor_parallel_size=tp,
        data_parallel_size=len(engines),
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        max_seq_len=config.max_seq_len,
        kv_blocks=sum(e.kv_budget.num_blocks for e in engines),
        kv_tokens=sum(e.kv_budget.tokens(config.kv_cache.block_size) for e in engines),
        kv_gib=sum(e.kv_budget.num_blocks * e.kv_budget.bytes_per_block for e in engines) / 2**30,
        load_s=load_s,
        init_s=init_s,
        warmup_s=sum(e.warmup_seconds for e in engines),
        compiled_executables=sum(e.runner.table.num_executables for e in engines),
        lowering_s=sum(e.runner.table.compile_seconds()[0] for e in engines),
        xla_compile_s=sum(e.runner.table.compile_seconds()[1] for e in engines),
        gpu_client=gpu_client.active_client(llm.engine.runner.mesh.devices.flat[0].platform),
        experts=expert_layout(spec.cfg, spec.expert_parallel, tp),
        quantization=spec.quantization,
        quantize_lm_head=spec.quantize_lm_head,
        kv_cache_dtype=np.dtype(spec.cache_dtype).name,
    )


# ---- runs ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class TimedRun:
    """One generate: its outputs, its wall-clock seconds and the stats of the steps it launched."""

    outputs: list[RequestOutput]
    elapsed_s: float
    stats: list[StepStats]
    start: float = 0.0  # time.perf_counter() when the generate began

    @property
    def output_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs)


def iteration_records(run: TimedRun, iteration: int = 0) -> list[dict[str, Any]]:
    """One dict per step of `run`, in launch order: "iteration" (the timed generate it belongs to), "step"
    (its index there), "launched_s" (seconds from the generate's start to the step's dispatch), "gap_ms" (to
    the next step's dispatch in the same generate, null for the last: once the pipeline is full, the step's
    device time), then StepStats' fields with its seconds in ms (host_ms, dispatch_ms)."""
    records = []
    for index, stats in enumerate(run.stats):
        fields = dataclasses.asdict(stats)
        launched = fields.pop("launched_at")
        following = run.stats[index + 1].launched_at if index + 1 < len(run.stats) else None
        record: dict[str, Any] = {
            "iteration": iteration,
            "step": index,
            "launched_s": launched - run.start,
            "gap_ms": None if following is None else 1e3 * (following - launched),
        }
        record.update(fields)
        record["host_ms"] = 1e3 * record.pop("host_seconds")
        record["dispatch_ms"] = 1e3 * record.pop("dispatch_seconds")
        records.append(record)
    return records


def write_iteration_log(path: str, records: Sequence[dict[str, Any]]) -> None:
    """JSON Lines, one record of `iteration_records` per line (floats rounded as in `to_json`)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(_rounded(record)) + "\n")


# ---- LoRA adapters ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoraSummary:
    adapters: int
    rank: int
    update_ms: float
    update_device_bf16_ms: float


def random_adapter_tensors(
    llm: LLM, rank: int, seed: int, modules: Sequence[str] | None = None, b_std: float = 0.01
) -> dict[str, np.ndarray]:
    """PEFT-named tensors of a random rank-`rank` adapter on every projection adapters may target in the model (or
    on those of `modules`): lora_A ~ N(0, 1/in), lora_B ~ N(0, b_std^2) (by default realistic sizes, values that
    do not matter to the timing)."""
    from jaxserve.models import lora

    spec = llm.engine.runner.spec
    rng = np.random.default_rng(seed)
    tensors = {}
    for (layer, module), site in lora.module_sites(spec.family.serving_specs(spec.cfg)).items():
        if modules is not None and module not in modules:
            continue
        inputs = int(np.prod(site.in_shape))
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        tensors[f"{name}.lora_A.weight"] = rng.standard_normal((rank, inputs), np.float32) * inputs**-0.5
        tensors[f"{name}.lora_B.weight"] = rng.standard_normal((site.out_width, rank), np.float32) * b_std
    return tensors


def random_adapters(llm: LLM, count: int, seed: int, first_id: int = 1) -> list[LoRARequest]:
    """`count` random adapters of the engine's max_lora_rank, loaded into `llm`; their requests (ids first_id on)."""
    from jaxserve.lora import LoRARequest

    rank = llm.config.lora.max_lora_rank
    config = {"r": rank, "lora_alpha": 2 * rank}
    requests = []
    for i in range(count):
        llm.load_lora(f"random-{i}", random_adapter_tensors(llm, rank, seed + i), config)
        requests.append(LoRARequest(f"random-{i}", first_id + i))
    return requests


def lora_update_ms(llm: LLM, adapter: LoRARequest, seed: int, repeats: int = 3, device_bf16: bool = False) -> float:
    """The median wall time of `update_lora` of one adapter with new random weights (made beforehand: float32 numpy
    arrays, or with `device_bf16` bfloat16 arrays on the device after one untimed update of that kind), until the
    tables hold them."""
    import jax
    import jax.numpy as jnp

    rank = llm.config.lora.max_lora_rank
    times = []
    for i in range(repeats + device_bf16):
        tensors = random_adapter_tensors(llm, rank, seed + 1000 + i)
        if device_bf16:
            tensors = jax.block_until_ready({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()})
        start = time.perf_counter()
        llm.update_lora(adapter.lora_name, tensors)
        jax.block_until_ready(llm.engine.runner.weights.step_weights)  # the tables (and the weights a is folded into)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[device_bf16:]))


def lora_summary(llm: LLM, adapters: Sequence[LoRARequest], seed: int) -> LoraSummary | None:
    if not adapters:
        return None
    return LoraSummary(
        len(adapters),
        llm.config.lora.max_lora_rank,
        lora_update_ms(llm, adapters[0], seed),
        lora_update_ms(llm, adapters[0], seed, device_bf16=True),
    )


def timed_generate(
    llm: LLM,
    workload: Workload,
    sampling: SamplingOptions,
    max_concurrency: int | None = None,
    adapters: Sequence[LoRARequest] = (),
) -> TimedRun:
    """Generates the workload (at most max_concurrency requests at once: `closed_loop_generate`), request i with
    adapters[i % len(adapters)] when there are any; a request that could not be served is a RuntimeError (it would
    skew the figures)."""
    params = sampling.params(workload.output_lens)
    lora = [adapters[i % len(adapters)] for i in range(len(workload.prompts))] if adapters else None
    start = time.perf_counter()
    if max_concurrency is None:
        outputs = llm.generate(workload.prompts, params, use_tqdm=False, lora_request=lora)
    else:
        outputs = closed_loop_generate(llm, workload.prompts, params, max_concurrency, lora)
    elapsed = time.perf_counter() - start
    failed = [o for o in outputs if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0].error}")
    return TimedRun(outputs, elapsed, [s for s in llm.step_stats if s.launched_at >= start], start)


def closed_loop_generate(
    llm: LLM,
    prompts: Sequence[Any],
    params: Sequence[SamplingParams],
    max_concurrency: int,
    lora: Sequence[LoRARequest | None] | None = None,
) -> list[RequestOutput]:
    """The prompts' final outputs (in their order), with at most max_concurrency requests unfinished at once:
    whenever a step finishes some, as many of the next prompts are submitted before the next step."""
    from jaxserve.prompts import normalize_prompts

    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
    adapters = [llm._adapter_name(r) for r in lora] if lora is not None else [None] * len(prompts)
    queue = collections.deque(zip(range(len(prompts)), normalize_prompts(list(prompts)), params, adapters, strict=True))
    outputs: dict[int, RequestOutput] = {}  # prompt index -> final output
    running: dict[str, int] = {}  # request id -> prompt index
    try:
        while queue or running:
            while queue and len(running) < max_concurrency:
                index, prompt, request_params, adapter = queue.popleft()
                running[llm._add(prompt, request_params, stream=False, lora_name=adapter)] = index
            for request_id in llm._pump():
                output = llm._take(request_id) if request_id in running else None
                if output is not None and output.finished:
                    outputs[running.pop(request_id)] = output
    except BaseException:
        for request_id in running:
            llm._abort(request_id)
        raise
    llm._drain()
    return [outputs[index] for index in range(len(prompts))]


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    """What `run_throughput` measured; the JSON keys of the module docstring."""

    engine: EngineSummary
    num_requests: int
    max_concurrency: int | None
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    requests_per_s: float
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    latency_ms: Percentiles | None
    steps: StepSummary
    lora: LoraSummary | None = None


def run_throughput(
    llm: LLM,
    workload: Workload,
    sampling: SamplingOptions,
    engine: EngineSummary,
    warmup: Workload,
    max_concurrency: int | None = None,
    iteration_log: str | None = None,
    adapters: Sequence[LoRARequest] = (),
    seed: int = 0,
) -> ThroughputResult:
    """The warm-up generate, then the timed one (at most max_concurrency requests at once; request i with
    adapters[i % len(adapters)] when there are any, then the adapter update timed); its steps go to
    `iteration_log` (a path, `write_iteration_log`) when given."""
    timed_generate(llm, warmup, sampling, adapters=adapters)
    run = timed_generate(llm, workload, sampling, max_concurrency, adapters)
    if iteration_log is not None:
        write_iteration_log(iteration_log, iteration_records(run))
    times = request_times(run.outputs)
    input_tokens = sum(len(o.prompt_token_ids) for o in run.outputs)
    return ThroughputResult(
        engine=engine,
        num_requests=len(run.outputs),
        max_concurrency=max_concurrency,
        input_tokens=input_tokens,
        output_tokens=run.output_tokens,
        elapsed_s=run.elapsed_s,
        output_tok_per_s=run.output_tokens / run.elapsed_s,
        total_tok_per_s=(input_tokens + run.output_tokens) / run.elapsed_s,
        requests_per_s=len(run.outputs) / run.elapsed_s,
        ttft_ms=times.ttft_ms,
        tpot_ms=times.tpot_ms,
        latency_ms=times.latency_ms,
        steps=step_summary(run.stats),
        lora=lora_summary(llm, adapters, seed),
    )


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """What `run_latency` measured; the JSON keys of the module docstring."""

    engine: EngineSummary
    batch_size: int
    input_len: int
    output_len: int
    num_iters: int
    num_warmup: int
    latency_s: Percentiles
    iteration_latencies_s: list[float]
    output_tok_per_s: float
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    steps: StepSummary
    lora: LoraSummary | None = None


def run_latency(
    llm: LLM,
    batches: Sequence[Workload],
    sampling: SamplingOptions,
    engine: EngineSummary,
    num_warmup: int,
    iteration_log: str | None = None,
    adapters: Sequence[LoRARequest] = (),
    seed: int = 0,
) -> LatencyResult:
    """Generates each batch in turn; the first `num_warmup` are not timed. output_tok_per_s is the mean
    iteration's: output tokens over the mean latency. The timed iterations' steps go to `iteration_log`."""
    if len(batches) <= num_warmup:
        raise ValueError(f"got {len(batches)} batches for {num_warmup} warm-up iterations: none would be timed")
    for batch in batches[:num_warmup]:
        timed_generate(llm, batch, sampling, adapters=adapters)
    runs = [timed_generate(llm, batch, sampling, adapters=adapters) for batch in batches[num_warmup:]]
    latencies = [run.elapsed_s for run in runs]
    times = request_times([o for run in runs for o in run.outputs])
    first = batches[0]
    summary = percentiles(latencies)
    assert summary is not None  # at least one timed run
    if iteration_log is not None:
        write_iteration_log(iteration_log, [r for i, run in enumerate(runs) for r in iteration_records(run, i)])
    return LatencyResult(
        engine=engine,
        batch_size=first.num_requests,
        input_len=len(first.prompts[0]),
        output_len=first.output_lens[0],
        num_iters=len(runs),
        num_warmup=num_warmup,
        latency_s=summary,
        iteration_latencies_s=latencies,
        output_tok_per_s=sum(run.output_tokens for run in runs) / sum(latencies),
        ttft_ms=times.ttft_ms,
        tpot_ms=times.tpot_ms,
        steps=step_summary([s for run in runs for s in run.stats]),
        lora=lora_summary(llm, adapters, seed),
    )


# ---- reports ------------------------------------------------------------------------------------


def report(result: ThroughputResult | LatencyResult, as_json: bool = False) -> str:
    """The human table, or one JSON object (`to_json`)."""
    if as_json:
        return to_json(result)
    return format_throughput(result) if isinstance(result, ThroughputResult) else format_latency(result)


def to_json(result: ThroughputResult | LatencyResult) -> str:
    """One JSON object with the keys of the module docstring."""
    kind = "throughput" if isinstance(result, ThroughputResult) else "latency"
    return json.dumps({"benchmark": kind, **_rounded(dataclasses.asdict(result))})


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def format_throughput(result: ThroughputResult) -> str:
    r = result
    lines = [
        *_engine_lines("throughput", r.engine, r.steps),
        "",
        f"requests            {r.num_requests}"
        + (f" (at most {r.max_concurrency} at once)" if r.max_concurrency is not None else ""),
        f"input tokens        {r.input_tokens} ({r.input_tokens / r.num_requests:.1f} per request)",
        f"output tokens       {r.output_tokens} ({r.output_tokens / r.num_requests:.1f} per request)",
        f"elapsed             {r.elapsed_s:.3f} s",
        f"output throughput   {r.output_tok_per_s:.1f} tok/s",
        f"total throughput    {r.total_tok_per_s:.1f} tok/s",
        f"request throughput  {r.requests_per_s:.2f} req/s",
        *_lora_lines(r.lora),
        "",
        *_percentile_table([("TTFT (ms)", r.ttft_ms), ("TPOT (ms)", r.tpot_ms), ("latency (ms)", r.latency_ms)]),
        "",
        *_step_lines(r.steps),
    ]
    return "\n".join(lines)


def format_latency(result: LatencyResult) -> str:
    r = result
    lines = [
        *_engine_lines("latency", r.engine, r.steps),
        "",
        f"batch               {r.batch_size} x {r.input_len} prompt tokens -> {r.output_len} output tokens",
        f"iterations          {r.num_iters} timed after {r.num_warmup} warm-up",
        f"output throughput   {r.output_tok_per_s:.1f} tok/s",
        *_lora_lines(r.lora),
        "",
        *_percentile_table([("latency (s)", r.latency_s), ("TTFT (ms)", r.ttft_ms), ("TPOT (ms)", r.tpot_ms)]),
        "",
        *_step_lines(r.steps),
    ]
    return "\n".join(lines)


def _lora_lines(lora: LoraSummary | None) -> list[str]:
    if lora is None:
        return []
    return [
        f"LoRA adapters       {lora.adapters} of rank {lora.rank} on every projection, requests spread over them",
        f"adapter update      {lora.update_ms:.1f} ms (update_lora of one, median of 3: float32 from host memory),",
        f"                    {lora.update_device_bf16_ms:.1f} ms (bfloat16 arrays on the device, a trainer's)",
    ]


def _engine_lines(kind: str, e: EngineSummary, steps: StepSummary) -> list[str]:
    peak = "-" if steps.peak_kv_usage is None else f"{100 * steps.peak_kv_usage:.1f}%"
    size = f"{e.kv_gib:.2f} GiB" if e.kv_gib >= 1 else f"{e.kv_gib * 1024:.2f} MiB"
    return [
        f"jaxserve bench {kind}: {e.model}",
        f"engine              {e.backend} backend, {e.dtype}, tensor parallel {e.tensor_parallel_size}, "
        f"data parallel {e.data_parallel_size}{'' if e.gpu_client is None else f', GPU client {e.gpu_client}'}"
        f"{'' if e.experts is None else f', experts {e.experts}'}"
        f"{'' if e.quantization is None else f', {e.quantization} weights'}"
        f"{' and lm_head' if e.quantize_lm_head else ''}; "
        f"max_batch_size {e.max_batch_size}, max_num_tokens {e.max_num_tokens}, max_seq_len {e.max_seq_len}",
        f"start-up            load {e.load_s:.2f} s, engine {e.init_s:.2f} s "
        f"(compiling {e.compiled_executables} executables: {e.warmup_s:.2f} s; summed over those not loaded "
        f"from the step store: tracing and lowering {e.lowering_s:.2f} s, XLA {e.xla_compile_s:.2f} s)",
        f"KV cache            {e.kv_blocks} blocks ({e.kv_tokens} tokens, {size}"
        f"{'' if e.kv_cache_dtype is None else f', {e.kv_cache_dtype}'}), peak usage {peak}",
    ]


def _percentile_table(rows: list[tuple[str, Percentiles | None]]) -> list[str]:
    lines = [f"{'':20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, p in rows:
        cells = ["-"] * 4 if p is None else [_number(v) for v in (p.mean, p.p50, p.p90, p.p99)]
        lines.append(f"{name:20}" + "".join(f"{c:>10}" for c in cells))
    return lines


def _step_lines(s: StepSummary) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{_number(value)} ms"

    return [
        f"steps               {s.num_steps}, {s.num_preempted} preemptions",
        f"host per step       {ms(s.mean_host_ms)} mean, of which dispatch {ms(s.mean_dispatch_ms)}",
        f"decode step         {ms(s.decode_step_ms)} median",
    ]


def _number(value: float) -> str:
    """Four significant digits or more: 0.1234, 12.35, 1234.6."""
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
