"""CI: jaxserve installs as one import package and serves from its installed copy alone.

1. Builds the wheel from a clean copy of the tree (tracked and new files that git does not ignore, so no stale
   build/ output leaks in) and checks that its only top-level name is `jaxserve` (top_level.txt and every
   file's path), that the subpackages are in it and that it declares the `jaxserve` console script.
2. Installs the tree with `pip install .` (not editable) into a fresh virtualenv that sees this Python's
   site-packages, without an index: every dependency must already be satisfied, nothing is downloaded.
3. From a folder that holds its own `models/` and `sharding/` packages (whose modules fail loudly when
   imported), without the source tree on sys.path, imports jaxserve from the virtualenv and serves a tiny
   random Llama through `LLM.from_params` (a `transformers.LlamaConfig` object, which has no `architectures`)
   with the dense reference's greedy tokens; then runs the `jaxserve` console script.

Run after the test suite by .ci/run; any failure raises (exit status 1) with what went wrong.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("jaxserve/models/llama.py", "jaxserve/kernels/__init__.py", "jaxserve/sharding/rules.py")
STRAY = "raise RuntimeError('imported the stray {name} of the working folder, not jaxserve.{name}')\n"

# Runs in the virtualenv, in the folder with the stray packages (sys.path[0] is that folder).
SERVE = """
import sys
from pathlib import Path

import jax
import numpy as np
import transformers

import jaxserve
from jaxserve import LLM, CompileConfig, SamplingParams
from jaxserve.dense import generate_dense
from jaxserve.models import registry

venv, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
for module in (jaxserve, jaxserve.models, jaxserve.kernels, jaxserve.sharding):
    assert Path(module.__file__).resolve().is_relative_to(venv), f"{module.__name__} from {module.__file__}"
assert not any(Path(p or ".").resolve() == repo for p in sys.path), f"the source tree is on sys.path: {sys.path}"


class Tokenizer:
    vocab_size, eos_token_ids = 128, ()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


config = transformers.LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)
family, cfg = registry.resolve(config.to_dict())
weights = family.init_weights(cfg, jax.random.key(0), np.float32)
llm = LLM.from_params(
    weights, config, Tokenizer(), max_batch_size=2, max_num_tokens=16, max_seq_len=32, attention_backend="xla",
    compile_config=CompileConfig(decode_batch_sizes=(2,), token_buckets=(16,), penalty_variants=False),
    show_progress=False,
)
prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
tokens = [o.outputs[0].token_ids for o in outputs]
assert tokens == generate_dense(family, cfg, weights, prompts, 4), tokens
here = str(Path.cwd().resolve()) + "/"
files = [(name, getattr(module, "__file__", None) or "") for name, module in list(sys.modules.items())]
stray = sorted(name for name, file in files if file.startswith(here))  # torch.ops' __file__ is not a path
assert not stray, f"modules of the working folder were imported: {stray}"
print("served", tokens)
"""


def run(*command: str | Path, cwd: Path | None = None, env: dict | None = None) -> str:
    result = subprocess.run(list(map(str, command)), cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"FAILED ({result.returncode}): {' '.join(map(str, command))}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def copy_tree(destination: Path) -> None:
    """What a fresh clone with the current changes holds: tracked files and new ones git does not ignore."""
    listed = run("git", "ls-files", "-z", "-co", "--exclude-standard", cwd=REPO)
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # deleted but still tracked: absent
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)


def check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert top_level == ["jaxserve"], f"{wheel.name}: top_level.txt lists {top_level}"
    roots = sorted({n.split("/")[0] for n in names} - {info})
    assert roots == ["jaxserve"], f"{wheel.name}: top-level entries {roots}"
    missing = [name for name in SUBPACKAGES if name not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert "jaxserve = jaxserve.cli:main" in entry_points, f"{wheel.name}: console scripts {entry_points}"


def make_stray_packages(folder: Path) -> None:
    """`models` and `sharding` packages named as jaxserve's subpackages once were, each module failing loudly."""
    for module in ("models/__init__", "models/attention", "sharding/__init__", "sharding/rules"):
        path = folder / f"{module}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STRAY.format(name=module.removesuffix("/__init__").replace("/", ".")))


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxserve-wheel-") as tmp:
        tmp = Path(tmp)
        source, venv, folder = tmp / "source", tmp / "venv", tmp / "work"
        copy_tree(source)
        # Build and install with this Python's setuptools (no isolated build env, nothing downloaded).
        pip = ("-m", "pip", "--disable-pip-version-check")
        run(sys.executable, *pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", source)
        (wheel,) = (tmp / "dist").glob("jaxserve-*.whl")
        check_wheel(wheel)
        # No pip or setuptools of its own (ensurepip's setuptools is older than the build needs): this Python's
        # pip installs into it, building with this Python's setuptools, which the virtualenv sees.
        run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
        python = venv / "bin" / "python"
        install = ("--python", python, "install", "-q", "--no-index", "--no-build-isolation", ".")
        run(sys.executable, *pip, *install, cwd=source)
        make_stray_packages(folder)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | {"JAX_PLATFORMS": "cpu"}
        print(run(python, "-c", SERVE, venv, REPO, cwd=folder, env=env).strip())
        usage = run(venv / "bin" / "jaxserve", "--help", cwd=folder, env=env)
        assert usage.startswith("usage: jaxserve"), usage
    print(
        f"wheel check passed: {wheel.name} holds jaxserve only and serves from a virtualenv "
        f"({time.perf_counter() - start:.1f} s)"
    )


if __name__ == "__main__":
    main()
