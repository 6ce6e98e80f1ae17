"""Greedy tokens of the default model in float32 against tokens recorded before a refactor of the engine.

`data/smollm2_greedy_float32.json` was written by the engine as it stood before the step contract,
output processor and runner lifecycle were restructured; any change of behaviour there shows up here
as a changed token. Same engine settings as the recording: xla backend, 4 rows, 32-token steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.config import CompileConfig, KvCacheConfig
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

RECORD = json.loads((Path(__file__).parent / "data" / "smollm2_greedy_float32.json").read_text())


@pytest.mark.slow
def test_default_model_greedy_tokens_equal_the_recorded_ones(smollm2):
    model, tokenizer = smollm2
    llm = LLM(
        model,
        tokenizer=tokenizer,
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=256,
        kv_cache_config=KvCacheConfig(),
        compile_config=CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False),
        attention_backend="xla",
        show_progress=False,
    )
    params = SamplingParams(max_tokens=RECORD["max_tokens"], temperature=0.0)

    raw = llm.generate(RECORD["prompts"], params, use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": q}] for q in RECORD["chats"]], params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in raw] == RECORD["prompt_tokens"]
    assert [o.outputs[0].token_ids for o in chat] == RECORD["chat_tokens"]
    assert [o.outputs[0].text for o in raw + chat] == RECORD["texts"]
