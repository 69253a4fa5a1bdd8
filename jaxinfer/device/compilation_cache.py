"""Compiled programs kept on disk, so a restart on the same machine compiles nothing.

Two layers, one switch (EngineConfig.compilation_cache, --no-compilation-cache; JAX's own
JAX_ENABLE_COMPILATION_CACHE=false turns both off) and one directory ($JAXINFER_CACHE/xla, or the one given
to JAX already in JAX_COMPILATION_CACHE_DIR):
- JAX's persistent compilation cache, for every jitted program: keyed by the lowered program, so a hit
  still pays for tracing and lowering (~0.5 s a step bucket of the 125M model on CPU) before the load.
- The engine's step executables (jaxinfer.device.runner), serialized under `executables/` and keyed by what
  decides the program without tracing it: jax's version and devices, the host's CPU, the mesh, the
  model's class and config, the arguments' shapes and shardings, the step's static inputs, and a digest
  of jaxinfer's own source. A hit is only XLA's load, and LLM reads the warm-up's steps back while the
  weights load. Only architectures defined in jaxinfer itself are kept there: the source of a model
  registered from elsewhere is not in the key, so its steps go through JAX's cache.

Only a freshly compiled executable is stored: one that JAX read back from its own cache is not (in jax
0.12, XLA:CPU serializes a deserialized executable without some of its functions, and the copy fails when
run), so a step whose program is already in JAX's cache, e.g. after an edit that changed no program, keeps
going through JAX's cache.

The cache is trusted code (executables and pickled tree structures): keep its directory private. Delete
it at any time; entries of an older jaxinfer or jax are never read again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import logging
import os
import pickle
import platform
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxinfer.config import cache_dir

log = logging.getLogger("jaxinfer")
FORMAT = 2   # of the executables' key and files (1 could hold re-serialized executables)
PACKAGES = ("jaxinfer", "jaxinfer.models", "jaxinfer.pallas_kernels")


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()


def _count_hit(event: str, **_: Any) -> None:
    if event == _JAX_CACHE_HIT:   # recorded in the thread that compiles
        _hits.count = jax_cache_hits() + 1


jax.monitoring.register_event_listener(_count_hit)


def jax_cache_hits() -> int:
    """Programs this thread has had from JAX's persistent cache rather than compiled."""
    return getattr(_hits, "count", 0)


def compilation_cache_dir() -> Path:
    """Under $JAXINFER_CACHE (default ~/.cache/jaxinfer), beside the random-weight checkpoints."""
    return cache_dir() / "xla"


def enable_compilation_cache() -> Path | None:
    """Cache every executable, however quick to compile (JAX's default skips those under a second, which
    is most of a small model's buckets). Returns the directory in use, None when the cache is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(compilation_cache_dir()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return Path(jax.config.jax_compilation_cache_dir)


def executables_dir() -> Path | None:
    """Where step executables go: inside JAX's cache directory; None where JAX's cache is off (or has no
    directory), and across processes (JAX's cache serves that case)."""
    directory = jax.config.jax_compilation_cache_dir
    if not jax.config.jax_enable_compilation_cache or directory is None or jax.process_count() > 1:
        return None
    return Path(directory) / "executables"


@functools.cache
def source_digest() -> str:
    """sha256 of every Python file of jaxinfer's packages: any change to the code makes new keys."""
    digest = hashlib.sha256()
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def defined_in_jaxinfer(cls: type) -> bool:
    """Every class the model's class inherits from is jaxinfer's own (so its source is in the key)."""
    return all(c.__module__.split(".")[0] in ("jaxinfer", "builtins") for c in cls.__mro__)


def signature(tree: Any) -> str:
    """A pytree's structure and each leaf's (array or jax.ShapeDtypeStruct) shape, dtype, placement (which
    slice each device holds: equal shardings written differently, as an executable read back writes its
    outputs', read the same) and layout in memory where it is not the default (fp8 weights laid out for the
    GEMM: jaxinfer.device.matmul.gemm_layouts)."""
    def placement(x: Any) -> Any:
        sharding = x.sharding
        return sharding.memory_kind, sorted((d.id, repr(i)) for d, i in sharding.devices_indices_map(x.shape).items())

    def layout(x: Any) -> tuple[int, ...] | None:
        order = getattr(getattr(x.format, "layout", None), "major_to_minor", None)
        return None if order is None or tuple(order) == tuple(range(len(x.shape))) else tuple(order)
    leaves, treedef = jax.tree.flatten(tree)
    return repr((str(treedef), [(x.shape, x.dtype.name, placement(x), layout(x)) for x in leaves]))


@functools.cache
def host_cpu() -> str:
    """The host's processor and its instruction-set flags: XLA:CPU code compiled for one CPU may not run on
    another, and a cache directory can be shared between machines."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.machine()} {platform.processor()} {flags}"


def executable_key(*parts: Any) -> str:
    """A digest of `parts` (their repr) with what every program depends on: jax, its devices, the host's
    CPU, the environment's XLA flags, jax's configuration, and jaxinfer's source."""
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    config = sorted((k, v) for k, v in jax.config.values.items() if isinstance(v, str | int | float | bool | None))
    everything = (FORMAT, jax.__version__, jax.devices()[0].client.platform_version, devices, host_cpu(),
                  os.environ.get("XLA_FLAGS", ""), config, source_digest(), *parts)
    return hashlib.sha256(repr(everything).encode()).hexdigest()


def load_executable(path: Path, devices: list[jax.Device]) -> jax.stages.Compiled | None:
    """The executable stored at `path`, run on `devices` (its mesh's, in the mesh's order), or None (missing,
    or unreadable: then it is compiled again)."""
    try:
        payload = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return serialize_executable.deserialize_and_load(*pickle.loads(payload), execution_devices=devices)
    except Exception as e:  # noqa: BLE001  a stale or damaged entry costs a compile, nothing else
        log.warning("ignoring the cached executable %s: %s", path, e)
        return None


def save_executable(path: Path, compiled: jax.stages.Compiled) -> None:
    """Write atomically: a process reading the directory sees a whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    partial.write_bytes(pickle.dumps(serialize_executable.serialize(compiled)))
    os.replace(partial, path)
