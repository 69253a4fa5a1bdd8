"""JAX's persistent compilation cache in jaxinfer's cache directory: a restart on the same machine loads each
step's executable from disk instead of compiling it again (seconds per bucket on CPU).

On by default (EngineConfig.compilation_cache, --no-compilation-cache to turn it off); JAX's own switch
JAX_ENABLE_COMPILATION_CACHE=false turns it off too, and a directory given to JAX already
(JAX_COMPILATION_CACHE_DIR) is kept. The cache is trusted code: keep its directory private.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxinfer.random_model import cache_dir


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
