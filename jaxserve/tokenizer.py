"""Text <-> token ids: the tokenizer wrapper, chat messages and templates, incremental detokenization
and stop strings.

`Tokenizer` wraps a transformers fast tokenizer built from a model directory (tokenizer.json and
friends) or from a GGUF file's metadata (see `jaxserve/models/gguf.py`, which avoids torch). It knows every
end-of-generation id: the tokenizer's eos, plus generation_config.json / config.json's
`eos_token_id` in a directory, plus llama.cpp's eot/eom ids in a GGUF file.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas. A character that spans
several byte-level tokens decodes to U+FFFD until its last byte arrives, so a delta ending in U+FFFD
is held back until the next token completes it. Decoding restarts a few tokens before the unread
part (not at the start of the sequence) so each step costs O(1); the restart window is decoded both
with and without the new tokens and only the difference is emitted, so tokenizers whose decoding of a
token depends on its neighbours (leading-space rules) stay consistent.

`validate_messages` checks a conversation before any chat template sees it (OpenAI's message format,
text only), so a malformed one is a TypeError / ValueError naming the message, not a Jinja internal;
`validate_conversations` does it for one conversation or several, as `LLM.chat` takes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded again before the first generated one: context for leading-space rules.
_CONTEXT_TOKENS = 5
# The roles of OpenAI's chat format ("developer" is its newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PART = "{'type': 'text', 'text': str}"


def _short(value: Any) -> str:
    """repr of a value of the caller's, cut to a length fit for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation as plain dicts, each with a `role` from CHAT_ROLES and a string `content`.

    `messages` is a list (or tuple) of dicts. A content is a string, or a list of OpenAI text parts
    ({"type": "text", "text": "..."}) whose texts are joined with newlines, as vLLM does; other parts
    (image_url, input_audio, ...) are refused: only text is supported. Other keys of a message (name,
    tool_call_id, tool_calls, ...) pass through to the chat template.

    Raises TypeError when `messages` is not a list or a message is not a dict, and ValueError for
    an empty conversation or a missing or bad role / content; each names the message's index.
    """
    if not isinstance(messages, (list, tuple)):
        hint = ""
        if isinstance(messages, Mapping):
            hint = " (a single message goes in a list: [message])"
        elif isinstance(messages, str):
            hint = " (a plain prompt is not a conversation)"
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}{hint}"
        )
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def validate_conversations(conversations: Any) -> list[list[dict[str, Any]]]:
    """One conversation or several (what `LLM.chat` takes), each checked by `validate_messages`.

    A non-empty list whose items are all lists (or tuples) holds several conversations; anything else
    is one. An error in one of several starts with "conversation i: " and keeps its type.
    """
    items = conversations if isinstance(conversations, (list, tuple)) else ()
    if not items or not all(isinstance(c, (list, tuple)) for c in items):
        return [validate_messages(conversations)]
    validated = []
    for i, conversation in enumerate(items):
        try:
            validated.append(validate_messages(conversation))
        except (TypeError, ValueError) as error:
            raise type(error)(f"conversation {i}: {error}") from error
    return validated


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise TypeError(
            f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}: {_short(message)}"
        )
    roles = ", ".join(repr(r) for r in CHAT_ROLES)
    if "role" not in message:
        raise ValueError(f"{where} has no 'role' (one of {roles})")
    role = message["role"]
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {roles}, got {_short(role)}")
    if "content" not in message:
        raise ValueError(f"{where} ({role}) has no 'content' (a string or a list of text parts {_TEXT_PART})")
    return {**message, "content": _message_text(f"{where}.content", message["content"])}


def _message_text(where: str, content: Any) -> str:
    """A message's content as one string: itself, or its text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(
            f"{where} must be a string or a list of text parts {_TEXT_PART}, "
            f"got {type(content).__name__}: {_short(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or "type" not in part:
            raise ValueError(f"{where}[{j}] must be a text part {_TEXT_PART}, got {_short(part)}")
        if part["type"] != "text":
            kind = _short(part["type"])
            raise ValueError(f"{where}[{j}] has type {kind}: only text parts {_TEXT_PART} are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string, got {_short(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


class Tokenizer:
    """A transformers tokenizer plus the model's end-of-generation ids."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.insert(0, hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in ids))

    @classmethod
    def from_source(cls, source: str | os.PathLike | None) -> Tokenizer:
        """From a model directory with tokenizer files or a .gguf file (what `LoadedModel.tokenizer_source` holds)."""
        if source is None:
            raise ValueError(
                "the model carries no tokenizer (no tokenizer.json / tokenizer_config.json next to its weights); "
                "pass a directory that holds one"
            )
        path = Path(source)
        if path.is_file() and path.suffix == ".gguf":
            from jaxserve.models.gguf import gguf_tokenizer

            hf_tokenizer, eos_ids = gguf_tokenizer(path)
            return cls(hf_tokenizer, eos_ids)
        if path.is_dir():
            return cls(_directory_tokenizer(path), _directory_eos_ids(path))
        raise FileNotFoundError(f"tokenizer source not found: {path} (expected a model directory or a .gguf file)")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self.hf_tokenizer)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        """Prompt ids for a conversation ([{"role": ..., "content": ...}, ...]) in the model's chat format.

        The conversation is checked by `validate_messages` first (its TypeError / ValueError); an
        error the template itself raises (a role order it refuses, a syntax error in `chat_template`)
        becomes a ValueError carrying the template's message.
        """
        from jinja2 import TemplateError

        conversation = validate_messages(messages)
        if chat_template is None and not self.hf_tokenizer.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; encode() a plain prompt instead, "
                "or pass chat_template= (a Jinja template)"
            )
        try:
            ids = self.hf_tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tokenize=True,
                return_dict=False,
            )
        except TemplateError as error:
            raise ValueError(f"the chat template cannot render this conversation: {error}") from error
        return list(ids)


# tokenizer_config.json classes that are a tokenizer.json and nothing more (transformers 4's name and 5's).
_PLAIN_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
# tokenizer_config.json keys that change nothing `TokenizerFile` does: a config with any other key (or
# add_bos_token / add_eos_token set, which transformers applies on top of tokenizer.json) goes to
# transformers.
_PLAIN_CONFIG_KEYS = frozenset(
    {
        "tokenizer_class", "backend", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
        "cls_token", "mask_token", "additional_special_tokens", "extra_special_tokens", "added_tokens_decoder",
        "model_max_length", "chat_template", "clean_up_tokenization_spaces", "model_input_names",
        "padding_side", "truncation_side", "add_bos_token", "add_eos_token",
    }
)  # fmt: skip
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _directory_tokenizer(directory: Path) -> Any:
    """The tokenizer of a model directory. A plain tokenizer.json (what a converted GGUF holds) is served by
    `TokenizerFile`, without importing transformers (a second of a CPU start); anything else by AutoTokenizer."""
    config_path = directory / "tokenizer_config.json"
    if (directory / "tokenizer.json").is_file() and config_path.is_file():
        with open(config_path) as f:
            config = json.load(f)
        special_path = directory / "special_tokens_map.json"  # transformers 4 writes one beside the config
        if special_path.is_file():
            with open(special_path) as f:
                config = {**json.load(f), **config}
        if config.get("tokenizer_class") in _PLAIN_FAST_TOKENIZERS:
            if TokenizerFile.serves(config):
                return TokenizerFile(directory, config)
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with its `content`."""
    return value.get("content") if isinstance(value, Mapping) else value


class TokenizerFile:
    """A tokenizer.json run by the `tokenizers` library, with the part of a transformers fast tokenizer's
    interface that `Tokenizer` uses: the same ids and text as `PreTrainedTokenizerFast` on the same files
    (tests/test_tokenizer.py compares them), and its chat-template rendering (a sandboxed Jinja environment
    with trim_blocks / lstrip_blocks, loop controls, `tojson`, `raise_exception` and `strftime_now`; the
    special tokens as template variables; the rendered text encoded without special tokens)."""

    def __init__(self, directory: Path, config: Mapping[str, Any]) -> None:
        from tokenizers import Tokenizer as Backend

        self.backend_tokenizer = Backend.from_file(str(directory / "tokenizer.json"))
        self.name_or_path = str(directory)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        template_file = directory / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else config.get("chat_template")
        )
        self._templates: dict[str, Any] = {}

    @staticmethod
    def serves(config: Mapping[str, Any]) -> bool:
        """Whether a tokenizer_config.json needs nothing of transformers beyond what this class does."""
        adds = config.get("add_bos_token") or config.get("add_eos_token")
        template = config.get("chat_template")
        return set(config) <= _PLAIN_CONFIG_KEYS and not adds and (template is None or isinstance(template, str))

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    def _id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tokenize: bool = True,
        return_dict: bool = False,
    ) -> list[int] | str:
        if return_dict:
            raise ValueError("TokenizerFile.apply_chat_template returns ids or text, not a dict")
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("the tokenizer has no chat template")
        if source not in self._templates:
            self._templates[source] = _jinja_environment().from_string(source)
        variables = {**self.special_tokens, "tools": None, "documents": None}
        text = self._templates[source].render(
            messages=list(conversation), add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _jinja_environment() -> Any:
    """The Jinja environment chat templates are written for (transformers' and vLLM's)."""
    from datetime import datetime

    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (which marks assistant text for training masks) renders
        its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTag]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text


def _directory_eos_ids(directory: Path) -> list[int]:
    """eos_token_id entries (an int or a list) of generation_config.json and config.json, when present."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            with open(directory / name) as f:
                value = json.load(f).get("eos_token_id")
            ids += [value] if isinstance(value, int) else list(value or [])
    return ids


def _rust_backend(tokenizer: Tokenizer) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast tokenizer whose decode adds nothing to it, else None.

    Only then does the Rust streaming decoder give the text `Tokenizer.decode` gives: a tokenizer that
    cleans up tokenization spaces after decoding (a Python step) keeps the Python path.
    """
    hf = getattr(tokenizer, "hf_tokenizer", None)  # None for a duck-typed tokenizer: Python path
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    return backend


class IncrementalDetokenizer:
    """Text deltas of a growing id sequence; feed generated ids one at a time with `add`.

    Holds back a delta that ends in U+FFFD (an incomplete multi-byte character) until a later
    token completes it; `flush` releases whatever is held back at the end of generation.

    Fast tokenizers stream through the `tokenizers` library's Rust DecodeStream (2.1 -> 0.74 ms per
    256 tokens for the default model, measured on CPU); others decode a window of ids twice per token
    in Python. Both give the text of the same prefix-offset algorithm.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self._prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self.ids)
        self.text = ""
        self._backend = _rust_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            context = self.ids[self._prefix_offset :]
            self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        if self._stream is None:
            return self._advance(final=False)
        delta = self._stream.step(self._backend, int(token_id))
        if not delta:
            return ""
        # Everything up to here is text now: the next held-back span starts after this id.
        self._prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back text, U+FFFD included: call once the sequence is finished."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` where the earliest stop string begins, or None; searching from `start`.

    Pass the length of the text already checked minus (longest stop - 1) as `start` to keep
    streaming checks linear.
    """
    hits = [i for stop in stops if stop and (i := text.find(stop, max(start, 0))) >= 0]
    return min(hits) if hits else None


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that begins some stop string: text a stream must not emit yet."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest
