"""Multi-process serving (`jaxserve.distributed`) with two processes on this machine, one CPU device each,
tensor parallelism over both: the greedy tokens equal the dense reference's, over the smaller of the two
processes' KV pools; LoRA adapters read from PEFT directories, swapped through one slot and unloaded, give a
one-process engine's tokens; killing either process ends the other with an error within a bounded time; `jaxserve
serve` over two processes answers and stops.

Each process is a fresh interpreter (jax.distributed must start before jax does) that reports one JSON
line on stdout.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 5

# argv: process id, coordinator port, what to do ("tokens" | "lora" | "forever"), the prompts (JSON), and for
# "lora" the adapters' directories (JSON: name -> path).
SCRIPT = textwrap.dedent(
    f"""
    import faulthandler, json, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung process's stacks, on the test's request
    from jaxserve import distributed
    process_id, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    distributed.initialize(f"127.0.0.1:{{port}}", 2, process_id, heartbeat_timeout_s={HEARTBEAT_S})
    import jax, jax.numpy as jnp, numpy as np
    from jaxserve import bench
    from jaxserve.config import CompileConfig, KvCacheConfig
    from jaxserve.dense import generate_dense
    from jaxserve.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.sampling import SamplingParams
    from jaxserve.models import registry, shapes
    from jaxserve.models.loader import LoadedModel

    # Random weights drawn by numpy from the shapes of the family's initialiser (which, run op by op,
    # takes seconds), the same in both processes.
    hf_config = shapes.shape("tiny-llama")
    family, cfg = registry.resolve(hf_config)
    rng = np.random.default_rng(0)
    shaped = jax.eval_shape(lambda key: family.init_weights(cfg, key, jnp.float32), jax.random.key(0))
    weights = jax.tree.map(lambda w: (rng.standard_normal(w.shape) * 0.2).astype(w.dtype), shaped)
    model = LoadedModel(family, cfg, weights, hf_config, None, "random weights")
    compile_config = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False)
    # Process 1 holds a smaller pool (20 blocks and the reserved one, against 33): both serve that one.
    kv_config = KvCacheConfig(max_tokens=320) if process_id == 1 else None
    # "lora": one adapter slot, so that the two adapters take turns in it.
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=4) if mode == "lora" else {{}}
    llm = LLM(
        model, tokenizer=bench.IdTextTokenizer(), max_batch_size=4, max_num_tokens=32, max_seq_len=128,
        kv_cache_config=kv_config, compile_config=compile_config, attention_backend="xla", show_progress=False,
        **lora,
    )
    report = dict(
        devices=[sorted(d.id for d in llm.engine.runner.mesh.devices.flat), [d.id for d in jax.local_devices()]],
        tp=llm.engine.runner.mesh.shape["model"], num_blocks=llm.engine.kv_budget.num_blocks,
    )
    prompts = json.loads(sys.argv[4])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    if process_id != 0:
        report["steps"] = llm.follow()
    elif mode == "tokens":
        report["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        report["steps"] = len(llm.engine.stats)
        llm.close()
        report["reference"] = generate_dense(model.family, model.config, model.weights, prompts, 6)
    elif mode == "lora":
        dirs = json.loads(sys.argv[5])
        requests = [LoRARequest(name, 1 + i, dirs[name]) for i, name in enumerate(sorted(dirs))]
        mixed = [None, requests[0], requests[1], requests[0], None, requests[1]]
        outputs = llm.generate(prompts, greedy, lora_request=mixed, use_tqdm=False)
        report["tokens"] = [o.outputs[0].token_ids for o in outputs]
        llm.unload_lora(requests[0].lora_name)  # its slot zeroed, then the other adapter's again
        outputs = llm.generate(prompts[:2], greedy, lora_request=[requests[1], None], use_tqdm=False)
        report["after_unload"] = [o.outputs[0].token_ids for o in outputs]
        try:
            from safetensors.numpy import load_file
            in_memory = load_file(dirs["a"] + "/adapter_model.safetensors")  # "a"'s tensors, without a path
            llm.load_lora("memory", in_memory, {{"r": 4, "lora_alpha": 8}})
        except ValueError as error:
            report["from_memory"] = str(error)
        report["steps"] = len(llm.engine.stats)
        llm.close()
    else:
        print("generating", flush=True)
        while True:
            llm.generate(prompts, greedy, use_tqdm=False)
    print(json.dumps(report), flush=True)
    """
)
PROMPTS = [np.random.default_rng(0).integers(0, 160, n).tolist() for n in (3, 17, 9, 30, 1, 24)]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: a client connecting to a port of that range before the
    coordinator listens on it can be given that very port as its own source port and connect to itself."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for port in np.random.default_rng().permutation(np.arange(max(low - 8192, 1024), low)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port)))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no free port below the ephemeral range")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    # An empty step store, as on a fresh machine: steps compiled on first use while others ran deadlocked the
    # processes, which stored steps (a warm cache) hid.
    env["JAXSERVE_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-multiprocess-")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


class _Process:
    """A subprocess whose stdout and stderr lines are collected by two threads as they come."""

    def __init__(self, args: list[str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        for stream in (self.popen.stdout, self.popen.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first line (stdout or stderr) that matches; fails on exit or timeout."""
        ended, deadline = 0, time.monotonic() + timeout
        while ended < 2:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                ended += 1
                continue
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matched {pattern!r}: {self.text()[-4000:]}")

    def wait(self, timeout: float) -> int:
        self.popen.wait(timeout=timeout)
        return self.popen.returncode

    def text(self) -> str:
        """Every line read so far (all of them once the process has exited and its streams are drained)."""
        while True:
            try:
                line = self.lines.get(timeout=1.0 if self.popen.poll() is not None else 0.0)
            except queue.Empty:
                return "".join(self.seen)
            if line is not None:
                self.seen.append(line)

    def report(self) -> dict:
        """The JSON line the check script printed last; the process has exited with status 0."""
        status, out = self.popen.returncode, self.text()
        assert status == 0, out[-4000:]
        return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def _reports(processes: list[_Process], timeout: float = 300) -> list[dict]:
    """Each process's report once every one has exited. The timeout guards against a hang: two processes that
    each start jax and compile an engine took over 120 s on a loaded 2-core CI machine, so it is well above
    that; on a hang every process's Python stacks are in the failure."""
    deadline = time.monotonic() + timeout
    try:
        for p in processes:
            p.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for p in processes:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGUSR1)  # the script's faulthandler prints every thread's stack
        time.sleep(2)
        for p in processes:
            p.kill()
        outputs = "\n".join(f"--- process {i}:\n{p.text()[-6000:]}" for i, p in enumerate(processes))
        pytest.fail(f"not every process exited within {timeout} s; their output and stacks:\n{outputs}")
    return [p.report() for p in processes]


def _script(mode: str, *extra: str) -> list[_Process]:
    port = str(_free_port())
    return [_Process(["-c", SCRIPT, str(i), port, mode, json.dumps(PROMPTS), *extra]) for i in range(2)]


def test_two_processes_give_the_dense_reference_tokens():
    processes = _script("tokens")
    try:
        leader, follower = _reports(processes)
    finally:
        for p in processes:
            p.kill()
    assert leader["tokens"] == leader["reference"]
    # One engine over both processes' devices, split over both; the smaller pool; every step run on both.
    assert leader["tp"] == follower["tp"] == 2
    assert leader["devices"][0] == follower["devices"][0] == sorted(leader["devices"][1] + follower["devices"][1])
    assert leader["num_blocks"] == follower["num_blocks"] == 21
    assert "KV pool lowered from 33 to 21 blocks" in processes[0].text()
    assert follower["steps"] == leader["steps"] > 0


def _peft_dir(path: Path, seed: int, rank: int, modules: dict[str, tuple[int, int]]) -> str:
    """A PEFT adapter directory for the tiny-llama shape: module -> (in, out) widths, random A and B in both
    layers (large enough that the tokens change)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for module, (width_in, width_out) in modules.items():
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, width_in)) * 0.5).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((width_out, rank)) * 0.5).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(modules)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def _one_process_lora_tokens(dirs: dict[str, str]) -> tuple[list, list]:
    """What the "lora" script's leader generates, from an engine of this process alone (two adapter slots)."""
    import jax
    import jax.numpy as jnp

    from jaxserve import bench
    from jaxserve.config import CompileConfig
    from jaxserve.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.models import registry, shapes
    from jaxserve.models.loader import LoadedModel
    from jaxserve.sampling import SamplingParams

    hf_config = shapes.shape("tiny-llama")  # the script's weights, drawn the same way
    family, cfg = registry.resolve(hf_config)
    rng = np.random.default_rng(0)
    shaped = jax.eval_shape(lambda key: family.init_weights(cfg, key, jnp.float32), jax.random.key(0))
    weights = jax.tree.map(lambda w: (rng.standard_normal(w.shape) * 0.2).astype(w.dtype), shaped)
    model = LoadedModel(family, cfg, weights, hf_config, None, "random weights")
    compile_config = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = [LoRARequest(name, 1 + i, dirs[name]) for i, name in enumerate(sorted(dirs))]
    with LLM(
        model, tokenizer=bench.IdTextTokenizer(), max_batch_size=4, max_num_tokens=32, max_seq_len=128,
        compile_config=compile_config, attention_backend="xla", show_progress=False,
        enable_lora=True, max_loras=2, max_lora_rank=4,
    ) as llm:  # fmt: skip
        mixed = [None, requests[0], requests[1], requests[0], None, requests[1]]
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, lora_request=mixed, use_tqdm=False)]
        after = llm.generate(PROMPTS[:2], greedy, lora_request=[requests[1], None], use_tqdm=False)
        base = llm.generate(PROMPTS, greedy, use_tqdm=False)
    return tokens, [o.outputs[0].token_ids for o in after], [o.outputs[0].token_ids for o in base]


def test_two_processes_serve_lora_adapters_from_their_directories(tmp_path):
    dirs = {
        "a": _peft_dir(tmp_path / "a", 1, 4, {"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (96, 64)}),
        "b": _peft_dir(tmp_path / "b", 2, 2, {"o_proj": (64, 64), "gate_proj": (64, 96), "k_proj": (64, 32)}),
    }
    processes = _script("lora", json.dumps(dirs))
    try:
        leader, follower = _reports(processes)
    finally:
        for p in processes:
            p.kill()
    tokens, after_unload, base = _one_process_lora_tokens(dirs)
    assert all(tokens[i] != base[i] for i in (1, 2, 3, 5))  # each adapter changes its rows' tokens
    assert leader["tokens"] == tokens
    assert leader["after_unload"] == after_unload
    assert "comes from memory: a multi-process run serves adapters from a PEFT directory" in leader["from_memory"]
    assert follower["steps"] == leader["steps"] > 0


# What the survivor says. Process 0: its step failed and the engine refuses to go on (then jax ends the
# process once the coordination service has missed the follower's heartbeats). A follower: jax's
# coordination service, on process 0, is gone, and jax ends the process.
DEAD_PEER = {
    "follower": "a peer process has most likely died",
    "leader": "lost process 0|JAX distributed service detected fatal errors",
}


@pytest.mark.parametrize("killed", ["follower", "leader"])
def test_killing_one_process_ends_the_other_with_an_error(killed):
    leader, follower = processes = _script("forever")
    victim, survivor = (follower, leader) if killed == "follower" else (leader, follower)
    try:
        leader.wait_for("^generating")
        time.sleep(1.0)  # steps in flight on both
        victim.popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            status = survivor.wait(timeout=6 * HEARTBEAT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the other process still runs {6 * HEARTBEAT_S} s after the {killed} was killed")
        seconds, out = time.monotonic() - killed_at, survivor.text()
    finally:
        for p in processes:
            p.kill()
    assert status != 0 and re.search(DEAD_PEER[killed], out), out[-4000:]
    print(f"the {killed}'s peer exited {seconds:.1f} s after the kill, status {status}")


def test_serve_over_two_processes_answers_and_stops():
    port = str(_free_port())
    flags = ["--random-weights=tiny-llama", "--max-seq-len=64", "--max-batch-size=2", "--max-num-tokens=16"]
    flags += ["--decode-batch-sizes=2", "--token-buckets=16", "--no-penalty-variants", "--port=0"]
    flags += [f"--coordinator=127.0.0.1:{port}", "--num-processes=2"]
    leader, follower = processes = [
        _Process(["-m", "jaxserve.cli", "serve", *flags, f"--process-id={i}"]) for i in range(2)
    ]
    try:
        url = leader.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        leader.popen.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0, leader.text()[-4000:]
        assert follower.wait(timeout=60) == 0, follower.text()[-4000:]
    finally:
        for p in processes:
            p.kill()
