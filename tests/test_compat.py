"""jaxserve.compat on the installed jax (CI runs this file on the oldest and the newest supported jax): each
private name it wraps still answers what jaxserve asks of it. Fresh interpreters, so that what this test
process has already started (a backend, the distributed runtime) does not decide the answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

BACKENDS = """
import jax
from jaxserve import compat
assert compat.backends_initialized() is False, "no backend yet: importing jax creates none"
jax.numpy.zeros(2).block_until_ready()
assert compat.backends_initialized() is True, "a computation created the CPU backend"
"""

DISTRIBUTED = """
import jax
from jaxserve import compat
assert compat.distributed_client() is None, "no client before jax.distributed.initialize"
jax.distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=1, process_id=0)
client = compat.distributed_client()
assert client is not None, "jax.distributed.initialize started no client"
# What jaxserve.distributed.StepChannel does with it: set, blocking get, delete.
client.key_value_set_bytes("jaxserve/compat/0", b"\\x00step")
assert client.blocking_key_value_get_bytes("jaxserve/compat/0", 1000) == b"\\x00step"
client.key_value_delete("jaxserve/compat/0")
jax.distributed.shutdown()
assert compat.distributed_client() is None, "shutdown leaves no client"
"""


def run_fresh(code: str) -> None:
    env_code = "import os; os.environ['JAX_PLATFORMS'] = 'cpu'\n" + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backends_initialized_turns_true_once_a_backend_exists():
    run_fresh(BACKENDS)


def test_distributed_client_is_the_key_value_store_of_jax_distributed():
    run_fresh(DISTRIBUTED.format(port=free_port()))
