"""The server's own settings (the engine's are the `LLM` keywords) and what it knows of the served model;
importable without fastapi, so the command line can show their defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.llm import LLM

# Larger bodies are refused with a 413 (a batch of 512 prompts of 2k token ids each is about 6 MB).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter the server loads at start (vLLM's --lora-modules name=path): clients send `name` as `model`
    to be served with the PEFT adapter directory at `path`."""

    name: str
    path: str

    def __post_init__(self) -> None:
        for field in ("name", "path"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"a LoRA module's {field} must be a non-empty string, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """served_model_name: the name clients send as `model`; api_key: None serves without authentication;
    max_request_bytes: larger request bodies get a 413; stream_interval: a stream gets its first token at
    once, then a chunk every stream_interval tokens (and the last one), as vLLM's --stream-interval;
    lora_modules: adapters loaded at start (the engine must serve LoRA adapters), each served under its name."""

    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    stream_interval: int = 1
    lora_modules: tuple[LoraModule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError(f"served_model_name must be a non-empty string, got {self.served_model_name!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be None or a non-empty string")
        size = self.max_request_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1, got {size!r}")
        interval = self.stream_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {interval!r}")
        if not all(isinstance(module, LoraModule) for module in self.lora_modules):
            raise ValueError(f"lora_modules must be LoraModule values, got {self.lora_modules!r}")
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names) or self.served_model_name in names:
            raise ValueError(
                f"lora_modules' names must differ from each other and from served_model_name "
                f"{self.served_model_name!r}, got {names}"
            )


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the HTTP front end needs of the engine's model, without the engine (which may run in another
    process): the tokenizer, the length limit and vocabulary, the compiled variants, the model's source, whether
    it serves LoRA adapters and the ones loaded already. Picklable."""

    tokenizer: Any
    max_seq_len: int
    vocab_size: int
    prompt_logprob_variants: bool
    penalty_variants: bool
    source: str | None
    enable_lora: bool = False
    adapters: tuple[str, ...] = ()

    @classmethod
    def of(cls, llm: LLM) -> ServedModel:
        steps = llm.engine.steps
        return cls(
            llm.tokenizer,
            llm.config.max_seq_len,
            llm.engine.vocab_size,
            steps.prompt_logprob_variants,
            steps.penalty_variants,
            llm.model.source,
            llm.config.lora is not None,
            tuple(llm.list_loras()),
        )
