"""A table of bad inputs, as a new user would try them, against the LLM API, the constructor, the configs,
the engine and model files (tests/models/test_bad_files.py sweeps those further): each raises the named
exception with a message that names the field (or the prompt, the message, the file), and afterwards a
greedy control request returns the tokens it returned before.

A tiny random Llama on the xla backend (its vocabulary has 160 tokens) and the one-character tokenizer.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.config import CompileConfig, KvCacheConfig, SchedulerConfig
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

VOCAB = 160
CONTROL_PROMPT = [5, 17, 42, 99, 3]
CONTROL = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
OK = [1, 2, 3]


@pytest.fixture(scope="module")
def llm(tiny_model, make_llm):
    buckets = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False)
    model = tiny_model("llama")
    llm = make_llm(model, compile_config=buckets)
    _MODELS[id(llm)] = model  # `llm.model` carries no weights: constructor cases build from this one
    return llm


_MODELS: dict[int, Any] = {}


def _the_llms_model(llm: LLM) -> Any:
    return _MODELS[id(llm)]


@pytest.fixture(scope="module")
def control_tokens(llm) -> list[int]:
    return llm.generate([CONTROL_PROMPT], CONTROL, use_tqdm=False)[0].outputs[0].token_ids


def sp(**fields) -> SamplingParams:
    return SamplingParams(**fields)


# (id, what the user does with `llm`, the exception, a substring of its message)
PROMPT_CASES = [
    ("prompt-none", lambda llm: llm.generate(None), TypeError, "prompt 0 is a NoneType"),
    ("prompt-int", lambda llm: llm.generate(5), TypeError, "prompt 0 is a int"),
    ("prompt-float", lambda llm: llm.generate(1.5), TypeError, "prompt 0 is a float"),
    ("prompt-bytes", lambda llm: llm.generate(b"hello"), TypeError, "decode it to a str"),
    ("prompt-bytearray", lambda llm: llm.generate(bytearray(b"hi")), TypeError, "bytearray"),
    ("prompt-set", lambda llm: llm.generate({1, 2}), TypeError, "prompt 0 is a set"),
    ("prompt-object", lambda llm: llm.generate(object()), TypeError, "prompt 0 is a object"),
    ("prompt-generator", lambda llm: llm.generate(x for x in [OK]), TypeError, "generator"),
    ("list-with-none", lambda llm: llm.generate(["ok", None]), TypeError, "prompt 1 is a NoneType"),
    ("list-with-int-and-str", lambda llm: llm.generate(["ok", 5]), TypeError, "prompt 1 is a int"),
    ("list-with-bytes", lambda llm: llm.generate(["ok", b"x"]), TypeError, "prompt 1 is a bytes"),
    ("float-token", lambda llm: llm.generate([1, 2.5, 3]), TypeError, "got 2.5 (float) at position 1"),
    ("bool-token", lambda llm: llm.generate([1, True]), TypeError, "at position 1"),
    ("nan-token", lambda llm: llm.generate([1, float("nan")]), TypeError, "at position 1"),
    ("nested-token-list", lambda llm: llm.generate([[1, [2]]]), TypeError, "prompt 0: token ids must be ints"),
    ("str-token-in-ids", lambda llm: llm.generate([[1, "a"]]), TypeError, "at position 1"),
    ("none-token-in-ids", lambda llm: llm.generate([[1, None]]), TypeError, "at position 1"),
    ("negative-token", lambda llm: llm.generate([1, -1]), ValueError, "prompt token ids must be ints in [0, 159]"),
    ("token-at-vocab", lambda llm: llm.generate([1, VOCAB]), ValueError, "[0, 159]"),
    ("token-2**40", lambda llm: llm.generate([1, 2**40]), ValueError, "[0, 159]"),
    ("numpy-huge-token", lambda llm: llm.generate(np.array([1, 2**40])), ValueError, "[0, 159]"),
    ("numpy-float-array", lambda llm: llm.generate(np.array([1.0, 2.0])), TypeError, "integer dtype"),
    ("numpy-2d-float", lambda llm: llm.generate(np.ones((2, 2))), TypeError, "integer dtype"),
    ("numpy-3d", lambda llm: llm.generate([np.ones((1, 2, 2), int)]), TypeError, "must be 1-D"),
    ("numpy-bool-array", lambda llm: llm.generate(np.array([True, False])), TypeError, "integer dtype"),
    ("empty-string", lambda llm: llm.generate(""), ValueError, "prompt is empty"),
    ("empty-token-list", lambda llm: llm.generate([[]]), ValueError, "prompt is empty"),
    ("empty-numpy", lambda llm: llm.generate(np.array([], np.int32)), ValueError, "prompt is empty"),
    ("second-prompt-bad", lambda llm: llm.generate([OK, [VOCAB + 1]]), ValueError, "prompt 1:"),
    (
        "dict-no-keys",
        lambda llm: llm.generate({"text": "hi"}),
        ValueError,
        "exactly one of ['prompt',",
    ),
    ("dict-both-keys", lambda llm: llm.generate({"prompt": "a", "prompt_token_ids": OK}), ValueError, "exactly one"),
    (
        "dict-extra-key",
        lambda llm: llm.generate({"prompt": "a", "multi_modal_data": {}}),
        ValueError,
        "multi_modal_data",
    ),
    ("dict-prompt-not-str", lambda llm: llm.generate({"prompt": 5}), TypeError, "'prompt' must be a str"),
    ("dict-prompt-ids-str", lambda llm: llm.generate({"prompt_token_ids": "abc"}), TypeError, "'prompt_token_ids'"),
    ("dict-prompt-ids-int", lambda llm: llm.generate({"prompt_token_ids": 5}), TypeError, "'prompt_token_ids'"),
    ("dict-ids-out-of-vocab", lambda llm: llm.generate({"prompt_token_ids": [VOCAB]}), ValueError, "[0, 159]"),
    ("dict-in-list-bad", lambda llm: llm.generate([{"prompt": "a"}, {"x": 1}]), ValueError, "prompt 1"),
    ("too-long-prompt-dict", lambda llm: llm.generate({"prompt_token_ids": [1.5]}), TypeError, "position 0"),
    ("stream-none", lambda llm: llm.stream(None), TypeError, "prompt 0 is a NoneType"),
    ("stream-bytes", lambda llm: llm.stream(b"x"), TypeError, "bytes"),
    ("stream-bad-token", lambda llm: llm.stream([VOCAB]), ValueError, "[0, 159]"),
    ("stream-bad-params", lambda llm: llm.stream(OK, {"max_tokens": 2}), TypeError, "sampling_params must be"),
]

PARAMS_CASES = [
    ("params-dict", lambda llm: llm.generate(OK, {"max_tokens": 4}), TypeError, "sampling_params must be"),
    ("params-list-length", lambda llm: llm.generate([OK, OK], [CONTROL]), ValueError, "got 1 sampling_params for 2"),
    ("params-list-with-dict", lambda llm: llm.generate([OK], [{"n": 1}]), TypeError, "sampling_params must be"),
    ("params-int", lambda llm: llm.generate(OK, 5), TypeError, "sampling_params must be"),
    ("stop-id-outside-vocab", lambda llm: llm.generate(OK, sp(stop_token_ids=[VOCAB])), ValueError, "stop_token_ids"),
    ("stop-id-2**31", lambda llm: llm.generate(OK, sp(stop_token_ids=[2**31])), ValueError, "stop_token_ids"),
    ("stop-id-2**40", lambda llm: sp(stop_token_ids=[2**40], min_tokens=1), ValueError, "stop_token_ids"),
    ("stop-ids-bare-int", lambda llm: sp(stop_token_ids=5), ValueError, "stop_token_ids"),
    ("stop-ids-str", lambda llm: sp(stop_token_ids="5"), ValueError, "stop_token_ids"),
    ("stop-ids-float", lambda llm: sp(stop_token_ids=[1.0]), ValueError, "stop_token_ids"),
    ("stop-ids-negative", lambda llm: sp(stop_token_ids=[-1]), ValueError, "stop_token_ids"),
    ("stop-int", lambda llm: sp(stop=5), ValueError, "stop"),
    ("stop-empty-string", lambda llm: sp(stop=[""]), ValueError, "stop"),
    ("stop-list-of-ints", lambda llm: sp(stop=[3]), ValueError, "stop"),
    ("stop-bytes", lambda llm: sp(stop=b"x"), ValueError, "stop"),
    ("top-k-2**40", lambda llm: sp(top_k=2**40), ValueError, "top_k"),
    ("top-k-minus-2", lambda llm: sp(top_k=-2), ValueError, "top_k"),
    ("top-k-float", lambda llm: sp(top_k=2.0), ValueError, "top_k"),
    ("top-k-str", lambda llm: sp(top_k="5"), ValueError, "top_k"),
    ("top-k-bool", lambda llm: sp(top_k=True), ValueError, "top_k"),
    ("n-zero", lambda llm: sp(n=0), ValueError, "n must be"),
    ("n-million", lambda llm: sp(n=10**6), ValueError, "n must be"),
    ("n-float", lambda llm: sp(n=2.0), ValueError, "n must be"),
    ("n-str", lambda llm: sp(n="2"), ValueError, "n must be"),
    ("temperature-negative", lambda llm: sp(temperature=-0.1), ValueError, "temperature"),
    ("temperature-nan", lambda llm: sp(temperature=float("nan")), ValueError, "temperature"),
    ("temperature-inf", lambda llm: sp(temperature=float("inf")), ValueError, "temperature"),
    ("temperature-str", lambda llm: sp(temperature="hot"), ValueError, "temperature"),
    ("temperature-huge", lambda llm: sp(temperature=1e39), ValueError, "temperature"),
    ("top-p-zero", lambda llm: sp(top_p=0.0), ValueError, "top_p"),
    ("top-p-above-one", lambda llm: sp(top_p=1.5), ValueError, "top_p"),
    ("top-p-str", lambda llm: sp(top_p="1"), ValueError, "top_p"),
    ("min-p-negative", lambda llm: sp(min_p=-0.1), ValueError, "min_p"),
    ("min-p-above-one", lambda llm: sp(min_p=1.1), ValueError, "min_p"),
    ("repetition-zero", lambda llm: sp(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    ("repetition-negative", lambda llm: sp(repetition_penalty=-1.0), ValueError, "repetition_penalty"),
    ("presence-3", lambda llm: sp(presence_penalty=3.0), ValueError, "presence_penalty"),
    ("frequency-minus-3", lambda llm: sp(frequency_penalty=-3.0), ValueError, "frequency_penalty"),
    ("frequency-nan", lambda llm: sp(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
    ("seed-str", lambda llm: sp(seed="x"), ValueError, "seed"),
    ("seed-float", lambda llm: sp(seed=1.5), ValueError, "seed"),
    ("seed-bool", lambda llm: sp(seed=True), ValueError, "seed"),
    ("max-tokens-zero", lambda llm: sp(max_tokens=0), ValueError, "max_tokens"),
    ("max-tokens-negative", lambda llm: sp(max_tokens=-5), ValueError, "max_tokens"),
    ("max-tokens-2**31", lambda llm: sp(max_tokens=2**31), ValueError, "max_tokens"),
    ("max-tokens-float", lambda llm: sp(max_tokens=16.0), ValueError, "max_tokens"),
    ("max-tokens-str", lambda llm: sp(max_tokens="16"), ValueError, "max_tokens"),
    ("min-tokens-above-max", lambda llm: sp(max_tokens=4, min_tokens=5), ValueError, "min_tokens"),
    ("min-tokens-negative", lambda llm: sp(min_tokens=-1), ValueError, "min_tokens"),
    ("min-tokens-2**40", lambda llm: sp(max_tokens=None, min_tokens=2**40), ValueError, "min_tokens"),
    ("logprobs-21", lambda llm: sp(logprobs=21), ValueError, "logprobs"),
    ("logprobs-negative", lambda llm: sp(logprobs=-1), ValueError, "logprobs"),
    ("logprobs-bool", lambda llm: sp(logprobs=True), ValueError, "logprobs"),
    ("prompt-logprobs-21", lambda llm: sp(prompt_logprobs=21), ValueError, "prompt_logprobs"),
    ("prompt-logprobs-uncompiled", lambda llm: llm.generate(OK, sp(prompt_logprobs=1)), ValueError, "prompt_logprobs"),
    ("penalty-uncompiled", lambda llm: llm.generate(OK, sp(frequency_penalty=0.5)), ValueError, "penalty_variants"),
    ("ignore-eos-int", lambda llm: sp(ignore_eos=1), ValueError, "ignore_eos"),
    ("skip-special-str", lambda llm: sp(skip_special_tokens="no"), ValueError, "skip_special_tokens"),
    (
        "too-many-banned-ids",
        lambda llm: llm.generate(OK, sp(min_tokens=1, stop_token_ids=list(range(9)))),
        ValueError,
        "min_tokens can hold back at most 8",
    ),
    ("unknown-field", lambda llm: sp(best_of=2), TypeError, "best_of"),
]


def chat(messages):
    return lambda llm: llm.chat(messages)


CHAT_CASES = [
    ("chat-dict", chat({"role": "user", "content": "hi"}), TypeError, "a single message goes in a list"),
    ("chat-str", chat("hello"), TypeError, "messages must be a list"),
    ("chat-none", chat(None), TypeError, "messages must be a list"),
    ("chat-int", chat(5), TypeError, "messages must be a list"),
    ("chat-empty", chat([]), ValueError, "messages"),
    ("chat-list-of-str", chat(["hello"]), TypeError, "messages[0] must be a dict"),
    ("chat-missing-role", chat([{"content": "hi"}]), ValueError, "messages[0]"),
    ("chat-missing-content", chat([{"role": "user"}]), ValueError, "messages[0] (user) has no 'content'"),
    ("chat-unknown-role", chat([{"role": "bot", "content": "hi"}]), ValueError, "messages[0].role must be one of"),
    ("chat-role-int", chat([{"role": 1, "content": "hi"}]), ValueError, "messages[0].role"),
    ("chat-content-int", chat([{"role": "user", "content": 5}]), ValueError, "messages[0].content"),
    ("chat-content-none", chat([{"role": "user", "content": None}]), ValueError, "messages[0].content"),
    ("chat-content-dict", chat([{"role": "user", "content": {"text": "hi"}}]), ValueError, "messages[0].content"),
    (
        "chat-image-part",
        chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ValueError,
        "only text parts",
    ),
    ("chat-part-without-type", chat([{"role": "user", "content": [{"text": "hi"}]}]), ValueError, "content[0]"),
    ("chat-part-str", chat([{"role": "user", "content": ["hi"]}]), ValueError, "content[0]"),
    (
        "chat-text-part-not-str",
        chat([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        ValueError,
        "content[0]",
    ),
    ("chat-second-bad", chat([{"role": "user", "content": "hi"}, "x"]), TypeError, "messages[1]"),
    (
        "chat-second-conversation-bad",
        chat([[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]]),
        ValueError,
        "conversation 1:",
    ),
]


def construct(model_source=None, **kwargs):
    def build(llm):
        from jaxserve.tokenizer import Tokenizer

        source = _the_llms_model(llm) if model_source is None else model_source
        options = dict(
            tokenizer=llm.tokenizer if "tokenizer" not in kwargs else kwargs.pop("tokenizer"),
            attention_backend="xla",
            show_progress=False,
        )
        assert Tokenizer  # the tokenizer argument may also be a path
        return LLM(source, **{**options, **kwargs})

    return build


ONE_DEVICE_TRAINER = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))  # a trainer's axis names

CONSTRUCTOR_CASES = [
    ("max-batch-size-zero", construct(max_batch_size=0), ValueError, "max_batch_size must be an int >= 1"),
    ("max-batch-size-negative", construct(max_batch_size=-3), ValueError, "max_batch_size"),
    ("max-batch-size-str", construct(max_batch_size="2"), TypeError, "max_batch_size"),
    ("max-batch-size-bool", construct(max_batch_size=True), TypeError, "max_batch_size"),
    ("max-batch-size-float", construct(max_batch_size=2.0), TypeError, "max_batch_size"),
    ("tp-zero", construct(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be an int >= 1"),
    ("tp-str", construct(tensor_parallel_size="2"), TypeError, "tensor_parallel_size"),
    ("tp-float", construct(tensor_parallel_size=2.0), TypeError, "tensor_parallel_size"),
    ("tp-too-many-devices", construct(tensor_parallel_size=64), ValueError, "needs 64 devices"),
    ("mesh-str", construct(mesh="data,model"), TypeError, "mesh must be a jax.sharding.Mesh"),
    ("mesh-without-model-axis", construct(mesh=ONE_DEVICE_TRAINER), ValueError, "no 'model' axis"),
    ("mesh-axes-unknown", construct(mesh=ONE_DEVICE_TRAINER, mesh_axes={"model": "x"}), ValueError, "'x' is not"),
    ("mesh-axes-without-mesh", construct(mesh_axes={"model": "tp"}), ValueError, "pass mesh= too"),
    (
        "tp-disagrees-with-mesh",
        construct(mesh=ONE_DEVICE_TRAINER, mesh_axes={"model": "tp"}, tensor_parallel_size=2),
        ValueError,
        "tensor_parallel_size=2 disagrees with the mesh, whose tensor-parallel axis has 1 devices",
    ),
    ("llm-seed-str", construct(seed="x"), TypeError, "seed must be an int"),
    ("llm-seed-float", construct(seed=1.5), TypeError, "seed must be an int"),
    ("llm-seed-none", construct(seed=None), TypeError, "seed must be an int"),
    ("dtype-unknown", construct(dtype="fp8"), ValueError, "dtype must be one of"),
    ("dtype-none", construct(dtype=None), ValueError, "dtype must be one of"),
    ("backend-unknown", construct(attention_backend="cuda"), ValueError, "attention_backend must be one of"),
    ("backend-pallas-on-cpu", construct(attention_backend="pallas"), ValueError, "needs a GPU"),
    ("model-empty", construct(model_source=""), ValueError, "model must name a model"),
    ("model-blank", construct(model_source="   "), ValueError, "model must name a model"),
    ("model-int", construct(model_source=5), TypeError, "model must be a name, a path or a LoadedModel"),
    ("model-none", construct(model_source=["model"]), TypeError, "model must be"),
    ("model-missing-path", construct(model_source="/nonexistent/dir/model"), FileNotFoundError, "/nonexistent"),
    ("tokenizer-int", construct(tokenizer=5), TypeError, "tokenizer must be a Tokenizer or a path"),
    ("tokenizer-missing-path", construct(tokenizer="/nonexistent/tok"), FileNotFoundError, "/nonexistent/tok"),
    ("show-progress-str", construct(show_progress="yes"), TypeError, "show_progress"),
    ("max-num-tokens-zero", construct(max_num_tokens=0), ValueError, "max_num_tokens"),
    ("max-num-tokens-str", construct(max_num_tokens="8"), ValueError, "max_num_tokens"),
    ("max-seq-len-one", construct(max_seq_len=1), ValueError, "max_seq_len"),
    ("max-seq-len-float", construct(max_seq_len=64.0), ValueError, "max_seq_len"),
    ("kv-config-dict", construct(kv_cache_config={"block_size": 16}), ValueError, "kv_cache must be a KvCacheConfig"),
    ("scheduler-config-str", construct(scheduler_config="fcfs"), ValueError, "scheduler must be a SchedulerConfig"),
    ("compile-config-int", construct(compile_config=5), ValueError, "compile must be a CompileConfig"),
    ("block-size-3", lambda llm: KvCacheConfig(block_size=3), ValueError, "block_size must be a power of two"),
    ("memory-fraction-0", lambda llm: KvCacheConfig(free_memory_fraction=0.0), ValueError, "free_memory_fraction"),
    ("kv-max-tokens-0", lambda llm: KvCacheConfig(max_tokens=0), ValueError, "max_tokens"),
    ("policy-str", lambda llm: SchedulerConfig(capacity_policy="fifo"), ValueError, "capacity_policy"),
    ("decode-sizes-empty", lambda llm: CompileConfig(decode_batch_sizes=()), ValueError, "decode_batch_sizes"),
    ("token-buckets-zero", lambda llm: CompileConfig(token_buckets=(0, 16)), ValueError, "token_buckets"),
    (
        "kv-too-small",
        construct(kv_cache_config=KvCacheConfig(max_tokens=16), max_seq_len=128),
        ValueError,
        "max_seq_len",
    ),
]


def bad_model(kind: str):
    """A model path of a bad kind, written when the case runs."""

    def build(llm):
        import json
        import tempfile
        from pathlib import Path

        from jaxserve.models.hub import default_model_path

        root = Path(tempfile.mkdtemp(prefix="bad-model-"))
        if kind in ("gguf-empty", "gguf-not-gguf", "gguf-truncated"):
            path = root / "model.gguf"
            head = default_model_path().read_bytes()[:4096] if kind == "gguf-truncated" else b""
            path.write_bytes({"gguf-empty": b"", "gguf-not-gguf": b"hello world, not gguf"}.get(kind, head))
        else:
            path = root
            config = dict(llm.model.hf_config)
            text = "{not json" if kind == "config-not-json" else json.dumps({**config, "num_hidden_layers": "thirty"})
            (root / "config.json").write_text(text)
        return construct(model_source=str(path))(llm)

    return build


MODEL_FILE_CASES = [
    ("gguf-empty", bad_model("gguf-empty"), ValueError, "empty file (0 bytes), not a GGUF file"),
    ("gguf-not-gguf", bad_model("gguf-not-gguf"), ValueError, "not a GGUF file"),
    ("gguf-truncated", bad_model("gguf-truncated"), ValueError, "truncated GGUF file"),
    ("config-not-json", bad_model("config-not-json"), ValueError, "config.json: not valid JSON"),
    ("config-wrong-type", bad_model("config-wrong-type"), ValueError, "num_hidden_layers must be an int >= 1"),
]

CASES = PROMPT_CASES + PARAMS_CASES + CHAT_CASES + CONSTRUCTOR_CASES + MODEL_FILE_CASES


def test_the_table_has_at_least_150_bad_inputs():
    assert len(CASES) >= 150 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("do", "error", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_a_clear_error_and_the_engine_serves_on(llm, control_tokens, do, error, names):
    with pytest.raises(error) as raised:
        do(llm)
    assert names in str(raised.value), str(raised.value)
    engine = llm.engine
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0, "the bad input queued something"
    assert llm.generate([CONTROL_PROMPT], CONTROL, use_tqdm=False)[0].outputs[0].token_ids == control_tokens
