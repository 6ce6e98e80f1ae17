"""Step variants: the static choices of a compiled step besides its shape (`StepVariant`: the sampler mode,
penalties, prompt logprobs), chosen per step on the host so the device never branches, and `StepConfig`,
the frozen key of the compiled table: the bucket table and the variants compiled, enumerated by one
function each (`forwards`, `samplers`, `compiled_steps`) for warmup, the capacity probe and `run`.

Host policy: no jax here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

import numpy as np

from jaxserve.buckets import Bucket, BucketTable
from jaxserve.config import EngineConfig
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow

# EOS and stop ids a row may ban while it has fewer than min_tokens outputs.
MAX_BANNED_TOKENS = 8


class SamplerMode(Enum):
    """How the step's sampler cuts the filters (jaxserve/sampler.py): chosen per step on the host, so
    the device never branches."""

    GREEDY = "greedy"  # every row greedy, none asks for top logprobs: an argmax (and the tokens' logprobs)
    CANDIDATES = "candidates"  # filters from each row's NUM_CANDIDATES best logits
    SORTED = "sorted"  # filters from a sort of the whole vocabulary (top-p without a small top-k)


# Logits per row the CANDIDATES mode keeps: a top-k up to this many (Hugging Face's default is 50) and
# a top-p that comes with one need no sort of the vocabulary.
NUM_CANDIDATES = 64


@dataclass(frozen=True, slots=True)
class StepVariant:
    """The static choices of a step besides its shape, chosen per step on the host (`choose_variant`).
    The runner runs a step as one or two compiled calls: the forward, per (bucket, prompt_logprobs), which
    also samples greedily, and, unless the step is `greedy_in_forward`, the sampler, per (rows, sampler,
    penalties).

    sampler: how the sampler cuts the filters (`SamplerMode`); every mode returns the sampled tokens'
        logprobs, every mode but GREEDY the top logprobs too.
    penalties: the step receives each row's token history for the repetition / presence / frequency
        penalties.
    prompt_logprobs: the step also scores every flat token's next prompt token (token buckets only).
    """

    sampler: SamplerMode = SamplerMode.CANDIDATES
    penalties: bool = False
    prompt_logprobs: bool = False

    @property
    def greedy_in_forward(self) -> bool:
        """A GREEDY step without penalties takes the forward's own greedy sample: no sampler call."""
        return self.sampler is SamplerMode.GREEDY and not self.penalties

    def __str__(self) -> str:
        extras = [name for name in ("penalties", "prompt_logprobs") if getattr(self, name)]
        return "+".join([self.sampler.value, *extras])


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


# What a request's parameters tell the variant choice, one record per row (the step inputs pack them into each
# request's sampling record, `step_inputs.SAMPLING_RECORD`, beside its top_k column).
VARIANT_FACTS = np.dtype(
    [
        ("greedy", np.bool_),
        ("penalty", np.bool_),
        ("top_logprobs", np.bool_),
        ("partial_top_p", np.bool_),  # top_p < 1, compared in double precision as SamplingParams holds it
        ("scores", np.bool_),  # asks for prompt logprobs (whether a chunk scores one is per row)
    ]
)


def variant_facts(params: SamplingParams) -> tuple[bool, ...]:
    """The request's VARIANT_FACTS."""
    return (
        params.is_greedy,
        has_penalty(params),
        bool(params.logprobs),
        params.top_p < 1.0,
        params.scored_prompt_start is not None,
    )


@dataclass(frozen=True, slots=True)
class StepConfig:
    """What fixes the compiled steps' inputs besides the model: the buckets, the variants compiled at
    warmup, and the padding ids. `forwards` and `samplers` enumerate what warmup compiles;
    `compiled_steps` the (bucket, variant) steps they serve, `largest_step` the capacity probe's.

    vocab_size: the out-of-vocabulary id that pads banned tokens and token histories.
    max_seq_len: the width of a token history.
    kv_groups: the KV layout's number of layer groups (`jaxserve/kv_layout.py`): a block table row holds a page
        per group for each block, and the slot mapping a row per group.
    """

    buckets: BucketTable
    vocab_size: int
    max_seq_len: int
    penalty_variants: bool = False
    prompt_logprob_variants: bool = False
    kv_groups: int = 1
    lora: bool = False  # the steps carry each token's adapter slot (StepInputs.lora_slots)

    @classmethod
    def from_config(
        cls, config: EngineConfig, vocab_size: int, attention_backend: str | None = None, kv_groups: int = 1
    ) -> StepConfig:
        compile_config = config.compile
        return cls(
            buckets=BucketTable.from_config(config, attention_backend),
            vocab_size=vocab_size,
            max_seq_len=config.max_seq_len,
            penalty_variants=compile_config.penalty_variants,
            prompt_logprob_variants=compile_config.prompt_logprobs,
            kv_groups=kv_groups,
            lora=config.lora is not None,
        )

    def forwards(self) -> tuple[tuple[Bucket, bool], ...]:
        """Every (bucket, prompt_logprobs) forward compiled at warmup: prompt-logprobs forwards for token
        buckets when compiled."""
        scoring = (False, True) if self.prompt_logprob_variants else (False,)
        return tuple(
            (bucket, flag) for bucket in self.buckets.buckets for flag in scoring if not (flag and bucket.decode_only)
        )

    def samplers(self) -> tuple[tuple[int, SamplerMode, bool], ...]:
        """Every (rows, sampler mode, penalties) sampler compiled at warmup: one per row count of the
        buckets, sampler mode and penalty choice, but GREEDY without penalties, which the forwards do
        (`StepVariant.greedy_in_forward`)."""
        rows = sorted({bucket.num_seqs for bucket in self.buckets.buckets})
        penalties = (False, True) if self.penalty_variants else (False,)
        return tuple(
            (r, mode, p)
            for r, mode, p in itertools.product(rows, SamplerMode, penalties)
            if not StepVariant(mode, p).greedy_in_forward
        )

    def variants(self, bucket: Bucket) -> tuple[StepVariant, ...]:
        """Every variant a step of this bucket can run as."""
        scoring = {flag for b, flag in self.forwards() if b == bucket}
        samplers = [(SamplerMode.GREEDY, False)]  # the forward's own
        samplers += [(mode, p) for rows, mode, p in self.samplers() if rows == bucket.num_seqs]
        return tuple(StepVariant(mode, p, flag) for flag in sorted(scoring) for mode, p in samplers)

    def compiled_steps(self) -> tuple[tuple[Bucket, StepVariant], ...]:
        """Every (bucket, variant) the compiled forwards and samplers serve."""
        return tuple((bucket, variant) for bucket in self.buckets.buckets for variant in self.variants(bucket))

    def largest_step(self) -> tuple[Bucket, StepVariant]:
        """The step with the largest activations, which the capacity probe runs: the most tokens, then
        rows, a token bucket over a decode one; prompt logprobs and penalties when compiled, the sorting
        sampler."""
        table = self.buckets
        bucket = max(table.buckets, key=lambda b: (b.num_tokens, b.num_seqs, not b.decode_only, table.table_width(b)))
        scoring = self.prompt_logprob_variants and not bucket.decode_only
        return bucket, StepVariant(SamplerMode.SORTED, self.penalty_variants, scoring)

    def choose_variant(self, batch: ScheduledBatch, records: np.ndarray, samples: np.ndarray) -> StepVariant:
        """The variant a batch needs: penalties or prompt logprobs when a row asks, and the cheapest sampler
        mode that is exact for every row. records: the rows' VARIANT_FACTS and top_k (structured, one per row);
        samples: which rows sample (the logits of the others are unused)."""
        prompt_logprobs = any(_scores_prompt(batch.rows[b]) for b in np.flatnonzero(records["scores"]))
        penalties = bool((records["penalty"] & samples).any())
        return StepVariant(self._sampler_mode(records, samples), penalties, prompt_logprobs)

    def sampler_mode(self, params: list[SamplingParams]) -> SamplerMode:
        """GREEDY when every row is greedy and none wants top logprobs (the sampled token's own logprob,
        `logprobs=0` or `token_logprobs`, comes with every mode); CANDIDATES when every sampling row's
        filters fit NUM_CANDIDATES logits; else SORTED."""
        dtype = np.dtype([*VARIANT_FACTS.descr, ("top_k", np.int32)])
        records = np.array([(*variant_facts(p), p.top_k or 0) for p in params], dtype=dtype)
        return self._sampler_mode(records, np.ones(len(records), dtype=np.bool_))

    def _sampler_mode(self, records: np.ndarray, samples: np.ndarray) -> SamplerMode:
        """sampler_mode over the records of the rows where `samples` (masks over the fields, not a copy of the
        records: selecting rows of a structured array costs a copy of every field)."""
        sampling = samples & ~records["greedy"]
        if not sampling.any() and not (samples & records["top_logprobs"]).any():
            return SamplerMode.GREEDY
        top_k = records["top_k"]  # 0: no top-k; one of the vocabulary's size or more is none either
        limited = (top_k > 0) & (top_k < self.vocab_size)
        # Without a top-k, min-p alone needs only the maximum; a top-p below 1 needs the whole mass.
        fits = np.where(limited, top_k <= NUM_CANDIDATES, ~records["partial_top_p"])
        return SamplerMode.CANDIDATES if fits[sampling].all() else SamplerMode.SORTED

    def check_supported(self, params: SamplingParams, num_eos_tokens: int) -> None:
        """Raises a ValueError naming the knob when a request needs a variant this engine does not compile."""
        if params.prompt_logprobs is not None and not self.prompt_logprob_variants:
            raise ValueError("prompt_logprobs needs CompileConfig(prompt_logprobs=True) at engine start")
        if has_penalty(params) and not self.penalty_variants:
            raise ValueError(
                "repetition/presence/frequency penalties need CompileConfig(penalty_variants=True) at engine start"
            )
        if params.min_tokens and num_eos_tokens + len(params.stop_token_ids) > MAX_BANNED_TOKENS:
            raise ValueError(
                f"min_tokens can hold back at most {MAX_BANNED_TOKENS} EOS / stop token ids; "
                f"got {num_eos_tokens + len(params.stop_token_ids)}"
            )


def _scores_prompt(row: ScheduledRow) -> bool:
    """Whether the row's chunk scores a prompt position: it holds a token at or after scored start - 1."""
    scored_start = row.request.sampling_params.scored_prompt_start
    return row.is_prefill and scored_start is not None and row.start + row.num_tokens >= scored_start
