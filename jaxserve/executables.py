"""Compiled steps kept on disk, so that a restart loads them instead of tracing and compiling them again.

jax's persistent compilation cache (turned on by the runner) skips XLA's compile, not the tracing and
lowering that come before it and compute its key, holding the GIL, so a cached start of a large step
table still spends most of its time tracing (docs/performance.md, start-up). This store keeps each compiled
executable (`jax.experimental.serialize_executable`) under a key made of everything that determines it:

- the source of the jaxserve package (models, kernels and sharding included) that builds the step: any edit
  changes every key;
- jax's and jaxlib's versions, the backend's platform and version, the devices' kinds and ids, XLA_FLAGS
  and the jax options that change lowering or compiling;
- the step's kind and its static arguments (the model config, the step table, dtype, backend, bucket,
  variant) and its abstract arguments (tree structure, shapes, dtypes, shardings).

The store stands in for jax's persistent cache: the engine turns that one on only without the store,
and while it is on the store saves nothing (see `jax_cache_on`). An entry that cannot be read or loaded
is logged, removed and compiled again; an executable that cannot be serialized is not stored. The store
keeps at most `max_bytes` (least recently used entries removed first). Entries are pickles, like jax's
own cache entries: only a directory the user controls should hold them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

SOURCE_PACKAGES = ("jaxserve",)
# jax options whose value changes what a traced step lowers to, or what XLA compiles it to.
LOWERING_OPTIONS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_threefry_partitionable",
    "jax_default_prng_impl",
    "jax_numpy_rank_promotion",
    "jax_disable_most_optimizations",
)
FORMAT = 1  # bump when an entry's layout changes


@functools.cache
def source_digest() -> str:
    """sha256 over every .py file of SOURCE_PACKAGES (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for name in SOURCE_PACKAGES:
        module = __import__(name)
        root = Path(module.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment(devices: Sequence[jax.Device]) -> str:
    """What besides the source and the arguments decides an executable: versions, devices, flags."""
    import jaxlib

    client = devices[0].client
    options = {name: _option(name) for name in LOWERING_OPTIONS}
    return repr(
        (
            FORMAT,
            jax.__version__,
            jaxlib.__version__,
            client.platform,
            client.platform_version,
            [(d.id, d.device_kind) for d in devices],
            os.environ.get("XLA_FLAGS", ""),
            sorted(options.items()),
        )
    )


def _option(name: str) -> Any:
    """A jax option's value: an attribute of jax.config for the options that have a context manager, `read` for
    the others (jax_disable_most_optimizations: no attribute, so a getattr default would hide its value)."""
    return getattr(jax.config, name) if hasattr(jax.config, name) else jax.config.read(name)


def abstract_signature(args: Any) -> str:
    """The arguments' tree structure and each leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(args)
    shapes = [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))) for x in leaves]
    return repr((str(tree), shapes))


def jax_cache_on() -> bool:
    """Whether jax's persistent compilation cache is on in this process (its directory set, not disabled).

    While it is, the store saves nothing: an executable jax loaded from its cache does not always
    serialize whole again (XLA:CPU drops functions from it, "Function ... not found" when it runs), and a
    compile cannot be kept from using the cache (jax decides that once per process)."""
    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


class ExecutableStore:
    """A directory of serialized compiled steps; `get_or_compile` is the one entry point."""

    def __init__(self, directory: str | os.PathLike, devices: Sequence[jax.Device], max_bytes: int = 8 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.directory = Path(directory)
        self.devices = list(devices)
        self.max_bytes = max_bytes
        self._environment = environment(self.devices)
        self.hits = 0
        self.misses = 0
        self._warned = False

    def key(self, kind: str, statics: str, args: Any) -> str:
        text = repr((source_digest(), self._environment, kind, statics, abstract_signature(args)))
        return hashlib.sha256(text.encode()).hexdigest()

    def get_or_compile(
        self, kind: str, statics: str, args: Any, compile_fn: Callable[[], jax.stages.Compiled]
    ) -> jax.stages.Compiled:
        """The stored executable for (kind, statics, args), else compile_fn()'s, which is then stored."""
        key = self.key(kind, statics, args)
        loaded = self._load(key)
        if loaded is not None:
            self.hits += 1
            return loaded
        self.misses += 1
        compiled = compile_fn()
        if jax_cache_on():
            if not self._warned:
                logger.info("jax's persistent compilation cache is on: the step store loads but stores nothing")
                self._warned = True
        else:
            self._save(key, compiled)
        return compiled

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.exe"

    def _load(self, key: str) -> jax.stages.Compiled | None:
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            with open(path, "rb") as f:
                serialized, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, backend=self.devices[0].client, execution_devices=self.devices
            )
        except FileNotFoundError:
            return None
        except Exception:
            logger.warning("stored executable %s could not be loaded; compiling it again", path, exc_info=True)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: evicted last
        return compiled

    def _save(self, key: str, compiled: jax.stages.Compiled) -> None:
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as error:  # e.g. a backend without serialization, or closed-over constants
            logger.debug("executable not stored: %s: %s", type(error).__name__, error)
            return
        if len(blob) > self.max_bytes:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as f:
                f.write(blob)
            os.replace(f.name, self._path(key))  # atomic: a concurrent reader sees all of it or nothing
            self._evict()
        except OSError:
            logger.warning("could not store an executable in %s", self.directory, exc_info=True)

    def _evict(self) -> None:
        """Removes the least recently used entries until the store holds at most max_bytes."""
        entries = []
        for path in self.directory.glob("*.exe"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
