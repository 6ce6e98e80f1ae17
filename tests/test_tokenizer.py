"""Tokenizer wrapper, chat templates, incremental detokenization and stop strings.

Fast tests use a tiny byte-level BPE trained on the spot (non-ASCII characters split into several
tokens, which is what the incremental detokenizer must handle); slow ones compare the default
model's GGUF tokenizer with transformers' own GGUF tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, stop_holdback
from models import hub

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["The capital of France is Paris.", "hello world, hello there", "tokens and more tokens"] * 20


def _tiny_hf_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(autouse=True, params=["rust-stream", "python"])
def detokenizer_path(request, monkeypatch) -> str:
    """Every test runs on both detokenizer paths: the Rust DecodeStream and the Python fallback."""
    import jaxserve.tokenizer as tokenizer_module

    if request.param == "python":
        monkeypatch.setattr(tokenizer_module, "_rust_backend", lambda tokenizer: None)
    return request.param


def test_fast_tokenizers_take_the_stream_path(tok, detokenizer_path):
    detok = IncrementalDetokenizer(tok)
    assert (detok._stream is not None) == (detokenizer_path == "rust-stream")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    _tiny_hf_tokenizer(CHAT_TEMPLATE).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_source(tokenizer_dir)


def test_round_trip_and_ids(tok):
    ids = tok.encode("hello world")
    assert ids and tok.decode(ids) == "hello world"
    assert tok.vocab_size == len(tok.hf_tokenizer) >= 256
    assert tok.eos_token_ids == (2, 0)  # tokenizer's <|im_end|> first, then generation_config.json
    assert tok.bos_token_id == 1


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=40))
def test_decode_inverts_encode(tok, text):
    assume("<|" not in text)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _stream(tok: Tokenizer, ids: list[int], prompt_ids: tuple[int, ...] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_multibyte_characters_are_held_back_until_complete(tok):
    text = "héllo 世界 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[:2]).endswith("\ufffd")  # "é" really is split across byte tokens
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert "" in deltas[:-1] and not any("\ufffd" in d for d in deltas)


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=30), st.text(min_size=1, max_size=30))
def test_streamed_deltas_add_up_to_the_text(tok, prompt, completion):
    assume("\ufffd" not in completion and "<|" not in prompt + completion)
    prompt_ids = tuple(tok.encode(prompt, add_special_tokens=False))
    deltas = _stream(tok, tok.encode(completion, add_special_tokens=False), prompt_ids)
    assert "".join(deltas) == completion
    assert not any("\ufffd" in d for d in deltas)


def test_leading_space_rules_keep_their_context():
    # SentencePiece-style decoding drops the "▁" (space) of the first token it sees, so a token
    # decoded alone loses its space; the detokenizer must decode it next to its predecessor.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))
    ids = tok.encode("hello world hello there")
    assert tok.decode(ids[-1:]) == tok.decode(ids[-1:]).lstrip()  # alone, a token has no leading space
    assert "".join(_stream(tok, ids)) == "hello world hello there"
    prompt = tuple(tok.encode("The capital"))
    assert "".join(_stream(tok, tok.encode("of France"), prompt)) == " of France"


def test_flush_releases_an_incomplete_character(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed and streamed.startswith("ok")
    assert detok.flush().endswith("\ufffd")


def test_special_tokens_are_skipped_in_deltas(tok):
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_ids[0]]
    assert "".join(_stream(tok, ids)) == "hello"


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == tok.encode(expected, add_special_tokens=False)
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix("<|im_start|>assistant\n")


def test_missing_chat_template_is_a_clear_error(tmp_path):
    _tiny_hf_tokenizer(None).save_pretrained(tmp_path)
    tok = Tokenizer.from_source(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    assert tok.decode(ids) == "hi"


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_source(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="the model carries no tokenizer"):
        Tokenizer.from_source(None)


# --- stop strings ---------------------------------------------------------------------------------


def test_find_stop_examples():
    assert find_stop("Paris. The end", ["."]) == 5
    assert find_stop("a STOP b END", ["END", "STOP"]) == 2
    assert find_stop("nothing here", ["STOP", ""]) is None
    assert find_stop("x.y.z", ["."], start=2) == 3


def test_stop_holdback_examples():
    assert stop_holdback("Hello <|e", ["<|end|>"]) == 3
    assert stop_holdback("Hello", ["<|end|>"]) == 0
    assert stop_holdback("abc", ["cd", "bcx"]) == 2


@settings(max_examples=60, deadline=None)
@given(st.text("ab.", max_size=12), st.lists(st.text("ab.", min_size=1, max_size=3), max_size=3))
def test_stop_helpers_match_brute_force(text, stops):
    found = [i for i in range(len(text)) if any(text.startswith(s, i) for s in stops)]
    assert find_stop(text, stops) == (found[0] if found else None)
    proper_prefixes = {s[:n] for s in stops for n in range(1, len(s))}
    expected = max((n for n in range(1, len(text) + 1) if text[-n:] in proper_prefixes), default=0)
    assert stop_holdback(text, stops) == expected


def test_gguf_tokenizer_with_bos_matches_transformers(tmp_path):
    # A byte-level vocabulary with one merge, control tokens <s> </s>, and add_bos_token set.
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[i] for i in range(256)] + ["<s>", "</s>", "ab"]
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((259, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer.from_source(tmp_path / "tiny.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["abc ab", "x</s>y", "é"]:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("ab")[0] == 256 and ours.eos_token_ids == (257,)
    # transformers' byte-level builder adds GPT-2's <|endoftext|> after the file's 259 tokens.
    assert ours.vocab_size == len(theirs) == 260
    assert ours.apply_chat_template([{"role": "user", "content": "ab"}]) == [256, 258]


# --- the default model's GGUF tokenizer -----------------------------------------------------------


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return hub.resolve_model_source(hub.DEFAULT_MODEL).path


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(default_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_source(default_gguf)
    theirs = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    for text in ["The capital of France is", "héllo wörld 你好 🙂\n\n  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(messages) == list(expected)
    assert ours.eos_token_ids == (2,) and ours.vocab_size == 49152


@pytest.mark.slow
def test_gguf_tokenizer_needs_no_torch(default_gguf):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now fails
        from jaxserve.tokenizer import Tokenizer
        tok = Tokenizer.from_source({str(default_gguf)!r})
        print(tok.encode("The capital of France is"))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[504, 3575, 282, 4649, 314]"
