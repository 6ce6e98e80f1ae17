"""A GGUF file converted once into a Hugging Face directory in the cache, and loaded from there afterwards.

Loading a GGUF pays for parsing its metadata (the vocabulary), for building a fast tokenizer from it
and for dequantising every tensor, each time: seconds on a CPU for the 135M default model. The
converted directory holds what the GGUF means, in the forms that load fastest:

    <cache>/converted/<gguf file stem>/
        config.json             the Hugging Face config built from the GGUF's metadata
        model.safetensors       every tensor dequantised, in float32 (exact: the dequantised values),
                                under its Hugging Face name, q/k rows already unpermuted
        tokenizer.json, tokenizer_config.json, special_tokens_map.json   (when the GGUF has a tokenizer)
        generation_config.json  the GGUF's end-of-generation ids (eos, eot, eom)
        source.json             the GGUF it came from: path, size, mtime and sha256, and FORMAT

`cached_conversion(gguf_path)` returns that directory, converting first when there is none or when it
was made from another file: a GGUF whose size or mtime changed is hashed, and a different sha256 (or
FORMAT) converts it again. A conversion is written to a temporary directory and renamed into place,
so an interrupted one leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the converted layout changes: every cached conversion is redone
STAMP = "source.json"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    stat = path.stat()
    return {"format": FORMAT, "path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def _read_stamp(directory: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_current(directory: Path, gguf_path: Path) -> bool:
    """Whether `directory` is a complete conversion of the file at gguf_path as it is now (see the module
    docstring); a file touched but unchanged gets its stamp updated."""
    stamp = _read_stamp(directory)
    if stamp is None or stamp.get("format") != FORMAT:
        return False
    stat = gguf_path.stat()
    if (stamp.get("size"), stamp.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
        return True
    if stamp.get("size") != stat.st_size or stamp.get("sha256") != file_sha256(gguf_path):
        return False
    (directory / STAMP).write_text(json.dumps(_stamp(gguf_path, stamp["sha256"])))
    return True


def cached_conversion(gguf_path: str | os.PathLike, cache_root: Path | None = None) -> Path:
    """The converted directory of a GGUF file in the cache (`jaxserve.models.hub.cache_dir()` unless given),
    converting it first when it is missing or stale."""
    from jaxserve.models.hub import cache_dir

    gguf_path = Path(gguf_path).absolute()
    target = (cache_root or cache_dir()) / "converted" / gguf_path.stem
    if target.is_dir() and is_current(target, gguf_path):
        return target
    print(f"jaxserve: converting {gguf_path.name} once into {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{gguf_path.stem}-"))
    staging.chmod(0o755)  # mkdtemp's 0o700 would make the cache unlike the rest of it
    try:
        convert_gguf(gguf_path, staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, directory: Path) -> None:
    """Writes the converted form of gguf_path into the (existing, empty) directory; the stamp last."""
    from safetensors.numpy import save_file

    from jaxserve.models import gguf

    sha256 = file_sha256(gguf_path)
    checkpoint = gguf.open_gguf(gguf_path)
    (directory / "config.json").write_text(json.dumps(checkpoint.hf_config, indent=2))
    tensors = {name: np.ascontiguousarray(array) for name, array in checkpoint.tensors()}
    save_file(tensors, directory / "model.safetensors")
    del tensors
    if gguf.has_tokenizer(gguf_path):
        tokenizer, eos_ids = gguf.gguf_tokenizer(gguf_path)
        tokenizer.save_pretrained(directory)
        generation = {"eos_token_id": list(eos_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (directory / STAMP).write_text(json.dumps(_stamp(gguf_path, sha256)))
    logger.info("converted %s into %s", gguf_path, directory)
