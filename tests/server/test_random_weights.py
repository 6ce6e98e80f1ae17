"""`jaxserve serve --random-weights NAME`: a model size served without its checkpoint, for load tests.
Prompts are token ids and a completion's text is its ids, so a stream carries text as with a real
vocabulary; text prompts and conversations are refused with a 400 naming the missing tokenizer."""

from __future__ import annotations

import itertools

import openai
import pytest

from jaxserve.cli import build_parser, served_llm
from jaxserve.sampling import SamplingParams
from jaxserve.server.config import ServerConfig

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

FLAGS = ["--dtype=float32", "--max-seq-len=64", "--max-batch-size=4", "--max-num-tokens=16"]
FLAGS += ["--decode-batch-sizes=4", "--token-buckets=16", "--no-penalty-variants"]
PROMPTS = [[5, 17, 42, 99, 3], [7, 8]]


def test_random_weights_serve_token_id_prompts_with_their_ids_as_text(serve_llm):
    args = build_parser().parse_args(["serve", "--random-weights", "tiny-llama", *FLAGS])
    offline, name = served_llm(args)
    assert name == "tiny-llama"
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    offline.close()
    llm, _ = served_llm(args)  # random weights of a fixed seed: the same model again
    running = serve_llm(llm, ServerConfig(name, None, 1 << 20, stream_interval=3))
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        stream = client.completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        deltas = [chunk.choices[0].text for chunk in stream if chunk.choices and chunk.choices[0].text]
        assert deltas and "".join(deltas) == "".join(f" {t}" for t in tokens)
        # --stream-interval 3: outputs come after the first token, then 3 at a time, the rest with the end.
        # A client slower than the engine gets the newest output only (queued ones merge, as in vLLM), so
        # a delta may span several reports, but every delta ends on a report's boundary.
        ends = list(itertools.accumulate(len(delta.split()) for delta in deltas))
        assert set(ends) <= {1, 4, 6} and ends[-1] == 6
    for request in (
        lambda: client.completions.create(model=name, prompt="text", max_tokens=2),
        lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(openai.BadRequestError, match="tokenizer"):
            request()


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1"):
        ServerConfig("m", stream_interval=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--stream-interval", "0"])


def test_random_weights_and_a_model_are_not_both_given(capsys):
    from jaxserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "some/model", "--random-weights", "tiny-llama"])
    assert "not both" in capsys.readouterr().err
