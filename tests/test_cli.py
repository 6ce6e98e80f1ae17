"""The `jaxserve` command line on the default model: generate and chat print only the answer on
stdout; bad arguments and missing models are clear errors with a non-zero exit."""

from __future__ import annotations

import pytest

from jaxserve.cli import main

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why


@pytest.mark.slow
def test_generate_prints_the_greedy_continuation(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out


def test_generate_passes_fp8_weights_and_an_fp8_kv_cache_to_the_engine(monkeypatch):
    """The FP8 flags reach the LLM that generate builds (the FP8 engine on the default model: its quality is
    tests/engine/test_quality.py's, its tokens against the dense reference tests/engine/test_fp8.py's)."""
    import jaxserve.llm

    seen = {}

    class Built(Exception):
        pass

    def record(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(jaxserve.llm, "LLM", record)
    args = ["generate", "The capital of France is", "--max-tokens", "8", "--quantization", "fp8"]
    with pytest.raises(Built):
        main([*args, "--kv-cache-dtype", "fp8", "--quantize-lm-head"])
    assert (seen["quantization"], seen["kv_cache_dtype"], seen["quantize_lm_head"]) == ("fp8", "fp8", True)


@pytest.mark.slow
def test_chat_answers_with_the_chat_template(capsys):
    assert main(["chat", "What is the capital of France?", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "<|im_start|>" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--dtype", "int8"], "invalid choice"),
        (["--quantization", "int4"], "invalid choice"),
        (["--kv-cache-dtype", "int8"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hello", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_path_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["generate", "hello", "--model", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "jaxserve: error:" in err and str(missing) in err


@pytest.mark.slow
def test_a_seed_beyond_64_bits_is_taken_modulo_2_32(capsys):
    """`--seed 2**70` used to end in a raw OverflowError traceback. It generates; the request's seed (and the
    engine's, which `LLM` takes modulo 2**32 the same way) is 2**70 + 7 modulo 2**32: `--seed 7`'s."""
    from jaxserve.sampling import SamplingParams

    args = ["generate", "The capital of France is", "--max-tokens", "4", "--temperature", "0.8"]
    assert main([*args, "--seed", str(2**70 + 7)]) == 0
    assert capsys.readouterr().out.strip()
    assert SamplingParams(seed=2**70 + 7).seed == SamplingParams(seed=7).seed == 7


def test_every_serve_option_is_documented_and_building_the_parser_imports_no_server():
    import argparse
    import subprocess
    import sys

    from jaxserve.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    assert not [a.option_strings or a.dest for a in serve._actions if not a.help], "an option without help"
    options = {option for action in serve._actions for option in action.option_strings}
    assert {"--host", "--port", "--served-model-name", "--api-key", "--max-batch-size", "--max-seq-len"} <= options
    code = (
        "import sys, jaxserve.cli as cli; cli.build_parser(); "
        "assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", [["bench", "throughput"], ["bench", "latency"], ["serve"]])
def test_bucket_aware_admission_is_on_unless_switched_off(command):
    from jaxserve.cli import _engine_keywords, build_parser
    from jaxserve.config import SchedulerConfig

    assert _engine_keywords(build_parser().parse_args(command))["scheduler_config"] == SchedulerConfig()
    off = build_parser().parse_args([*command, "--no-bucket-aware-admission"])
    assert _engine_keywords(off)["scheduler_config"] == SchedulerConfig(bucket_aware_admission=False)


def test_data_parallel_size_reaches_the_llm_keywords_and_serve_checks_the_devices(capsys):
    import jax

    from jaxserve.cli import _engine_keywords, build_parser

    args = build_parser().parse_args(["bench", "throughput", "--data-parallel-size", "2"])
    assert _engine_keywords(args)["data_parallel_size"] == 2
    assert _engine_keywords(build_parser().parse_args(["bench", "throughput"]))["data_parallel_size"] == 1
    # serve takes it (tests/server/test_data_parallel.py serves two replicas); too many is the LLM's error.
    assert main(["serve", "--data-parallel-size", str(jax.device_count() + 1)]) == 1
    assert "devices, but only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--data-parallel-size", "0"])
    assert exit_info.value.code == 2
