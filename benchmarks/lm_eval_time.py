"""lm-evaluation-harness wall time: the `jaxserve` model against lm-eval's `hf` model on one CPU.

    python benchmarks/lm_eval_time.py                       # the acceptance test's tiny float32 Llama
    python benchmarks/lm_eval_time.py --pretrained DIR      # a Hugging Face directory (the converted default model)

The tasks are tests/integrations/test_lm_eval.py's (a local multiple-choice, a generate_until and a
rolling-loglikelihood task, written to a temporary directory). Each backend runs `simple_evaluate` over
all three --repeats times in this process, lm-eval building its model each time; the first jaxserve run
includes building the engine (compiling or loading its steps), later ones take that engine again (the
jaxserve model keeps the last one built with the same arguments). Prints seconds per run and the ratio of
the best runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from test_lm_eval import TASKS, _tiny_llama_dir, _write_tasks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", help="a Hugging Face model directory (default: the tests' tiny Llama)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager

    import jaxserve.integrations.lm_eval  # noqa: F401  (registers "jaxserve")

    root = Path(tempfile.mkdtemp(prefix="lm_eval_time_"))
    model_dir = args.pretrained or str(_tiny_llama_dir(root))
    manager = TaskManager(include_path=str(_write_tasks(root)))
    common = {"tasks": list(TASKS), "task_manager": manager, "batch_size": 1}
    backends = {
        "jaxserve": {"model": "jaxserve", "model_args": f"pretrained={model_dir},dtype=float32"},
        "hf": {"model": "hf", "model_args": f"pretrained={model_dir},dtype=float32", "device": "cpu"},
    }
    print(f"model {model_dir}, tasks {list(TASKS)}, load average {os.getloadavg()[0]:.1f}")
    best = {}
    for name, kwargs in backends.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            lm_eval.simple_evaluate(**kwargs, **common)
            times.append(time.perf_counter() - start)
        best[name] = min(times)
        print(f"{name:<9} " + " ".join(f"{t:7.2f} s" for t in times))
    print(f"jaxserve / hf (best runs): {best['jaxserve'] / best['hf']:.2f}, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
