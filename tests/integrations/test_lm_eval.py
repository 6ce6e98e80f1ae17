"""The lm-eval model (`jaxserve.integrations.lm_eval`) against lm-eval's own `hf` model on one tiny random
Llama in float32: a multiple-choice task, a generate_until task and a rolling log-likelihood task, all
local (JSONL data and task YAMLs written here), give the same per-request results and metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs lm-eval (the eval extra)")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.needs_torch, pytest.mark.usefixtures("unoptimized_compiles")]  # tests/conftest.py says why

CORPUS = [
    "the cat sat on the mat. the dog ran in the park.",
    "one two three four five six seven eight nine ten",
    "question: what is red? answer: an apple is red.",
] * 10
QUESTIONS = [
    {"question": "the cat sat on the", "choices": [" mat", " dog", " park", " red apple"], "answer": 0},
    {"question": "one two three", "choices": [" four", " five six", " ten", " cat"], "answer": 0},
    {"question": "question: what is red? answer:", "choices": [" an apple", " the dog", " two", " mat"], "answer": 0},
]
PROMPTS = [{"prompt": "the dog ran in", "target": "the park"}, {"prompt": "five six", "target": "seven"}]
DOCUMENTS = [{"text": "the cat sat on the mat."}, {"text": " ".join(CORPUS[:6])}]  # the second over windows

TASKS = {
    "tiny_mc": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}],
    },
    "tiny_gen": {
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": ["."], "max_gen_toks": 12, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
    "tiny_ppl": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    },
}


def _tiny_llama_dir(root: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # a sharper random model, so greedy continuations are not all one token
        model.lm_head.weight.mul_(8.0)
    directory = root / "tiny-llama"
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def _write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    data = {"tiny_mc": QUESTIONS, "tiny_gen": PROMPTS, "tiny_ppl": DOCUMENTS}
    for name, spec in TASKS.items():
        path = tasks / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data[name]))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test",
            **spec,
        }
        (tasks / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return tasks


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import jaxserve.integrations.lm_eval  # noqa: F401  (registers "jaxserve")

    root = tmp_path_factory.mktemp("lm_eval")
    model_dir, tasks = _tiny_llama_dir(root), _write_tasks(root)
    manager = TaskManager(include_path=str(tasks))
    common = {"tasks": list(TASKS), "task_manager": manager, "log_samples": True, "batch_size": 1}
    jaxserve_args = f"pretrained={model_dir},dtype=float32,max_num_tokens=32,max_batch_size=4"
    ours = lm_eval.simple_evaluate(model="jaxserve", model_args=jaxserve_args, **common)
    # The hf model predicts max_length tokens per rolling window, jaxserve max_length - 2 (room for the
    # window's context token and one generated token): the same windows with these lengths.
    hf_args = f"pretrained={model_dir},dtype=float32,max_length=94"
    reference = lm_eval.simple_evaluate(model="hf", model_args=hf_args, device="cpu", **common)
    return ours, reference


def _responses(results, task):
    return [sample["resps"] for sample in results["samples"][task]]


def test_multiple_choice_matches_the_hf_model(evaluations):
    ours, reference = evaluations
    for mine, theirs in zip(_responses(ours, "tiny_mc"), _responses(reference, "tiny_mc"), strict=True):
        for [(logprob, greedy)], [(expected, expected_greedy)] in zip(mine, theirs, strict=True):
            assert abs(logprob - expected) < 1e-3
            assert greedy == expected_greedy
    assert ours["results"]["tiny_mc"]["acc,none"] == reference["results"]["tiny_mc"]["acc,none"]


def test_generate_until_matches_the_hf_model(evaluations):
    ours, reference = evaluations
    mine, theirs = _responses(ours, "tiny_gen"), _responses(reference, "tiny_gen")
    assert mine == theirs
    assert any(text for [text] in mine)  # something was generated
    assert ours["results"]["tiny_gen"]["exact_match,none"] == reference["results"]["tiny_gen"]["exact_match,none"]


def test_rolling_loglikelihood_matches_the_hf_model(evaluations):
    ours, reference = evaluations
    for [[mine]], [[theirs]] in zip(_responses(ours, "tiny_ppl"), _responses(reference, "tiny_ppl"), strict=True):
        assert abs(mine - theirs) < 1e-3 and math.isfinite(mine)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        expected = reference["results"]["tiny_ppl"][metric]
        assert ours["results"]["tiny_ppl"][metric] == pytest.approx(expected, rel=1e-4)


def test_a_model_built_again_with_the_same_arguments_takes_the_same_engine(tmp_path):
    """lm-eval builds its model for every simple_evaluate: the same model and keywords take the previous
    engine; other keywords close it and build another; release_engine closes the one kept."""
    from jaxserve.integrations.lm_eval import JaxserveLM, release_engine

    model_dir = _tiny_llama_dir(tmp_path)
    first = JaxserveLM.create_from_arg_string(
        f"pretrained={model_dir},dtype=float32,max_num_tokens=32,max_batch_size=4"
    )
    again = JaxserveLM.create_from_arg_string(
        f"pretrained={model_dir},dtype=float32,max_num_tokens=32,max_batch_size=4"
    )
    assert again.llm is first.llm and not first.llm.engine.closed
    other = JaxserveLM.create_from_arg_string(
        f"pretrained={model_dir},dtype=float32,max_num_tokens=32,max_batch_size=2"
    )
    assert other.llm is not first.llm and first.llm.engine.closed
    release_engine()
    assert other.llm.engine.closed
