"""Python's full garbage collections against the engine (CPU or GPU; docs/benchmarks.md, "gc.freeze()").

    python benchmarks/gc_pauses.py objects [--cache-dir DIR]   # tracked objects, one full collection's time
    python benchmarks/gc_pauses.py bench on|off                # bench throughput, full collections after init

`objects` builds an LLM of the default model (max_batch_size 64, max_seq_len 256, decode sizes 1-64, the
whole table compiled at start, or loaded from the step store in DIR when a run before filled it) with the
freeze turned off, then prints how many objects the collector tracks and the fastest of three full
collections, then the same collection after `gc.freeze()`. Run it twice with one --cache-dir: cold, then
loaded. `bench` runs `jaxserve bench throughput --random-weights tiny-llama --num-requests 1024
--input-len 16 --output-len 32 --max-batch-size 1024` in this process with the LLM's freeze on or off and
counts the full collections after the LLM is ready (a `gc.callbacks` timer).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import tempfile
import time

import jaxserve.llm as llm_module


def _full_collection_ms() -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def objects(cache_dir: str) -> None:
    from jaxserve import LLM, CompileConfig

    llm_module._freeze_long_lived_objects = lambda: None  # measure what the freeze would take out
    compile_config = CompileConfig(cache_dir=cache_dir, lazy=False, decode_batch_sizes=(1, 8, 16, 32, 64))
    start = time.perf_counter()
    llm = LLM("smollm2-135m-instruct", max_batch_size=64, max_seq_len=256, compile_config=compile_config)
    ready = time.perf_counter() - start
    gc.collect()
    compiled = len(llm.engine.runner.compile_timings)
    print(f"ready in {ready:.1f} s ({compiled} executables compiled, the rest loaded from {cache_dir})")
    print(f"tracked objects {len(gc.get_objects())}, full collection {_full_collection_ms():.1f} ms")
    gc.freeze()
    print(f"after gc.freeze(): full collection {_full_collection_ms():.2f} ms")
    gc.unfreeze()
    llm.close()


def bench(freeze: bool) -> None:
    from jaxserve import cli

    if not freeze:
        llm_module._freeze_long_lived_objects = lambda: None
    pauses: list[float] = []
    state = {"ready": False, "start": 0.0}
    init = llm_module.LLM.__init__

    def init_then_mark(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        state["ready"] = True

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] == 2 and state["ready"]:
            if phase == "start":
                state["start"] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - state["start"])

    llm_module.LLM.__init__ = init_then_mark
    gc.callbacks.append(on_collection)
    out = io.StringIO()
    args = ["bench", "throughput", "--random-weights", "tiny-llama", "--num-requests", "1024", "--input-len", "16"]
    with contextlib.redirect_stdout(out):
        cli.main([*args, "--output-len", "32", "--max-batch-size", "1024", "--json"])
    record = json.loads(out.getvalue())
    print(
        f"freeze {'on' if freeze else 'off'}: {record['output_tok_per_s']:.0f} output tok/s, host "
        f"{record['steps']['mean_host_ms']:.2f} ms per step, {len(pauses)} full collections after init, "
        f"{1e3 * sum(pauses):.0f} ms in all"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("objects").add_argument("--cache-dir", default=None)
    sub.add_parser("bench").add_argument("freeze", choices=("on", "off"))
    args = parser.parse_args()
    if args.what == "objects":
        objects(args.cache_dir or tempfile.mkdtemp())
    else:
        bench(args.freeze == "on")


if __name__ == "__main__":
    main()
