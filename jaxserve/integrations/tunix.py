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

- The actor's parameters are served as they are: tunix's Llama3 models (the Hugging Face config is
  derived from theirs), or another tunix model with the same parameter names when `hf_config` is given.
  `update_params` (tunix's weight sync, after every step: `model()` is None, so tunix never takes the
  engine's weights for the actor's) merges what it receives into the last full set and calls
  `LLM.update_weights`: nothing is recompiled. LoRA parameters are refused (merge them first), and so
  is tunix's `offload_to_cpu` (it moves the rollout model's variables; the engine has none to move).
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
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.rl.rollout import base_rollout

from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

# tunix's parameter names (as tunix's Llama3 / Qwen3 modules call them) -> our weights' fields.
_TOP_FIELDS = {"embedder.input_embedding": "embed", "final_norm.w": "final_norm", "lm_head.w": "lm_head"}
_LAYER_FIELDS = {
    "input_layernorm.w": "attn_norm",
    "attn.q_proj.w": "wq",
    "attn.k_proj.w": "wk",
    "attn.v_proj.w": "wv",
    "attn.o_proj.w": "wo",
    "attn.q_norm.w": "q_norm",
    "attn.k_norm.w": "k_norm",
    "post_attention_layernorm.w": "mlp_norm",
    "mlp.gate_proj.kernel": "w_gate",
    "mlp.up_proj.kernel": "w_up",
    "mlp.down_proj.kernel": "w_down",
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


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


def to_jaxserve_params(flat: Mapping[str, jax.Array]) -> dict[str, Any]:
    """tunix's parameter names -> our field-named tree (layers stacked [L, ...]: the per-layer layouts
    are the same), with device arrays only: tunix syncs weights under a transfer guard.

    Raises ValueError naming the parameter that has no place (LoRA parameters included)."""
    top: dict[str, jax.Array] = {}
    layers: dict[str, dict[int, jax.Array]] = {}
    for name, value in flat.items():
        if "lora" in name:
            raise ValueError(f"LoRA parameter {name}: merge the adapters into the weights before serving them")
        match = _LAYER_NAME.fullmatch(name)
        if name in _TOP_FIELDS:
            top[_TOP_FIELDS[name]] = value
        elif match is not None and match.group(2) in _LAYER_FIELDS:
            layers.setdefault(_LAYER_FIELDS[match.group(2)], {})[int(match.group(1))] = value
        else:
            raise ValueError(
                f"tunix parameter {name} has no counterpart in jaxserve's weights "
                f"(known: {sorted(_TOP_FIELDS)} and layers.N.{{{', '.join(sorted(_LAYER_FIELDS))}}})"
            )
    stacked = {}
    for field, per_layer in layers.items():
        if sorted(per_layer) != list(range(len(per_layer))):
            raise ValueError(f"layers of {field}: got indices {sorted(per_layer)}, expected 0..{len(per_layer) - 1}")
        stacked[field] = jnp.stack([per_layer[i] for i in range(len(per_layer))])
    return {**top, "layers": stacked}


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
    hf_config: the model's Hugging Face config (dict or object); derived for a tunix Llama3.
    llm_kwargs: `LLM` keywords (max_batch_size, compile_config, logprobs_mode, ...).
    """

    def __init__(
        self,
        rollout_actor: nnx.Module,
        tokenizer: Any,
        mesh: jax.sharding.Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        hf_config: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        if rollout_config is None:
            raise ValueError("JaxserveRollout needs the rollout_config (its lengths size the engine)")
        max_seq_len = max(
            rollout_config.kv_cache_size, rollout_config.max_prompt_length + rollout_config.max_tokens_to_generate
        )
        if hf_config is None:
            if not isinstance(rollout_actor, llama3.Llama3):
                raise TypeError(
                    f"cannot derive a Hugging Face config for a {type(rollout_actor).__name__}: pass hf_config"
                )
            hf_config = llama3_hf_config(rollout_actor.config, max_seq_len)
        self._tokenizer = tokenizer
        self._params = flat_params(nnx.state(rollout_actor, nnx.Param))
        options = {"logprobs_mode": "processed_logprobs", "max_seq_len": max_seq_len, "show_progress": False}
        self.llm = LLM.from_params(
            to_jaxserve_params(self._params), hf_config, _EngineTokenizer(tokenizer), **{**options, **llm_kwargs}
        )
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
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
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
        """Serves new parameter values: `params` (an NNX State, all or some of the actor's parameters)
        merged into the last full set, then `LLM.update_weights` (checked, cast, nothing recompiled)."""
        merged = {**self._params, **flat_params(params)}
        # On CPU tunix syncs under a guard against explicit host <-> device transfers; placing the weights
        # layer by layer indexes each layer out with a host integer, which that guard counts as one.
        with jax.transfer_guard("allow"):
            self.llm.update_weights(to_jaxserve_params(merged))
        self._params = merged

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
