"""Records transformers' reference for tests/models/test_gemma3_270m.py into gemma3_270m_transformers.json: for each
of its prompts, the token ids (jaxserve's tokenizer), then transformers' 8 greedy tokens and the logprob of each,
in float32, read from the same GGUF file (gemma-3-270m, fetched into the cache on first use). Loading the GGUF
into transformers takes about a minute on a 2-core CPU, which is why the test reads this recording. Run it again
when the prompts change:

    python tests/models/data/record_gemma3_270m.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from jaxserve.models import hub
from jaxserve.models.loader import load_model
from jaxserve.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
RECORD = HERE / "gemma3_270m_transformers.json"


def load_test_module():
    """tests/models/test_gemma3_270m.py, for its prompts and token count."""
    spec = importlib.util.spec_from_file_location("test_gemma3_270m", HERE.parent / "test_gemma3_270m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record() -> dict:
    test = load_test_module()
    path = hub.resolve_model_source(hub.GEMMA3_270M).path
    # transformers reads the file with gguf's GGUFReader twice (the config, then the weights), ~13 s each for the
    # 262,144 vocabulary strings: one reader serves both.
    readers: dict = {}
    original = gguf.GGUFReader

    def reader(file, *args, **kwargs):
        key = (str(file), args, tuple(sorted(kwargs.items())))
        return readers[key] if key in readers else readers.setdefault(key, original(file, *args, **kwargs))

    gguf.GGUFReader = reader
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        gguf.GGUFReader = original
    tokenizer = Tokenizer.from_source(load_model(hub.GEMMA3_270M, dtype="float32", on_device=False).tokenizer_source)
    cases = []
    with torch.no_grad():
        for prompt in test.PROMPTS:
            ids = tokenizer.encode(prompt)
            out = model.eval().generate(
                torch.tensor([ids]),
                max_new_tokens=test.NEW_TOKENS,
                min_new_tokens=test.NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
            cases.append({"prompt_ids": ids, "tokens": tokens, "logprobs": np.float32(logprobs).tolist()})
    return {"transformers": transformers.__version__, "new_tokens": test.NEW_TOKENS, "cases": cases}


if __name__ == "__main__":
    recorded = record()
    cases = ",\n".join(json.dumps(case) for case in recorded.pop("cases"))
    RECORD.write_text(json.dumps(recorded)[:-1] + f', "cases": [\n{cases}\n]}}\n')
    print(f"wrote {RECORD}")
