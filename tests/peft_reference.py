"""The LoRA tests' independent reference (tests/engine/test_lora.py, tests/server/test_lora_server.py): a tiny
random Llama saved as transformers saves it, random PEFT adapters saved as peft saves them, and transformers +
peft's greedy tokens in float32 with the adapter applied unmerged. Imported by name (pyproject's pytest
`pythonpath` puts tests/ on the path)."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

VOCAB = 160
NEW_TOKENS = 8
HF_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
    tie_word_embeddings=False,
)


def save_base_model(directory: Path) -> transformers.LlamaForCausalLM:
    """The tiny random Llama (seed 0, float32), saved in `directory`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF_CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory)
    return model


def save_adapter(base: transformers.PreTrainedModel, directory: Path, seed: int, **options) -> None:
    """A peft adapter with random A and B (B scaled up so that it moves the greedy tokens), saved as peft saves."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    model.save_pretrained(directory)
    model.unload()  # the base model without the adapter's layers, for the next one


def peft_tokens(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers + peft's NEW_TOKENS greedy tokens of each prompt (float32, no stop at eos: the requests ignore
    it), the adapter applied unmerged; adapter_dir None: the base model."""
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(generated[0, len(prompt) :].tolist())
    return out
