"""`jaxserve bench` with the LoRA tables folded into the weights (the engine's default on one device) or kept
separate (`LoraConfig.fold=False`), to compare the two in one machine start: batch-1 decode and the update of an
adapter (`lora.update_ms`).

    python benchmarks/experiments/lora_fold.py separate latency --random-weights llama-3.1-8b --batch-size 1 \
        --input-len 128 --output-len 128 --num-iters 3 --lora-adapters 4 --max-lora-rank 16
"""

from __future__ import annotations

import functools
import sys

import jaxserve.llm
from jaxserve.cli import main
from jaxserve.config import LoraConfig

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("fold", "separate"):
        sys.exit(__doc__)
    jaxserve.llm.LoraConfig = functools.partial(LoraConfig, fold=sys.argv[1] == "fold")
    sys.argv = ["jaxserve", "bench", *sys.argv[2:]]
    main()
