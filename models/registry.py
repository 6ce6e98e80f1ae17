"""Maps Hugging Face `architectures` names to the family module that implements them.

A family module exposes the model protocol (config class with `from_hf`, `param_specs`,
`checkpoint_rules`, `init_weights`, `forward`, `compute_logits`); `resolve` returns the module and
its config built from the checkpoint's config.json.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from models import llama

# Architecture name -> (family module, its config class).
_ARCHITECTURES: dict[str, tuple[ModuleType, Any]] = {
    "LlamaForCausalLM": (llama, llama.LlamaConfig),
    "MistralForCausalLM": (llama, llama.LlamaConfig),
    "Qwen2ForCausalLM": (llama, llama.LlamaConfig),
    "Qwen3ForCausalLM": (llama, llama.LlamaConfig),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve(hf_config: dict) -> tuple[ModuleType, Any]:
    """(family module, family config) for a Hugging Face config.json dict."""
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(
            f"config has no 'architectures' entry; supported architectures: {', '.join(supported_architectures())}"
        )
    for name in architectures:
        if name in _ARCHITECTURES:
            family, config_cls = _ARCHITECTURES[name]
            return family, config_cls.from_hf(hf_config)
    raise ValueError(
        f"unsupported architecture {', '.join(architectures)}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
