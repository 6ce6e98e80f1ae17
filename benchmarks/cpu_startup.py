"""Start-up and scoring on a CPU with the default model (SmolLM2-135M-Instruct).

    python benchmarks/cpu_startup.py [--repeats 2] [--json]

Each figure comes from a fresh Python process (what a user pays), after one untimed run of the same
command so that the model cache, the converted model and the step store are warm:

- `chat`: the wall time of `jaxserve chat "What is the capital of France?" --max-tokens 16`;
- `llm_ready`: the wall time of a process that imports jaxserve and builds `LLM("smollm2-135m-instruct")`
  with default settings (the import alone is reported too);
- `score <max_seq_len>`: an LLM with `CompileConfig(prompt_logprobs=True)` at max_seq_len 512 and 8192
  (max_num_tokens 256, penalty variants off, prefix caching off so every call computes its prompts)
  scores 16 short prompts (`prompt_logprobs=0`, `max_tokens=1`) twice: the first call's time includes
  whatever it compiles (or loads from the step store), the second is the steady cost.

The load average (`os.getloadavg`) is printed next to every figure: on a shared machine a figure taken
under load is not comparable. Run it against another checkout with PYTHONPATH pointing there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHAT = ["-m", "jaxserve.cli", "chat", "What is the capital of France?", "--max-tokens", "16"]

READY = """
import time
t0 = time.perf_counter()
from jaxserve import LLM
t1 = time.perf_counter()
LLM("smollm2-135m-instruct", show_progress=False)
t2 = time.perf_counter()
print("RESULT", t1 - t0, t2 - t1)
"""

SCORE = """
import sys, time
from jaxserve import LLM, SamplingParams
from jaxserve.config import CompileConfig, KvCacheConfig

max_seq_len = int(sys.argv[1])
subjects = ["The capital of France", "Water", "A cat", "The sun", "Music", "Paris", "Rain", "A river",
            "The moon", "Bread", "A forest", "The ocean", "Snow", "A city", "The wind", "Fire"]
t0 = time.perf_counter()
llm = LLM(
    "smollm2-135m-instruct",
    max_seq_len=max_seq_len,
    max_num_tokens=256,
    kv_cache_config=KvCacheConfig(enable_prefix_caching=False),
    compile_config=CompileConfig(prompt_logprobs=True, penalty_variants=False),
    show_progress=False,
)
t1 = time.perf_counter()
params = SamplingParams(max_tokens=1, prompt_logprobs=0)
prompts = [f"{s} is well known. It is one of the things people talk about." for s in subjects]
times = []
for _ in range(2):  # without prefix caching the second call computes every prompt again
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
    assert all(o.error is None and o.prompt_logprobs for o in outs)
print("RESULT", t1 - t0, *times)
"""


def timed(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done.stdout


def result(stdout: str) -> list[float]:
    [line] = [line for line in stdout.splitlines() if line.startswith("RESULT")]
    return [float(x) for x in line.split()[1:]]


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def measure(name: str, args: list[str], repeats: int) -> list[dict]:
    timed(args)  # warm: the default model fetched and converted, the steps stored
    rows = []
    for _ in range(repeats):
        before = load()
        seconds, stdout = timed(args)
        row = {"figure": name, "wall_s": round(seconds, 2), "load_before": before, "load_after": load()}
        if "RESULT" in stdout:
            row["parts_s"] = [round(x, 2) for x in result(stdout)]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=("chat", "ready", "score"), default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import jaxserve

    print(f"jaxserve from {os.path.dirname(jaxserve.__file__)}", file=sys.stderr)
    rows = []
    if args.only in (None, "chat"):
        rows += measure("chat", CHAT, args.repeats)
    if args.only in (None, "ready"):
        rows += measure("llm_ready (import, LLM())", ["-c", READY], args.repeats)
    if args.only in (None, "score"):
        for max_seq_len in (512, 8192):
            rows += measure(f"score {max_seq_len} (start, 1st, 2nd)", ["-c", SCORE, str(max_seq_len)], args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        parts = f"  parts {row['parts_s']}" if "parts_s" in row else ""
        print(f"{row['figure']:36s} {row['wall_s']:7.2f} s  load {row['load_before']} -> {row['load_after']}{parts}")


if __name__ == "__main__":
    main()
