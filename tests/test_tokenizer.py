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
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.models import convert, hub
from jaxserve.tokenizer import (
    CHAT_ROLES,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerFile,
    find_stop,
    stop_holdback,
    validate_conversations,
    validate_messages,
)

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


@pytest.fixture(params=["rust-stream", "python"])
def detokenizer_path(request, monkeypatch) -> str:
    """A test that asks for it runs on both detokenizer paths: the Rust DecodeStream and the Python fallback
    (every test that streams through IncrementalDetokenizer does)."""
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


def test_multibyte_characters_are_held_back_until_complete(tok, detokenizer_path):
    text = "héllo 世界 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[:2]).endswith("\ufffd")  # "é" really is split across byte tokens
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert "" in deltas[:-1] and not any("\ufffd" in d for d in deltas)


# The detokenizer path fixture patches one function for the whole test: nothing to reset between examples.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=30), st.text(min_size=1, max_size=30))
def test_streamed_deltas_add_up_to_the_text(tok, detokenizer_path, prompt, completion):
    assume("\ufffd" not in completion and "<|" not in prompt + completion)
    prompt_ids = tuple(tok.encode(prompt, add_special_tokens=False))
    deltas = _stream(tok, tok.encode(completion, add_special_tokens=False), prompt_ids)
    assert "".join(deltas) == completion
    assert not any("\ufffd" in d for d in deltas)


def test_leading_space_rules_keep_their_context(detokenizer_path):
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


def test_flush_releases_an_incomplete_character(tok, detokenizer_path):
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed and streamed.startswith("ok")
    assert detok.flush().endswith("\ufffd")


def test_special_tokens_are_skipped_in_deltas(tok, detokenizer_path):
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_ids[0]]
    assert "".join(_stream(tok, ids)) == "hello"


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == tok.encode(expected, add_special_tokens=False)
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix("<|im_start|>assistant\n")


# Texts and conversations a tokenizer file must treat as transformers does.
PARITY_TEXTS = ["hello world", "The capital of France is", "héllo wörld 你好 🙂\n\n  x", "", " a  b ", "x <|im_end|> y"]
PARITY_CONVERSATIONS = [
    [HELLO := {"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, HELLO, {"role": "assistant", "content": "Hi."}, HELLO],
    [{"role": "user", "content": "héllo 🙂 <|im_start|>"}],
]


def _assert_same_as_transformers(ours: Any, theirs: Any) -> None:
    assert isinstance(ours, TokenizerFile)
    assert (len(ours), ours.eos_token_id, ours.bos_token_id) == (len(theirs), theirs.eos_token_id, theirs.bos_token_id)
    for text in PARITY_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for conversation in PARITY_CONVERSATIONS:
        for prompt in (True, False):
            kwargs = {"add_generation_prompt": prompt, "tokenize": True, "return_dict": False}
            assert ours.apply_chat_template(conversation, **kwargs) == list(
                theirs.apply_chat_template(conversation, **kwargs)
            ), (conversation, prompt)


def test_a_plain_tokenizer_file_gives_what_transformers_gives(tok, tokenizer_dir):
    _assert_same_as_transformers(tok.hf_tokenizer, PreTrainedTokenizerFast.from_pretrained(tokenizer_dir))
    generation = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}|{% endfor %}"
    assert tok.decode(tok.apply_chat_template([HELLO, HELLO], chat_template=generation)) == "hello|hello|"


def test_a_plain_tokenizer_file_loads_without_transformers(tokenizer_dir):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["transformers"] = None  # any `import transformers` now fails
        from jaxserve.tokenizer import Tokenizer
        tok = Tokenizer.from_source({str(tokenizer_dir)!r})
        print(tok.decode(tok.apply_chat_template([{{"role": "user", "content": "hello"}}]), skip_special_tokens=False))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n\n"


def test_tokenizer_configs_transformers_must_interpret_go_to_transformers(tmp_path):
    _tiny_hf_tokenizer(CHAT_TEMPLATE).save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for extra in ({"add_bos_token": True}, {"a_key_of_some_tokenizer_class": 1}):
        config_path.write_text(json.dumps({**config, **extra}))
        assert not isinstance(Tokenizer.from_source(tmp_path).hf_tokenizer, TokenizerFile), extra


def test_missing_chat_template_is_a_clear_error(tmp_path):
    _tiny_hf_tokenizer(None).save_pretrained(tmp_path)
    tok = Tokenizer.from_source(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0]['content'] }}")
    assert tok.decode(ids) == "hi"


# --- chat messages --------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}
# (id, messages, error type, message): each raised by validate_messages and by apply_chat_template.
BAD_CONVERSATIONS = [
    ("string", "hi", TypeError, r"^messages must be a list of .* got str \(a plain prompt"),
    ("one-dict", USER, TypeError, r"^messages must be a list of .* got dict \(a single message goes in a list"),
    ("none", None, TypeError, r"^messages must be a list of .* got NoneType"),
    ("int", 5, TypeError, r"^messages must be a list of .* got int"),
    ("generator", (m for m in [USER]), TypeError, r"^messages must be a list of .* got generator"),
    ("empty", [], ValueError, r"^messages is empty"),
    ("int-message", [5], TypeError, r"^messages\[0\] must be a dict .* got int: 5"),
    ("none-message", [None], TypeError, r"^messages\[0\] must be a dict .* got NoneType"),
    ("pair-message", [["user", "hi"]], TypeError, r"^messages\[0\] must be a dict .* got list"),
    ("second-is-str", [USER, "and then"], TypeError, r"^messages\[1\] must be a dict .* got str: 'and then'"),
    ("no-role", [{"content": "hi"}], ValueError, r"^messages\[0\] has no 'role' \(one of 'system',"),
    (
        "unknown-role",
        [{"role": "bot", "content": "hi"}],
        ValueError,
        r"^messages\[0\]\.role must be one of .* got 'bot'",
    ),
    ("capital-role", [{"role": "User", "content": "hi"}], ValueError, r"^messages\[0\]\.role .* got 'User'"),
    ("none-role", [{"role": None, "content": "hi"}], ValueError, r"^messages\[0\]\.role .* got None"),
    ("int-role", [USER, {"role": 1, "content": "hi"}], ValueError, r"^messages\[1\]\.role .* got 1"),
    ("list-role", [{"role": ["user"], "content": "hi"}], ValueError, r"^messages\[0\]\.role .* got \['user'\]"),
    ("no-content", [{"role": "user"}], ValueError, r"^messages\[0\] \(user\) has no 'content'"),
    ("none-content", [{"role": "assistant", "content": None}], ValueError, r"^messages\[0\]\.content .* got NoneType"),
    (
        "int-content",
        [{"role": "user", "content": 5}],
        ValueError,
        r"^messages\[0\]\.content must be a string .* got int",
    ),
    ("bytes-content", [{"role": "user", "content": b"hi"}], ValueError, r"^messages\[0\]\.content .* got bytes"),
    (
        "part-not-in-list",
        [{"role": "user", "content": {"type": "text", "text": "hi"}}],
        ValueError,
        r"^messages\[0\]\.content must be a string or a list of text parts .* got dict",
    ),
    (
        "image-part",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
        ValueError,
        r"^messages\[0\]\.content\[0\] has type 'image_url': only text parts .* are supported",
    ),
    (
        "text-then-audio",
        [USER, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
        ValueError,
        r"^messages\[1\]\.content\[1\] has type 'input_audio': only text parts",
    ),
    (
        "string-part",
        [{"role": "user", "content": ["hi"]}],
        ValueError,
        r"^messages\[0\]\.content\[0\] must be a text part",
    ),
    (
        "untyped-part",
        [{"role": "user", "content": [{"text": "hi"}]}],
        ValueError,
        r"^messages\[0\]\.content\[0\] must be",
    ),
    (
        "nested-parts",
        [{"role": "user", "content": [[{"type": "text", "text": "hi"}]]}],
        ValueError,
        r"^messages\[0\]\.content\[0\] must be a text part",
    ),
    (
        "part-no-text",
        [{"role": "user", "content": [{"type": "text"}]}],
        ValueError,
        r"\.content\[0\]\.text must be a string, got None",
    ),
    (
        "part-int-text",
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        ValueError,
        r"\.content\[0\]\.text .* got 5",
    ),
]


@pytest.mark.parametrize(
    ("messages", "error", "message"), [c[1:] for c in BAD_CONVERSATIONS], ids=[c[0] for c in BAD_CONVERSATIONS]
)
def test_bad_conversations_name_the_message_and_field(tok, messages, error, message):
    with pytest.raises(error, match=message):
        validate_messages(messages)
    with pytest.raises(error, match=message):
        tok.apply_chat_template(messages)


def test_one_conversation_or_several():
    assert validate_conversations([USER]) == [[USER]]
    assert validate_conversations(([USER], (USER, USER))) == [[USER], [USER, USER]]
    with pytest.raises(TypeError, match=r"^messages must be a list .* got dict \(a single message"):
        validate_conversations(USER)
    with pytest.raises(ValueError, match=r"^messages is empty"):
        validate_conversations([])
    with pytest.raises(ValueError, match=r"^conversation 1: messages is empty"):
        validate_conversations([[USER], []])
    with pytest.raises(ValueError, match=r"^conversation 1: messages\[0\]\.role .* got 'bot'"):
        validate_conversations([[USER], [{"role": "bot", "content": "hi"}]])
    with pytest.raises(TypeError, match=r"^messages\[1\] must be a dict .* got list"):
        validate_conversations([USER, [USER]])  # mixed: one conversation with a bad message


def test_long_values_are_cut_in_messages():
    with pytest.raises(ValueError) as excinfo:
        validate_messages([{"role": "x" * 10_000, "content": "hi"}])
    assert len(str(excinfo.value)) < 200


def test_accepted_conversation_forms(tok):
    text_parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": text_parts},
    ]
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello\nworld"}]
    assert validate_messages(as_parts) == as_strings
    assert as_parts[1]["content"] is text_parts  # the caller's messages are not modified
    assert tok.apply_chat_template(as_parts) == tok.apply_chat_template(as_strings)
    assert tok.apply_chat_template(tuple(as_strings)) == tok.apply_chat_template(as_strings)
    every_role = [{"role": role, "content": ""} for role in CHAT_ROLES]
    assert validate_messages(every_role) == every_role
    assert validate_messages([{"role": "user", "content": []}]) == [{"role": "user", "content": ""}]


def test_extra_message_keys_reach_the_template(tok):
    messages = [
        {"role": "user", "content": "hello", "name": "world"},
        {"role": "tool", "content": "ok", "tool_call_id": "t1"},
    ]
    assert validate_messages(messages) == messages
    template = "{% for m in messages %}{{ m['name'] or m['tool_call_id'] }}:{{ m['content'] }} {% endfor %}"
    assert tok.decode(tok.apply_chat_template(messages, chat_template=template)) == "world:hello t1:ok "


def test_template_errors_are_value_errors(tok):
    refuses_system = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role, please') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="the chat template cannot render this conversation: no system role, please"):
        tok.apply_chat_template([{"role": "system", "content": "s"}], chat_template=refuses_system)
    with pytest.raises(ValueError, match="the chat template cannot render this conversation"):
        tok.apply_chat_template([USER], chat_template="{% for %}")


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
def test_the_converted_default_tokenizer_gives_what_transformers_gives(default_gguf):
    directory = convert.cached_conversion(default_gguf)  # what `LLM()` serves
    ours = Tokenizer.from_source(directory)
    _assert_same_as_transformers(ours.hf_tokenizer, PreTrainedTokenizerFast.from_pretrained(directory))
    assert ours.eos_token_ids == (2,) and ours.vocab_size == 49152


@pytest.fixture(scope="module")
def default_tok(default_gguf) -> Tokenizer:
    return Tokenizer.from_source(default_gguf)


@pytest.mark.slow
def test_default_chat_template_joins_text_parts(default_tok):
    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": t} for t in texts]

    as_parts = [
        {"role": "system", "content": parts("You are terse.")},
        {"role": "user", "content": parts("What is 2+2?", "Answer in one word.")},
        {"role": "assistant", "content": parts("Four.")},
        {"role": "user", "content": parts("And 3+3?")},
    ]
    as_strings = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?\nAnswer in one word."},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 3+3?"},
    ]
    ids = default_tok.apply_chat_template(as_strings)
    assert default_tok.apply_chat_template(as_parts) == ids
    assert "<|im_start|>user\nWhat is 2+2?\nAnswer in one word.<|im_end|>" in default_tok.decode(
        ids, skip_special_tokens=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("messages", "error", "message"),
    [c[1:] for c in BAD_CONVERSATIONS if c[0] in ("one-dict", "no-content", "image-part", "unknown-role")],
)
def test_default_chat_template_sees_only_valid_conversations(default_tok, messages, error, message):
    # Before validation these were a ValueError from dict() ("dictionary update sequence element"), a
    # Jinja UndefinedError, a TypeError inside the template ("can only concatenate str"), and accepted.
    with pytest.raises(error, match=message):
        default_tok.apply_chat_template(messages)


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
