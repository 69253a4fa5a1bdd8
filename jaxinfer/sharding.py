"""The logical-axis rules table: the one place that says which mesh axis shards which named dimension.

Model code names dimensions logically ("embed", "heads", ...); changing the parallel layout means
changing the mesh, never the model. Tensor parallel is Megatron-style: QKV and gate/up are split by
output (heads, mlp), O and down by input, so each layer needs one all-reduce after attention and one
after the MLP; the vocabulary is split for the embedding and the LM head. QKV and gate/up are each one
fused weight whose block axis carries the "heads" or "mlp" name (jaxinfer.checkpoint.FusedSpec).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.mesh import MeshConfig, MeshError

Axes = tuple[str | None, ...]

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("dp", "ep"),  # each dp x ep replica serves its own requests (ep: attention data-parallel)
    "vocab": "tp",      # vocabulary-parallel embedding and LM head
    "drawn": "tp",      # a step's sampled rows split over tp: each rank filters and draws its share
    "embed": None,      # the residual stream is replicated within a tp group
    "heads": "tp",      # column-parallel Q, row-parallel O
    "kv_heads": "tp",   # K/V heads (replicated first where tp exceeds them)
    "mlp": "tp",        # column-parallel gate/up, row-parallel down
    "layers": "pp",     # pipeline stages: each holds its slice of the stacked layers (and of the KV pool)
    "seq": "sp",        # sequence parallel: a step's tokens split over sp (ring attention, device/attention/ring.py)
    "pages": ("dp", "ep", "sp"),  # each replica owns its slice of the KV page pool, spread over its sp ranks
    "experts": "ep",    # expert parallel: experts split over ep, tokens exchanged by all-to-all
    "head_dim": None,
}


def _is_axes(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the rules table: turns logical axes into shardings and shard_map specs.

    Mesh axes of size 1 are left out of every spec: the placement is the same, and nothing inside a
    shard_map then varies over them, so no collective over a one-device axis is ever emitted.

    Inside a pipeline stage (`stage()`), pp is already manual: specs there are resolved against the mesh
    in context (traced under `jax.set_mesh`), and the layers are the stage's own.
    """

    mesh: jax.sharding.Mesh
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = tuple(RULES.items())
    in_stage: bool = False

    def stage(self) -> Layout:
        """The layout seen by the code of one pipeline stage."""
        return dataclasses.replace(self, rules=tuple((k, None if k == "layers" else v) for k, v in self.rules),
                                   in_stage=True)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that split a logical axis."""
        entry = dict(self.rules)[logical] if logical is not None else None
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return tuple(a for a in names if self.mesh.shape[a] > 1)

    def spec(self, axes: Axes | None) -> PartitionSpec:
        """None (or ()) is replicated."""
        def entry(logical: str | None) -> str | tuple[str, ...] | None:
            names = self.mesh_axes(logical)
            return names[0] if len(names) == 1 else names or None
        return PartitionSpec(*map(entry, axes or ()))

    def sharding(self, axes: Axes | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.spec(axes) if self.in_stage else self.sharding(axes))

    @property
    def platform(self) -> str:
        """The mesh's devices' platform ("cpu", "gpu", "tpu"): a mesh holds one kind."""
        return self.mesh.devices.flat[0].platform

    def axis_size(self, logical: str) -> int:
        """How many shards a logical axis is split into."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(logical))

    def shard_map(self, fn: Callable, in_axes: tuple, out_axes: Any, *, check_vma: bool = True) -> Callable:
        """`fn` run per device under jax.shard_map, its arguments and results named by logical axes.

        in_axes holds one entry per argument: an axes tuple, None (replicated), or a pytree of those
        matching the argument; out_axes likewise for the result.
        """
        def specs(tree: Any) -> Any:
            return jax.tree.map(self.spec, tree, is_leaf=_is_axes)

        mesh = jax.sharding.get_abstract_mesh() if self.in_stage else self.mesh
        return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(specs, in_axes)), out_specs=specs(out_axes),
                             check_vma=check_vma)


def device_bytes(tree, device: jax.Device) -> int:
    """Bytes of the shards of every array in `tree` (or jax.ShapeDtypeStruct with a sharding) on `device`."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree) if device in x.sharding.device_set)


def kv_head_repeat(cfg: ModelConfig, tp: int) -> int:
    """How often each KV head is replicated so every tp shard holds the KV heads its query heads use."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def validate(cfg: ModelConfig, mesh: MeshConfig) -> None:
    """Refuse, before anything compiles, a mesh this model cannot be split over."""
    tp = mesh.tp
    if cfg.num_heads % tp:
        raise MeshError(f"tp={tp} does not divide the model's {cfg.num_heads} attention heads; "
                        f"use a tp that divides {cfg.num_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise MeshError(f"tp={tp} and the model's {cfg.num_kv_heads} KV heads must divide one another "
                        f"(KV heads are split when tp divides them and replicated when they divide tp)")
    if cfg.mlp_layers and cfg.intermediate_size % tp:
        raise MeshError(f"tp={tp} does not divide the MLP width {cfg.intermediate_size}")
    if cfg.num_experts:
        if cfg.num_experts % mesh.ep:
            raise MeshError(f"ep={mesh.ep} does not divide the model's {cfg.num_experts} experts; "
                            f"use an ep that divides {cfg.num_experts}")
        if cfg.moe_intermediate_size % tp:
            raise MeshError(f"tp={tp} does not divide the expert MLP width {cfg.moe_intermediate_size}")
    elif mesh.ep > 1:
        raise MeshError(f"ep={mesh.ep}: expert parallel needs a mixture-of-experts model, and "
                        f"{cfg.architecture} is dense; use ep=1 (and dp for more replicas)")
    if mesh.pp > cfg.num_layers:
        raise MeshError(f"pp={mesh.pp} exceeds the model's {cfg.num_layers} layers: every pipeline stage needs "
                        f"at least one layer; use pp <= {cfg.num_layers}")

def validate_sp(sp: int, context_length: int, page_size: int) -> None:
    """sp spreads each sequence's pages over its ranks: a full context must reach every rank."""
    pages = -(-context_length // page_size)
    if sp > pages:
        raise MeshError(f"sp={sp} exceeds the {pages} KV pages of the model's {context_length}-token context "
                        f"(pages of {page_size} tokens): some sp ranks could never hold a page; use sp <= {pages} "
                        f"or smaller pages")
