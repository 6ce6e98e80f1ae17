"""The engine in a process of its own, what `jaxserve serve` runs (as vLLM's engine core): the HTTP front end
(the event loop: parsing, tokenizing, streaming) and the engine loop (scheduling, dispatch, detokenizing)
each have a GIL, so many streaming clients no longer stretch the engine's steps.

    server process                                       engine process (spawned)
    AsyncEngine --("submit" | "abort" | "stop")--pipe--> commands thread --> EngineDriver
                  ("load_lora" | "unload_lora")
    AsyncEngine <--loop-- reader thread <--pipe-- sender thread <--queue-- EngineDriver.run
                          ("submitted" | "called" | "step" | "failed" | "ended")

The engine process builds the `LLM` itself (`build(arg)`, a picklable function: the devices belong to it,
the server process never starts a jax backend) and answers ("ready", ServedModel), or ("error", the
exception) if it could not: `EngineProcess(...)` returns once the engine is ready, or raises that error.
The server process reads its pipe in a thread of its own, which hands each message to the event loop
(`call_soon_threadsafe`): the loop's own readiness callbacks would not do, as uvloop makes the descriptor
non-blocking and a message can arrive in parts. Each round's outputs are one message, in the driver's order.
A LoRA load or unload runs on the driver's side (`EngineDriver.load_lora`, through the engine process's LLM) and
is answered ("called", its number, the error or None).
In the engine process a sender thread pickles and writes the messages, so the engine loop waits neither on
pickling nor on a full pipe (the reader thread needs the GIL of a busy event loop to empty it); both
processes shorten the GIL's switch interval (`jaxserve.gil`) while these threads run.

Stopping: `stop` (the server's lifespan shutdown, after the requests in flight were aborted) asks the
driver to drain and end; the engine process closes its LLM and exits. SIGINT does not reach the engine
process's loop (a Ctrl-C in a terminal signals both processes; the server stops the engine in order);
should the server process die, the engine process sees the pipe close and exits at once. Should the engine
process die, every request in flight fails with Unavailable (a 503) and /health answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

from jaxserve import gil
from jaxserve.sampling import SamplingParams
from jaxserve.server.config import ServedModel
from jaxserve.server.driver import EngineDriver, Event, Unavailable

logger = logging.getLogger(__name__)

# How long `close` waits for the engine process to end by itself before it is terminated.
STOP_TIMEOUT_S = 120.0


class EngineProcess:
    """The engine loop in a spawned process, over the LLM that `build(arg)` makes there; a Backend of
    `AsyncEngine`. Blocks until the engine is ready (its warmup included) and raises what stopped it from
    starting; `model` is what the front end needs of it. Use as a context manager, or `close()` it."""

    def __init__(self, build: Callable[[Any], Any], arg: Any, *, log_level: int = logging.WARNING) -> None:
        context = multiprocessing.get_context("spawn")  # a forked child would inherit the parent's threads
        commands, self._commands = context.Pipe(duplex=False)
        self._events, events = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_engine_main, args=(commands, events, build, arg, log_level), name="jaxserve-engine", daemon=True
        )
        self._process.start()
        commands.close()
        events.close()
        self._reader: threading.Thread | None = None
        self._gil = contextlib.ExitStack()  # the short GIL switch interval while the reader thread runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[Event], None] | None = None
        self._pending: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[None]] = {}  # LoRA loads and unloads, by number, until answered
        self._next_call = 0
        self._gone = False
        try:
            self.model: ServedModel = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self) -> ServedModel:
        try:
            message = self._events.recv()
        except (EOFError, OSError):
            self._process.join(10)
            raise RuntimeError(
                f"the engine process exited (code {self._process.exitcode}) before it was ready; its log is above"
            ) from None
        if message[0] == "error":
            raise message[1]
        if message[0] != "ready":
            raise RuntimeError(f"the engine process sent {message[0]!r} before it was ready")
        return message[1]

    # ---- Backend (event loop thread) -------------------------------------------------------------

    def start(self, deliver: Callable[[Event], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._deliver = deliver
        # The reader thread takes the GIL from the busy event loop at least twice a message.
        self._gil.enter_context(gil.short_switch_interval())
        self._reader = threading.Thread(target=self._read, name="jaxserve-engine-events", daemon=True)
        self._reader.start()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool,
        stream_interval: int,
        lora_name: str | None = None,
    ) -> Awaitable[object]:
        assert self._loop is not None, "start() first"
        future: asyncio.Future[None] = self._loop.create_future()
        self._pending[request_id] = future
        if not self._send(("submit", prompt, params, request_id, stream, stream_interval, lora_name)):
            self._pending.pop(request_id, None)
            future.set_exception(Unavailable("the engine process is not running"))
        return future

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def load_lora(self, name: str, path: str) -> Awaitable[object]:
        return self._call("load_lora", name, path)

    def unload_lora(self, name: str) -> Awaitable[object]:
        return self._call("unload_lora", name)

    def _call(self, kind: str, *args: Any) -> asyncio.Future[None]:
        assert self._loop is not None, "start() first"
        future: asyncio.Future[None] = self._loop.create_future()
        number, self._next_call = self._next_call, self._next_call + 1
        self._calls[number] = future
        if not self._send((kind, number, *args)):
            self._calls.pop(number, None)
            future.set_exception(Unavailable("the engine process is not running"))
        return future

    @property
    def is_running(self) -> bool:
        return not self._gone and self._process.is_alive()

    async def stop(self) -> None:
        """Asks the engine loop to drain and end, and waits for the process (its outputs read meanwhile)."""
        self._send(("stop",))
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 10)  # what it sent last
        await asyncio.sleep(0)  # ... handed to the loop
        self.close()

    # ---- the pipe --------------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> bool:
        if self._gone:
            return False
        try:
            self._commands.send(message)
        except (BrokenPipeError, OSError):
            return False
        return True

    def _read(self) -> None:
        """The reader thread: every message, handed to the loop in order; the pipe's end, as `_lost`."""
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if not self._call_in_loop(self._handle, message):
                return
        self._call_in_loop(self._lost)

    def _call_in_loop(self, callback: Callable[..., None], *args: Any) -> bool:
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed in between
            return False
        return True

    def _handle(self, message: tuple[Any, ...]) -> None:
        if message[0] in ("submitted", "called"):
            kind, key, error = message
            future = (self._pending if kind == "submitted" else self._calls).pop(key, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
        elif self._deliver is not None:
            self._deliver(message)

    def _lost(self) -> None:
        """The pipe closed: the engine process ended (or is ending)."""
        if self._gone:
            return
        self._gone = True
        self._process.join(1)  # it is exiting: the pipe closes with the process
        message = f"the engine process exited (code {self._process.exitcode})"
        for future in [*self._pending.values(), *self._calls.values()]:
            if not future.done():
                future.set_exception(Unavailable(message))
        self._pending.clear()
        self._calls.clear()
        if self._deliver is not None:
            self._deliver(("ended", message))

    def close(self) -> None:
        """Ends the engine process: asks it to stop, then terminates it if it has not ended in time."""
        if self._process.is_alive():
            self._send(("stop",))
            self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: terminating it", STOP_TIMEOUT_S)
            self._process.terminate()
            self._process.join(10)
        self._gone = True
        self._commands.close()
        self._events.close()
        self._gil.close()


# ---- the engine process ---------------------------------------------------------------------------


def _engine_main(
    commands: Connection, events: Connection, build: Callable[[Any], Any], arg: Any, log_level: int
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process stops the engine, in order
    logging.basicConfig(level=log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        llm = build(arg)
    except BaseException as error:
        events.send(("error", _portable(error)))
        return
    # The engine loop hands its messages to a sender thread, which pickles and writes them: the loop never
    # waits on the pipe (a full pipe, while the server process's reader waits for its GIL) or on pickling.
    outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_events, args=(outbox, events), name="jaxserve-events", daemon=True)
    sender.start()

    def emit(*message: Any) -> None:
        outbox.put(message)

    try:
        with llm, gil.short_switch_interval():  # the loop, the commands and the sender thread share the GIL
            driver = EngineDriver(llm.replicas, emit, llm)
            emit("ready", ServedModel.of(llm))
            threading.Thread(
                target=_serve_commands, args=(commands, driver, emit), name="jaxserve-commands", daemon=True
            ).start()
            driver.run()
    finally:
        outbox.put(None)  # what the loop sent last (its "ended" too) reaches the server before the exit
        sender.join()


def _send_events(outbox: queue.SimpleQueue[tuple[Any, ...] | None], events: Connection) -> None:
    """The sender thread: every message of the outbox to the server process, in order, until None."""
    while (message := outbox.get()) is not None:
        try:
            events.send(message)
        except (BrokenPipeError, OSError):  # the server process is gone: the commands thread exits
            pass


def _serve_commands(commands: Connection, driver: EngineDriver, emit: Callable[..., None]) -> None:
    """The server's requests, applied to the driver as they arrive."""
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            logger.warning("the server process is gone: the engine process exits")
            os._exit(0)
        kind = message[0]
        if kind == "submit":
            _, prompt, params, request_id, stream, interval, lora_name = message
            future = driver.submit(
                prompt, params, request_id, stream=stream, stream_interval=interval, lora_name=lora_name
            )
            future.add_done_callback(lambda done, rid=request_id: emit("submitted", rid, _portable(done.exception())))
        elif kind in ("load_lora", "unload_lora"):
            _, number, *args = message
            called = driver.load_lora(*args) if kind == "load_lora" else driver.unload_lora(*args)
            called.add_done_callback(lambda done, n=number: emit("called", n, _portable(done.exception())))
        elif kind == "abort":
            driver.abort(message[1])
        elif kind == "stop":
            driver.request_stop()
            return
        else:
            logger.error("unknown message from the server process: %r", kind)


def _portable(error: BaseException | None) -> BaseException | None:
    """The error itself if it pickles, else a RuntimeError with its text."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
