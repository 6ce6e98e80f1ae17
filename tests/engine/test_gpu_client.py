"""The GPU client default (jaxserve/gpu_client.py): XLA's TFRT client for a one-device engine, asked for
only when the user has not chosen, before jax starts a backend, and said once."""

import logging

import pytest

from jaxserve import capacity, cli, gpu_client

ENV = gpu_client.TFRT_CLIENT_ENV


@pytest.fixture
def fresh(monkeypatch):
    """A process where nothing has set the variable yet, jax has no backend and a GPU one may start."""
    monkeypatch.setenv(ENV, "")  # records the variable's state, so what the code sets is undone after the test
    monkeypatch.delenv(ENV)
    monkeypatch.setattr(gpu_client, "_set_here", False)
    monkeypatch.setattr(capacity, "backends_started", lambda: False)
    monkeypatch.setattr(gpu_client, "gpu_backend_possible", lambda: True)
    return monkeypatch


def test_one_device_engine_asks_for_the_tfrt_client_once(fresh, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.gpu_client"):
        assert gpu_client.use_tfrt_client_default(1) is True
        assert gpu_client.use_tfrt_client_default(1) is False  # the LLM after the CLI: nothing more, no log
    assert gpu_client.os.environ[ENV] == "1"
    assert [r.getMessage() for r in caplog.records] == [
        f"set {ENV}=1: XLA's TFRT GPU client launches each step from a thread of its own"
    ]


def test_the_users_choice_is_kept(fresh, caplog):
    fresh.setenv(ENV, "0")
    with caplog.at_level(logging.INFO, logger="jaxserve.gpu_client"):
        assert gpu_client.use_tfrt_client_default(1) is False
    assert gpu_client.os.environ[ENV] == "0"
    assert f"{ENV}=0 (set by the user)" in caplog.text


@pytest.mark.parametrize("num_devices", [0, 2, 8])
def test_multi_device_engines_keep_jaxs_default_client(fresh, num_devices):
    assert gpu_client.use_tfrt_client_default(num_devices) is False
    assert ENV not in gpu_client.os.environ


def test_nothing_is_set_once_jax_has_started_or_where_no_gpu_can_start(fresh, caplog):
    fresh.setattr(capacity, "backends_started", lambda: True)
    with caplog.at_level(logging.INFO, logger="jaxserve.gpu_client"):
        assert gpu_client.use_tfrt_client_default(1) is False
    assert "already initialised" in caplog.text
    fresh.setattr(capacity, "backends_started", lambda: False)
    fresh.setattr(gpu_client, "gpu_backend_possible", lambda: False)
    assert gpu_client.use_tfrt_client_default(1) is False
    assert ENV not in gpu_client.os.environ


@pytest.mark.parametrize(
    "flags, devices",
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--data-parallel-size", "2"], 2),
        (["--tensor-parallel-size", "2", "--data-parallel-size", "4"], 8),
    ],
)
def test_the_cli_counts_the_engines_devices(flags, devices):
    args = cli.build_parser().parse_args(["bench", "latency", "--random-weights", "tiny-llama", *flags])
    assert cli._engine_devices(args) == devices
    serve = cli.build_parser().parse_args(["serve", *flags])
    assert cli._engine_devices(serve) == devices


def test_a_multi_process_server_counts_every_process():
    args = cli.build_parser().parse_args(
        ["serve", "--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "0"]
    )
    assert cli._engine_devices(args) == 2


def test_llm_asks_for_the_client_by_its_device_count(monkeypatch, tiny_model):
    from jaxserve.llm import LLM

    class Stop(Exception):
        pass

    asked = []

    def record(num_devices):
        asked.append(num_devices)
        raise Stop  # before any engine is built

    monkeypatch.setattr(gpu_client, "use_tfrt_client_default", record)
    model = tiny_model("llama")
    for keywords in ({}, {"tensor_parallel_size": 1}, {"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        with pytest.raises(Stop):
            LLM(model, **keywords)
    assert asked == [1, 1, 0, 0]


@pytest.mark.parametrize(
    "platform, value, client",
    [("cpu", "1", None), ("gpu", None, "stream_executor"), ("gpu", "0", "stream_executor"), ("cuda", "1", "tfrt")],
)
def test_the_active_client_is_named_as_the_variable_asks(monkeypatch, platform, value, client):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert gpu_client.active_client(platform) == client
