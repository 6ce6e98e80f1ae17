"""The multi-process arguments are checked before anything starts, with messages that name what to fix:
`DistributedConfig` (what `jaxserve.distributed.initialize` takes) and `jaxserve serve --coordinator
--num-processes --process-id`."""

from __future__ import annotations

import re

import pytest

from jaxserve.cli import main
from jaxserve.distributed import DistributedConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(coordinator_address="h:1", num_processes=0, process_id=0), ValueError, "num_processes must be >= 1"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), ValueError, r"process_id must be in \[0, 1\]"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=-1), ValueError, "process_id must be in"),
        (dict(num_processes=2, process_id=1), ValueError, "coordinator_address missing"),
        (dict(coordinator_address="h:1", num_processes=2), ValueError, "process_id missing"),
        (dict(coordinator_address="host", num_processes=2, process_id=0), ValueError, "must be HOST:PORT"),
        (dict(coordinator_address="h:99999", num_processes=2, process_id=0), ValueError, "must be HOST:PORT"),
        (dict(coordinator_address="h:1", num_processes=2.0, process_id=0), TypeError, "num_processes must be an int"),
        (dict(heartbeat_timeout_s=0), ValueError, "heartbeat_timeout_s must be >= 1"),
    ],
)
def test_bad_distributed_configs_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        DistributedConfig(**kwargs)


def test_good_distributed_configs():
    assert DistributedConfig().num_processes is None  # jax's cluster detection
    assert DistributedConfig("10.0.0.1:1234", 2, 1).process_id == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator=127.0.0.1:1234", "--num-processes=2", "--process-id=2"], r"--process-id must be in \[0, 1\]"),
        (["--coordinator=127.0.0.1:1234", "--num-processes=2"], "go together: give all three or none"),
        (["--num-processes=2", "--process-id=0"], "go together"),
        (["--coordinator=localhost", "--num-processes=2", "--process-id=0"], "--coordinator must be HOST:PORT"),
        (["--num-processes=0"], "--num-processes: must be an int >= 1"),
    ],
)
def test_serve_refuses_bad_multihost_flags(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--random-weights=tiny-llama", *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
