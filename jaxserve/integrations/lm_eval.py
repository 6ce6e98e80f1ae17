"""An lm-evaluation-harness model served by jaxserve, registered as "jaxserve" (`lm_eval.api.model.TemplateLM`).

    import lm_eval
    import jaxserve.integrations.lm_eval  # registers the model

    results = lm_eval.simple_evaluate(model="jaxserve", model_args="pretrained=path/to/hf_dir,dtype=float32",
                                      tasks=["hellaswag"])

or from the shell, `python -m jaxserve.integrations.lm_eval --model jaxserve --model_args pretrained=...`
(lm-eval's own command line, with the model registered; `lm_eval` alone cannot find models outside its
package). An `LLM` built beforehand can be passed too: `simple_evaluate(model=JaxserveLM(llm), ...)`.

- Each call submits its whole request list to the engine at once (one `LLM.generate`): continuous
  batching orders the work, so lm-eval's `batch_size` is accepted and ignored.
- `loglikelihood`: the prompt is context + continuation, scored from the continuation on
  (`SamplingParams(prompt_logprobs=1, prompt_logprobs_start=len(context))`), so the choices of one
  question take their context's full KV blocks from the prefix cache and compute it once.
  `is_greedy`: every continuation token is the top-1 (rank 1) of its position.
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows (`max_length - 2` tokens of prediction,
  the prefix token first), every window of every document in one call, summed per document.
- `generate_until`: `until` (plus the EOS text) -> `stop`, `max_gen_toks` -> `max_tokens`; greedy unless
  `do_sample` (then `temperature`, `top_p`, `top_k`, `seed` as given). Contexts longer than
  `max_length - max_gen_toks` are cut on the left, as lm-eval's other backends do.

lm-eval builds its model anew for every `simple_evaluate`; a `JaxserveLM` built from the same model and
keywords as the previous one takes that one's engine (one is kept: a different model closes it;
`release_engine()` closes it too).

Needs lm-eval (`pip install -e ".[eval]"`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxserve.config import CompileConfig
from jaxserve.llm import LLM
from jaxserve.models.hub import DEFAULT_MODEL
from jaxserve.sampling import RequestOutput, SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for its hf and vllm models
# generate_until keywords passed on to SamplingParams when do_sample is set.
SAMPLING_KWARGS = ("temperature", "top_p", "top_k", "min_p", "seed")

# One scored request: the prompt, and the first position whose token is scored.
Scored = tuple[list[int], int]


@register_model("jaxserve")
class JaxserveLM(TemplateLM):
    """lm-eval's model over an `LLM`; see the module docstring.

    pretrained: what `LLM(model)` takes (a name, a Hugging Face directory, a .gguf file, ...) or an `LLM`
        (built with `CompileConfig(prompt_logprobs=True)` for the log-likelihood requests).
    dtype, max_seq_len, max_num_tokens, seed and other `LLM` keywords (llm_kwargs) build the engine; the
        engine is compiled with its prompt-logprobs steps. max_length: lm-eval's name for max_seq_len.
    max_batch_size: sequences per engine step (lm-eval passes its own --max_batch_size here).
    batch_size, device: lm-eval's, accepted and ignored (continuous batching; jax's default device).
    max_gen_toks: max_tokens of generate_until requests that give no max_gen_toks.
    add_bos_token: None encodes with the tokenizer's own special tokens (as lm-eval's hf model), True /
        False forces it. prefix_token_id: the token an empty context stands for (None: BOS, else EOS).
    """

    def __init__(
        self,
        pretrained: str | os.PathLike | LLM = DEFAULT_MODEL,
        *,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        batch_size: Any = None,
        device: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__()
        del batch_size, device  # see the docstring
        if isinstance(pretrained, LLM):
            if llm_kwargs or max_length is not None:
                raise ValueError(f"pass LLM keywords when building the LLM, not with one: got {sorted(llm_kwargs)}")
            self.llm = pretrained
        else:
            if max_length is not None:
                llm_kwargs["max_seq_len"] = max_length
            compile_config = llm_kwargs.pop("compile_config", None) or CompileConfig()
            compile_config = dataclasses.replace(compile_config, prompt_logprobs=True)
            self.llm = _shared_llm(pretrained, compile_config=compile_config, **llm_kwargs)
        self.tokenizer = self.llm.tokenizer
        self._max_gen_toks = max_gen_toks
        self._add_bos_token = add_bos_token
        self._prefix_token_id = prefix_token_id

    # ---- what TemplateLM asks of a model ------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Tokens of one sequence: prompt and generated ones."""
        return self.llm.config.max_seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer.hf_tokenizer, "name_or_path", "jaxserve")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = True if self._add_bos_token is None else self._add_bos_token
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each continuation after its context, all in one `generate`."""
        longest = self.max_length - 1  # the engine generates at least one token
        scored = []
        for _key, context, continuation in requests:
            prompt = (context + continuation)[-longest:]
            scored.append((prompt, max(1, len(prompt) - len(continuation))))
        results = self._score(scored, disable_tqdm)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:  # rolling windows are cached per document by their caller
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 2,  # room for the window's context token and one generated token
                context_len=1,
            )
            document = [(None, *make_disjoint_window(window)) for window in rolling]
            windows.extend(document)
            counts.append(len(document))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, start = [], 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in scores[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params = [], []
        for context, gen_kwargs in (request.args for request in requests):
            sampling, max_tokens = self._generation_params(gen_kwargs, eos_text)
            max_tokens = min(max_tokens, self.max_length - 1)
            prompts.append(self.tok_encode(context)[-(self.max_length - max_tokens) :])
            params.append(sampling)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for request, output in zip(requests, outputs, strict=True):
            _raise_error(output)
            texts.append(output.outputs[0].text)
            self.cache_hook.add_partial("generate_until", request.args, texts[-1])
        return texts

    # ---- engine requests ----------------------------------------------------------------------

    def _score(self, scored: Sequence[Scored], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Sum of the logprobs of each prompt's tokens from its start on, and whether each was the top-1."""
        results: list[tuple[float, bool] | None] = [(0.0, True) if start >= len(p) else None for p, start in scored]
        todo = [i for i, result in enumerate(results) if result is None]  # an empty continuation scores 0
        params = [SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=scored[i][1]) for i in todo]
        outputs = self.llm.generate([scored[i][0] for i in todo], params, use_tqdm=not disable_tqdm)
        for i, output in zip(todo, outputs, strict=True):
            results[i] = _continuation_score(output, *scored[i])
        return [result for result in results if result is not None]

    def _generation_params(self, gen_kwargs: dict[str, Any], eos_text: str) -> tuple[SamplingParams, int]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks=self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text or None)
        max_tokens = int(kwargs.pop("max_gen_toks"))
        sampling = {name: kwargs[name] for name in SAMPLING_KWARGS if name in kwargs}
        if not kwargs.get("do_sample", False):
            sampling = {"temperature": 0.0}
        stop = [s for s in until if s]
        return SamplingParams(max_tokens=max_tokens, stop=stop, **sampling), max_tokens


# The engine of the last JaxserveLM built from a model name and keywords: lm-eval builds its model anew for
# every `simple_evaluate`, and a script or notebook that evaluates task after task would otherwise build
# (load, lay out, and load its compiled steps for) the same engine each time.
_last: tuple[tuple[str, str], LLM] | None = None


def _shared_llm(pretrained: str | os.PathLike, **llm_kwargs: Any) -> LLM:
    """The previous JaxserveLM's engine when it was built with the same model and keywords, else a new one
    (the previous engine is closed: one is kept at most); see `release_engine`."""
    global _last
    key = (os.fspath(pretrained), repr(sorted(llm_kwargs.items())))
    if _last is not None and _last[0] == key:
        return _last[1]
    release_engine()
    llm = LLM(pretrained, **llm_kwargs)
    _last = (key, llm)
    return llm


def release_engine() -> None:
    """Closes the engine kept for the next `JaxserveLM` with the same arguments (its device memory freed)."""
    global _last
    if _last is not None:
        _last[1].close()
        _last = None


def _continuation_score(output: RequestOutput, prompt: list[int], start: int) -> tuple[float, bool]:
    _raise_error(output)
    entries = output.prompt_logprobs
    if entries is None:
        raise RuntimeError(f"request {output.request_id} came back without prompt logprobs")
    chosen = [entries[p][token] for p, token in enumerate(prompt) if p >= start]  # type: ignore[index]
    return sum(c.logprob for c in chosen), all(c.rank == 1 for c in chosen)


def _raise_error(output: RequestOutput) -> None:
    if output.error is not None:
        raise RuntimeError(f"jaxserve could not serve request {output.request_id}: {output.error}")


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
