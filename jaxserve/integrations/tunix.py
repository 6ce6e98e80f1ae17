"""A google-tunix rollout engine served by jaxserve: `JaxserveRollout` implements tunix's `BaseRollout`
(`tunix.rl.rollout.base_rollout`) on top of `LLM.from_params`, `LLM.update_weights` and the sampled
tokens' logprob arrays (`SamplingParams(token_logprobs=True)`).

    from functools import partial
    from tunix.rl import rl_cluster
    from jaxserve.integrations.tunix import JaxserveRollout

    config = rl_cluster.ClusterConfig(
        role_to_mesh=..., training_config=..., rollout_config=rollout_config,
        rollout_engine=partial(JaxserveRollout, max_batch_size=64),  # any LLM keyword
    )

- The actor's parameters are served as they are (`jaxserve.models.tunix_params` maps tunix's names to
  our fields): tunix's Llama3, Gemma (Gemma and Gemma 2) and Gemma3 models, whose Hugging Face config is
  derived from theirs, or another tunix model with the same parameter names (Qwen3) when `hf_config` is given.
  `update_params` (tunix's weight sync, after every step: `model()` is None, so tunix never takes the
  engine's weights for the actor's) merges what it receives into the last full set and calls
  `LLM.update_weights`: nothing is recompiled. tunix's `offload_to_cpu` is refused (it moves the rollout model's
  variables; the engine has none to move).
- An actor trained with LoRA (qwix's `*_lora_a` / `*_lora_b` parameters beside the base ones; give `lora_alpha`,
  the qwix LoraProvider's alpha) is served as the base model plus one adapter, "actor" (`LLM.load_lora`), which
  every `generate` uses; tunix then syncs only the LoRA parameters, and `update_params` replaces the adapter in
  place (`LLM.update_lora`: a few megabytes, nothing recompiled) instead of the whole model's weights.
- `generate` follows tunix's vLLM rollout: prompts tokenized as tunix does (BOS prepended once), every
  prompt its own request (a seeded config seeds prompt i with seed + i, so copies of one prompt differ),
  generation stopped at `eos_tokens` (the tokenizer's EOS by default), which stay in the tokens;
  prompts left-padded to `max_prompt_length` (to the next power of two of the longest when longer).
- Logprobs are "processed" by default (`logprobs_mode`, as tunix's vLLM rollout): log_softmax of the
  logits divided by the temperature (and filtered by top-k / top-p), which is what tunix's trainer
  computes for the actor and the reference. `get_per_token_logps` returns the logprobs recorded while
  the last `generate` sampled, row by row: the old policy's, with no second forward.

Needs google-tunix (`pip install -e ".[tunix]"`, Python >= 3.11).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.gemma import model as gemma
from tunix.models.gemma3 import model as gemma3
from tunix.models.llama3 import model as llama3
from tunix.rl.rollout import base_rollout

from jaxserve.llm import LLM
from jaxserve.lora import LoRARequest, split_qwix
from jaxserve.models.tunix_params import to_jaxserve_params
from jaxserve.sampling import SamplingParams


def flat_params(state: Any) -> dict[str, jax.Array]:
    """A Flax NNX State (or a nested dict of arrays) as {dotted path: array}; the arrays are not copied."""
    tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    flat: dict[str, jax.Array] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(tree, "")
    return flat


def llama3_hf_config(config: llama3.ModelConfig, max_position_embeddings: int) -> dict[str, Any]:
    """The Hugging Face config of the model a tunix Llama3 computes (default rope: tunix's has no scaling).

    Its rope theta is `apply_rope`'s default, not `config.rope_theta`: tunix's Llama3 attention calls
    apply_rope without the config's theta (google-tunix 0.1.7), and the policy served must be the one
    tunix trains."""
    rope_theta = inspect.signature(llama3.apply_rope).parameters["rope_theta"].default
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.weight_tying,
        "max_position_embeddings": max_position_embeddings,
    }


# tunix's Gemma norms add this epsilon (a literal in their RMSNorm, google-tunix 0.1.7).
_GEMMA_NORM_EPS = 1e-6
_GEMMA_LAYER_TYPES = {"GLOBAL": "full_attention", "LOCAL_SLIDING": "sliding_attention"}


def _gemma_common(config: Any, kinds: list[str], max_position_embeddings: int) -> dict[str, Any]:
    """The keys every Gemma version's Hugging Face config shares, from a tunix Gemma or Gemma3 config."""
    hf = {
        "vocab_size": config.num_embed,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": _GEMMA_NORM_EPS,
        "hidden_activation": "gelu_pytorch_tanh",  # nnx.gelu: the tanh approximation
        "tie_word_embeddings": True,
        "max_position_embeddings": max_position_embeddings,
    }
    if "sliding_attention" in kinds:
        hf["sliding_window"] = config.sliding_window_size
    return hf


def gemma_hf_config(config: gemma.ModelConfig, max_position_embeddings: int) -> dict[str, Any]:
    """The Hugging Face config of the model a tunix Gemma computes: a Gemma when it has no post norms,
    soft-caps or sliding layers, a Gemma 2 when it has both post norms (its layer kinds from
    `attention_types`, its soft-caps as set: None written as null, which means no cap).

    tunix scales the queries by head_dim ** -0.5 and rotates them with `apply_rope`'s default base whatever
    the version, so a Gemma 2's query_pre_attn_scalar is head_dim and its rope_theta that default."""
    kinds = [_GEMMA_LAYER_TYPES[t.name] for t in itertools.islice(config.attention_types, config.num_layers)]
    caps = {
        "attn_logit_softcapping": config.attn_logits_soft_cap,
        "final_logit_softcapping": config.final_logit_softcap,
    }
    post_norms = (config.use_post_attn_norm, config.use_post_ffw_norm)
    hf = {
        **_gemma_common(config, kinds, max_position_embeddings),
        "rope_theta": float(inspect.signature(gemma.apply_rope).parameters["max_wavelength"].default),
    }
    if post_norms == (False, False) and set(kinds) == {"full_attention"} and all(c is None for c in caps.values()):
        return {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **hf}
    if post_norms == (True, True):
        extra = {"query_pre_attn_scalar": config.head_dim, "layer_types": kinds, **caps}
        return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **hf, **extra}
    raise ValueError(
        f"a tunix Gemma with use_post_attn_norm={post_norms[0]}, use_post_ffw_norm={post_norms[1]}, "
        f"attn_logits_soft_cap={caps['attn_logit_softcapping']}, final_logit_softcap={caps['final_logit_softcapping']} "
        f"and {sorted(set(kinds))} layers is neither a Gemma (no post norms, soft-caps or sliding layers) nor a "
        "Gemma 2 (both post norms)"
    )


def gemma3_hf_config(config: gemma3.ModelConfig, max_position_embeddings: int) -> dict[str, Any]:
    """The Hugging Face config of the language model a tunix Gemma3 computes (a multimodal one's vision side
    is not served): sliding layers in tunix's fixed pattern (`GEMMA3_ATTENTION_PATTERN`, repeated), full
    layers rotated with the global base scaled linearly by `global_scale_factor`, sliding layers with the
    local base; the query scale `query_pre_attn_norm` says; no soft-caps."""
    if config.local_scale_factor != 1.0:
        raise ValueError(
            f"tunix Gemma3 local_scale_factor={config.local_scale_factor}: only unscaled sliding-layer rope (1.0, "
            "as every released Gemma 3 has it) is served"
        )
    pattern = itertools.cycle(gemma3.GEMMA3_ATTENTION_PATTERN)
    kinds = [_GEMMA_LAYER_TYPES[t.name] for t in itertools.islice(pattern, config.num_layers)]
    by_head_dim = config.query_pre_attn_norm == gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_gemma_common(config, kinds, max_position_embeddings),
        "layer_types": kinds,
        "query_pre_attn_scalar": config.head_dim if by_head_dim else config.embed_dim // config.num_heads,
        "rope_theta": float(config.global_base_frequency),
        "rope_local_base_freq": float(config.local_base_frequency),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    if config.global_scale_factor != 1.0:
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(config.global_scale_factor)}
    return hf


def tunix_hf_config(model: nnx.Module, max_position_embeddings: int) -> dict[str, Any]:
    """The Hugging Face config of a tunix Llama3, Gemma (Gemma or Gemma 2) or Gemma3 model."""
    derive = {llama3.Llama3: llama3_hf_config, gemma.Gemma: gemma_hf_config, gemma3.Gemma3: gemma3_hf_config}
    for module, config_of in derive.items():
        if isinstance(model, module):
            return config_of(model.config, max_position_embeddings)
    raise TypeError(f"cannot derive a Hugging Face config for a {type(model).__name__}: pass hf_config")


class _EngineTokenizer:
    """tunix's tokenizer (its TokenizerAdapter, or anything with encode / decode / bos_id / eos_id /
    pad_id) as the engine reads one; prompts are encoded as tunix's samplers do."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (int(self.tokenizer.eos_id()),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        bos = self.tokenizer.bos_id()
        if add_special_tokens and bos is not None:
            ids = [bos, *ids]
            while len(ids) > 1 and ids[0] == ids[1] == bos:  # one BOS, as tunix's dedup_bos_ids
                ids = ids[1:]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


class JaxserveRollout(base_rollout.BaseRollout):
    """tunix's rollout interface over a jaxserve `LLM` (see the module docstring).

    rollout_actor: the tunix model whose parameters are served (RLCluster passes the actor).
    tokenizer, mesh, rollout_config: as RLCluster passes them; the engine's max_seq_len holds
        max(kv_cache_size, max_prompt_length + max_tokens_to_generate) tokens.
    hf_config: the model's Hugging Face config (dict or object); derived for a tunix Llama3, Gemma or Gemma3.
    lora_alpha: for an actor with LoRA parameters, qwix's alpha (the adapter is scaled by alpha / rank).
    llm_kwargs: `LLM` keywords (max_batch_size, compile_config, logprobs_mode, ...).
    """

    ADAPTER = LoRARequest("actor", 1)

    def __init__(
        self,
        rollout_actor: nnx.Module,
        tokenizer: Any,
        mesh: jax.sharding.Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        hf_config: Any = None,
        lora_alpha: float | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if rollout_config is None:
            raise ValueError("JaxserveRollout needs the rollout_config (its lengths size the engine)")
        max_seq_len = max(
            rollout_config.kv_cache_size, rollout_config.max_prompt_length + rollout_config.max_tokens_to_generate
        )
        if hf_config is None:
            hf_config = tunix_hf_config(rollout_actor, max_seq_len)
        self._tokenizer = tokenizer
        self._params, self._lora = split_qwix(flat_params(nnx.state(rollout_actor, nnx.Param)))
        options = {"logprobs_mode": "processed_logprobs", "max_seq_len": max_seq_len, "show_progress": False}
        self._lora_config = None
        if self._lora:
            if lora_alpha is None:
                raise ValueError(
                    "the rollout actor has LoRA parameters: pass lora_alpha (its qwix LoraProvider's alpha)"
                )
            rank = max(int(v.shape[-1]) for k, v in self._lora.items() if k.endswith("_lora_a"))
            options.update(enable_lora=True, max_loras=1, max_lora_rank=rank)
            self._lora_config = {"lora_alpha": lora_alpha}
        self.llm = LLM.from_params(
            to_jaxserve_params(self._params), hf_config, _EngineTokenizer(tokenizer), **{**options, **llm_kwargs}
        )
        if self._lora:
            with jax.transfer_guard("allow"):
                self.llm.load_lora(self.ADAPTER.lora_name, self._lora, self._lora_config)
        self._recorded: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The engine's device mesh (axes "data", "model")."""
        return self.llm.engine.runner.mesh

    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs: Any
    ) -> base_rollout.RolloutOutput:
        """One completion per prompt (tunix repeats a prompt for its num_generations)."""
        if kwargs:
            raise TypeError(f"JaxserveRollout.generate takes no extra sampling arguments, got {sorted(kwargs)}")
        encode = self.llm.tokenizer.encode
        prompt_ids = [encode(p) for p in prompts]
        params = [_sampling_params(rollout_config, self.eos_id(), i) for i in range(len(prompts))]
        adapter = self.ADAPTER if self._lora else None
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False, lora_request=adapter
        )
        failed = [(i, o.error) for i, o in enumerate(outputs) if o.error is not None]
        if failed:
            raise RuntimeError(f"the engine could not serve prompt {failed[0][0]}: {failed[0][1]}")
        completions = [o.outputs[0] for o in outputs]
        tokens = [np.asarray(c.token_ids, np.int32) for c in completions]
        self._recorded = {
            self._key(ids, t): c.token_logprobs for ids, t, c in zip(prompt_ids, tokens, completions, strict=True)
        }
        return base_rollout.RolloutOutput(
            text=[c.text for c in completions],
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=self._left_padded(prompt_ids, rollout_config.max_prompt_length),
            logprobs=[c.token_logprobs for c in completions] if rollout_config.return_logprobs else None,
        )

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """[B, C] float32: each row's logprobs as recorded by the last `generate` (0 past its end), for
        prompts left-padded and completions right-padded with pad_id. A row that call did not generate
        raises a ValueError."""
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or len(prompts) != len(completions):
            raise ValueError(
                f"prompt_tokens and completion_tokens must be [B, P] and [B, C], got {prompts.shape} "
                f"and {completions.shape}"
            )
        out = np.zeros(completions.shape, np.float32)
        for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            recorded = self._recorded.get(self._key(prompt, completion))
            if recorded is None:
                raise ValueError(
                    f"row {b} was not generated by the last generate call: this rollout returns the logprobs "
                    "recorded while sampling, not those of other tokens"
                )
            n = min(len(recorded), completions.shape[1])
            out[b, :n] = recorded[:n]
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Serves new parameter values: `params` (an NNX State, all or some of the actor's parameters) merged into
        the last full set; base parameters through `LLM.update_weights`, LoRA parameters (an actor trained with
        LoRA: tunix syncs those only) through `LLM.update_lora` (checked, cast, nothing recompiled)."""
        base, lora = split_qwix(flat_params(params))
        if lora and not self._lora:
            raise ValueError(
                f"LoRA parameter {next(iter(lora))}: this rollout serves an actor without LoRA parameters; build it "
                "from the LoRA actor (or merge the adapters into the weights)"
            )
        # On CPU tunix syncs under a guard against explicit host <-> device transfers; placing the weights
        # layer by layer indexes each layer out with a host integer, which that guard counts as one.
        with jax.transfer_guard("allow"):
            if base:
                merged = {**self._params, **base}
                self.llm.update_weights(to_jaxserve_params(merged))
                self._params = merged
            if lora:
                merged_lora = {**self._lora, **lora}
                self.llm.update_lora(self.ADAPTER.lora_name, merged_lora, self._lora_config)
                self._lora = merged_lora

    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self) -> None:
        """None: no tunix module holds the weights the engine serves (they are the engine's own copy). So
        tunix, which skips the weight sync when the rollout's model shares the actor's weights, syncs
        after every step; and its `offload_to_cpu`, which moves the rollout model's variables, is not
        supported (`rollout.llm.sleep()` frees the engine's memory instead)."""
        return None

    def _key(self, prompt: Sequence[int], completion: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A row's identity whatever its padding: the prompt without leading pad ids, the completion
        without trailing ones."""
        pad = self.pad_id()
        prompt, completion = [int(t) for t in prompt], [int(t) for t in completion]
        start = next((i for i, t in enumerate(prompt) if t != pad), len(prompt))
        end = len(completion)
        while end and completion[end - 1] == pad:
            end -= 1
        return tuple(prompt[start:]), tuple(completion[:end])

    def _left_padded(self, prompt_ids: list[list[int]], max_prompt_length: int) -> np.ndarray:
        longest = max(len(ids) for ids in prompt_ids)
        width = max_prompt_length if longest <= max_prompt_length else 1 << (longest - 1).bit_length()
        padded = np.full((len(prompt_ids), width), self.pad_id(), np.int32)
        for i, ids in enumerate(prompt_ids):
            padded[i, width - len(ids) :] = ids
        return padded


def _sampling_params(config: base_rollout.RolloutConfig, eos_id: int, index: int) -> SamplingParams:
    """A RolloutConfig as one prompt's SamplingParams, with the sampled tokens' logprob array."""
    seed = None if config.seed is None else int(np.asarray(config.seed).reshape(-1)[0]) + index
    return SamplingParams(
        temperature=float(config.temperature),
        top_p=1.0 if config.top_p is None else float(config.top_p),
        top_k=config.top_k,
        seed=seed,
        max_tokens=config.max_tokens_to_generate,
        stop_token_ids=list(config.eos_tokens) if config.eos_tokens is not None else [eos_id],
        token_logprobs=True,
    )
