"""Multi-process serving through jax.distributed: one global mesh over every process's devices, one
scheduler on process 0.

Every process runs the same program (`jaxserve serve ... --coordinator HOST:PORT --num-processes N
--process-id I`, or a script that calls `initialize` first). Each builds the same engine over the global
mesh (tensor parallelism across processes): the same runner, the same probe and the same KV pool, whose
size is the minimum over the processes (`agree_on_num_blocks`). Process 0 then owns the scheduler, the
block manager and the front end; the runner sends each step it dispatches through a `StepChannel` (which
compiled step, then its StepInputs) and every other process `follow`s: it runs the same compiled step on
the same inputs, so that the collectives inside the step meet. Only process 0 reads the outputs. When
process 0 closes its engine it sends "stop" and the followers return. A LoRA adapter slot process 0 writes
(`Runner.write_adapter`) goes through the channel too, before the step that reads it: the adapter's name and
the PEFT directory it was read from, which every process reads for itself (as each reads the checkpoint), or
none for a slot zeroed; an adapter from memory is refused in a multi-process run (`Engine.load_adapter`).

The channel is the coordination service's key-value store (the gRPC service jax.distributed starts on
process 0), not a device collective: sending a step through it measured several times faster than
`multihost_utils.broadcast_one_to_all` (a psum over the processes) of the same inputs
(docs/log/2026-benchmarks.md, "Figures moved out of the code").

A dead peer: a step in flight fails at once (the CPU collectives' connection is reset) and the engine
refuses to go on; an idle process learns of it from the coordination service within the heartbeat
timeout, and jax ends it with a log line that names the process that stopped answering.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve import compat
from jaxserve.buckets import Bucket
from jaxserve.lora import LoraAdapter, read_peft_dir
from jaxserve.runner import Runner
from jaxserve.step_inputs import StepInputs, padding_inputs
from jaxserve.variants import StepConfig, StepVariant

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10  # jax's default (100 s) leaves a server hanging that long on a dead peer
_POLL_MS = 10_000  # a follower's wait for the next step, repeated while process 0 is idle
# Process 0 keeps the messages of the last _KEPT_STEPS steps in the store (the steps and the adapter writes
# between them). A step cannot complete before every follower has run it (its collectives wait for them: the
# engine is split over every process's devices, `LLM` refuses other layouts), and the engine reads each
# step's tokens at most two steps after dispatching it, so a follower has always read a message long before
# it is deleted.
_KEPT_STEPS = 16
_STEP, _STOP, _ADAPTER = 0, 1, 2
_channel_numbers = itertools.count()


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Where the processes of one run meet. All of coordinator_address, num_processes and process_id, or
    none of them (jax's cluster detection: Slurm, Open MPI, TPU pods; JAX_COORDINATOR_ADDRESS)."""

    coordinator_address: str | None = None  # "HOST:PORT" of process 0, which starts the coordinator there
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    initialization_timeout_s: int = 300  # how long a process waits for the others to join
    # How long an exiting process waits for the others to exit too (jax then ends them all): what process 0
    # does after closing its LLM, and a follower that failed, are bounded by it.
    shutdown_timeout_s: int = 60

    def __post_init__(self) -> None:
        given = [f for f in ("coordinator_address", "num_processes", "process_id") if getattr(self, f) is not None]
        if given and len(given) < 3:
            missing = sorted({"coordinator_address", "num_processes", "process_id"} - set(given))
            raise ValueError(
                f"distributed serving needs coordinator_address, num_processes and process_id together "
                f"(or none of them, for jax's cluster detection): {', '.join(missing)} missing"
            )
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"coordinator_address must be HOST:PORT (process 0's address and a free port), "
                    f"got {self.coordinator_address!r}"
                )
        timeouts = ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s")
        for name in ("num_processes", "process_id", *timeouts):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes - 1}] (num_processes={self.num_processes}), "
                f"got {self.process_id}"
            )
        for name in timeouts:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 second, got {getattr(self, name)}")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    initialization_timeout_s: int = 300,
    shutdown_timeout_s: int = 60,
) -> DistributedConfig:
    """Joins this process to a multi-process run (`jax.distributed.initialize`); call it before anything
    else uses jax. Returns the validated config. Blocks until every process has joined."""
    config = DistributedConfig(
        coordinator_address,
        num_processes,
        process_id,
        heartbeat_timeout_s,
        initialization_timeout_s,
        shutdown_timeout_s,
    )
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialized in this process: initialize once")
    # Cross-process collectives on CPU (the default implementation in recent jax; explicit, since without
    # one a CPU mesh over several processes compiles but its collectives fail).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        config.coordinator_address,
        config.num_processes,
        config.process_id,
        initialization_timeout=config.initialization_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        shutdown_timeout_seconds=config.shutdown_timeout_s,
    )
    logger.info(
        "process %d of %d: %d local devices, %d in all (coordinator %s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "detected"),
    )
    return config


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0: the one that schedules and serves (every process of a single-process run)."""
    return jax.process_index() == 0


def agree_on_num_blocks(num_blocks: int) -> int:
    """The smallest of every process's KV pool size (every process calls it at the same point): the pool
    is one global array, its size part of every compiled step's shapes."""
    sizes = [int(n) for n in multihost_utils.process_allgather(np.int64(num_blocks))]
    agreed = min(sizes)
    if agreed < num_blocks:
        logger.warning(
            "KV pool lowered from %d to %d blocks: the smallest over the processes %s", num_blocks, agreed, sizes
        )
    else:
        logger.info("KV pool of %d blocks on every process (each process's own: %s)", agreed, sizes)
    return agreed


def check_adapter_source(adapter: LoraAdapter) -> None:
    """ValueError for an adapter from memory, which the other processes of a multi-process run cannot read."""
    if adapter.path is None:
        raise ValueError(
            f"LoRA adapter {adapter.name!r} comes from memory: a multi-process run serves adapters from a PEFT "
            "directory that every process can read (LoRARequest's lora_path, load_lora(name, path))"
        )


@dataclass(frozen=True, slots=True)
class AdapterWrite:
    """A LoRA slot process 0 wrote: the adapter `name` read from its PEFT directory `path`, or (both None) zeros."""

    slot: int
    name: str | None
    path: str | None

    def read(self) -> LoraAdapter | None:
        """The adapter, read from its directory by this process (None: the slot is zeroed)."""
        if self.path is None:
            return None
        try:
            return read_peft_dir(self.name, self.path)
        except (OSError, ValueError) as error:
            raise RuntimeError(
                f"process {jax.process_index()} could not read LoRA adapter {self.name!r} from {self.path}, which "
                f"process 0 loaded: every process reads it from that path: {error}"
            ) from error


def follow(runner: Runner, channel: StepChannel) -> int:
    """A follower's loop: runs each step process 0 sends, on the same inputs, and writes each LoRA slot it
    wrote, until process 0 stops; returns the number of steps run. It waits for each step's tokens before
    running the one after next, so that a failed step raises here rather than leaving calls queued behind it."""
    previous, count = None, 0
    while (message := channel.receive(runner.spec.steps)) is not None:
        if isinstance(message, AdapterWrite):
            adapter = message.read()
            if adapter is not None:
                runner.weights.check_adapter(adapter)
                runner.weights.prepare_adapter(adapter)
            runner.weights.write_adapter(message.slot, adapter)
            continue
        bucket, variant, inputs = message
        output = runner.run(inputs, bucket, variant)
        if previous is not None:
            jax.block_until_ready(previous.token_ids)
        previous, count = output, count + 1
    if previous is not None:
        jax.block_until_ready(previous.token_ids)
    logger.info("process %d: process 0 stopped after %d steps", jax.process_index(), count)
    return count


class StepChannel:
    """Process 0 -> the followers: one message per step, in order, through the coordination service's
    key-value store. A message is a header (step or stop, and the index of the step's (bucket, variant)
    in `StepConfig.compiled_steps()`) then the raw bytes of the StepInputs leaves; the receiver rebuilds
    them over `padding_inputs` of that step, the one declaration of their shapes and dtypes. An adapter
    write is a header (adapter, and the slot) then its name and path as JSON."""

    def __init__(self) -> None:
        client = compat.distributed_client()  # the store multihost_utils uses too
        if client is None:
            raise RuntimeError("jax.distributed is not initialized: call jaxserve.distributed.initialize first")
        # Every process builds its engines, and so their channels, in the same order: the n-th channel of
        # each process has the same name, and a later engine's keys do not meet an earlier one's.
        self._name = f"jaxserve/steps/{next(_channel_numbers)}"
        self._client, self._count, self._stopped = client, 0, False
        self._deleted = 0  # the messages below this count are deleted from the store
        self._step_ends: collections.deque[int] = collections.deque()  # the count after each kept step
        self._templates: dict[int, tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]] = {}
        self._indices: dict[tuple[Bucket, StepVariant], int] = {}
        self._steps: StepConfig | None = None

    def send_step(self, steps: StepConfig, bucket: Bucket, variant: StepVariant, inputs: StepInputs) -> None:
        index = self._index(steps, bucket, variant)
        treedef, layout = self._template(steps, index)
        leaves, sent_treedef = jax.tree.flatten(inputs)
        if sent_treedef != treedef or [(leaf.shape, leaf.dtype) for leaf in leaves] != layout:
            raise ValueError(f"the inputs of step {bucket} {variant} do not have the shapes of its padding inputs")
        self._send(_STEP, index, b"".join(np.ascontiguousarray(leaf).tobytes() for leaf in leaves))

    def send_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Tells the followers to write `slot` as this process does: the adapter read from its PEFT directory
        (ValueError for an adapter from memory, which they cannot read), or zeros (None)."""
        if adapter is not None:
            check_adapter_source(adapter)
        names = {"name": None, "path": None} if adapter is None else {"name": adapter.name, "path": adapter.path}
        self._send(_ADAPTER, slot, json.dumps(names).encode())

    def send_stop(self) -> None:
        if not self._stopped:
            self._send(_STOP, 0, b"")
            self._stopped = True

    def receive(self, steps: StepConfig) -> tuple[Bucket, StepVariant, StepInputs] | AdapterWrite | None:
        """The next step or adapter write (None: process 0 stopped); waits for it as long as process 0 is alive."""
        message = self._receive()
        kind, index = (int(x) for x in np.frombuffer(message[:8], np.int32))
        if kind == _STOP:
            return None
        if kind == _ADAPTER:
            names = json.loads(message[8:])
            return AdapterWrite(index, names["name"], names["path"])
        bucket, variant = self._compiled_steps(steps)[index]
        treedef, layout = self._template(steps, index)
        leaves, offset = [], 8
        for shape, dtype in layout:
            size = int(np.prod(shape)) * dtype.itemsize
            leaves.append(np.frombuffer(message, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape))
            offset += size
        return bucket, variant, jax.tree.unflatten(treedef, leaves)

    def _send(self, kind: int, index: int, payload: bytes) -> None:
        if self._count == 0:  # a process 0 that exits without closing its engine still stops the followers
            atexit.register(self.send_stop)
        header = np.array([kind, index], np.int32).tobytes()
        self._client.key_value_set_bytes(f"{self._name}/{self._count}", header + payload)
        self._count += 1
        if kind != _STEP:
            return
        self._step_ends.append(self._count)
        if len(self._step_ends) > _KEPT_STEPS:  # the messages up to the step _KEPT_STEPS steps back
            end = self._step_ends.popleft()
            for number in range(self._deleted, end):
                self._client.key_value_delete(f"{self._name}/{number}")
            self._deleted = end

    def _receive(self) -> bytes:
        key = f"{self._name}/{self._count}"
        while True:
            try:
                message = self._client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except Exception as error:  # jax raises its runtime error; only a timeout means "still idle"
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise RuntimeError(f"process {jax.process_index()} lost process 0: {error}") from error
        self._count += 1
        return message

    def _compiled_steps(self, steps: StepConfig) -> tuple[tuple[Bucket, StepVariant], ...]:
        if steps is not self._steps:  # the engine may replace its step table once, before it starts
            self._steps, self._templates = steps, {}
            self._indices = {step: i for i, step in enumerate(steps.compiled_steps())}
        return tuple(self._indices)

    def _index(self, steps: StepConfig, bucket: Bucket, variant: StepVariant) -> int:
        self._compiled_steps(steps)
        return self._indices[(bucket, variant)]

    def _template(self, steps: StepConfig, index: int) -> tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]:
        if index not in self._templates:
            bucket, variant = self._compiled_steps(steps)[index]
            leaves, treedef = jax.tree.flatten(padding_inputs(bucket, variant, steps))
            self._templates[index] = treedef, [(leaf.shape, leaf.dtype) for leaf in leaves]
        return self._templates[index]
