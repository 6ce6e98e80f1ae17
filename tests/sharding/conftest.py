"""Shared by the sharding tests: run a check script in a fresh process with several host devices.

jax fixes its device count when it starts, so multi-device checks run in their own process
(XLA_FLAGS=--xla_force_host_platform_device_count=N) and print their results as one JSON line. They compile
with jax's most optimisations off (JAX_DISABLE_MOST_OPTIMIZATIONS): the checks compare sharded results with
single-device ones (token for token or within a tolerance) and read layouts, none what XLA's passes make of a
program, and compiling the 4-device programs is most of their time (tests/sharding took half as long with it on
a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest


def _run_with_host_devices(script: str, num_devices: int = 4, timeout: int = 900) -> dict:
    devices = f"--xla_force_host_platform_device_count={num_devices}"
    env = dict(os.environ, XLA_FLAGS=devices, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def run_with_host_devices() -> Callable[..., dict]:
    """`run_with_host_devices(script, num_devices=4)`: the JSON the script printed last."""
    return _run_with_host_devices
