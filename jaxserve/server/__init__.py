"""The OpenAI-compatible HTTP server behind `jaxserve serve` (FastAPI + uvicorn).

    protocol.py   request bodies (pydantic), with vLLM's field names and defaults
    params.py     request -> prompt token ids and SamplingParams, checked against the engine
    responses.py  RequestOutput -> response JSON: completions, chat, logprobs, usage, stream chunks
    frontend.py   the async front end over the engine driver (which steps the data-parallel replicas),
                  and the driver in a thread of this process (EngineThread)
    engine_process.py  the driver in a process of its own (what `jaxserve serve` runs)
    metrics.py    the Prometheus metrics of one server
    config.py     ServerConfig: the served model name, the API key, the body size limit; ServedModel
    app.py        the FastAPI application: routes, authentication, errors
    launch.py     uvicorn, signals and a clean shutdown

Only the server imports fastapi, uvicorn and prometheus-client: the engine and the other commands work
without them.
"""
