"""The FastAPI application of `jaxserve serve`: vLLM's OpenAI-compatible routes over one `AsyncEngine`
(the engine in a thread of this process, or in its own process: `frontend`).

    POST /v1/completions, /v1/chat/completions   (whole responses, or server-sent events with stream=true)
    GET  /v1/models, /health, /version, /tokenizer_info, /metrics
    POST /tokenize, /detokenize
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (only when the engine serves LoRA adapters)

Bodies are read here (at most `max_request_bytes`, else 413) and parsed by `protocol`; `params` turns them
into engine inputs and `responses` turns outputs into JSON. Every error is OpenAI's error body. With an API
key, the /v1 routes need `Authorization: Bearer <key>` (401 otherwise), as vLLM's. A client that goes away
aborts its requests: a stream when the connection closes, a whole response through a watcher of the
connection that cancels the handler.

LoRA adapters (vLLM's): a request whose `model` is a loaded adapter's name is served with that adapter, the
served model name with the base model. The adapters of `ServerConfig.lora_modules` are loaded at start, through
the same engine call as /v1/load_lora_adapter; /v1/models lists each adapter with the base model as its parent.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from jaxserve.sampling import RequestOutput
from jaxserve.server import protocol
from jaxserve.server.config import ServedModel, ServerConfig
from jaxserve.server.driver import StepFailed, Unavailable
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.frontend import AsyncEngine, RequestGroup
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.params import EngineInputs, EngineLimits, chat_inputs, completion_inputs
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from jaxserve.server.responses import (
    ChatStream,
    CompletionStream,
    ResponseContext,
    chat_response,
    completion_response,
    sse,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its response was ready."""


class EventStream(StreamingResponse):
    """Server-sent events whose body iterator is closed however the response ends, a client gone while a
    chunk is being sent included: closing it aborts the stream's requests at once."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def build_app(model: ServedModel, frontend: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The application serving `model` through `frontend`; its lifespan starts and stops the front end's
    engine driver (an engine thread, or the engine process's loop)."""
    server = OpenAIServer(model, frontend, config)

    if config.lora_modules and not model.enable_lora:
        names = [module.name for module in config.lora_modules]
        raise ValueError(f"lora_modules {names} need an engine that serves LoRA adapters (enable_lora)")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.frontend.start()
        try:
            await server.load_lora_modules()
            yield
        finally:
            await server.frontend.stop()

    app = FastAPI(title="jaxserve", version=_version(), lifespan=lifespan)
    app.state.server = server
    authorized = [Depends(server.authorize)]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=authorized)
    if model.enable_lora:
        for path, route in (("load", server.load_lora_adapter), ("unload", server.unload_lora_adapter)):
            app.add_api_route(f"/v1/{path}_lora_adapter", route, methods=["POST"], dependencies=authorized)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])
    app.add_api_route("/metrics", server.metrics, methods=["GET"])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    return app


class OpenAIServer:
    """The routes' state: the engine's front end, its tokenizer and limits, and the metrics."""

    def __init__(self, model: ServedModel, frontend: AsyncEngine, config: ServerConfig) -> None:
        self.config = config
        self.model_name = config.served_model_name
        self.tokenizer = model.tokenizer
        self.max_seq_len = model.max_seq_len
        self.limits = EngineLimits(
            model.max_seq_len, model.vocab_size, model.prompt_logprob_variants, model.penalty_variants
        )
        self.frontend = frontend
        self.model_source = model.source
        self.created = int(time.time())
        # The LoRA adapters requests may name as `model`: name -> the path it was loaded from (None: loaded on the
        # LLM before the server started).
        self.adapters: dict[str, str | None] = dict.fromkeys(model.adapters)

    # ---- /v1 -------------------------------------------------------------------------------------

    async def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'")

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        lora_name = self._lora_name(body.model)
        inputs = completion_inputs(body, self.tokenizer, self.limits)
        ctx = self._context(body, "cmpl", inputs, logprobs=body.logprobs, echo=body.echo)
        group = await self._submit(inputs, ctx.id, body.stream, lora_name)
        if body.stream:
            return EventStream(self._completion_events(group, ctx, body.stream_options))
        finals = await self._finals(request, group)
        return JSONResponse(completion_response(ctx, finals))

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        lora_name = self._lora_name(body.model)
        inputs = chat_inputs(body, self.tokenizer, self.limits)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        ctx = self._context(body, "chatcmpl", inputs, logprobs=logprobs)
        group = await self._submit(inputs, ctx.id, body.stream, lora_name)
        if body.stream:
            return EventStream(self._chat_events(group, ctx, body.stream_options))
        [final] = await self._finals(request, group)
        return JSONResponse(chat_response(ctx, final))

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxserve",
            "root": self.model_source,
            "parent": None,
            "max_model_len": self.max_seq_len,
            "permission": [],
        }
        adapters = [
            {**card, "id": name, "root": path, "parent": self.model_name} for name, path in self.adapters.items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    # ---- LoRA adapters ---------------------------------------------------------------------------

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime load: {"lora_name", "lora_path"}; the adapter is served under its name from now on."""
        body: LoadLoraAdapterRequest = await self._parse(request, LoadLoraAdapterRequest)
        name = body.lora_name
        if not name:
            raise bad_request("lora_name must be a non-empty string", "lora_name")
        if name == self.model_name or name in self.adapters:
            raise bad_request(
                f"The LoRA adapter {name!r} has already been loaded (or names the base model).", "lora_name"
            )
        if body.load_inplace:
            raise bad_request("load_inplace is not supported: unload the adapter, then load it again", "load_inplace")
        await self._adapter_call(self.frontend.load_lora(name, body.lora_path), "lora_path")
        self.adapters[name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime unload: {"lora_name"}; requests naming it are refused at once, and it is unloaded once
        the requests in flight have finished."""
        body: UnloadLoraAdapterRequest = await self._parse(request, UnloadLoraAdapterRequest)
        name = body.lora_name
        if name not in self.adapters:
            raise bad_request(
                f"The LoRA adapter {name!r} cannot be found; loaded: {sorted(self.adapters)}", "lora_name"
            )
        path = self.adapters.pop(name)
        try:
            await self._adapter_call(self.frontend.unload_lora(name), "lora_name")
        except Exception:
            self.adapters[name] = path
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def load_lora_modules(self) -> None:
        """The adapters of `ServerConfig.lora_modules`, loaded before the server takes requests."""
        for module in self.config.lora_modules:
            try:
                await self.frontend.load_lora(module.name, module.path)
            except Exception as error:
                raise RuntimeError(f"LoRA module {module.name}={module.path}: {error}") from error
            self.adapters[module.name] = module.path

    async def _adapter_call(self, call: Awaitable[None], param: str) -> None:
        """An adapter load or unload; what refused it as a 400 (an adapter the model cannot take, a path without
        one), 503 when the engine is gone."""
        try:
            await call
        except (ValueError, TypeError, OSError) as error:
            raise bad_request(str(error), param) from None
        except Unavailable as error:
            raise APIError(503, str(error)) from None

    # ---- the other routes ------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.frontend.is_running:
            raise APIError(503, "the engine is not running")
        return Response(status_code=200)

    async def version(self) -> dict[str, str]:
        return {"version": _version()}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        body: protocol.TokenizeRequest = await self._parse(request, protocol.TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' (a string) and 'messages' (a conversation)", "prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            try:
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=add_special) if body.prompt else []
            except ValueError as error:  # e.g. a model without a tokenizer
                raise bad_request(str(error), "prompt") from None
        else:
            try:
                ids = self.tokenizer.apply_chat_template(
                    body.messages, add_generation_prompt=body.add_generation_prompt, chat_template=body.chat_template
                )
            except (TypeError, ValueError) as error:
                raise bad_request(str(error), "messages") from None
        strs = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_seq_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, str]:
        body: protocol.DetokenizeRequest = await self._parse(request, protocol.DetokenizeRequest)
        vocab = self.limits.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"tokens must be ids in [0, {vocab - 1}], got {outside[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def tokenizer_info(self) -> dict[str, Any]:
        """What lm-evaluation-harness's remote tokenizer reads: the eos and bos tokens (as text, which it
        encodes back to their ids) and the chat template."""
        tokenizer = self.tokenizer
        hf = getattr(tokenizer, "hf_tokenizer", None)
        eos, bos = tokenizer.eos_token_ids, getattr(tokenizer, "bos_token_id", None)
        return {
            "tokenizer_class": type(hf if hf is not None else tokenizer).__name__,
            "eos_token": tokenizer.decode(eos[:1], skip_special_tokens=False) if eos else None,
            "bos_token": tokenizer.decode([bos], skip_special_tokens=False) if bos is not None else None,
            "eos_token_ids": list(eos),
            "bos_token_id": bos,
            "chat_template": getattr(hf, "chat_template", None),
            "model_max_length": self.max_seq_len,
            "vocab_size": self.limits.vocab_size,
        }

    async def metrics(self) -> Response:
        return Response(self.frontend.metrics.render(), media_type=CONTENT_TYPE)

    # ---- pieces ----------------------------------------------------------------------------------

    async def _parse(self, request: Request, model: type[T]) -> T:
        """The body, read up to the size limit, decoded and validated; the model name checked."""
        body = protocol.parse(model, await self._read_json(request))  # type: ignore[arg-type]
        name = getattr(body, "model", None)
        if name is not None and name != self.model_name and name not in self.adapters:
            raise APIError(404, self._no_such_model(name), "model")
        ignored = body.ignored_fields()
        if ignored:
            logger.warning("fields present in the request but ignored: %s", ", ".join(ignored))
        return body

    def _lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (one `_parse` found), None for the base model."""
        return None if model is None or model == self.model_name else model

    def _no_such_model(self, name: str) -> str:
        adapters = f", and the LoRA adapters {sorted(self.adapters)}" if self.adapters else ""
        return f"The model `{name}` does not exist (this server serves `{self.model_name}`{adapters})."

    async def _read_json(self, request: Request) -> Any:
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_large = f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)"
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, too_large)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, too_large)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise bad_request(f"the request body is not valid JSON: {error}") from None

    def _context(
        self,
        body: protocol.SamplingFields,
        prefix: str,
        inputs: EngineInputs,
        *,
        logprobs: int | None,
        echo: bool = False,
    ) -> ResponseContext:
        return ResponseContext(
            id=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
            created=int(time.time()),
            model=getattr(body, "model", None) or self.model_name,
            tokenizer=self.tokenizer,
            n=inputs.params.n,
            logprobs=logprobs,
            echo=echo,
            echo_only=inputs.echo_only,
            texts=inputs.texts,
            include_stop_str=body.include_stop_str_in_output,
            tokens_as_ids=body.return_tokens_as_token_ids,
        )

    async def _submit(
        self, inputs: EngineInputs, response_id: str, stream: bool, lora_name: str | None
    ) -> RequestGroup:
        request_id = f"{response_id}-{uuid.uuid4().hex[:8]}"  # unique even when clients reuse request_id
        try:
            return await self.frontend.submit(
                inputs.prompts,
                inputs.params,
                request_id,
                stream=stream,
                stream_interval=self.config.stream_interval,
                lora_name=lora_name,
            )
        except (ValueError, TypeError) as error:
            if lora_name is not None and lora_name not in self.adapters:  # unloaded since the request was parsed
                raise APIError(404, self._no_such_model(lora_name), "model") from None
            raise bad_request(str(error)) from None
        except Unavailable as error:
            raise APIError(503, str(error)) from None

    async def _finals(self, request: Request, group: RequestGroup) -> list[RequestOutput]:
        try:
            finals = await _unless_disconnected(request, group.finals())
        except StepFailed as error:
            raise APIError(500, str(error)) from None
        except Unavailable as error:
            raise APIError(503, str(error)) from None
        finally:
            group.close()
        for output in finals:
            if output.error is not None:
                raise APIError(500, f"the engine could not serve the request: {output.error}")
        return finals

    async def _completion_events(
        self, group: RequestGroup, ctx: ResponseContext, options: StreamOptions | None
    ) -> AsyncGenerator[str, None]:
        stream = CompletionStream(ctx, bool(options and options.continuous_usage_stats))
        index_of = {request_id: i for i, request_id in enumerate(group.request_ids)}
        async for event in _events(group, lambda output: stream.chunks(index_of[output.request_id], output)):
            yield event
        if options is not None and options.include_usage and group.completed:
            yield sse(stream.usage_chunk())
        yield sse("[DONE]")

    async def _chat_events(
        self, group: RequestGroup, ctx: ResponseContext, options: StreamOptions | None
    ) -> AsyncGenerator[str, None]:
        stream = ChatStream(ctx, bool(options and options.continuous_usage_stats))
        for chunk in stream.role_chunks():
            yield sse(chunk)
        async for event in _events(group, stream.chunks):
            yield event
        if options is not None and options.include_usage and group.completed:
            yield sse(stream.usage_chunk())
        yield sse("[DONE]")


async def _events(group: RequestGroup, chunks: Any) -> AsyncIterator[str]:
    """The group's outputs as events; an error ends them with one `data: {"error": ...}` event. The group is
    closed (its unfinished requests aborted) however this ends."""
    try:
        async for output in group.outputs():
            if output.error is not None:
                raise APIError(500, f"the engine could not serve the request: {output.error}")
            for chunk in chunks(output):
                yield sse(chunk)
    except (APIError, StepFailed, Unavailable) as error:
        yield sse(_as_api_error(error).body())
    except Exception as error:
        logger.exception("a stream failed")
        yield sse(APIError(500, f"internal error: {type(error).__name__}: {error}").body())
    finally:
        group.close()


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter directory to serve under lora_name."""

    model_config = ConfigDict(extra="allow")

    lora_name: str
    lora_path: str
    load_inplace: bool = False

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's); lora_int_id is accepted and not needed."""

    model_config = ConfigDict(extra="allow")

    lora_name: str
    lora_int_id: int | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _as_api_error(error: Exception) -> APIError:
    if isinstance(error, APIError):
        return error
    return APIError(503 if isinstance(error, Unavailable) else 500, str(error))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientGone()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return JSONResponse(error.body(), status_code=error.status)


async def _client_gone(_: Request, error: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    message = f"{error.detail}: {request.method} {request.url.path}"
    return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code)


async def _internal_error(_: Request, error: Exception) -> Response:
    """Any other exception (uvicorn logs its traceback): a 500 in the OpenAI schema."""
    return JSONResponse(APIError(500, f"internal error: {type(error).__name__}: {error}").body(), status_code=500)


def _version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
