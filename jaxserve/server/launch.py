"""Running the application under uvicorn, and ending it cleanly.

The engine is an `LLM` of this process (its loop in a thread: `EngineThread`) or an `EngineProcess` (what
`jaxserve serve` runs). SIGINT / SIGTERM: uvicorn stops accepting connections and waits for the open ones;
`Server.handle_exit` first fails every request in flight (503, or a final error event in a stream) and
aborts it in the engine, so that wait is short; then the lifespan shutdown stops the engine loop, and
`serve` returns
(uvicorn re-raises the signal it caught once it is done; `serve` takes that signal itself, so the process
exits with status 0 rather than dying of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from jaxserve.llm import LLM
from jaxserve.server.app import build_app
from jaxserve.server.config import ServedModel, ServerConfig
from jaxserve.server.engine_process import EngineProcess
from jaxserve.server.frontend import AsyncEngine, Backend, EngineThread
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server, with `ready` set once it listens and a shutdown that aborts what is in flight."""

    def __init__(self, config: uvicorn.Config, frontend: AsyncEngine) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self.ready.set()

    def handle_exit(self, sig: int, frame: Any) -> None:
        """A signal (or a caller in another thread): aborting is left to the event loop, where it is safe."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.frontend.shut_down)
        super().handle_exit(sig, frame)


def make_server(
    engine: LLM | EngineProcess,
    host: str,
    port: int,
    config: ServerConfig,
    *,
    log_level: str = "info",
    access_log: bool = True,
) -> Server:
    """A uvicorn server of the application over `engine` (not started: `run()` it, or `serve`)."""
    backend: Backend
    if isinstance(engine, EngineProcess):
        model, backend = engine.model, engine
    else:
        model, backend = ServedModel.of(engine), EngineThread(engine.replicas, engine)
    app = build_app(model, AsyncEngine(backend, ServerMetrics(config.served_model_name)), config)
    uvicorn_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on"
    )
    return Server(uvicorn_config, app.state.server.frontend)


def serve(engine: LLM | EngineProcess, host: str, port: int, config: ServerConfig, *, log_level: str = "info") -> None:
    """Serves until SIGINT / SIGTERM, then returns once the shutdown is complete."""
    if config.api_key is None and not _is_loopback(host):
        logger.warning(
            "serving on %s without an API key: anyone who can reach this address can use the model "
            "(pass --api-key, or bind 127.0.0.1)",
            host,
        )
    server = make_server(engine, host, port, config, log_level=log_level)
    with _signals_taken():
        server.run()


@contextlib.contextmanager
def _signals_taken() -> Iterator[None]:
    """While uvicorn serves, its handlers replace these; the signal it re-raises at the end lands here."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
