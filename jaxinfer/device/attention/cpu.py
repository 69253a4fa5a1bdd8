"""The "cpu" attention backend: ragged paged attention as a C++ kernel XLA:CPU calls through its FFI.

XLA:CPU runs the jnp reference over 16-token pages as dozens of small gathers and matmuls per layer, each
at a fixed cost, so a decode step's attention cost far more than its K/V reads (and its kernels a third
of a step's compile time). The kernel (paged_attention_cpu.cc) walks each sequence's pages once per
block of its query tokens and kv head, on XLA's intra-op threads when the step is large enough. The engine
calls it as `rope_write_attend`: RoPE, the K/V writes and attention in one call per layer, the pools
updated in place.

It is compiled on first use with the host's C++ compiler (`$CXX`, else `c++`) against the FFI headers of
the jaxlib that runs it, for this machine's instruction set, and kept in $JAXINFER_CACHE/kernels under a
digest of all three: a pip install needs no compiler, and where none works the engine keeps the jnp
reference (`available()` says why).
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
from pathlib import Path

import jax
import numpy as np

from jaxinfer.config import cache_dir
from jaxinfer.pallas_kernels.rope_cache import cos_sin

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
TARGETS = {"jaxinfer_ragged_paged_attention": "RaggedPagedAttention", "jaxinfer_rope_write_attend": "RopeWriteAttend"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC")
DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine."""


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def library_path() -> Path:
    """Where the built kernel lives: one file per source, compiler, jaxlib and host CPU."""
    from jaxinfer.device.compilation_cache import host_cpu

    digest = hashlib.sha256(repr((SOURCE.read_bytes(), _compiler(), FLAGS, jax.ffi.include_dir(),
                                  jax.__version__, host_cpu())).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"paged_attention_cpu-{digest}.so"


def build() -> Path:
    """Compiles the kernel unless this machine already has it (atomically: concurrent builds are harmless)."""
    lib = library_path()
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [*_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"{shlex.join(cmd)}: {e}") from e
        if done.returncode != 0:
            raise BuildError(f"{shlex.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(out, lib)
    return lib


@functools.cache
def _register() -> str | None:
    """Builds, loads and registers the kernel once per process; the reason it cannot, or None."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (BuildError, OSError, AttributeError) as e:
        log.warning("the cpu attention kernel is unavailable, using the jnp reference: %s", e)
        return str(e)
    return None


def available() -> bool:
    return _register() is None


def unavailable_reason() -> str | None:
    return _register()


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                           num_seqs: jax.Array, *, sm_scale: float) -> jax.Array:
    """The contract of `ragged_paged_attention_reference` (without return_lse), on one CPU device."""
    if reason := _register():
        raise BuildError(reason)
    call = jax.ffi.ffi_call("jaxinfer_ragged_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, *map(_i32, (layer, page_table, seq_lens, query_start, num_seqs)),
                sm_scale=np.float32(sm_scale))


def rope_write_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      layer: jax.Array, positions: jax.Array, slots: jax.Array, inv_freq: jax.Array,
                      page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array, num_seqs: jax.Array, *,
                      sm_scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's attention in one call on one CPU device: `rope_and_write_reference` (q, k unrotated), then
    `ragged_paged_attention_reference` over the written pools -> (out, k_pages, v_pages). The pools are
    aliased to the results, so a pool the caller no longer holds (donated, or a loop's carry) is written
    in place."""
    if reason := _register():
        raise BuildError(reason)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
               jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call("jaxinfer_rope_write_attend", results, input_output_aliases={3: 1, 4: 2})
    cos, sin = cos_sin(positions, inv_freq)   # XLA's cos and sin, vectorized (the reference's own)
    return call(q, k, v, k_pages, v_pages, _i32(layer), _i32(slots), cos, sin,
                *map(_i32, (page_table, seq_lens, query_start, num_seqs)), sm_scale=np.float32(sm_scale))


def _i32(x) -> jax.Array:
    return jax.numpy.asarray(x, dtype=np.int32)
