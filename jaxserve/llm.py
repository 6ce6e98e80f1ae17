"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, `chat`, `stream`.

A thin layer over `Engine`: it loads the model (a name, a path, or parameters already in memory),
derives the engine limits with TensorRT-LLM's rules, and drives the step loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve import capacity
from jaxserve.config import CompileConfig, KvCacheConfig, SchedulerConfig, make_engine_config
from jaxserve.engine import Engine, StepStats
from jaxserve.sampling import RequestOutput, SamplingParams
from jaxserve.tokenizer import Tokenizer
from models.hub import DEFAULT_MODEL
from models.loader import LoadedModel, load_model
from sharding.mesh import make_mesh

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Message = dict[str, str]


def resolve_dtype(dtype: str) -> str:
    """ "auto" -> bfloat16 on an accelerator, float32 on CPU (where bfloat16 matmuls are slow)."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_max_batch_size() -> int:
    return 8 if jax.default_backend() == "cpu" else 256


class LLM:
    """Generate from a model with continuous batching over a paged KV cache.

    model: the default name (`smollm2-135m-instruct`), a Hugging Face directory, a .gguf file, an orbax
        checkpoint directory, a hub id, or a `LoadedModel` (e.g. from `models.loader.load_from_pytree`
        for parameters just trained).
    dtype: "auto" loads a checkpoint in bfloat16 on an accelerator and float32 on CPU and serves a
        `LoadedModel` in its own dtype; "float32" / "bfloat16" / "float16" loads, or casts, the weights to it.
    max_batch_size: sequences per step (default 256 on GPU, 8 on CPU); max_num_tokens: tokens per
        step (default 8192, at most max_batch_size * max_seq_len); max_seq_len: from the model config
        when None (a larger value is lowered to it, with a warning).
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        *,
        tokenizer: Tokenizer | None = None,
        dtype: str = "auto",
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        max_seq_len: int | None = None,
        kv_cache_config: KvCacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        compile_config: CompileConfig | None = None,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        capacity.raise_memory_fraction_default()
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=resolve_dtype(dtype))
        if tokenizer is None:
            if loaded.tokenizer_source is None:
                raise ValueError(f"{loaded.source} has no tokenizer: pass tokenizer=Tokenizer.from_source(...)")
            tokenizer = Tokenizer.from_source(loaded.tokenizer_source)
        self.model, self.tokenizer = loaded, tokenizer
        self.config = make_engine_config(
            loaded.hf_config,
            max_batch_size=max_batch_size or default_max_batch_size(),
            max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len,
            kv_cache=kv_cache_config,
            scheduler=scheduler_config,
            compile=compile_config,
            attention_backend=attention_backend,
            dtype=dtype,
        )
        mesh: Mesh | None = make_mesh(tp=tensor_parallel_size) if tensor_parallel_size > 1 else None
        self.engine = Engine(
            loaded.family,
            loaded.config,
            loaded.weights,
            tokenizer,
            self.config,
            mesh=mesh,
            seed=seed,
            show_progress=show_progress,
        )

    @property
    def step_stats(self) -> list[StepStats]:
        """Per-step statistics: tokens, sequences, bucket, KV usage, preemptions, prefix hit rate."""
        return list(self.engine.stats)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completes every prompt (text, or a list of token ids); outputs in the order of the prompts.

        A prompt the engine can never serve (too long for max_seq_len, ...) comes back finished with
        `error` set; the others are served. Malformed input (bad ids, bad params) raises ValueError.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(prompt, sp))
        except ValueError as error:
            for request_id in ids:  # all or nothing: the valid prompts queued so far are withdrawn
                self.engine.abort(request_id)
            self._drain()
            raise ValueError(f"prompt {len(ids)}: {error}") from error
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of {"role", "content"} dicts) or several, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the request's partial output after every step that added a token; the last one is finished."""
        request_id = self.engine.add_request(prompt, sampling_params)
        while True:
            for output in self.engine.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        self._drain()
                        return

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm) as progress:
            while len(done) < len(request_ids):
                for output in self.engine.step(finished_only=True):
                    if output.request_id in wanted:
                        done[output.request_id] = output
                        progress.update(1)
        self._drain()
        return [done[i] for i in request_ids]

    def _drain(self) -> None:
        """Reads back the step still in flight, so the engine is idle between calls."""
        while self.engine.has_unfinished() and not self.engine.scheduler.has_unfinished():
            self.engine.step(finished_only=True)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[Any]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
