"""Pre-quantized checkpoints written from a full-precision one (the hf-tiny fixtures), as the public formats
store them, each beside its dequantized twin: the same checkpoint with every quantized weight replaced by
float32 values * scales, the reference a quantized load must reproduce.

- "fp8" with a block: transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): quantization_config
  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [rows, cols]};
  each Linear weight [out, in] float8_e4m3fn, `<name>_scale_inv` float32 [ceil(out / rows), ceil(in / cols)],
  weight = stored * scale_inv (edge blocks partial).
- "fp8", strategy "tensor": AutoFP8's per-tensor FP8 with static activations: {"quant_method": "fp8",
  "activation_scheme": "static", "ignored_layers": ["lm_head"]}; a 0-d `<name>_scale` and a 0-d
  `input_scale` beside each weight.
- "compressed-tensors": llm-compressor's schemes: {"quant_method": "compressed-tensors", "format":
  "float-quantized" | "int-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights":
  {"num_bits": 8, "type": "float" | "int", "strategy": "channel" | "tensor" | "group" | "block", ...},
  "input_activations": {dynamic per-token fp8}}}, "ignore": ["lm_head"]}; `<name>_scale` of [out, 1]
  (channel), [1] (tensor), [out, ceil(in / group_size)] (group) or [ceil(out / rows), ceil(in / cols)]
  (block), in float32 or the scale_dtype asked for (llm-compressor often stores the model's bfloat16).

    python tests/quantized_checkpoints.py SRC DST fp8 32 48
    python tests/quantized_checkpoints.py SRC DST compressed-tensors channel fp8
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

# The decoder layers' Linear weights (attention, MLP, experts); the router, norms, embedding and head are left.
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
QMAX = {"fp8": 448.0, "int8": 127.0}


def quantize(w: np.ndarray, qtype: str, rows: int, cols: int,
             scale_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (values, scales [ceil(out / rows), ceil(in / cols)]), one symmetric scale per block (held
    in scale_dtype, as float32)."""
    out, inp = w.shape
    nr, nc = -(-out // rows), -(-inp // cols)
    padded = np.zeros((nr * rows, nc * cols), np.float32)
    padded[:out, :inp] = np.abs(w)
    amax = padded.reshape(nr, rows, nc, cols).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / QMAX[qtype], 1.0).astype(scale_dtype).astype(np.float32)
    q = np.clip(w / expand(scale, rows, cols, w.shape), -QMAX[qtype], QMAX[qtype])
    values = np.round(q).astype(np.int8) if qtype == "int8" else q.astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def expand(scale: np.ndarray, rows: int, cols: int, shape: tuple[int, int]) -> np.ndarray:
    """One scale per element of the [out, in] weight."""
    return np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[: shape[0], : shape[1]]


def write(src: Path, dst: Path, method: str, *, qtype: str = "fp8", strategy: str = "block",
          block: tuple[int, int] = (128, 128), scale_dtype: str = "float32") -> tuple[Path, Path]:
    """(the quantized checkpoint, its dequantized twin) written from `src`; strategy "group" takes groups of
    block[1] input columns."""
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    quantized, twin = {}, {}
    for name, w in tensors.items():
        w = w.astype(np.float32) if LINEAR.match(name) else w
        quantized[name] = twin[name] = w
        if not LINEAR.match(name):
            continue
        rows, cols = {"block": block, "group": (1, block[1]), "channel": (1, w.shape[1]), "tensor": w.shape}[strategy]
        values, scale = quantize(w, qtype, rows, cols, scale_dtype)
        quantized[name] = values
        if method == "fp8" and strategy == "tensor":   # AutoFP8's static scheme: 0-d scales, the input's too
            quantized[name + "_scale"] = scale.reshape(()).astype(scale_dtype)
            quantized[name.removesuffix("weight") + "input_scale"] = np.array(np.abs(w).max() / 448, np.float32)
        else:
            stored_scale = scale.reshape(1) if strategy == "tensor" else scale
            quantized[name + ("_scale_inv" if method == "fp8" else "_scale")] = stored_scale.astype(scale_dtype)
        twin[name] = values.astype(np.float32) * expand(scale, rows, cols, w.shape)
    config = json.loads((src / "config.json").read_text())
    for path, weights, qc in ((dst, quantized, _config(method, qtype, strategy, block)),
                              (dst.with_name(dst.name + "-dequantized"), twin, None)):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        for f in src.iterdir():   # one safetensors file, whatever the source's sharding
            if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
                shutil.copy(f, path / f.name)
        (path / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return dst, dst.with_name(dst.name + "-dequantized")


def _config(method: str, qtype: str, strategy: str, block: tuple[int, int]) -> dict:
    if method == "fp8":
        if strategy == "tensor":
            return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    weights = {"num_bits": 8, "type": "float" if qtype == "fp8" else "int", "symmetric": True,
               "strategy": strategy, "dynamic": False, "observer": "minmax"}
    if strategy == "block":
        weights["block_structure"] = list(block)
    if strategy == "group":
        weights.update(group_size=block[1], actorder=None)
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": f"{'float' if qtype == 'fp8' else 'int'}-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


if __name__ == "__main__":
    src, dst, method, *rest = sys.argv[1:]
    if method == "fp8":
        print(*write(Path(src), Path(dst), "fp8", block=(int(rest[0]), int(rest[1]))))
    else:
        print(*write(Path(src), Path(dst), method, strategy=rest[0], qtype=rest[1]))
