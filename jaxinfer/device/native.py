"""Builds, loads and registers jaxinfer's C++ kernels for XLA:CPU (called through its FFI).

A kernel is compiled on first use with the host's C++ compiler (`$CXX`, else `c++`) against the FFI headers
of the jaxlib that runs it, for this machine's instruction set, and kept in $JAXINFER_CACHE/kernels under a
digest of all three: a pip install needs no compiler, and where none works the caller keeps its jnp
reference (`register` says why instead of raising).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax

from jaxinfer.config import cache_dir

HEADER = Path(__file__).with_name("parallel_for.h")   # shared by the kernels (and part of their builds' key)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC")

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """A kernel could not be compiled or loaded on this machine."""


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def library_path(source: Path, flags: Sequence[str] = FLAGS) -> Path:
    """Where `source`'s build lives: one file per source, compiler, flags, jaxlib and host CPU (a cache directory
    may be shared by machines whose instruction sets differ)."""
    from jaxinfer.device.compilation_cache import host_cpu

    key = (source.read_bytes(), HEADER.read_bytes(), compiler(), tuple(flags), jax.ffi.include_dir(), jax.__version__,
           host_cpu())
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{digest}.so"


def build(source: Path, flags: Sequence[str] = FLAGS) -> Path:
    """Compiles `source` unless this machine already has it (atomically: concurrent builds are harmless)."""
    lib = library_path(source, flags)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [*compiler(), *flags, f"-I{HEADER.parent}", f"-I{jax.ffi.include_dir()}", str(source), "-o", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"{shlex.join(cmd)}: {e}") from e
        if done.returncode != 0:
            raise BuildError(f"{shlex.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(out, lib)
    return lib


def register(source: Path, targets: Mapping[str, str], flags: Sequence[str] = FLAGS) -> str | None:
    """Builds and loads `source` and registers each FFI target name -> exported handler symbol for XLA:CPU, once
    per process; the reason it cannot (also logged once), or None."""
    return _register(source, tuple(targets.items()), tuple(flags))


@functools.cache
def _register(source: Path, targets: tuple[tuple[str, str], ...], flags: tuple[str, ...]) -> str | None:
    try:
        library = ctypes.cdll.LoadLibrary(str(build(source, flags)))
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (BuildError, OSError, AttributeError) as e:
        log.warning("the C++ kernel %s is unavailable, using the jnp reference: %s", source.name, e)
        return str(e)
    return None
