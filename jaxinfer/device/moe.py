"""Mixture-of-experts FFN (Mixtral / Qwen3-MoE routing), expert parallel over "ep" with one shard_map.

Routing reproduces Hugging Face exactly, ties included: logits = x @ router in x's dtype (as HF's gate
Linear), softmax over all experts in float32, `lax.top_k` (ties -> lower expert index, like torch.topk), the top-k
probabilities renormalised if `normalize`, cast to x's dtype; each chosen expert computes
down(silu(gate(x)) * up(x)) and the k results are weighted and summed.

Expert parallel layout (the rules table): tokens are sharded over the batch axes, which must include the
experts' axis ("batch" -> ("dp", "ep")), so every ep rank routes its own replica's tokens; experts are
split over "ep" and each expert's FFN width over "tp" (Megatron: column-parallel gate/up, row-parallel
down). Gate and up are one weight [X, E, G, 2M/G] stored shard by shard (jaxinfer.checkpoint.FusedSpec:
block g holds shard g's gate and up columns), so one grouped matmul computes both. Per device, with T
local tokens, A = T*k assignments and capacity C = A (room for every assignment going to one rank, so no
token is ever dropped whatever the routing):

1. route; 2. sort the assignments by global expert, which groups them by owner (expert // X_local) and
   within an owner by local expert, and write them compacted into a fixed [ep, C, .] send buffer;
3. all-to-all over ep (tiled: split axis 0 = destination, concat axis 0 = source); 4. sort what arrived
   by local expert and run it through the local experts, gate and up in one (`_grouped`): on GPUs the
   Pallas grouped matmul, quantized experts on the CPU backend the C++ grouped matmul, elsewhere each
   expert's rows in tiles (`_tiled`); 5.
   all-to-all back to the source slots; 6. weight and sum the k choices; 7. one psum over tp (each tp
   rank holds a partial down-projection), none at tp=1. Counts are a local histogram, returned sharded
   like the tokens.

Bytes per device (b = x's itemsize; everything fixed-shape, there is no ragged all-to-all on CPU):
- dispatch all-to-all: ep * C * (E * b + 4). The local expert id of each slot (int32, x_local marks an
  empty slot) rides in the same message, bitcast into trailing columns of an unsigned-int view of the
  payload: sending it separately would cost a third all-to-all, and the receiver cannot know it otherwise.
- combine all-to-all: ep * C * E * b.
The analytical minimum is n * k * E * b each way (what a ragged all-to-all would move): the padded
buffers cost ep times that. Where ep == 1 both all-to-alls are trivial and are not emitted. The combine
payload also travels as an unsigned-int view, so bf16 stays 2 bytes on the wire (see step 5).

Empty slots are sorted last (id x_local, outside every group) and their outputs masked with `where`, whatever
the grouped product leaves in rows beyond sum(group_sizes).
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.checkpoint import unfuse
from jaxinfer.device import quant_matmul_cpu
from jaxinfer.device.matmul import has_fp8_gemm
from jaxinfer.pallas_kernels import grouped_matmul
from jaxinfer.quant import QuantArray, axes_of
from jaxinfer.sharding import Layout

TOKENS = ("batch", "seq", "embed")
WEIGHTS_IN, WEIGHTS_OUT = ("experts", "embed", "mlp", None), ("experts", "mlp", "embed")
KERNEL_PLATFORMS = ("gpu",)   # where the experts go through the grouped matmul kernel (elsewhere interpreted)


def route(x: jax.Array, router: jax.Array, valid: jax.Array, *, top_k: int, normalize: bool,
          min_rows: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """HF routing of x [R, N, E]: (weights [R, N, k] in x's dtype, experts int32 [R, N, k], counts [R, X]).

    Fewer than `min_rows` rows are padded with invalid ones: on GPUs two rows keep the router's product a GEMM
    (one row's is strength-reduced and written out whole, [E, X] in float32: see device.matmul.model_matmul)."""
    r, n = valid.shape
    if r * n < min_rows:
        pad = ((0, 0), (0, -(-min_rows // r) - n))
        weights, experts, counts = route(jnp.pad(x, (*pad, (0, 0))), router, jnp.pad(valid, pad), top_k=top_k,
                                         normalize=normalize)
        return weights[:, :n], experts[:, :n], counts
    # The gate's logits are rounded to the model dtype before the float32 softmax, as in transformers
    # (a no-op for float32; for bfloat16 it keeps near-tied top-k choices identical to the reference).
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    logits = logits.astype(jnp.float32)
    probs, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        probs = probs / probs.sum(-1, keepdims=True)
    hits = (experts[..., None] == jnp.arange(router.shape[1])) & valid[..., None, None]
    return probs.astype(x.dtype), experts.astype(jnp.int32), hits.sum((1, 2), dtype=jnp.int32)


def _gate_and_up(gate_up: jax.Array, axis: int) -> list[jax.Array]:
    """A fused gate/up output with its G blocks at `axis` -> (gate, up), each with G * M/G columns there."""
    half = gate_up.shape[axis + 1] // 2
    return unfuse(gate_up, (half, half), axis)


def moe_reference(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                  valid: jax.Array, *, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The ground truth: plain jnp, the chosen experts' weights gathered per token. Padding tokens -> 0."""
    w_gate_up, w_down = _plain(w_gate_up, x.dtype), _plain(w_down, x.dtype)
    weights, experts, counts = route(x, router, valid, top_k=top_k, normalize=normalize)
    gate, up = _gate_and_up(jnp.einsum("rne,rnkegc->rnkgc", x, w_gate_up[experts]), axis=3)
    out = jnp.einsum("rnkm,rnkme->rnke", jax.nn.silu(gate) * up, w_down[experts])
    y = (weights[..., None] * out).sum(2)
    return jnp.where(valid[..., None], y, 0).astype(x.dtype), counts


def _plain(w: jax.Array | QuantArray, dtype) -> jax.Array:
    """Quantized experts dequantized (the reference's form)."""
    return w.dequantize(dtype) if isinstance(w, QuantArray) else w


def _grouped(xs: jax.Array, w: jax.Array | QuantArray, sizes: jax.Array, expert: jax.Array,
             layout: Layout, backend: str) -> jax.Array:
    """xs [n, K] (rows grouped by local expert, `sizes` rows each; `expert` [n] each row's) times the local
    experts' weights [X, K, *out] -> [n, prod(out)] in xs's dtype.

    On GPUs, the Pallas grouped matmul (jaxinfer.pallas_kernels.grouped_matmul) wherever it tiles the experts:
    it reads the experts the rows chose, as stored, and writes only its output; fp8 ones only where the GPU has
    fp8 tensor cores (Triton converts float8 on those only), on fp8 activations as a dense fp8 weight is
    (jaxinfer.quant.fp8_matmul: per row and block for block-wise scales, per row for per-channel ones).
    Quantized experts on the "cpu" backend: the C++ grouped matmul (jaxinfer.device.quant_matmul_cpu), which
    reads each chosen expert's 1-byte values once, as the dense kernel reads a weight (`_tiled` would convert
    each to float32 first: an fp8 model decoded at a fifth of float32's speed, int8 at 1.09x).
    Elsewhere each expert's rows in tiles (`_tiled`): a step reads the experts its rows chose. On CPU that
    beats each row times its own gathered expert (`_per_row`) even at a decode step's few rows (4x at 8 rows
    of 128 experts: XLA:CPU copies each row's expert out); GPUs keep `_per_row` for the shapes the kernel does
    not tile below X rows (5X for block-wise experts), where XLA:GPU fuses the gather into the reduction and
    a loop would launch kernels per expert. XLA's `lax.ragged_dot` is no alternative: it multiplies every
    expert by a masked copy of all the rows, X times the work (8.6x a dense product of the rows at X = 8)."""
    blockwise = isinstance(w, QuantArray) and w.scale.shape[1] > 1
    if isinstance(w, QuantArray) and backend == "cpu" and quant_matmul_cpu.available():
        experts, k = w.shape[:2]
        return quant_matmul_cpu.grouped_quantized_matmul(
            xs, w.values.reshape(experts, k, -1), w.scale.reshape(experts, w.scale.shape[1], -1), sizes, block=w.block)
    if _kernel_takes(w, layout):
        values, scale = (w.values, w.scale) if isinstance(w, QuantArray) else (w, None)
        values = values.reshape(*values.shape[:2], -1)
        scale = None if scale is None else scale.reshape(*scale.shape[:2], -1)
        return grouped_matmul.grouped_matmul(
            xs, values, scale, sizes, block=w.block if blockwise else None,
            fp8_activations=scale is not None and values.dtype == jnp.float8_e4m3fn,
            interpret=layout.platform != "gpu")
    if layout.platform == "gpu" and xs.shape[0] < w.shape[0] * (5 if blockwise else 1):
        return _per_row(xs, w, expert)
    return _tiled(xs, w, sizes)


def _tiled(xs: jax.Array, w: jax.Array | QuantArray, sizes: jax.Array) -> jax.Array:
    """xs [n, K] (grouped by expert, `sizes` rows each) times w [X, K, *out] -> [n, prod(out)] in xs's dtype,
    rows past the groups 0: a loop over the experts that have rows, each converted to float32 once and
    multiplied by its rows a tile at a time (the last tile masked where it runs into the next group). The work
    is the rows' own plus at most a tile per expert, and a step reads the experts its rows chose."""
    n, k = xs.shape
    tile = min(64, 1 << max(3, (n // sizes.shape[0] - 1).bit_length()))   # about the rows per expert
    starts = jnp.cumsum(sizes) - sizes
    padded = jnp.pad(xs, ((0, tile), (0, 0)))      # the last group's last tile stays in bounds

    def expert(g, out):
        weight = jax.tree.map(lambda a: a[g], w)
        weight = (weight.dequantize() if isinstance(weight, QuantArray) else weight.astype(jnp.float32))

        def tile_of_rows(t, out):
            first = starts[g] + t * tile
            rows = lax.dynamic_slice_in_dim(padded, first, tile).astype(jnp.float32)
            y = jnp.dot(rows, weight.reshape(k, -1), precision=lax.Precision.HIGHEST).astype(out.dtype)
            mine = (jnp.arange(tile) < sizes[g] - t * tile)[:, None]
            return lax.dynamic_update_slice_in_dim(
                out, jnp.where(mine, y, lax.dynamic_slice_in_dim(out, first, tile)), first, 0)

        return lax.fori_loop(0, -(-sizes[g] // tile), tile_of_rows, out)

    out = jnp.zeros((n + tile, math.prod(w.shape[2:])), xs.dtype)
    chosen = jnp.nonzero(sizes, size=sizes.shape[0])[0]    # the experts with rows, first
    return lax.fori_loop(0, (sizes > 0).sum(), lambda i, out: expert(chosen[i], out), out)[:n]


def _kernel_takes(w: jax.Array | QuantArray, layout: Layout) -> bool:
    """Whether the grouped matmul kernel takes a device's experts w [X, K, *out] on this mesh."""
    values = w.values if isinstance(w, QuantArray) else w
    if layout.platform not in KERNEL_PLATFORMS or (values.dtype == jnp.float8_e4m3fn and not has_fp8_gemm(layout)):
        return False
    block = w.block if isinstance(w, QuantArray) and w.scale.shape[1] > 1 else None
    return grouped_matmul.fits(w.shape[1], math.prod(w.shape[2:]), block)


def _device_rows(w: jax.Array | QuantArray, axis: str, dtype) -> jax.Array | QuantArray:
    """Inside the shard_map, the down projection [X, M / tp, E] of this device's rows of M, whose block-wise
    scales [X, blocks of M, E] cover all of M: cut to this device's blocks where its rows start a block, else
    (a split inside a block) the weight dequantized with each row's own block's scale."""
    if not isinstance(w, QuantArray) or w.scale.shape[1] == 1:
        return w
    rows, first = w.shape[1], lax.axis_index(axis) * w.shape[1]
    if rows % w.block == 0:
        return w.shard_rows(first)
    scale = jnp.take(w.scale, (first + jnp.arange(rows)) // w.block, axis=1)
    return (w.values.astype(jnp.float32) * scale).astype(dtype)


def _per_row(xs: jax.Array, w: jax.Array | QuantArray, expert: jax.Array) -> jax.Array:
    """Row i of xs [n, K] times expert[i]'s weight of w [X, K, *out] -> [n, prod(out)] in xs's dtype, as a
    product and a float32 sum over K, each weight element times its scale (block-wise) or the sum times the
    column's (per channel). Written so, XLA:GPU fuses the gather of each row's weight into one reduction that
    reads it where it lies; as a batched dot of experts this large it copied each row's expert out first."""
    n, k = xs.shape
    x = xs.astype(jnp.float32)[:, :, None]
    if not isinstance(w, QuantArray):
        return (x * w[expert].reshape(n, k, -1).astype(jnp.float32)).sum(1).astype(xs.dtype)
    values = w.values[expert].reshape(n, k, -1).astype(jnp.float32)
    scale = w.scale[expert].reshape(n, w.scale.shape[1], -1)                        # [n, blocks, N]
    if scale.shape[1] == 1:
        return ((x * values).sum(1) * scale[:, 0]).astype(xs.dtype)
    rows = jnp.repeat(scale, w.block, axis=1)[:, :k]                                # each row's block's scale
    return (x * values * rows).sum(1).astype(xs.dtype)


def _uint(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def _pack(payload: jax.Array, ids: jax.Array) -> jax.Array:
    """[..., E] activations and int32 ids [...] -> one unsigned-int array [..., E + 4 / itemsize]."""
    uint = _uint(payload.dtype)
    tail = lax.bitcast_convert_type(ids, uint).reshape(*ids.shape, -1)
    return jnp.concatenate([lax.bitcast_convert_type(payload, uint), tail], axis=-1)


def _unpack(packed: jax.Array, embed: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    tail = packed[..., embed:]
    tail = tail[..., 0] if tail.shape[-1] == 1 else tail
    return lax.bitcast_convert_type(packed[..., :embed], dtype), lax.bitcast_convert_type(tail, jnp.int32)


def moe(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, valid: jax.Array, *,
        top_k: int, normalize: bool, layout: Layout, backend: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Expert-parallel MoE FFN. x [R, N, E], router [E, X], w_gate_up [X, E, G, 2M/G] (gate and up fused in
    G column blocks), w_down [X, M, E], valid bool [R, N] -> (y [R, N, E] in x's dtype, padding tokens 0;
    counts int32 [R, X] of valid tokens).

    backend: the engine's ("cpu": quantized experts through the C++ grouped matmul; see `_grouped`).

    Communication per call and device: two all-to-alls over ep (bytes in the module docstring) and, where
    the FFN width is split (tp > 1), one all-reduce of the [n, E] output; no all-gather, weights never move.
    """
    gu, dn = (w.values if isinstance(w, QuantArray) else w for w in (w_gate_up, w_down))  # (quantized: the values)
    chex.assert_rank([x, router, gu, dn, valid], [3, 2, 4, 3, 2])
    chex.assert_shape(router, (x.shape[-1], gu.shape[0]))
    chex.assert_shape(gu, (gu.shape[0], x.shape[-1], None, None))
    chex.assert_shape(dn, (gu.shape[0], gu.shape[2] * gu.shape[3] // 2, x.shape[-1]))
    chex.assert_shape(valid, x.shape[:2])
    num_experts = router.shape[1]
    ep_axis, tp_axis = _one_mesh_axis(layout, "experts"), _one_mesh_axis(layout, "mlp")
    ep, tp = layout.axis_size("experts"), layout.axis_size("mlp")
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over ep={ep}: "
                         f"use an ep that divides {num_experts}")
    batch_axes = layout.mesh_axes("batch")
    if ep > 1 and ep_axis not in batch_axes:
        raise ValueError(f"expert parallel needs the tokens sharded over {ep_axis!r} too (rules 'batch' -> "
                         f"(..., {ep_axis!r})); they are sharded over {batch_axes}")
    x_local = num_experts // ep
    seq_axes = layout.mesh_axes("seq")

    def a2a(t: jax.Array) -> jax.Array:
        return lax.all_to_all(t, ep_axis, 0, 0, tiled=True) if ep > 1 else t

    def local(x, valid, router, w_gate_up, w_down):
        r, n, embed = x.shape
        weights, experts, counts = route(x, router, valid, top_k=top_k, normalize=normalize,
                                         min_rows=2 if layout.platform == "gpu" else 1)
        cap = r * n * top_k  # C: one slot per assignment, to every rank
        # 2. dispatch: sorted by global expert = grouped by owner, then by local expert; padding sorts last.
        flat = jnp.where(valid[..., None], experts, num_experts).reshape(cap)
        order = jnp.argsort(flat, stable=True)
        chosen = flat[order]
        dest = chosen // x_local  # == ep for padding: dropped by the scatter, filled with 0 by the gather
        first = jnp.searchsorted(chosen, jnp.arange(ep) * x_local)
        slot = jnp.arange(cap) - first[jnp.minimum(dest, ep - 1)]
        tokens = x.reshape(r * n, embed)[order // top_k]
        payload = jnp.zeros((ep, cap, embed), x.dtype).at[dest, slot].set(tokens, mode="drop")
        ids = jnp.full((ep, cap), x_local, jnp.int32).at[dest, slot].set(chosen % x_local, mode="drop")
        # 3. to the owners; 4. grouped FFN over everything that arrived, sorted by local expert.
        received, ids = _unpack(a2a(_pack(payload, ids)).reshape(ep * cap, -1), embed, x.dtype)
        by_expert = jnp.argsort(ids, stable=True)
        sizes = (ids[:, None] == jnp.arange(x_local)).sum(0, dtype=jnp.int32)  # empty slots: beyond sum(sizes)
        xs, expert = received[by_expert], ids[by_expert]   # expert == x_local: an empty slot
        blocks = w_gate_up.shape[2:]                    # this device's column blocks: [G / tp, 2M/G]
        down = _device_rows(w_down, tp_axis, x.dtype) if tp > 1 else w_down
        row_expert = jnp.minimum(expert, x_local - 1)   # empty slots' rows: any expert's scale, zeroed below
        fused = _grouped(xs, w_gate_up, sizes, row_expert, layout, backend)   # gate and up at once
        gate, up = _gate_and_up(fused.reshape(-1, *blocks), axis=1)
        out = _grouped(jax.nn.silu(gate) * up, down, sizes, row_expert, layout, backend)
        out = jnp.where((expert < x_local)[:, None], out, 0)
        out = jnp.zeros_like(out).at[by_expert].set(out)  # back to arrival order
        # 5. back to the source slots; 6. weight and sum the k choices; 7. one all-reduce over tp.
        # The unsigned view pins the wire format to x's dtype: for bf16, XLA:CPU would otherwise move the
        # rounding of the f32 matmul result past the all-to-all and send float32.
        wire = lax.bitcast_convert_type(out.reshape(ep, cap, embed), _uint(x.dtype))
        back = lax.bitcast_convert_type(a2a(wire), x.dtype).at[dest, slot].get(mode="fill", fill_value=0)
        per_choice = jnp.zeros_like(back).at[order].set(back).reshape(r, n, top_k, embed)
        y = (weights[..., None] * per_choice).sum(2)
        if seq_axes:  # the replica's tokens are split over sp: its counts are the ranks' sum
            counts = lax.psum(counts, seq_axes)
        return (lax.psum(y, tp_axis) if tp > 1 else y), counts

    weight_axes = (axes_of(w_gate_up, WEIGHTS_IN), axes_of(w_down, WEIGHTS_OUT))
    return layout.shard_map(local, in_axes=(TOKENS, TOKENS[:2], None, *weight_axes),
                            out_axes=(TOKENS, ("batch", None)),   # a pallas_call's output has no vma type
                            check_vma=False)(x, valid, router, w_gate_up, w_down)


def _one_mesh_axis(layout: Layout, logical: str) -> str | None:
    """The single mesh axis (of size > 1) that splits `logical`, or None."""
    axes = layout.mesh_axes(logical)
    if len(axes) > 1:
        raise ValueError(f"moe needs {logical!r} on at most one mesh axis, the rules give {axes}")
    return axes[0] if axes else None
