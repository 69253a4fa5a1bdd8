"""Hugging Face safetensors -> sharded jax arrays, each device reading only its own slice.

safetensors' numpy backend cannot represent bfloat16, so the files are read here directly: the header
is JSON, the data a flat buffer, and each slice comes out of a read-only memory map (ml_dtypes gives
numpy its bfloat16), so no host ever holds a full copy of the model. Only safetensors, never pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.quant import QTYPES, QuantArray, quantize

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8}
QUANTIZED = ("F8_E4M3", "I8")   # read only as the values of a quantized weight (QuantSpec), never cast


class CheckpointError(ValueError):
    """A checkpoint jaxinfer cannot load: the message names the file or tensor and what is wrong."""


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight in our layout and where it lives in a Hugging Face checkpoint.

    `view` splits the HF tensor's dims into groups (e.g. q_proj [H*D, E] is ((H, D), (E,))); our array is
    that view transposed by `perm`, with axis repeat[0] repeated repeat[1] times (KV-head replication).
    Leading "layers" and "experts" axes stack the tensors named by `hf` with {layer} and {expert};
    `layer_ids` says which checkpoint layers a stack holds (e.g. only the MoE layers), default all; a None
    among them is a slot that holds no layer (a pipeline stage's padding) and reads as zeros.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf: str
    view: tuple[tuple[int, ...], ...] | None = None
    perm: tuple[int, ...] | None = None
    repeat: tuple[int, int] = (0, 1)
    layer_ids: tuple[int | None, ...] | None = None
    pad: tuple[int, int] | None = None  # (axis, size on disk): our axis is longer, the rest reads as zeros
    contract: int = 0   # a matmul weight (the model multiplies it with ctx.matmul or ctx.moe, which take it
    #                     quantized, or held for the CPU kernel): how many axes after the stacking ones it
    #                     contracts (0: not one)
    row_block: int | None = None  # a stored scale: each row on disk covers this many output rows (repeated)

    @property
    def stack_depth(self) -> int:
        """How many leading axes stack separate checkpoint tensors."""
        if self.axes[:1] != ("layers",):
            return 0
        return 2 if self.axes[1:2] == ("experts",) else 1

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[self.stack_depth:]

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        if self.view is not None:
            return self.view
        shape = list(self.layer_shape)
        shape[self.repeat[0]] //= self.repeat[1]
        if self.pad is not None:
            shape[self.pad[0]] = self.pad[1]
        perm = self.perm or tuple(range(len(shape)))
        return tuple((shape[perm.index(j)],) for j in range(len(shape)))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The tensor's shape on disk: hf_shape, except a scale's rows, one per `row_block` output rows."""
        if self.row_block is None:
            return self.hf_shape
        rows, cols = self.hf_shape
        return (-(-rows // self.row_block), cols)

    def hf_name(self, position: int = 0, expert: int = 0) -> str | None:
        """The checkpoint tensor of one stacked slot; None for a padding slot."""
        layer = self.layer_ids[position] if self.layer_ids is not None else position
        return None if layer is None else self.hf.format(layer=layer, expert=expert)

    def hf_names(self) -> list[str]:
        names = (self.hf_name(*ids) for ids in itertools.product(*map(range, self.shape[: self.stack_depth])))
        return [n for n in names if n is not None]

    @property
    def parts(self) -> tuple[ParamSpec, ...]:
        """The checkpoint-backed specs this weight is read from: itself (see FusedSpec)."""
        return (self,)

    def map_parts(self, fn: Callable[[ParamSpec], ParamSpec]) -> ParamSpec:
        return fn(self)


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Weights that one matmul reads together (q/k/v, gate/up), stored as one array, shard by shard.

    Every part is column-parallel: split along `axis` (counted from the end, so stacking leading axes
    leaves it in place) into `shards` equal blocks, one per device of the column split. Our array replaces
    that axis by two, [shards, columns of one shard], block g holding [part 0's block g, part 1's block g,
    ...]. Sharding the block axis as the parts' column axis was gives each device its own columns of every
    part, contiguous: one matmul reads them all, and its output splits by `widths`, the same on every block.
    """

    parts: tuple[ParamSpec, ...]
    axis: int = -1
    shards: int = 1

    def __post_init__(self):
        first, a = self.parts[0], self.axis
        for p in self.parts:
            if p.shape[:a] != first.shape[:a] or p.shape[a + 1:] != first.shape[a + 1:]:
                raise ValueError(f"fused parts {p.hf} {p.shape} and {first.hf} {first.shape} differ outside axis {a}")
            if p.shape[a] % self.shards:
                raise ValueError(f"{p.hf}: {p.shape[a]} columns do not split into {self.shards} shards")

    @property
    def widths(self) -> tuple[int, ...]:
        """Each part's columns in one shard's block."""
        return tuple(p.shape[self.axis] // self.shards for p in self.parts)

    @property
    def block_axis(self) -> int:
        """Our array's [shards] axis (the next one holds the columns of one block)."""
        return len(self.parts[0].shape) + self.axis

    @property
    def shape(self) -> tuple[int, ...]:
        s, d = self.parts[0].shape, self.block_axis
        return (*s[:d], self.shards, sum(self.widths), *s[d + 1:])

    @property
    def axes(self) -> tuple[str | None, ...]:
        a, d = self.parts[0].axes, self.block_axis
        return (*a[:d], a[d], None, *a[d + 1:])

    @property
    def stack_depth(self) -> int:
        return self.parts[0].stack_depth

    @property
    def layer_ids(self) -> tuple[int | None, ...] | None:
        return self.parts[0].layer_ids

    @property
    def contract(self) -> int:
        return self.parts[0].contract

    def map_parts(self, fn: Callable[[ParamSpec], ParamSpec]) -> FusedSpec:
        return dataclasses.replace(self, parts=tuple(map(fn, self.parts)))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A matmul weight held quantized (jaxinfer.quant.QuantArray): its values read from `weight`, stored
    quantized with their scales in `scale` (a pre-quantized checkpoint), or quantized per output channel
    on the devices as they load (`stored` False: `scale` then only gives the scales' shape and axes)."""

    weight: ParamSpec | FusedSpec
    scale: ParamSpec | FusedSpec
    qtype: str              # "int8" or "fp8"
    block: int              # contraction rows per scale
    stored: bool

    shape = property(lambda self: self.weight.shape)
    axes = property(lambda self: self.weight.axes)
    stack_depth = property(lambda self: self.weight.stack_depth)
    layer_ids = property(lambda self: self.weight.layer_ids)
    contract = property(lambda self: self.weight.contract)

    @property
    def out(self) -> int:
        return len(self.shape) - self.stack_depth - self.contract

    @property
    def matmul_axes(self) -> tuple[str | None, ...]:
        """The logical axes of one layer's weight: what the matmul contracts, then its outputs."""
        return self.axes[len(self.axes) - self.contract - self.out:]

    @property
    def parts(self) -> tuple[ParamSpec, ...]:
        return self.weight.parts + (self.scale.parts if self.stored else ())

    def map_parts(self, fn: Callable[[ParamSpec], ParamSpec]) -> QuantSpec:
        return dataclasses.replace(self, weight=self.weight.map_parts(fn), scale=self.scale.map_parts(fn))


Spec = ParamSpec | FusedSpec | QuantSpec


def fuse(parts: Sequence[jax.Array], spec: FusedSpec) -> jax.Array:
    """The parts' arrays (each in its ParamSpec's layout) laid out as `spec`'s one array, shard by shard."""
    d = spec.block_axis
    blocks = [x.reshape(*x.shape[:d], spec.shards, w, *x.shape[d + 1:]) for x, w in zip(parts, spec.widths,
                                                                                      strict=True)]
    return jnp.concatenate(blocks, axis=d + 1)


def unfuse(y: jax.Array, widths: Sequence[int], axis: int) -> list[jax.Array]:
    """The output of a matmul with a fused weight (jaxinfer.checkpoint.FusedSpec), [..., G, sum(widths), ...]
    with its G blocks at `axis`, -> one array per part, [..., G * width, ...]. Block g's columns of a part
    are column shard g of that part, so merging the blocks back needs no communication."""
    parts = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=axis + 1)
    return [p.reshape(*p.shape[:axis], -1, *p.shape[axis + 2:]) for p in parts]


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size, data memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
            for t in header.values():
                t["shape"], t["dtype"] = list(t["shape"]), str(t["dtype"])
        except (struct.error, ValueError, UnicodeDecodeError, AttributeError, TypeError, KeyError, IndexError) as e:
            raise CheckpointError(f"{path} is not a valid safetensors file (corrupt header: {e!r})") from None
        self.tensors = header
        self.data_start = 8 + n
        if self.data_start + end > size:
            raise CheckpointError(f"{path} is truncated: its header describes {self.data_start + end} bytes "
                                  f"but the file has {size}; download it again")
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if size else None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def check_dtype(self, name: str) -> None:
        if self.tensors[name]["dtype"] not in DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self.path} has dtype {self.tensors[name]['dtype']}; "
                                  f"jaxinfer reads {', '.join(DTYPES)}")

    def array(self, name: str) -> np.ndarray:
        """A zero-copy view: slicing it reads only the touched pages."""
        self.check_dtype(name)
        t = self.tensors[name]
        begin, end = t["data_offsets"]
        raw = self._map[self.data_start + begin: self.data_start + end]
        return raw.view(DTYPES[t["dtype"]]).reshape(t["shape"])


class Checkpoint:
    """The safetensors files of a Hugging Face directory (one file, or several with an index)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index (needs a weight_map): {e!r}") from None
            names = sorted(set(weight_map.values()))
            outside = [n for n in names if Path(n).name != n]
            if outside:
                raise CheckpointError(f"{index} names shard files outside the checkpoint directory: {outside}")
        else:
            names = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not names:
            raise CheckpointError(f"{str(path)!r} has no *.safetensors files (jaxinfer reads only safetensors)")
        for n in names:
            if not (path / n).is_file():
                raise CheckpointError(f"{index} names {n}, which is missing from {path}")
        self.path = path
        self.files = {n: SafetensorsFile(path / n) for n in names}
        self.where = {t: f for f in self.files.values() for t in f.tensors}
        if weight_map:
            for t, n in weight_map.items():
                if t not in self.files[n].tensors:
                    raise CheckpointError(f"{index} places {t!r} in {n}, but that file does not hold it")

    def dtype(self, name: str) -> str | None:
        """A tensor's dtype as the file names it (e.g. "BF16", "F8_E4M3"); None if no file holds it."""
        return self.where[name].tensors[name]["dtype"] if name in self.where else None

    def check(self, specs: Any) -> None:
        """Every tensor present with the shape the config implies and a dtype jaxinfer reads, before anything
        is read or compiled. specs: a pytree of specs (a model's Weights)."""
        for key, spec in named_specs(specs):
            quantized = spec.weight.parts if isinstance(spec, QuantSpec) and spec.stored else ()
            for part, name in ((p, n) for p in spec.parts for n in p.hf_names()):
                if name not in self.where:
                    need = "the scales of a quantized tensor" if part.row_block else "needed"
                    raise CheckpointError(f"checkpoint {self.path} lacks tensor {name!r} ({need} for {key})")
                found, want = self.where[name].shape(name), part.stored_shape
                if found != want and not (part.row_block and math.prod(found) == math.prod(want) == 1):
                    raise CheckpointError(f"tensor {name!r} has shape {list(found)} but config.json implies "
                                          f"{list(want)}: config and weights do not match")
                self.where[name].check_dtype(name)
                dtype = self.dtype(name)
                if dtype in QUANTIZED and part not in quantized:
                    raise CheckpointError(f"tensor {name!r} is stored as {dtype}, but config.json declares no "
                                          f"quantization of it (its quantization_config, where one is given, "
                                          f"leaves it out)")
                if part in quantized and dtype not in QUANTIZED:
                    raise CheckpointError(f"tensor {name!r} is {dtype}, but its scales say it is quantized")

    def read(self, spec: Spec, index: tuple[slice, ...]) -> np.ndarray:
        """Our-layout slice `index` of a parameter, reading only the rows it needs from each tensor."""
        if isinstance(spec, FusedSpec):
            return self._read_fused(spec, index)
        depth = spec.stack_depth
        if depth == 0:
            return self._read_one(spec, spec.hf, index)
        ranges = [range(*index[i].indices(spec.shape[i])) for i in range(depth)]
        rest = tuple(len(range(*s.indices(n))) for s, n in zip(index[depth:], spec.layer_shape, strict=True))
        names = [spec.hf_name(*ids) for ids in itertools.product(*ranges)]
        parts = {n: self._read_one(spec, n, index[depth:]) for n in names if n is not None}
        dtype = next(iter(parts.values())).dtype if parts else np.float32
        zeros = np.zeros(rest, dtype)
        return np.stack([zeros if n is None else parts[n] for n in names]).reshape(*map(len, ranges), *rest)

    def _read_one(self, spec: ParamSpec, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if spec.pad is not None:
            return self._read_padded(spec, name, index)
        shape = spec.layer_shape
        ours = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        axis, r = spec.repeat
        lo, hi = ours[axis]
        ours[axis] = (lo // r, -(-hi // r))                      # source heads behind replicated ones
        perm = spec.perm or tuple(range(len(shape)))
        view_idx = [ours[perm.index(j)] for j in range(len(shape))]
        hf_idx, dims, rest, j = [], [], [], 0
        for group in spec.groups:
            inner = math.prod(group[1:])
            sub = view_idx[j: j + len(group)]
            if all(s == (0, n) for s, n in zip(sub[1:], group[1:], strict=True)):  # one contiguous row range
                hf_idx.append(slice(sub[0][0] * inner, sub[0][1] * inner))
                dims += [sub[0][1] - sub[0][0], *group[1:]]
                rest += [slice(None)] * len(group)
            else:
                hf_idx.append(slice(None))
                dims += list(group)
                rest += [slice(a, b) for a, b in sub]
            j += len(group)
        data = self._source(spec, name)[tuple(hf_idx)].reshape(dims)[tuple(rest)]
        data = np.transpose(data, perm)
        if r > 1:
            data = np.repeat(data, r, axis=axis)
            start = lo - ours[axis][0] * r
            data = np.take(data, range(start, start + hi - lo), axis=axis)
        return data

    def _source(self, spec: ParamSpec, name: str) -> np.ndarray:
        """The tensor as stored, a scale's rows repeated to one per output row (a per-tensor scale is one)."""
        data = self.where[name].array(name)
        if spec.row_block is None:
            return data
        rows, cols = spec.hf_shape
        return np.repeat(np.asarray(data, np.float32).reshape(-1, cols), spec.row_block, axis=0)[:rows]

    def _read_fused(self, spec: FusedSpec, index: tuple[slice, ...]) -> np.ndarray:
        """Each block of the slice: the parts' columns of that shard that fall in it, side by side."""
        d = spec.block_axis
        lo, hi, step = index[d + 1].indices(sum(spec.widths))
        if step != 1:
            raise ValueError(f"fused weights are read in contiguous column ranges, not with step {step}")
        blocks = []
        for block in range(*index[d].indices(spec.shards)):
            pieces, start = [], 0
            for part, width in zip(spec.parts, spec.widths, strict=True):
                a, b = max(lo, start), min(hi, start + width)
                if a < b:
                    cols = slice(block * width + a - start, block * width + b - start)
                    pieces.append(self.read(part, (*index[:d], cols, *index[d + 2:])))
                start += width
            blocks.append(np.concatenate(pieces, axis=d))
        return np.stack(blocks, axis=d)


    def _read_padded(self, spec: ParamSpec, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Rows past the size on disk (a vocabulary padded to a multiple of tp) are zeros."""
        axis, real = spec.pad
        shape = spec.layer_shape
        start, stop = index[axis].indices(shape[axis])[:2]
        on_disk = dataclasses.replace(spec, shape=(*spec.shape[: spec.stack_depth], *shape[:axis], real,
                                                   *shape[axis + 1:]), pad=None)
        inside = slice(min(start, real), min(stop, real))
        data = self._read_one(on_disk, name, (*index[:axis], inside, *index[axis + 1:]))
        widths = [(0, 0)] * data.ndim
        widths[axis] = (0, (stop - start) - data.shape[axis])
        return np.pad(data, widths)


def is_spec(x: Any) -> bool:
    """A weight's spec: the leaf of a model's weights before loading."""
    return isinstance(x, ParamSpec | FusedSpec | QuantSpec)


def named_specs(specs: Any) -> list[tuple[str, Spec]]:
    """(path, spec) of every spec leaf, e.g. ("layers.0.weights.attn.qkv", spec)."""
    leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec)
    return [(jax.tree_util.keystr(path, simple=True, separator="."), spec) for path, spec in leaves]


def load_params(ckpt: Checkpoint, specs: Any, sharding_of: Callable, dtype, progress: bool = True) -> Any:
    """The pytree of specs as sharded arrays; jax asks for each device's slice and only that slice is
    read and cast (a fused weight's slice from its parts' tensors)."""
    ckpt.check(specs)
    named = named_specs(specs)
    arrays = []

    def read(spec: ParamSpec | FusedSpec, dtype=None) -> jax.Array:
        def one(idx, spec=spec):
            data = ckpt.read(spec, idx)
            return data if dtype is None else data.astype(dtype)
        return jax.make_array_from_callback(spec.shape, sharding_of(spec.axes), one)

    for i, (key, spec) in enumerate(named):
        if progress:
            _progress(i, len(named), key)
        for fused in (s for s in (spec, getattr(spec, "weight", None)) if isinstance(s, FusedSpec)):
            check_fused(key, fused, sharding_of)
        if not isinstance(spec, QuantSpec):
            arrays.append(read(spec, dtype))
        elif spec.stored:   # values as stored (int8, float8_e4m3fn), scales in float32
            arrays.append(QuantArray(read(spec.weight), read(spec.scale, np.float32), out=spec.out, block=spec.block,
                                     axes=spec.matmul_axes))
        else:
            full = read(spec.weight, np.float32)
            arrays.append(quantize_on_devices(full, spec, sharding_of))
            full.delete()   # one weight at full precision at a time
    if progress:
        _progress(len(named), len(named), "done")
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), arrays)


def abstract(spec: Spec, dtype, sharding_of: Callable) -> Any:
    """The jax.ShapeDtypeStruct (a QuantArray of them for a quantized weight) a spec loads as."""
    if not isinstance(spec, QuantSpec):
        return jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sharding_of(spec.axes))
    return QuantArray(jax.ShapeDtypeStruct(spec.shape, QTYPES[spec.qtype], sharding=sharding_of(spec.axes)),
                      jax.ShapeDtypeStruct(spec.scale.shape, jnp.float32, sharding=sharding_of(spec.scale.axes)),
                      out=spec.out, block=spec.block, axes=spec.matmul_axes)


def quantize_on_devices(w: jax.Array, spec: QuantSpec, sharding_of: Callable) -> QuantArray:
    """A full-precision weight, sharded, -> its QuantArray with the spec's shardings, quantized in place on
    each device (per output channel: jaxinfer.quant.quantize)."""
    shardings = QuantArray(sharding_of(spec.axes), sharding_of(spec.scale.axes), out=spec.out, block=spec.block,
                           axes=spec.matmul_axes)
    return _quantizer(spec.qtype, spec.contract, shardings)(w)


@functools.cache
def _quantizer(qtype: str, contract: int, shardings: QuantArray) -> Callable:
    """One compiled quantizer per kind of weight, not per weight."""
    return jax.jit(functools.partial(quantize, qtype=qtype, contract=contract, out=shardings.out,
                                     axes=shardings.axes), out_shardings=shardings)


def check_fused(key: str, spec: FusedSpec, sharding_of: Callable) -> None:
    """A fused weight is right only if its blocks are exactly the shards its parts would have had."""
    d = spec.block_axis
    sharding = sharding_of(spec.axes)
    split = _splits(sharding, d)
    if split != spec.shards:
        raise ValueError(f"{key} is stored in {spec.shards} column blocks, but the layout splits them {split} ways: "
                         f"build the weights with the layout's column shards")
    for part in spec.parts:
        if _mesh_axes(sharding_of(part.axes), d) != _mesh_axes(sharding, d):
            raise ValueError(f"{key}: part {part.hf} is split over {_mesh_axes(sharding_of(part.axes), d)}, the "
                             f"fused weight over {_mesh_axes(sharding, d)}: fused parts must share their column split")


def _mesh_axes(sharding: jax.sharding.NamedSharding, dim: int) -> tuple[str, ...]:
    entry = sharding.spec[dim] if dim < len(sharding.spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _splits(sharding: jax.sharding.NamedSharding, dim: int) -> int:
    return math.prod(sharding.mesh.shape[a] for a in _mesh_axes(sharding, dim))


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    end = "\n" if done == total else ""
    if sys.stderr.isatty() or done == total:
        sys.stderr.write(f"\rloading weights [{bar}] {done}/{total} {what:<12}{end}")
        sys.stderr.flush()
