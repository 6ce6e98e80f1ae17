"""Which of XLA's two GPU clients jax starts for an engine's process.

jax's CUDA plugin starts XLA's StreamExecutor client unless XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 asks for
its TFRT client. The TFRT client hands each execution to a thread of its own (one per device), which
updates the step's recorded CUDA graphs and launches them, so the engine's call of a compiled step returns
sooner and the engine loop builds the next step while that thread launches this one: about half the
host time per dispatch, with the same tokens and the same device step time (docs/performance.md).

jaxserve sets the variable as it sets the memory fraction (`capacity.raise_memory_fraction_default`): only
when the user has not, only before jax starts a backend (the client is chosen then, once per process), and
only for an engine on one device, the configuration it was measured in; tensor- and data-parallel
engines keep jax's default client. Set the variable to 0 to keep the StreamExecutor client, or to 1 before
anything starts jax (a notebook that ran jax first) to choose the TFRT one.
"""

from __future__ import annotations

import logging
import os

from jaxserve.capacity import env_default_before_jax, gpu_backend_possible

logger = logging.getLogger(__name__)

TFRT_CLIENT_ENV = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"
_set_here = False  # this process already set it (the CLI, then LLM): say so once


def use_tfrt_client_default(num_devices: int) -> bool:
    """Sets TFRT_CLIENT_ENV=1 for an engine of `num_devices` devices when that is one, the user has not set
    the variable, jax has no backend yet and may start a GPU one. Returns whether it was set."""
    global _set_here
    if _set_here:
        return False
    if TFRT_CLIENT_ENV not in os.environ and (num_devices != 1 or not gpu_backend_possible()):
        return False
    outcome = env_default_before_jax(TFRT_CLIENT_ENV, "1", logger)
    if outcome == "started":
        logger.info("jax is already initialised: its GPU client stays as it is (%s is read at start)", TFRT_CLIENT_ENV)
    if outcome != "set":
        return False
    _set_here = True
    logger.info("set %s=1: XLA's TFRT GPU client launches each step from a thread of its own", TFRT_CLIENT_ENV)
    return True


def active_client(platform: str) -> str | None:
    """The GPU client this process runs on a device of `platform`: "tfrt" or "stream_executor" as the
    variable asks (jax's CUDA plugin reads it as an integer when it starts), None off a GPU. Read from the
    environment: set after jax started, the variable does not describe the running client."""
    if platform not in ("gpu", "cuda"):
        return None
    try:
        tfrt = int(os.environ.get(TFRT_CLIENT_ENV, "0")) != 0
    except ValueError:
        tfrt = False
    return "tfrt" if tfrt else "stream_executor"
