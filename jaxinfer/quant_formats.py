"""Which weights are held quantized (jaxinfer.quant.QuantArray), and how the quantized checkpoints people
download store theirs.

Quantized as they load (`quantization="int8"|"fp8"`): every matmul weight of the decoder layers (q/k/v,
o, gate/up, down and the experts'), one scale per output channel; the embedding, the LM head, the norms,
the biases and the MoE router stay as stored. A model marks its matmul weights (ParamSpec.contract); one with
a vocab axis (the LM head) is never quantized.

Pre-quantized, from config.json's `quantization_config`:
- quant_method "fp8" with a `weight_block_size` (transformers' fine-grained FP8, as DeepSeek and Qwen3-FP8
  publish): float8_e4m3fn weights with float32 `<name>_scale_inv`, one per [rows, columns] block of the
  [out, in] tensor (any block shape; the edges of a tensor that is not a multiple of it are partial
  blocks). Despite the name, weight = stored * scale_inv.
- quant_method "fp8" without one (AutoFP8's and vLLM's per-tensor FP8, as the first FP8 Llama and Mixtral
  checkpoints were published): `<name>_scale` (`...q_proj.weight_scale`), one per tensor ([] or [1]); a
  static scheme's `input_scale` is not read.
- quant_method "compressed-tensors" (llm-compressor's FP8 and INT8 schemes, in its unpacked formats):
  float8_e4m3fn or int8 weights with `<name>_scale`, strategy "tensor", "channel" ([out, 1]), "group"
  ([out, in / group_size]) or "block" (`block_structure`).
A weight is quantized where the checkpoint stores it in 8 bits (the rest, such as the layers a config's
`ignore` list names, stay as stored), and then its scales must be there. The declared activation scheme
(dynamic per-token fp8) is recorded; weights-only is what runs where no fp8 matmul exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from jaxinfer.checkpoint import QUANTIZED, CheckpointError, FusedSpec, ParamSpec, QuantSpec, Spec, is_spec

STORED_QTYPES = {"F8_E4M3": "fp8", "I8": "int8"}


@dataclasses.dataclass(frozen=True)
class StoredQuantization:
    """A pre-quantized checkpoint's scheme: the scale tensors' name suffix and the block each scale covers
    in the [out, in] weight (None: all of that dimension)."""

    method: str
    qtype: str                       # "fp8" or "int8"
    scale_suffix: str
    rows: int | None = None
    cols: int | None = None
    activations: str | None = None   # e.g. "dynamic" fp8 per token, as the checkpoint declares


def stored_quantization(config: dict[str, Any]) -> StoredQuantization | None:
    """config.json's quantization_config, checked (None where the checkpoint is not quantized)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"fp8 checkpoints in format {qc.get('fmt')!r} are not supported (only e4m3)")
        block = _block(qc.get("weight_block_size"), "weight_block_size")
        rows, cols = block or (None, None)
        suffix = "_scale_inv" if block else "_scale"   # per-tensor FP8 names its scale as vLLM reads it
        return StoredQuantization("fp8", "fp8", suffix, rows, cols, qc.get("activation_scheme"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise CheckpointError(f"quantization_config quant_method {method!r} is not supported: jaxinfer reads 'fp8' "
                          f"and 'compressed-tensors' (FP8 or INT8 weights), or quantizes a full-precision "
                          f"checkpoint as it loads (quantization='int8' or 'fp8')")


UNPACKED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


def _compressed_tensors(qc: dict[str, Any]) -> StoredQuantization:
    fmt = qc.get("format")
    if fmt is not None and fmt not in UNPACKED_FORMATS:
        raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported: jaxinfer reads 8-bit weights "
                              f"stored one per byte ({', '.join(UNPACKED_FORMATS)})")
    groups = list((qc.get("config_groups") or {}).values())
    schemes = {repr(g.get("weights")) for g in groups}
    if len(schemes) != 1:
        raise CheckpointError(f"compressed-tensors with {len(schemes)} weight schemes in config_groups; jaxinfer "
                              f"reads one scheme for every quantized layer")
    w = groups[0].get("weights") or {}
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if bits != 8 or kind not in ("float", "int") or not w.get("symmetric", True):
        raise CheckpointError(f"compressed-tensors weights of {bits}-bit {kind} (symmetric={w.get('symmetric')}) "
                              f"are not supported: jaxinfer reads symmetric 8-bit float or int weights")
    if strategy == "tensor":
        rows, cols = None, None
    elif strategy == "channel":
        rows, cols = 1, None
    elif strategy == "group":
        if w.get("actorder") == "group":   # its groups are not consecutive columns (a weight_g_idx maps them)
            raise CheckpointError("compressed-tensors groups in activation order (actorder='group') are not "
                                  "supported: jaxinfer reads groups of consecutive input columns")
        size = w.get("group_size")
        if not _positive_int(size):
            raise CheckpointError(f"compressed-tensors group_size={size!r} must be a positive integer")
        rows, cols = 1, size
    elif strategy == "block":
        rows, cols = _block(w.get("block_structure"), "block_structure")
    else:
        raise CheckpointError(f"compressed-tensors weight strategy {strategy!r} is not supported (tensor, channel, "
                              f"group, block)")
    act = groups[0].get("input_activations") or {}
    activations = f"{'dynamic' if act.get('dynamic') else 'static'} {act.get('strategy')}" if act else None
    qtype = "fp8" if kind == "float" else "int8"
    return StoredQuantization("compressed-tensors", qtype, "_scale", rows, cols, activations)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _block(value: Any, name: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(map(_positive_int, value)):
        raise CheckpointError(f"quantization_config {name}={value!r} must be two positive integers [rows, cols]")
    return int(value[0]), int(value[1])


def quantized_specs(specs: Any, method: str | None, stored: StoredQuantization | None = None,
                    stored_dtype: Callable[[str], str | None] | None = None) -> Any:
    """The model's weight specs with each matmul weight made a QuantSpec: as stored where the checkpoint
    holds it in 8 bits (`stored_dtype`: a tensor's dtype as the checkpoint names it, None where it is
    absent), else quantized as it loads where `method` asks, else left as it is."""
    def one(spec: Spec) -> Spec:
        if isinstance(spec, QuantSpec) or not spec.contract or "vocab" in spec.axes:   # the LM head stays
            return spec
        if stored is not None and stored_dtype is not None:
            dtypes = {d for p in spec.parts for n in p.hf_names() if (d := stored_dtype(n)) is not None}
            if dtypes & set(QUANTIZED):
                if len(dtypes) != 1:
                    names = [n for p in spec.parts for n in p.hf_names()[:1]]
                    raise CheckpointError(f"tensors {names} are read as one weight but stored in {sorted(dtypes)}: "
                                          f"either all of them are quantized or none")
                return _stored(spec, stored, STORED_QTYPES[dtypes.pop()])
        return _on_the_fly(spec, method) if method else spec
    return jax.tree.map(one, specs, is_leaf=is_spec)


def _on_the_fly(spec: ParamSpec | FusedSpec, qtype: str) -> QuantSpec:
    k = _contraction(spec)
    return QuantSpec(spec, _scales(spec, lambda p: "", blocks=1, row_block=None), qtype, block=k, stored=False)


def _stored(spec: ParamSpec | FusedSpec, stored: StoredQuantization, qtype: str) -> QuantSpec:
    k = _contraction(spec)
    cols = stored.cols or k
    scale = _scales(spec, lambda p: p.hf + stored.scale_suffix, blocks=-(-k // cols),
                    row_block=stored.rows)
    return QuantSpec(spec, scale, qtype, block=cols, stored=True)


def _contraction(spec: ParamSpec | FusedSpec) -> int:
    first = spec.parts[0]
    return math.prod(first.layer_shape[: first.contract])


def _scales(spec: ParamSpec | FusedSpec, name, *, blocks: int, row_block: int | None) -> ParamSpec | FusedSpec:
    """The scales' spec: the weight's, its contraction axes replaced by one axis of `blocks`. On disk a
    scale tensor is [out rows / row_block, blocks] beside the [out, in] weight (row_block None: one row for
    all), so it reads through the weight's own view and permutation with `in` replaced by `blocks`."""
    def part(p: ParamSpec) -> ParamSpec:
        d, c, groups = p.stack_depth, p.contract, p.groups
        n_out = sum(len(g) for g in groups[:-1])        # the [out, in] tensor: its `in` group comes last
        perm = p.perm or tuple(range(len(p.layer_shape)))
        axis, times = p.repeat
        return ParamSpec(shape=(*p.shape[:d], blocks, *p.layer_shape[c:]), axes=(*p.axes[:d], None, *p.axes[d + c:]),
                         hf=name(p), view=(*groups[:-1], (blocks,)), perm=(n_out, *perm[c:]),
                         repeat=(axis - c + 1, times) if times > 1 else (0, 1), layer_ids=p.layer_ids,
                         row_block=row_block or math.prod(p.hf_shape[:-1]))
    if isinstance(spec, FusedSpec):
        return dataclasses.replace(spec, parts=tuple(map(part, spec.parts)))
    return part(spec)
