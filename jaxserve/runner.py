"""The model runner: owns the weights, the paged KV cache and the mesh, compiles one step function per
bucket ahead of time at warmup, and runs a step: `run(inputs) -> StepOutput` (device arrays).

One compiled step (DESIGN.md "Data flow") does, on the device:
  1. gathers the tokens the previous step sampled into this step's token_ids (overlap);
  2. the model's forward over the flat token batch, writing K/V into the donated cache;
  3. logits at each sequence's last token, min_tokens bans, then the sampler; prompt-logprobs variants
     also score every flat token's next prompt token; greedy variants take an argmax and branch on
     nothing (a device-side conditional makes the step's call wait for the device on a GPU).
Under tensor parallelism the weights and the cache are split over the mesh's model axis (the Pallas
kernels run per device under shard_map, models/attention.py). It is the JAX stand-in for a captured
CUDA graph: shapes are fixed per bucket, and anything that would compile after warmup is refused with
an error naming the shape.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from jaxserve.inputs import Bucket, BucketTable, CarriedTokens, SamplingInputs, StepInputs, TokenHistory
from jaxserve.sampler import SamplingTensors, compute_logprobs, sample
from models.attention import PagedAttentionMetadata, PagedKVCache
from sharding.mesh import MODEL_AXIS, make_mesh
from sharding.rules import shard_weights

logger = logging.getLogger(__name__)

# Stop ids a request can ban while it has fewer than min_tokens outputs (EOS + stop_token_ids).
MAX_BANNED_TOKENS = 8


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class DeviceInputs:
    """StepInputs plus the per-step extras, as the compiled step receives them."""

    token_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    slot_mapping: Int[Array, " T"]
    cu_q_lens: Int[Array, " B+1"]
    kv_lens: Int[Array, " B"]
    block_table: Int[Array, "B M"]
    logits_indices: Int[Array, " B"]
    num_seqs: Int[Array, ""]
    carried_mask: Bool[Array, " B"]  # row b's last input token is the previous step's sample ...
    carried_source: Int[Array, " B"]  # ... of that row of the previous step
    banned_tokens: Int[Array, "B NB"]  # token ids row b may not sample this step (padding: V)
    step: Int[Array, ""]  # step counter, folded into the PRNG key
    want_logprobs: Bool[Array, ""]  # some row asked for logprobs: compute the top-N and the ranks


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's results on the device. token_ids is padded to max_batch_size rows, so the next step
    can gather from it whatever bucket either step used."""

    token_ids: Int[Array, " Bmax"]
    logprobs: Float[Array, " B"]
    ranks: Int[Array, " B"]  # 1 + tokens more likely than the sampled one, over the whole vocabulary
    top_logprobs: Float[Array, "B N"]
    top_token_ids: Int[Array, "B N"]
    # Prompt-logprobs variants only: per flat token, the logprob and rank of the prompt token after it.
    prompt_logprobs: Float[Array, " T"] | None = None
    prompt_ranks: Int[Array, " T"] | None = None
    prompt_top_logprobs: Float[Array, "T N"] | None = None
    prompt_top_token_ids: Int[Array, "T N"] | None = None


# Tokens per slice of the prompt-logprobs computation: the logits of one slice ([slice, V] float32) are
# all it holds at once.
PROMPT_LOGPROBS_SLICE = 512


def _gather_carried(inputs: DeviceInputs, previous_tokens: Int[Array, " Bmax"]) -> Int[Array, " T"]:
    """token_ids with each carried row's last input replaced by the previous step's sample."""
    num_tokens = inputs.token_ids.shape[0]
    # Rows without a carried token scatter out of bounds (dropped): padding rows share index 0.
    target = jnp.where(inputs.carried_mask, inputs.logits_indices, num_tokens)
    return inputs.token_ids.at[target].set(previous_tokens[inputs.carried_source], mode="drop")


def step_fn(
    weights: Any,
    kv_cache: PagedKVCache,
    inputs: DeviceInputs,
    sampling: SamplingTensors,
    previous_tokens: Int[Array, " Bmax"],
    key: Array,
    token_history: Int[Array, "B S"] | None,
    num_prompt_tokens: Int[Array, " B"] | None,
    prompt_targets: Int[Array, " T"] | None = None,
    *,
    family: ModuleType,
    cfg: Any,
    backend: str,
    num_top_logprobs: int,
    max_q_len: int | None = None,
    mesh: Mesh | None = None,
    greedy: bool = False,
) -> tuple[StepOutput, PagedKVCache]:
    """One engine step on the device (see the module docstring); `mesh` when tensor-parallel.

    greedy (static): every row is greedy and none asks for top-N logprobs: an argmax step without
    conditionals, whose call returns before the device runs it (a conditional blocks the host).
    """
    token_ids = _gather_carried(inputs, previous_tokens)
    meta = PagedAttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_table=inputs.block_table,
        kv_lens=inputs.kv_lens,
        cu_q_lens=inputs.cu_q_lens,
        num_seqs=inputs.num_seqs,
        backend=backend,
        max_q_len=max_q_len,
        mesh=mesh,
    )
    hidden, kv_cache = family.forward(weights, token_ids, inputs.positions, kv_cache, meta, cfg)
    logits = family.compute_logits(weights, hidden[inputs.logits_indices], cfg)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, inputs.banned_tokens].set(-jnp.inf, mode="drop")
    if token_history is not None:
        # The carried token is also the newest entry of its row's history.
        carried = token_ids[inputs.logits_indices]
        column = jnp.where(inputs.carried_mask, inputs.positions[inputs.logits_indices], token_history.shape[1])
        token_history = token_history.at[jnp.arange(column.shape[0]), column].set(carried, mode="drop")
    key = jax.random.fold_in(key, inputs.step)
    out = sample(
        logits,
        sampling,
        key,
        token_history=token_history,
        num_prompt_tokens=num_prompt_tokens,
        greedy_only=greedy,
    )
    padded = jnp.zeros_like(previous_tokens).at[: out.token_ids.shape[0]].set(out.token_ids)
    # top_k over the vocabulary costs 2.2 ms for 256 x 128256 on an H200 (an argmax 0.05 ms): it runs only
    # in steps where some row asked for logprobs, a branch decided on the device (which, like every XLA
    # GPU conditional with real work, makes the host wait for the device at this point; see
    # sampler.sample). The greedy variant has no such row.
    with_details = partial(_logprob_details, num_top=num_top_logprobs)
    without = partial(_no_logprob_details, num_top=num_top_logprobs)
    if greedy:
        ranks, top_logprobs, top_ids = without(logits, out.token_ids)
    else:
        ranks, top_logprobs, top_ids = jax.lax.cond(inputs.want_logprobs, with_details, without, logits, out.token_ids)
    output = StepOutput(padded, out.logprobs, ranks, top_logprobs, top_ids)
    if prompt_targets is not None:
        prompt = _prompt_logprobs(weights, hidden, prompt_targets, family=family, cfg=cfg, num_top=num_top_logprobs)
        output = dataclasses.replace(
            output,
            prompt_logprobs=prompt[0],
            prompt_ranks=prompt[1],
            prompt_top_logprobs=prompt[2],
            prompt_top_token_ids=prompt[3],
        )
    return output, kv_cache


def _prompt_logprobs(
    weights: Any, hidden: Float[Array, "T D"], targets: Int[Array, " T"], *, family: ModuleType, cfg: Any, num_top: int
) -> tuple[Float[Array, " T"], Int[Array, " T"], Float[Array, "T N"], Int[Array, "T N"]]:
    """Logprob and rank of each token's target (the next prompt token; negative: none, zeros returned) and
    the top-N logprobs, over the raw logits (no bans), PROMPT_LOGPROBS_SLICE tokens at a time."""
    num_tokens = hidden.shape[0]
    size = math.gcd(num_tokens, PROMPT_LOGPROBS_SLICE)

    def one_slice(args):
        h, t = args
        logits = family.compute_logits(weights, h, cfg).astype(jnp.float32)
        target = jnp.maximum(t, 0)
        chosen, top_logprobs, top_ids = compute_logprobs(logits, target, num_top)
        target_logit = jnp.take_along_axis(logits, target[:, None], axis=-1)
        ranks = 1 + jnp.sum(logits > target_logit, axis=-1, dtype=jnp.int32)
        valid = t >= 0
        return jnp.where(valid, chosen, 0.0), jnp.where(valid, ranks, 0), top_logprobs, top_ids.astype(jnp.int32)

    slices = (hidden.reshape(num_tokens // size, size, -1), targets.reshape(num_tokens // size, size))
    chosen, ranks, top_logprobs, top_ids = jax.lax.map(one_slice, slices)
    return (
        chosen.reshape(num_tokens),
        ranks.reshape(num_tokens),
        top_logprobs.reshape(num_tokens, num_top),
        top_ids.reshape(num_tokens, num_top),
    )


def _logprob_details(
    logits: Float[Array, "B V"], token_ids: Int[Array, " B"], *, num_top: int
) -> tuple[Int[Array, " B"], Float[Array, "B N"], Int[Array, "B N"]]:
    """Rank of each sampled token over the whole vocabulary, and the top-N logprobs with their ids."""
    chosen = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)
    ranks = 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)
    _, top_logprobs, top_ids = compute_logprobs(logits, token_ids, num_top)
    return ranks, top_logprobs, top_ids


def _no_logprob_details(
    logits: Float[Array, "B V"], token_ids: Int[Array, " B"], *, num_top: int
) -> tuple[Int[Array, " B"], Float[Array, "B N"], Int[Array, "B N"]]:
    rows = logits.shape[0]
    return jnp.zeros(rows, jnp.int32), jnp.zeros((rows, num_top), jnp.float32), jnp.zeros((rows, num_top), jnp.int32)


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """What fixes the compiled steps: the model, the KV pool, the buckets and the sampler's variants."""

    family: ModuleType
    cfg: Any
    buckets: BucketTable
    dtype: jnp.dtype
    backend: str  # "pallas" | "xla"
    max_seq_len: int
    num_top_logprobs: int
    penalty_variants: bool  # also compile each bucket with a token history for the penalties
    prompt_logprob_variants: bool = False  # also compile each token bucket with prompt logprobs
    greedy_variants: bool = False  # also compile each bucket as an all-greedy step without conditionals


class Runner:
    """Weights, KV cache and the compiled step per variant (bucket, penalties, prompt logprobs, greedy); see
    the module docstring."""

    def __init__(self, spec: RunnerSpec, weights: Any, mesh: Mesh | None = None, seed: int = 0) -> None:
        self.spec = spec
        self.mesh = mesh if mesh is not None else make_mesh(tp=1, devices=jax.devices()[:1])
        tp = self.mesh.shape[MODEL_AXIS]
        if spec.backend == "pallas" and tp > 1 and (spec.cfg.num_kv_heads % tp or spec.cfg.num_heads % tp):
            raise ValueError(
                f"attention_backend='pallas' with tp={tp} runs the kernels per device on a share of the heads: "
                f"num_kv_heads ({spec.cfg.num_kv_heads}) and num_heads ({spec.cfg.num_heads}) must be divisible "
                "by tp; use a tp that divides them or attention_backend='xla'"
            )
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self.weights = shard_weights(weights, spec.family.param_specs(spec.cfg), self.mesh)
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0
        self._key = jax.device_put(jax.random.PRNGKey(seed), self._replicated)
        self._previous = jax.device_put(np.zeros(spec.buckets.max_batch_size, np.int32), self._replicated)
        # (bucket, penalties, prompt logprobs, greedy) -> the compiled step
        self._compiled: dict[tuple[Bucket, bool, bool, bool], jax.stages.Compiled] = {}
        self._step_count = 0

    # ---- memory ---------------------------------------------------------------------------------

    def _cache_sharding(self) -> NamedSharding:
        tp = self.mesh.shape[MODEL_AXIS]
        kv_axis = MODEL_AXIS if self.spec.cfg.num_kv_heads % tp == 0 else None  # replicated when tp > K
        return NamedSharding(self.mesh, PartitionSpec(None, None, None, kv_axis, None))

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        cfg = self.spec.cfg
        return (cfg.num_layers, num_blocks, self.spec.buckets.block_size, cfg.num_kv_heads, cfg.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocates the zeroed block pool; compiled steps are specialised to its size."""
        if self._compiled:
            raise RuntimeError("the KV cache is allocated once, before warmup")
        shape, sharding = self._cache_shape(num_blocks), self._cache_sharding()
        zeros = jax.jit(partial(jnp.zeros, shape, self.spec.dtype), out_shardings=sharding)
        self.kv_cache, self.num_blocks = PagedKVCache(k=zeros(), v=zeros()), num_blocks

    # ---- compilation ----------------------------------------------------------------------------

    def _abstract_args(self, bucket: Bucket, penalties: bool, num_blocks: int, prompt_lp: bool = False) -> tuple:
        rep = self._replicated
        T, B, M = bucket.num_tokens, bucket.num_seqs, self.spec.buckets.max_blocks_per_seq

        def arr(shape: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        inputs = DeviceInputs(
            token_ids=arr((T,)),
            positions=arr((T,)),
            slot_mapping=arr((T,)),
            cu_q_lens=arr((B + 1,)),
            kv_lens=arr((B,)),
            block_table=arr((B, M)),
            logits_indices=arr((B,)),
            num_seqs=arr(()),
            carried_mask=arr((B,), jnp.bool_),
            carried_source=arr((B,)),
            banned_tokens=arr((B, MAX_BANNED_TOKENS)),
            step=arr(()),
            want_logprobs=arr((), jnp.bool_),
        )
        sampling = jax.tree_util.tree_map(
            lambda x: arr(x.shape, x.dtype), SamplingTensors.neutral(B), is_leaf=lambda x: isinstance(x, jax.Array)
        )
        cache_leaf = jax.ShapeDtypeStruct(
            self._cache_shape(num_blocks), self.spec.dtype, sharding=self._cache_sharding()
        )
        weights = jax.tree_util.tree_map(
            lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding), self.weights
        )
        history = (arr((B, self.spec.max_seq_len)), arr((B,))) if penalties else (None, None)
        previous = arr((self.spec.buckets.max_batch_size,))
        key = jax.ShapeDtypeStruct(self._key.shape, self._key.dtype, sharding=rep)
        targets = arr((T,)) if prompt_lp else None
        return (weights, PagedKVCache(cache_leaf, cache_leaf), inputs, sampling, previous, key, *history, targets)

    def compile_step(
        self,
        bucket: Bucket,
        penalties: bool,
        num_blocks: int | None = None,
        prompt_lp: bool = False,
        greedy: bool = False,
    ) -> jax.stages.Compiled:
        """Lowers and compiles the step for one bucket (not cached here: warmup stores the results)."""
        spec = self.spec
        fn = partial(
            step_fn,
            family=spec.family,
            cfg=spec.cfg,
            backend=spec.backend,
            num_top_logprobs=spec.num_top_logprobs,
            max_q_len=1 if bucket.decode_only else None,
            mesh=self.mesh if self.mesh.shape[MODEL_AXIS] > 1 else None,
            greedy=greedy,
        )
        jitted = jax.jit(fn, donate_argnums=(1,))  # argument 1 is the KV cache: updated in place
        args = self._abstract_args(bucket, penalties, self.num_blocks if num_blocks is None else num_blocks, prompt_lp)
        return jitted.lower(*args).compile()

    def probe_step(
        self, compiled: jax.stages.Compiled, bucket: Bucket, penalties: bool, num_blocks: int, prompt_lp: bool = False
    ) -> None:
        """Runs a step compiled for a small pool once on an all-padding batch (for its memory peak)."""
        args = self._abstract_args(bucket, penalties, num_blocks, prompt_lp)
        weights, cache, *rest = args
        zeros = [
            jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), x)
            if x is not None
            else None
            for x in (cache, *rest)
        ]
        out, _ = compiled(self.weights, *zeros)
        jax.block_until_ready(out)

    def warmup(self, show_progress: bool = True) -> float:
        """Compiles every step variant ahead of time; returns the seconds taken.

        Variants: every bucket with and without penalties (penalty_variants), every token bucket with
        prompt logprobs (prompt_logprob_variants), and every bucket as an all-greedy step
        (greedy_variants).
        """
        from tqdm.auto import tqdm

        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache before warmup")
        variants = (False, True) if self.spec.penalty_variants else (False,)
        buckets = self.spec.buckets.buckets
        shapes = [(b, p, False, False) for b in buckets for p in variants]
        if self.spec.prompt_logprob_variants:
            shapes += [(b, p, True, False) for b in buckets if not b.decode_only for p in variants]
        if self.spec.greedy_variants:
            shapes += [(b, False, False, True) for b in buckets]
        start = time.perf_counter()
        for key in tqdm(shapes, desc="compiling step buckets", disable=not show_progress):
            bucket, penalties, prompt_lp, greedy = key
            t0 = time.perf_counter()
            self._compiled[key] = self.compile_step(bucket, penalties, prompt_lp=prompt_lp, greedy=greedy)
            logger.info(
                "compiled T=%d B=%d%s penalties=%s prompt_logprobs=%s greedy=%s in %.2fs",
                bucket.num_tokens,
                bucket.num_seqs,
                " (decode)" if bucket.decode_only else "",
                penalties,
                prompt_lp,
                greedy,
                time.perf_counter() - t0,
            )
        total = time.perf_counter() - start
        logger.info("warmup: %d step variants in %.1fs", len(shapes), total)
        return total

    # ---- one step -------------------------------------------------------------------------------

    def run(
        self,
        inputs: StepInputs,
        sampling: SamplingInputs,
        carried: CarriedTokens,
        banned_tokens: np.ndarray,
        history: TokenHistory | None = None,
        want_logprobs: bool = False,
        prompt_targets: np.ndarray | None = None,
        greedy: bool = False,
    ) -> StepOutput:
        """Dispatches one precompiled step; returns its device outputs without waiting for them.

        prompt_targets: per flat token, the next prompt token whose logprob to compute (inputs.NO_TARGET
        for none); only the prompt-logprobs variants take it.
        greedy: every row is greedy and none wants logprobs (the greedy variants; see `step_fn`).
        """
        bucket = inputs.bucket
        compiled = self._compiled.get((bucket, history is not None, prompt_targets is not None, greedy))
        if compiled is None:
            shapes = [(b.num_tokens, b.num_seqs, b.decode_only) for b in self.spec.buckets.buckets]
            raise RuntimeError(
                f"no compiled step for T={bucket.num_tokens} B={bucket.num_seqs} decode_only={bucket.decode_only} "
                f"penalties={history is not None} prompt_logprobs={prompt_targets is not None} greedy={greedy}: "
                f"shapes are compiled only at warmup (compiled (T, B, decode_only): {shapes})"
            )
        device_inputs = DeviceInputs(
            **inputs.arrays(),
            carried_mask=carried.mask,
            carried_source=carried.source_row,
            banned_tokens=banned_tokens,
            step=np.int32(self._step_count),
            want_logprobs=np.bool_(want_logprobs),
        )
        sampling_tensors = _host_sampling(sampling)
        hist = (history.token_ids, history.num_prompt_tokens) if history is not None else (None, None)
        args = (self.weights, self.kv_cache, device_inputs, sampling_tensors, self._previous, self._key)
        out, self.kv_cache = compiled(*args, *hist, prompt_targets)
        self._previous = out.token_ids
        self._step_count += 1
        return out


def _host_sampling(sampling: SamplingInputs) -> SamplingTensors:
    """The sampling arrays as numpy leaves: the compiled step transfers them with the other inputs."""
    return SamplingTensors(**sampling.arrays())


def default_compilation_cache_dir() -> str:
    base = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return os.path.join(base, "xla")


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turns on jax's persistent compilation cache (unless the user configured one), so a restart is fast."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir or default_compilation_cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    logger.info("persistent compilation cache: %s", path)
