"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, `chat`, `stream`.

A thin layer over `Engine`: it checks its arguments, loads the model (a name, a path, or parameters
already in memory), derives the engine limits with TensorRT-LLM's rules, and drives the step loop.
Every call drives the same engines: each step's outputs go to the mailbox of the request they belong
to, so `generate` calls and several `stream` iterators can be consumed in any order from one thread.
A call that raises (a bad prompt, a step that failed, a KeyboardInterrupt) aborts the requests it added;
a stream that is closed or dropped aborts its request, whose KV blocks are freed at once.

Data parallelism: `data_parallel_size` engines (replicas), each on its own devices with its own KV pool,
scheduler and prefix cache, routed to and stepped as one `jaxserve.replicas.ReplicaSet` (the server's
engine driver uses the same): a new request goes to the least loaded replica, and each step of the loop
steps every replica with work.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import capacity, distributed, gpu_client
from jaxserve.config import (
    DTYPES,
    CompileConfig,
    EngineConfig,
    KvCacheConfig,
    LoraConfig,
    SchedulerConfig,
    make_engine_config,
)
from jaxserve.engine import Engine, StepStats, model_dtype
from jaxserve.lora import LoraAdapter, LoRARequest, flat_names, read_adapter, split_qwix
from jaxserve.models.hub import DEFAULT_MODEL
from jaxserve.models.loader import LoadedModel, load_from_pytree, load_model
from jaxserve.prompts import Prompt, normalize_prompt, normalize_prompts
from jaxserve.replicas import ReplicaSet, Round
from jaxserve.sampling import SEED_MODULUS, RequestOutput, SamplingParams
from jaxserve.sharding.mesh import DATA_AXIS, MESH_AXES, MODEL_AXIS, make_mesh, serving_mesh
from jaxserve.tokenizer import Tokenizer, validate_conversations

logger = logging.getLogger(__name__)

Message = dict[str, Any]


def resolve_dtype(dtype: str) -> str:
    """ "auto" -> bfloat16 on an accelerator, float32 on CPU (where bfloat16 matmuls are slow)."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_max_batch_size() -> int:
    """8 on CPU; on an accelerator the upper bound of the size the engine picks from the KV pool."""
    return 8 if jax.default_backend() == "cpu" else max(capacity.AUTO_BATCH_SIZES)


def _freeze_long_lived_objects() -> None:
    """gc.collect(), then gc.freeze(): every object alive once the engines are ready (the modules, the
    engines and their compiled steps, jax's tracing caches) moves to the collector's permanent generation,
    so the full collections a long generate triggers no longer scan them (each one paused the engine loop).
    `LLM.close` unfreezes them. Objects are still freed when their last reference goes; only garbage cycles
    among frozen objects wait for the unfreeze."""
    gc.collect()
    gc.freeze()


class LLM:
    """Generate from a model with continuous batching over a paged KV cache.

    model: the default name (`smollm2-135m-instruct`), a Hugging Face directory, a .gguf file, an orbax
        checkpoint directory, a hub id, or a `LoadedModel` (e.g. from `jaxserve.models.loader.load_from_pytree`
        for parameters just trained).
    tokenizer: a `Tokenizer`, or a path it loads from (a model directory or a .gguf file); None takes
        the model's own.
    dtype: "auto" loads a checkpoint in bfloat16 on an accelerator and float32 on CPU and serves a
        `LoadedModel` in its own dtype; "float32" / "bfloat16" / "float16" loads, or casts, the weights to it.
    max_batch_size: sequences per step (default 8 on CPU; on a GPU 1024, 512 or 256, the largest whose
        sequences of 256 tokens the KV pool holds); max_num_tokens: tokens per
        step (default 8192, at most max_batch_size * max_seq_len); max_seq_len: from the model config
        when None (a larger value is lowered to it, with a warning).
    tensor_parallel_size: devices the weights and the KV cache are split over (None: the mesh's "model"
        axis size with a mesh, else 1); with a mesh it must equal that size.
    mesh: a `jax.sharding.Mesh` to serve on (a trainer's): the weights and the KV cache are placed on its
        devices by the rules table, split over its tensor-parallel axis and replicated over every other
        axis. mesh_axes: which of its axes is the engine's "model" axis, e.g. {"model": "tp"} (None: the
        axis named "model"; {"model": None}: replicate on every device); see `jaxserve.sharding.mesh.serving_mesh`.
    data_parallel_size: replicas of the model, each an `Engine` with its own KV pool (sized from its own
        devices' memory), scheduler and prefix cache, fed by this LLM by load (see the module docstring).
        Without a mesh, replica r serves on the devices [r * tp, (r + 1) * tp) of `jax.devices()`; with
        one, on the r-th of data_parallel_size equal slices of its "data" axis (every axis but the
        tensor-parallel one, as `serving_mesh` folds them), which it must divide. Replica r samples
        unseeded requests with seed + r.
    logprobs_mode: "raw_logprobs" (default) or "processed_logprobs": what sampled tokens' logprobs are
        taken over (`EngineConfig.logprobs_mode`, vLLM's option of that name).
    enable_expert_parallel: a mixture of experts' layout under tensor parallelism (vLLM's option of that name):
        True puts E / tp whole experts on each device, False splits each expert's hidden over them, None (the
        default) chooses as `EngineConfig.enable_expert_parallel` says. Ignored, with a warning, for a dense model.
    kv_cache_dtype: None (default: `kv_cache_config`'s dtype, "auto") or "fp8" (vLLM's option of that name): K and V
        stored as float8_e4m3fn (`KvCacheConfig.dtype`).
    quantization: None (default) or "fp8" (vLLM's option of that name): the linear layers' weights in
        float8_e4m3fn with per-output-channel scales, quantized on the device layer by layer as they are placed
        (and again on every `update_weights`), activations quantized per token; `EngineConfig.quantization`.
    quantize_lm_head: with quantization, an untied lm_head in FP8 too (`EngineConfig.quantize_lm_head`).
    enable_lora / max_loras / max_lora_rank: serve LoRA adapters beside the base model (vLLM's options): up to
        max_loras adapters on the device at once, of rank up to max_lora_rank, each request with its own
        (`generate(..., lora_request=LoRARequest(name, id, path))`, `load_lora`, `update_lora`); base-model rows
        and rows of different adapters share each step. A request whose adapter finds no slot free of running
        requests waits for one (least recently used adapters are replaced first).
    seed: the engine's PRNG seed for unseeded sampling (any int, taken modulo 2**32).

    `llm.model` is the model's description (family, config, Hugging Face config, sources) without its
    weights: the engine holds the only copy it serves (`update_weights` replaces it). `llm.replicas` is the
    `ReplicaSet` that routes to and steps the replicas; `llm.engines` are their engines, `llm.engine` the first.
    """

    def __init__(
        self,
        model: str | os.PathLike | LoadedModel = DEFAULT_MODEL,
        *,
        tokenizer: Tokenizer | str | os.PathLike | None = None,
        dtype: str = "auto",
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        max_seq_len: int | None = None,
        kv_cache_config: KvCacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        compile_config: CompileConfig | None = None,
        attention_backend: str = "auto",
        tensor_parallel_size: int | None = None,
        data_parallel_size: int = 1,
        mesh: Mesh | None = None,
        mesh_axes: Mapping[str, str | None] | None = None,
        logprobs_mode: str = "raw_logprobs",
        enable_expert_parallel: bool | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str | None = None,
        quantize_lm_head: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        _check_arguments(model, dtype, max_batch_size, tensor_parallel_size, seed, show_progress)
        _check_size("data_parallel_size", data_parallel_size)
        replica_meshes = _start_backend(mesh, mesh_axes, tensor_parallel_size, data_parallel_size)
        if isinstance(model, LoadedModel):
            loaded = model
        else:  # host weights: the runner lays them out on the device one layer at a time
            loaded = load_model(model, dtype=resolve_dtype(dtype), on_device=False)
        self.tokenizer = _tokenizer(tokenizer, loaded)
        quantization = _checkpoint_quantization(quantization, loaded.hf_config)
        if kv_cache_dtype is not None:
            kv_cache_config = dataclasses.replace(kv_cache_config or KvCacheConfig(), dtype=kv_cache_dtype)
        self.config = make_engine_config(
            loaded.hf_config,
            max_batch_size=default_max_batch_size() if max_batch_size is None else max_batch_size,
            auto_max_batch_size=max_batch_size is None and jax.default_backend() != "cpu",
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            kv_cache=kv_cache_config,
            scheduler=scheduler_config,
            compile=compile_config,
            attention_backend=attention_backend,
            dtype=dtype,
            logprobs_mode=logprobs_mode,
            enable_expert_parallel=enable_expert_parallel,
            quantization=quantization,
            quantize_lm_head=quantize_lm_head,
            lora=_lora_config(enable_lora, max_loras, max_lora_rank),
        )
        self.replicas = ReplicaSet(
            _start_engines(loaded, self.tokenizer, self.config, replica_meshes, seed=seed, show_progress=show_progress)
        )
        # The engine serves its own copy of the weights (the serving layout); holding the checkpoint layout
        # too kept a second copy of every weight on the device for the LLM's lifetime.
        self.model = dataclasses.replace(loaded, weights=None)
        # The latest output of every request a call of this LLM is waiting for (None: none yet).
        self._mailboxes: dict[str, RequestOutput | None] = {}
        self.weights_version = 0  # how many times update_weights replaced the weights
        self._adapters: dict[str, LoraAdapter] = {}  # the LoRA adapters loaded, by name
        self._adapter_ids: dict[int, str] = {}  # LoRARequest.lora_int_id -> name
        _freeze_long_lived_objects()

    @classmethod
    def from_params(
        cls,
        params: Any,
        config: Any,
        tokenizer: Any,
        *,
        lora_alpha: float | None = None,
        lora_name: str = "default",
        **engine_kwargs: Any,
    ) -> LLM:
        """An LLM over parameters already in memory, without conversion.

        params: the family's weights dataclass; a nested dict keyed by our field names or by Hugging
            Face names (a Flax Linen params tree, "kernel" matrices [in, out] included); or a Flax NNX
            `State` (its `to_pure_dict()`), as `jaxserve.models.loader.load_from_pytree` takes them.
            A tunix model trained with qwix LoRA keeps its `*_lora_a` / `*_lora_b` parameters beside the
            base ones: they are split off and served as the adapter `lora_name` (`LoRARequest(lora_name, id)`
            picks it; a request without one gets the base model), which needs `lora_alpha` (the qwix
            LoraProvider's alpha) and turns `enable_lora` on with `max_lora_rank` at least the tree's rank.
        config: the model's Hugging Face config, a config.json dict or a `PretrainedConfig`.
        tokenizer: a `Tokenizer` or a path it loads from. engine_kwargs: the `LLM` keywords; dtype "auto"
            serves the parameters in their own floating-point dtype.
        """
        from jaxserve.models import registry

        hf_config = config.to_dict() if hasattr(config, "to_dict") else config
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"config must be a Hugging Face config dict or object, got {type(config).__name__}")
        hf_config = dict(hf_config)
        family, cfg = registry.resolve(hf_config)
        tree, lora = _split_lora_params(_pure_params(params), lora_alpha)
        if lora:
            rank = max(int(np.shape(value)[-1]) for key, value in lora.items() if key.endswith("_lora_a"))
            engine_kwargs = {"enable_lora": True, "max_lora_rank": rank, **engine_kwargs}
            if not engine_kwargs["enable_lora"]:
                raise ValueError("the parameters hold LoRA parameters, which need enable_lora=True")
            if engine_kwargs["max_lora_rank"] < rank:
                limit = engine_kwargs["max_lora_rank"]
                raise ValueError(f"the parameters' LoRA rank {rank} is above max_lora_rank={limit}")
        dtype = np.dtype(model_dtype(engine_kwargs.get("dtype", "auto"), tree)).name
        # Not cast here: the runner casts them to `dtype` layer by layer as it places them, so no cast copy
        # of the whole tree is made.
        weights = load_from_pytree(family, cfg, tree, dtype, cast=False)
        loaded = LoadedModel(family, cfg, weights, hf_config, None, "parameters in memory")
        llm = cls(loaded, tokenizer=tokenizer, **{**engine_kwargs, "dtype": dtype})
        if lora:
            try:
                llm.load_lora(lora_name, lora, {"lora_alpha": lora_alpha})
            except Exception:
                llm.close()  # an adapter that does not fit the model: nothing is left holding device memory
                raise
        return llm

    @property
    def engines(self) -> list[Engine]:
        """The replicas' engines."""
        return self.replicas.engines

    @property
    def engine(self) -> Engine:
        """The first replica's engine (the only one without data parallelism)."""
        return self.replicas.engines[0]

    def update_weights(self, params: Any) -> int:
        """Replaces every weight's values in place (same shapes, placed and cast as the current ones),
        without compiling anything, and returns the new weights version (1 after the first update).

        `params`: the model's weights dataclass, or a nested dict keyed by our field names or Hugging Face
        names (as `jaxserve.models.loader.load_from_pytree` takes), checked before anything changes. Its arrays may
        be laid out in any way, on any devices (a trainer's FSDP or tensor-parallel shardings): each layer
        is resharded into the serving layout on its way in (the first update from a layout not seen before
        compiles that small slicing and resharding; the steps never recompile). The prefix cache is
        dropped. Refused (RuntimeError) while a request is unfinished: call it between `generate` calls.
        The old device buffers are freed layer by layer as the new ones are placed.
        """
        self.replicas.on_every_replica("update_weights", lambda engine: engine.update_weights(params))
        self.weights_version += 1
        return self.weights_version

    # ---- LoRA adapters --------------------------------------------------------------------------

    def load_lora(self, name: str, source: Any, config: Any = None) -> None:
        """Loads a LoRA adapter to serve under `name`: a PEFT directory (adapter_config.json and
        adapter_model.safetensors), or PEFT-named tensors in memory (`lora_A.weight` [r, in], `lora_B.weight`
        [out, r] of q/k/v/o/gate/up/down_proj) with their adapter_config (a dict or a peft `LoraConfig`). Checked
        against the model (shapes, rank <= max_lora_rank, targets the model has) before anything changes;
        nothing compiles. A name already loaded is an error: `update_lora` replaces an adapter's weights."""
        self._check_lora("load_lora")
        if name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded: update_lora({name!r}, ...) replaces it")
        self._put_adapter(read_adapter(name, source, config))

    def update_lora(self, name: str, source: Any, config: Any = None) -> None:
        """Replaces a loaded adapter's weights in place (`load_lora`'s sources; tensors in memory are read with
        the adapter's own config unless another is given), without compiling anything; the blocks the prefix
        cache holds for it are never reused. Refused while a request is unfinished (as `update_weights`)."""
        old = self._known_adapter(name)
        if config is None and not isinstance(source, str | os.PathLike):
            config = old.config
        adapter = dataclasses.replace(read_adapter(name, source, config), version=old.version + 1)
        self._put_adapter(adapter)

    def unload_lora(self, name: str) -> None:
        """Forgets a loaded adapter and frees its slot. Refused while a request is unfinished."""
        self._known_adapter(name)
        self.replicas.on_every_replica("unload_lora", lambda engine: engine.unload_adapter(name))
        del self._adapters[name]
        self._adapter_ids = {i: n for i, n in self._adapter_ids.items() if n != name}

    def list_loras(self) -> list[str]:
        """The names of the loaded adapters, in the order they were loaded."""
        return list(self._adapters)

    def _check_lora(self, what: str) -> None:
        if self.config.lora is None:
            raise ValueError(f"{what} needs an LLM that serves LoRA adapters: LLM(..., enable_lora=True)")

    def _put_adapter(self, adapter: LoraAdapter) -> None:
        self.replicas.on_every_replica("load_lora", lambda engine: engine.load_adapter(adapter))
        self._adapters[adapter.name] = adapter

    def _known_adapter(self, name: str) -> LoraAdapter:
        if name not in self._adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self._adapters)}")
        return self._adapters[name]

    def _adapter_name(self, request: LoRARequest | None) -> str | None:
        """The adapter a request is served with, loaded from its path the first time it is named."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        self._check_lora("a lora_request")
        known = self._adapter_ids.get(request.lora_int_id)
        if known is not None and known != request.lora_name:
            raise ValueError(f"LoRARequest id {request.lora_int_id} names adapter {known!r}, not {request.lora_name!r}")
        if request.lora_name not in self._adapters:
            if request.lora_path is None:
                raise ValueError(f"unknown LoRA adapter {request.lora_name!r} and its LoRARequest has no lora_path")
            self.load_lora(request.lora_name, request.lora_path)
        self._adapter_ids[request.lora_int_id] = request.lora_name
        return request.lora_name

    def sleep(self, level: int = 1) -> None:
        """Frees device memory between uses, e.g. for a trainer on the same device (vLLM's sleep mode):
        level 1 moves the weights to host memory and frees the KV pool, level 2 frees both (the next
        `update_weights` brings weights, before or after `wake_up`). Refused while a request is unfinished."""
        self.replicas.on_every_replica("sleep", lambda engine: engine.sleep(level))

    def wake_up(self) -> None:
        """Takes the memory back (KV pool, and the weights level 1 kept on the host); nothing recompiles."""
        self.replicas.on_every_replica("wake_up", Engine.wake_up)

    def close(self) -> None:
        """Aborts what is unfinished and frees every device buffer of this LLM (`with LLM(...) as llm:`
        does it on leaving the block); the LLM serves no more. Another LLM can be built afterwards."""
        self.replicas.close()
        self._mailboxes.clear()
        gc.unfreeze()  # what this LLM held (and everything frozen with it) is collected as usual again

    def follow(self) -> int:
        """On every process but process 0 of a multi-process run (`jaxserve.distributed`): runs the steps of
        process 0's engine until process 0 closes its LLM, then closes this one; returns the steps run."""
        if self.engine.step_channel is None or distributed.is_leader():
            raise RuntimeError("follow() is for the processes other than 0 of a multi-process run: process 0 serves")
        try:
            return distributed.follow(self.engine.runner, self.engine.step_channel)
        finally:
            self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def step_stats(self) -> list[StepStats]:
        """Per-step statistics: tokens, sequences, bucket, KV usage, preemptions, prefix hit rate; with several
        replicas, the steps of all of them in the order they were launched (each replica's own:
        `llm.engines[r].stats`)."""
        return self.replicas.step_stats()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt; outputs in the order of the prompts (see `jaxserve.prompts` for what a
        prompt can be). lora_request: the adapter every prompt is served with, or one per prompt (None: the base
        model), as vLLM's.

        A prompt the engine can never serve (too long for max_seq_len, ...) comes back finished with
        `error` set; the others are served. Malformed input raises (TypeError for a wrong type,
        ValueError for a bad value) and queues nothing.
        """
        from tqdm.auto import tqdm

        prompts = normalize_prompts(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        adapters = [self._adapter_name(r) for r in _per_prompt(lora_request, len(prompts), "lora_request")]
        ids = self._add_all(prompts, params, adapters)
        try:
            with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as progress:
                outputs = self._finals(ids, progress.update)
        except BaseException:
            for request_id in ids:
                self._abort(request_id)
            raise
        self._drain()
        return outputs

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of {"role", "content"} dicts) or several, with the chat template.

        content is a string or a list of OpenAI text parts (joined); a malformed conversation raises a
        TypeError or ValueError naming the message and the field before anything is queued.
        """
        conversations = validate_conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def stream(
        self, prompt: Any, sampling_params: SamplingParams | None = None, lora_request: LoRARequest | None = None
    ) -> RequestStream:
        """An iterator over the request's output after every step that changed it; the last is finished.

        The request is queued now (bad input raises here). Closing the iterator, or dropping it, aborts
        the request and frees its blocks.
        """
        adapter = self._adapter_name(lora_request)
        request_id = self._add(normalize_prompt(prompt), sampling_params, stream=True, lora_name=adapter)
        return RequestStream(self, request_id)

    # ---- the shared step loop -------------------------------------------------------------------

    def _add(self, prompt: Prompt, params: SamplingParams | None, stream: bool, lora_name: str | None = None) -> str:
        """Queues the request on the least loaded replica."""
        request_id = self.replicas.add(prompt, params, stream=stream, lora_name=lora_name)
        self._mailboxes[request_id] = None
        return request_id

    def _add_all(
        self, prompts: list[Prompt], params: list[SamplingParams | None], adapters: list[str | None]
    ) -> list[str]:
        """All or nothing: the first prompt that raises withdraws the ones queued before it."""
        ids: list[str] = []
        try:
            for prompt, sp, adapter in zip(prompts, params, adapters, strict=True):
                ids.append(self._add(prompt, sp, stream=False, lora_name=adapter))
        except BaseException as error:
            for request_id in ids:
                self._abort(request_id)
            self._drain()
            if type(error) in (ValueError, TypeError):
                raise type(error)(f"prompt {len(ids)}: {error}") from error
            raise
        return ids

    def _pump(self) -> list[str]:
        """One step of every replica with work; each output goes to its request's mailbox. Returns the ids
        that got one."""
        if not self.replicas.has_unfinished():
            raise RuntimeError("the engine has nothing left to run, but a request of this LLM is unfinished")
        return self._deliver(self.replicas.step())

    def _deliver(self, stepped: Round) -> list[str]:
        """The round's outputs to their mailboxes, then the first step failure raised (the failed replica has
        requeued its requests; the caller's aborts withdraw its own)."""
        delivered = []
        for output in stepped.outputs:
            if output.request_id in self._mailboxes:  # else: aborted by its caller, nobody waits for it
                self._mailboxes[output.request_id] = output
                delivered.append(output.request_id)
        if stepped.failures:
            raise stepped.failures[0].error
        return delivered

    def _take(self, request_id: str) -> RequestOutput | None:
        """The request's latest undelivered output; a finished request's mailbox closes."""
        output = self._mailboxes.get(request_id)
        if output is not None:
            self._mailboxes[request_id] = None
            if output.finished:
                del self._mailboxes[request_id]
        return output

    def _finals(self, request_ids: list[str], on_finished: Any) -> list[RequestOutput]:
        """Steps the engine until every request has its final output."""
        done: dict[str, RequestOutput] = {}
        waiting = set(request_ids)

        def collect(request_id: str) -> None:
            output = self._take(request_id)
            if output is not None and output.finished:
                done[request_id] = output
                waiting.discard(request_id)
                on_finished(1)

        for request_id in request_ids:  # finished while another call stepped the engine
            collect(request_id)
        while waiting:
            for request_id in self._pump():
                if request_id in waiting:
                    collect(request_id)
        return [done[i] for i in request_ids]

    def _abort(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)
        self.replicas.abort(request_id)  # nothing if it finished

    def _drain(self) -> None:
        """Reads back the steps still in flight on the replicas where no request runs, so that they are idle
        between calls."""
        self._deliver(self.replicas.drain())


class RequestStream(Iterator[RequestOutput]):
    """One request's outputs as they grow (see `LLM.stream`); `close()` or dropping it aborts the request."""

    def __init__(self, llm: LLM, request_id: str) -> None:
        self.request_id = request_id
        self._llm: LLM | None = llm

    def __next__(self) -> RequestOutput:
        llm = self._llm
        if llm is None:
            raise StopIteration
        output = llm._take(self.request_id)
        while output is None:
            llm._pump()
            output = llm._take(self.request_id)
        if output.finished:
            self._llm = None
        return output

    def close(self) -> None:
        """Aborts the request if it has not finished; its blocks are freed now."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm._abort(self.request_id)

    def __del__(self) -> None:
        self.close()


def _lora_config(enable_lora: Any, max_loras: Any, max_lora_rank: Any) -> LoraConfig | None:
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora must be a bool, got {enable_lora!r}")
    return LoraConfig(max_loras, max_lora_rank) if enable_lora else None


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """One value for every prompt, or a sequence of one per prompt."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} prompts")
        return list(value)
    return [value] * count


def _check_arguments(
    model: Any, dtype: Any, max_batch_size: Any, tensor_parallel_size: Any, seed: Any, show_progress: Any
) -> None:
    """The constructor's own arguments (the engine configs check theirs)."""
    if not isinstance(model, str | os.PathLike | LoadedModel):
        raise TypeError(f"model must be a name, a path or a LoadedModel, got {type(model).__name__}")
    if isinstance(model, str) and not model.strip():
        raise ValueError("model must name a model: got an empty string")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    sizes = {"max_batch_size": max_batch_size, "tensor_parallel_size": tensor_parallel_size}
    for name, value in sizes.items():
        if value is not None:  # None: the default
            _check_size(name, value)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    if not isinstance(show_progress, bool):
        raise TypeError(f"show_progress must be a bool, got {show_progress!r}")


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")


def _start_backend(
    mesh: Mesh | None, axes: Mapping[str, str | None] | None, tp: int | None, dp: int
) -> list[Mesh | None]:
    """Each replica's mesh, once jax's backend is started with this engine's defaults (the memory fraction,
    the TFRT GPU client for a one-device engine of one process)."""
    capacity.raise_memory_fraction_default()  # before the meshes start jax's backend
    one_device = mesh is None and (tp or 1) == 1 and dp == 1
    gpu_client.use_tfrt_client_default(1 if one_device and not jax.distributed.is_initialized() else 0)
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        tp = _multiprocess_tp(tp, dp, mesh, axes)
    return _replica_meshes(mesh, axes, tp, dp)


def _start_engines(
    loaded: LoadedModel,
    tokenizer: Tokenizer,
    config: EngineConfig,
    meshes: list[Mesh | None],
    *,
    seed: int,
    show_progress: bool,
) -> list[Engine]:
    """One engine per replica mesh; replica r samples unseeded requests with seed + r."""
    return [
        Engine(
            loaded.family,
            loaded.config,
            loaded.weights,
            tokenizer,
            config,
            mesh=mesh,
            seed=(seed + replica) % SEED_MODULUS,
            show_progress=show_progress,
        )
        for replica, mesh in enumerate(meshes)
    ]


def _multiprocess_tp(tp: int | None, dp: int, mesh: Mesh | None, axes: Mapping[str, str | None] | None) -> int | None:
    """tensor_parallel_size in a multi-process run, where one engine is split over every device of every
    process (the followers keep pace with process 0 because every step's collectives span them all)."""
    count, processes = jax.device_count(), jax.process_count()
    why = f"a run of {processes} processes serves one engine split over all their {count} devices"
    if dp != 1:
        raise ValueError(f"{why}: data_parallel_size must be 1, got {dp}")
    if mesh is not None:
        size = serving_mesh(mesh, axes).shape[MODEL_AXIS]
        if size != count:
            raise ValueError(f"{why}: the mesh's tensor-parallel axis must hold all of them, it has {size}")
        return tp
    if tp is not None and tp != count:
        raise ValueError(f"{why}: tensor_parallel_size must be {count} (or left out), got {tp}")
    return count


def _engine_mesh(mesh: Mesh | None, axes: Mapping[str, str | None] | None, tp: int | None) -> Mesh | None:
    """The engine's mesh: the caller's (axes mapped by `serving_mesh`), or one of tp local devices (None: one
    device); a tensor_parallel_size given with a mesh must be its tensor-parallel size."""
    if mesh is None:
        if axes is not None:
            raise ValueError("mesh_axes names axes of a mesh: pass mesh= too, or leave mesh_axes out")
        return make_mesh(tp=tp) if tp is not None and tp > 1 else None
    serving = serving_mesh(mesh, axes)
    size = serving.shape[MODEL_AXIS]
    if tp is not None and tp != size:
        raise ValueError(
            f"tensor_parallel_size={tp} disagrees with the mesh, whose tensor-parallel axis has {size} devices "
            f"(the mesh's axes: {dict(mesh.shape)}, mesh_axes={axes}): leave tensor_parallel_size out or make "
            "them equal"
        )
    return serving


def _replica_meshes(
    mesh: Mesh | None, axes: Mapping[str, str | None] | None, tp: int | None, dp: int
) -> list[Mesh | None]:
    """Each replica's mesh (see `LLM`'s data_parallel_size); one replica: `_engine_mesh`'s."""
    engine_mesh = _engine_mesh(mesh, axes, tp)
    if dp == 1:
        return [engine_mesh]
    if mesh is None:
        tp, available = tp or 1, len(jax.devices())
        if dp * tp > available:
            raise ValueError(
                f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices, but only {available} "
                f"are available ({jax.default_backend()}): lower them, or on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={dp * tp} before jax starts"
            )
        whole = make_mesh(tp=tp, dp=dp)
    else:
        whole = serving_mesh(mesh, axes)
    rows = whole.shape[DATA_AXIS]
    if rows % dp:
        raise ValueError(
            f"data_parallel_size={dp} must divide the mesh's data-parallel axis, {rows} groups of "
            f"{whole.shape[MODEL_AXIS]} tensor-parallel devices (the mesh's axes: {dict(whole.shape)} once "
            f"mapped by mesh_axes={axes})"
        )
    per_replica, grid = rows // dp, whole.devices
    return [Mesh(grid[r * per_replica : (r + 1) * per_replica], MESH_AXES) for r in range(dp)]


def _pure_params(params: Any) -> Any:
    """A Flax NNX State (or a tree holding nnx Variables) as plain nested dicts of arrays; anything else
    as it is. flax is imported only when the parameters come from it."""
    if not type(params).__module__.startswith("flax"):
        return params
    from flax import nnx

    to_pure_dict = getattr(nnx, "to_pure_dict", None)  # flax < 0.11 has the State method only
    return to_pure_dict(params) if to_pure_dict is not None else params.to_pure_dict()


def _split_lora_params(tree: Any, lora_alpha: float | None) -> tuple[Any, dict[str, Any]]:
    """(the base parameters, the qwix LoRA parameters as dotted names) of `from_params`' tree."""
    if isinstance(tree, Mapping):
        base, lora = split_qwix(flat_names(tree["params"] if set(tree) == {"params"} else tree))
        if lora:
            if lora_alpha is None:
                raise ValueError(
                    f"the parameters hold qwix LoRA parameters ({next(iter(lora))}, ...): pass lora_alpha (the "
                    "qwix LoraProvider's alpha) to serve them as an adapter, or merge them into the weights"
                )
            return base, lora
    if lora_alpha is not None:
        raise ValueError("lora_alpha was given, but the parameters hold no qwix LoRA parameters (*_lora_a / *_lora_b)")
    return tree, {}


def _checkpoint_quantization(quantization: str | None, hf_config: dict) -> str | None:
    """`quantization`, or "fp8" for an FP8 checkpoint (its weights are served in FP8 as vLLM serves them)."""
    from jaxserve.models.fp8_checkpoint import checkpoint_format

    if quantization is None and checkpoint_format(hf_config) is not None:
        logger.info("an FP8 checkpoint (quantization_config): serving its linear weights in FP8 (quantization='fp8')")
        return "fp8"
    return quantization


def _tokenizer(tokenizer: Any, loaded: LoadedModel) -> Any:
    """The tokenizer argument as a tokenizer: loaded from a path, or the model's own."""
    if isinstance(tokenizer, str | os.PathLike):
        return Tokenizer.from_source(tokenizer)
    if tokenizer is None:
        if loaded.tokenizer_source is None:
            raise ValueError(f"{loaded.source} has no tokenizer: pass tokenizer=Tokenizer.from_source(...)")
        return Tokenizer.from_source(loaded.tokenizer_source)
    missing = [m for m in ("encode", "decode", "eos_token_ids") if not hasattr(tokenizer, m)]
    if missing:
        raise TypeError(f"tokenizer must be a Tokenizer or a path, got {type(tokenizer).__name__} (no {missing})")
    return tokenizer


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[Any]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
