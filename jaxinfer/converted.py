"""A converted checkpoint: a model's weights in jaxinfer's own layout, written with orbax-checkpoint, so that a
start restores arrays instead of converting safetensors again (stacking layers, fusing, transposing, casting).

What is stored is the layout of no mesh: the model's `weights()` with KV heads once, the vocabulary unpadded,
the layers stacked as the model groups them, and each fused weight's parts apart (fused, they would be laid
out for one column split). Restoring onto a mesh reads every array in a sharding that mesh admits, each
device (each process) reading only its slice, and then makes the mesh's own layout on the devices, one
group of weights at a time: layers regrouped into pipeline stages or one stack per layer, KV heads repeated
for tp, the vocabulary padded, fused parts laid out shard by shard. Weights converted quantized stay as
they are; weights converted in full precision may be quantized as they land.

    OUT/jaxinfer.json                   the manifest: format, layout version, jaxinfer version, model code,
                                        dtype, quantization, the groups written
    OUT/params/{embed,layers_0,..,head} one orbax checkpoint per group of weights
    OUT/config.json, tokenizer files    as in the Hugging Face directory (config.json's dtype: the stored one)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoint import (
    QUANTIZED,
    Checkpoint,
    CheckpointError,
    FusedSpec,
    ParamSpec,
    QuantSpec,
    Spec,
    abstract,
    fuse,
    is_spec,
    load_params,
    quantize_on_devices,
)
from jaxinfer.config import read_json
from jaxinfer.device.layers import LayerStack, Weights, layer_ids
from jaxinfer.models import Model, config_from_dir, model_for
from jaxinfer.quant import QuantArray
from jaxinfer.quant_formats import quantized_specs, stored_quantization
from jaxinfer.sharding import Layout

MANIFEST = "jaxinfer.json"
FORMAT = "jaxinfer.converted"
LAYOUT_VERSION = 1   # what the groups hold and how: a directory of another version is refused (convert again)
PARAMS = "params"
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt")
NOT_COPIED = {"model.safetensors.index.json", "config.json", MANIFEST}   # config.json: rewritten


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("jaxinfer")
    except PackageNotFoundError:
        return "unknown"


def model_code(model: Model) -> str:
    """The class whose `weights()` wrote (and must read) the layout."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


def canonical(model: Model) -> Weights:
    """The model's weight specs in the layout of no mesh, each fused weight as a tuple of its parts."""
    return jax.tree.map(lambda s: s.parts if isinstance(s, FusedSpec) else s,
                        model.weights(kv_repeat=1, vocab_multiple=1, column_shards=1), is_leaf=is_spec)


def fitted(specs: Any, layout: Layout) -> Any:
    """Specs whose axes `layout` cannot split evenly are left whole along them: a sharding every mesh admits
    (e.g. 2 KV heads on tp=4), so that the same arrays are written from and read onto any mesh."""
    def fit(p: ParamSpec) -> ParamSpec:
        axes = tuple(a if a is None or n % layout.axis_size(a) == 0 else None
                     for a, n in zip(p.axes, p.shape, strict=True))
        return dataclasses.replace(p, axes=axes)
    return jax.tree.map(lambda s: s.map_parts(fit), specs, is_leaf=is_spec)


def groups(weights: Weights) -> list[tuple[str, Any]]:
    """The groups written and restored one at a time: the embedding, each layer stack, the head."""
    return [("embed", weights.embed), *((f"layers_{i}", s.weights) for i, s in enumerate(weights.layers)),
            ("head", weights.head)]


def convert(src: str | Path, out: str | Path, layout: Layout, dtype: Any, quantization: str | None = None,
            progress: bool = True) -> dict:
    """Hugging Face directory `src` -> converted checkpoint `out` (which must not exist yet or be empty),
    read and written by the devices of `layout`; returns the manifest."""
    src, out = Path(src), Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory: choose a new one")
    ckpt = Checkpoint(src)
    model = model_for(config_from_dir(src))
    config = read_json(src / "config.json")
    stored = stored_quantization(config)
    specs = fitted(quantized_specs(canonical(model), quantization, stored, ckpt.dtype), layout)
    ckpt.check(specs)
    names = [name for name, _ in groups(specs)]
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    with ocp.PyTreeCheckpointer(use_compression=False) as writer:   # zstd would cost more to read than it saves
        for name, group in tqdm(groups(specs), desc="converting", unit="group", disable=not progress):
            arrays = load_params(ckpt, group, layout.sharding, dtype, progress=False)
            writer.save(out / PARAMS / name, args=ocp.args.PyTreeSave(arrays))   # one group alive at a time
    manifest = {"format": FORMAT, "layout_version": LAYOUT_VERSION, "jaxinfer_version": version(),
                "model_code": model_code(model), "architecture": model.cfg.architecture,
                "dtype": jnp.dtype(dtype).name, "quantization": quantization, "groups": names,
                "stored_dtypes": {n: d for s in jax.tree.leaves(specs, is_leaf=is_spec) for p in s.parts
                                  for n in p.hf_names() if (d := ckpt.dtype(n)) in QUANTIZED}}
    if jax.process_index() == 0:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in NOT_COPIED:
                shutil.copyfile(f, out / f.name)
        config.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(config | {"dtype": manifest["dtype"]}, indent=2))
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))   # last: its presence says the rest is whole
    return manifest


def open_checkpoint(path: str | Path) -> Checkpoint | Converted:
    """The weights of a model directory: a converted checkpoint (it holds jaxinfer.json), else the Hugging
    Face safetensors. An orbax directory jaxinfer did not write is refused with what to do instead."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return Converted(path)
    inside = [path, *(p for p in path.iterdir() if p.is_dir())] if path.is_dir() else []
    if not any(path.glob("*.safetensors")) and any((d / m).exists() for d in inside for m in ORBAX_MARKERS):
        raise CheckpointError(f"{path} is an orbax checkpoint that jaxinfer did not write (it has no {MANIFEST}): "
                              f"jaxinfer restores only its own conversions; convert the Hugging Face checkpoint "
                              f"with python -m jaxinfer.convert --model HF_DIR --out DIR")
    return Checkpoint(path)


class Converted:
    """A converted checkpoint directory, its manifest checked: what `LLM` reads in place of a Checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        again = (f"convert it again from the Hugging Face checkpoint: python -m jaxinfer.convert --model HF_DIR "
                 f"--out {path}")
        try:
            m = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable {MANIFEST} ({e}); {again}") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise CheckpointError(f"{path}/{MANIFEST} is not a jaxinfer manifest; {again}")
        if m.get("layout_version") != LAYOUT_VERSION:
            raise CheckpointError(f"{path} holds layout version {m.get('layout_version')} (written by jaxinfer "
                                  f"{m.get('jaxinfer_version')}); this jaxinfer reads version {LAYOUT_VERSION}: "
                                  f"{again}")
        missing = [g for g in m.get("groups", []) if not (self.path / PARAMS / g / "_CHECKPOINT_METADATA").is_file()]
        if missing or not m.get("groups"):
            raise CheckpointError(f"{path} is incomplete: {PARAMS}/{', '.join(missing) or '*'} missing or unfinished; "
                                  f"{again}")
        self.manifest, self.again = m, again
        self.quantization: str | None = m["quantization"]

    def dtype(self, name: str) -> str | None:
        """The dtype a tensor of the source checkpoint was stored in, where it was stored quantized."""
        return self.manifest["stored_dtypes"].get(name)

    def canonical(self, model: Model, layout: Layout) -> Weights:
        if model_code(model) != self.manifest["model_code"]:
            raise CheckpointError(f"{self.path} was written by {self.manifest['model_code']}, and this config is "
                                  f"served by {model_code(model)}; {self.again}")
        stored = stored_quantization(read_json(self.path / "config.json"))
        return fitted(quantized_specs(canonical(model), self.quantization, stored, self.dtype), layout)

    def restore(self, model: Model, specs: Weights, layout: Layout, dtype: Any, progress: bool = True) -> Weights:
        """The weights of `specs` (the mesh's own layout, as `LLM` builds them) from what is stored."""
        import orbax.checkpoint as ocp
        from tqdm import tqdm

        canon = self.canonical(model, layout)
        if [n for n, _ in groups(canon)] != self.manifest["groups"]:
            raise CheckpointError(f"{self.path} holds groups {self.manifest['groups']}, but its config.json makes "
                                  f"{[n for n, _ in groups(canon)]}; {self.again}")
        bar = tqdm(total=len(self.manifest["groups"]), desc="restoring", unit="group", disable=not progress)

        def read(name: str, group: Any) -> Any:
            target = jax.tree.map(lambda s: abstract(s, dtype, layout.sharding), group, is_leaf=is_spec)
            try:
                arrays = reader.restore(self.path / PARAMS / name, args=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
            except (ValueError, OSError, KeyError) as e:
                raise CheckpointError(f"{self.path}: {PARAMS}/{name} cannot be read as this model's weights "
                                      f"({str(e)[:300]}); {self.again}") from None
            bar.update()
            return arrays

        def source(stack: LayerStack) -> int:
            ids = {i for i in layer_ids(stack) if i is not None}
            return next(k for k, c in enumerate(canon.layers) if ids <= set(layer_ids(c)))

        with ocp.PyTreeCheckpointer() as reader:
            embed = land(specs.embed, canon.embed, read("embed", canon.embed), layout)
            sources = [source(stack) for stack in specs.layers]
            stacks, held = [], None
            for j, (stack, k) in enumerate(zip(specs.layers, sources, strict=True)):
                if held is None or held[0] != k:
                    held = (k, read(f"layers_{k}", canon.layers[k].weights))
                stacks.append(LayerStack(land(stack.weights, canon.layers[k].weights, held[1], layout,
                                              last=k not in sources[j + 1:]), first=stack.first, stages=stack.stages))
            head = land(specs.head, canon.head, read("head", canon.head), layout)
        bar.close()
        return Weights(embed=embed, layers=tuple(stacks), head=head)


def land(targets: Any, stored: Any, arrays: Any, layout: Layout, last: bool = True) -> Any:
    """Stored arrays (the canonical specs `stored`) -> the arrays of the spec tree `targets`, on the devices;
    `last`: no later call reads `arrays`, so each is freed once its weight is made (the peak is the weights
    plus one stored weight, not one stored group)."""
    def one(t: Spec, c: Spec | tuple, a: Any) -> Any:
        out = make(t, c, a)
        if last:
            kept = {id(y) for y in jax.tree.leaves(out)}   # a stored array that is already the weight stays
            for x in jax.tree.leaves(a):
                if id(x) not in kept:
                    x.delete()
        return out

    def make(t: Spec, c: Spec | tuple, a: Any) -> Any:
        cs, xs = (list(c), list(a)) if isinstance(c, tuple) else ([c], [a])
        if isinstance(cs[0], QuantSpec):
            if not isinstance(t, QuantSpec) or cs[0].qtype != t.qtype:
                raise CheckpointError(f"{t.parts[0].hf} is stored as {cs[0].qtype}, but is asked for as "
                                      f"{getattr(t, 'qtype', 'unquantized')}")
            return QuantArray(_build(t.weight, [q.weight for q in cs], [x.values for x in xs], layout),
                              _build(t.scale, [q.scale for q in cs], [x.scale for x in xs], layout),
                              out=t.out, block=t.block, axes=t.matmul_axes)
        if isinstance(t, QuantSpec):   # full precision as stored, quantized as it lands
            full = _build(t.weight, cs, xs, layout)
            q = quantize_on_devices(full, t, layout.sharding)
            full.delete()
            return q
        return _build(t, cs, xs, layout)
    return jax.tree.map(one, targets, stored, arrays, is_leaf=is_spec)


def _build(t: ParamSpec | FusedSpec, cs: list[ParamSpec], xs: list[jax.Array], layout: Layout) -> jax.Array:
    sharding = layout.sharding(t.axes)
    if isinstance(t, ParamSpec) and _same(cs[0], t) and xs[0].sharding.is_equivalent_to(sharding, len(t.shape)):
        return xs[0]   # stored as the mesh holds it: nothing to make
    picks = [_picks(c, p) for c, p in zip(cs, t.parts, strict=True)]
    unstacked = tuple(dataclasses.replace(c, layer_ids=None) for c in cs)
    return _builder(t.map_parts(lambda p: dataclasses.replace(p, layer_ids=None)), unstacked, sharding)(xs, picks)


def _same(c: ParamSpec, t: ParamSpec) -> bool:
    return c.shape == t.shape and c.layer_ids == t.layer_ids and c.repeat == t.repeat


def _picks(c: ParamSpec, t: ParamSpec) -> dict[str, np.ndarray] | None:
    """Which stored layers `t` holds: None, all of them as stored; {"start"}: a run of them; {"positions",
    "real"}: any of them in any order, and which slots hold one (a stage's padding does not). Arguments of
    the program, so that one program serves every layer."""
    if not t.stack_depth or c.layer_ids == t.layer_ids:
        return None
    where = {layer: k for k, layer in enumerate(c.layer_ids)}
    positions = [where.get(layer, 0) for layer in t.layer_ids]
    if None not in t.layer_ids and positions == list(range(positions[0], positions[0] + len(positions))):
        return {"start": np.int32(positions[0])}
    return {"positions": np.asarray(positions, np.int32), "real": np.asarray([i is not None for i in t.layer_ids])}


@functools.cache
def _builder(t: ParamSpec | FusedSpec, cs: tuple[ParamSpec, ...], sharding: jax.sharding.NamedSharding):
    """One compiled program per kind of weight: stored parts -> the weight `t` in its sharding."""
    def build(xs: list[jax.Array], picks: list) -> jax.Array:
        if isinstance(t, FusedSpec):
            return fuse([_part(*a) for a in zip(xs, cs, t.parts, picks, strict=True)], t)
        return _part(xs[0], cs[0], t, picks[0])
    return jax.jit(build, out_shardings=sharding)


def _part(x: jax.Array, c: ParamSpec, t: ParamSpec, pick: dict[str, jax.Array] | None) -> jax.Array:
    """A stored array (spec `c`) as `t` holds it: its layers picked (zeros in a stage's padding slots), KV
    heads repeated, the vocabulary padded."""
    d = t.stack_depth
    if pick is not None and "start" in pick:
        x = jax.lax.dynamic_slice_in_dim(x, pick["start"], t.shape[0], axis=0)
    elif pick is not None:
        real = pick["real"].reshape(-1, *[1] * (x.ndim - 1))
        x = jnp.where(real, x[pick["positions"]], jnp.zeros((), x.dtype))
    axis, times = t.repeat
    if times > c.repeat[1]:
        x = jnp.repeat(x, times // c.repeat[1], axis=d + axis)
    widths = [(0, n - m) for n, m in zip(t.shape, x.shape, strict=True)]
    if any(w for _, w in widths):
        x = jnp.pad(x, widths)
    if x.shape != t.shape:
        raise CheckpointError(f"{t.hf}: stored as {c.shape}, which does not make {t.shape}")
    return x
