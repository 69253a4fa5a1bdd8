"""The layout planner: its collectives and bytes against the engine's compiled programs and loaded arrays, its
ranking and exclusions, `--mesh auto`, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.mesh import MeshConfig, MeshError
from jaxinfer.models import config_from_dir
from jaxinfer.plan import Workload, layouts, plan
from jaxinfer.plan.__main__ import main
from jaxinfer.plan.auto import auto_mesh
from jaxinfer.plan.compiled import compile_layout
from jaxinfer.plan.hardware import CPU_DEFAULT, device_kind
from jaxinfer.plan.roofline import expert_share, step_seconds
from jaxinfer.sharding import validate

# layouts other modules serve too (tiny_llm shares their engines and the run's compilation cache their programs)
MEASURED = [("llama", "dp=2,tp=2"), ("llama", "pp=2"), ("llama", "sp=2"), ("qwen3_moe", "ep=2,tp=2")]


@pytest.mark.parametrize("name, mesh", MEASURED)
def test_the_planners_collectives_and_bytes_are_the_engines(tiny_llm, hf_tiny, name, mesh):
    llm = tiny_llm(name, mesh, max_tokens_per_step=16)
    llm.generate([list(range(3, 23))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))  # 16 + 4, decode
    planned = compile_layout(llm.config, llm.mesh_config, llm.dtype, llm.engine.config, 1)
    measured = llm.collective_report()
    assert (planned.prefill, planned.decode) == (measured["prefill"], measured["decode"])
    assert sum(r["count"] for r in planned.decode.values()) > 0
    assert planned.weight_bytes == llm.parameter_bytes_per_device()
    assert planned.kv_bytes_per_token == llm.engine.kv_bytes_per_token
    cfg, layout = llm.config, llm.mesh_config   # the experts' gate, up and down, split over ep and tp
    experts = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert planned.expert_bytes == experts * jnp.dtype(llm.dtype).itemsize // (layout.ep * layout.tp)


@pytest.mark.parametrize("mesh", [MeshConfig(), MeshConfig(ep=4), MeshConfig(ep=2, sp=2)])
def test_a_step_reads_the_experts_its_tokens_chose(hf_tiny, mesh):
    """expert_share against routing drawn at random: each token of the ep group's step chooses k distinct experts
    of X, and a device reads those of its own X / ep that any token chose."""
    cfg = dataclasses.replace(config_from_dir(hf_tiny / "qwen3_moe"), num_experts=128, experts_per_token=8)
    rng = np.random.default_rng(0)
    local = cfg.num_experts // mesh.ep
    for tokens in (1, 2, 8, 16):
        routed, trials = mesh.ep * tokens // mesh.sp, 1000
        chosen = np.argsort(rng.random((trials, routed, cfg.num_experts)), axis=-1)[..., :cfg.experts_per_token]
        touched = np.zeros((trials, cfg.num_experts), bool)
        touched[np.arange(trials)[:, None, None], chosen] = True
        assert expert_share(cfg, mesh, tokens) == pytest.approx(touched[:, :local].mean(), abs=0.01)
    assert expert_share(cfg, mesh, 16, routed=2) == expert_share(cfg, mesh, 2)   # padding routes none
    assert expert_share(config_from_dir(hf_tiny / "llama"), mesh, 1) == 1.0   # a dense model reads it all


def test_weights_a_device_reads_slower_than_its_memory_take_that_rate(hf_tiny):
    """A decode step's weights cost their bytes per dtype at the device's read rate for that dtype (a CPU's C++
    matmul converts 1-byte weights slower than its memory delivers them), at the memory bandwidth without one."""
    cfg, mesh = config_from_dir(hf_tiny / "llama"), MeshConfig(tp=2)
    plain = compile_layout(cfg, mesh, jnp.float32, EngineConfig(), 1, programs=False)
    int8 = compile_layout(cfg, mesh, jnp.float32, EngineConfig(quantization="int8"), 1, programs=False)
    assert plain.weight_bytes_by_dtype == {"float32": plain.weight_bytes}
    assert set(int8.weight_bytes_by_dtype) == {"float32", "int8"}     # embedding, head and norms stay float32
    assert sum(int8.weight_bytes_by_dtype.values()) == int8.weight_bytes < plain.weight_bytes
    bw = CPU_DEFAULT.memory_bandwidth
    fast = dataclasses.replace(CPU_DEFAULT, matmul_rate=dict.fromkeys(CPU_DEFAULT.matmul_rate, 1e30), weight_read={})
    slow = dataclasses.replace(fast, weight_read={"int8": bw / 4})
    step = lambda kind, held: step_seconds(cfg, mesh, kind, "int8", held, 1, 1, 0.0, 1, 0.0)  # noqa: E731
    assert step(fast, int8) == pytest.approx(mesh.size * int8.weight_bytes / bw + fast.step_overhead, rel=1e-12)
    extra = mesh.size * int8.weight_bytes_by_dtype["int8"] * (4 - 1) / bw    # fake devices share the host's rates
    assert step(slow, int8) - step(fast, int8) == pytest.approx(extra, rel=1e-9)
    assert step(slow, plain) == step(fast, plain)                           # no int8 weights, no change


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_calibration_times_each_weight_dtype_as_the_engine_multiplies_it(dtype):
    """The calibration's matmul probes run the engine's own matmul: XLA's dot for float32, the C++ matmul for
    the 16-bit and 1-byte weights; on every device at once, each multiplying its own rows."""
    from jaxinfer.plan.calibrate import engine_matmul, weight_bytes

    mm, x, w = engine_matmul(jax.devices()[:2], dtype, 2, 64)
    hlo = mm.lower(x, w).compile().as_text()
    assert ("jaxinfer_quantized_matmul" in hlo) == (dtype != "float32")
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(w)) == weight_bytes(dtype, 64)
    reference = np.asarray(x, np.float32) @ np.asarray(w.dequantize() if hasattr(w, "dequantize") else w, np.float32)
    bound = 2.0**-8 if dtype == "bfloat16" else 1e-5   # a bfloat16 product is rounded to bfloat16 (2^-9 of it)
    np.testing.assert_allclose(np.asarray(mm(x, w), np.float32), reference, atol=bound * np.abs(reference).max())


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_weight_read_probe_multiplies_distinct_weights_one_after_another(dtype):
    """The decode read probe streams as many distinct weights as `total` asks (a weight read again and again
    would come from the caches), each matmul on the previous one's result."""
    from jaxinfer.plan.calibrate import weight_bytes, weight_chain

    f, x, weights = weight_chain(jax.devices()[:2], dtype, 64, total=3 * weight_bytes(dtype, 64) - 1)
    assert len(weights) == 3
    values = [np.asarray(w.values if hasattr(w, "values") else w) for w in weights]
    assert not np.array_equal(values[0], values[1]) and not np.array_equal(values[1], values[2])
    hlo = f.lower(x, weights).compile().as_text()
    assert hlo.count('custom_call_target="jaxinfer_quantized_matmul"') == (3 if dtype == "int8" else 0)
    np.testing.assert_array_equal(np.asarray(f(x, weights)), np.asarray(x))   # each product adds 0 times itself


def test_workload_parsing_and_the_layouts_a_model_admits(hf_tiny):
    assert Workload.parse("prompt=100, concurrency=3") == Workload(prompt=100, output=256, concurrency=3)
    for bad, why in [("prompt=1,prompt=2", "twice"), ("prompt", "cannot read"), ("tokens=3", "cannot read"),
                     ("output=x", "not an integer"), ("concurrency=0", "at least 1")]:
        with pytest.raises(ValueError, match=why):
            Workload.parse(bad)
    cfg = config_from_dir(hf_tiny / "llama")               # 8 heads, 2 KV heads, 4 layers, 512-token context
    found = layouts(cfg, 8, Workload(concurrency=2))
    for mesh in found:
        validate(cfg, mesh)
        assert mesh.size == 8 and mesh.dp * mesh.ep <= 2 and mesh.ep == 1
    assert MeshConfig(dp=2, tp=4) in found and MeshConfig(pp=8) not in found and MeshConfig(dp=8) not in found
    with pytest.raises(MeshError, match="no layout of LlamaForCausalLM uses 4096 devices"):
        layouts(cfg, 4096, Workload(concurrency=1))       # tp <= 8, pp <= 4, sp <= 32 pages


def test_what_does_not_fit_is_last_and_targets_exclude(hf_tiny):
    cfg = config_from_dir(hf_tiny / "llama")
    kind = dataclasses.replace(device_kind("cpu", 8), memory_bytes=700 * 2**10)  # a replica's weights: 834 KiB
    config = EngineConfig(max_tokens_per_step=16)
    loose = plan(cfg, 2, kind, Workload(prompt=32, output=8, concurrency=2), jnp.float32, config, prune=4)
    fits = [c for c in loose.ranked if c.fits]
    last = loose.ranked[len(fits):]                       # ranked last, each with its reason
    assert sorted(str(c.mesh) for c in last) == ["dp=2", "sp=2"]   # a whole replica's weights on each device
    assert all(c.excluded.startswith("does not fit") and c.compiled.weight_bytes > 0.9 * kind.memory_bytes
               for c in last)
    assert fits and loose.best.fits
    tight = plan(cfg, 2, kind, Workload(prompt=32, output=8, concurrency=2), jnp.float32, config, tpot_s=1e-6,
                 prune=4)
    assert all(c.excluded for c in tight.ranked)
    assert all(c.excluded.startswith("misses TPOT") for c in tight.ranked if c.fits and c.compiled_programs)
    assert tight.why().startswith("no layout meets every target") and tight.best.fits


@pytest.mark.parametrize("devices", [1, 4])   # all 8: test_llm_mesh_auto_uses_every_device
def test_mesh_auto_picks_a_valid_layout_that_serves_the_reference(tiny_llm, hf_tiny, golden, check_reference,
                                                                  devices):
    cfg = config_from_dir(hf_tiny / "llama")
    mesh, result = auto_mesh(cfg, jnp.float32, EngineConfig(), devices=jax.devices()[:devices], compiles=1)
    validate(cfg, mesh)
    assert mesh.size == devices and result.best.mesh == mesh and result.best.compiled_programs
    assert check_reference(tiny_llm("llama", str(mesh) if mesh.size > 1 else ""), golden("llama")) > 0


def test_llm_mesh_auto_uses_every_device(hf_tiny, golden, check_reference, monkeypatch):
    from jaxinfer import LLM
    from jaxinfer.plan import auto

    monkeypatch.setattr(auto, "AUTO_COMPILES", 1)           # the search itself: test_mesh_auto_picks_...
    with LLM(hf_tiny / "qwen3_moe", mesh="auto", dtype="float32") as llm:
        assert llm.mesh_config.size == len(jax.devices()) and llm.plan.best.mesh == llm.mesh_config
        validate(llm.config, llm.mesh_config)
        assert check_reference(llm, golden("qwen3_moe")) > 0


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu9"], "unknown device kind 'tpu9'"),
    (["--workload", "prompt=lots"], "workload prompt='lots' is not an integer"),
    (["--devices", "4096", "--workload", "concurrency=1"], "no layout of LlamaForCausalLM uses 4096 devices"),
    (["--devices", "0"], "must be at least 1"),
    (["--model", "/nonexistent"], "neither a checkpoint directory"),
])
def test_bad_input_is_a_clear_message_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_bench_plan_holds_predictions_against_measurement():
    from jaxinfer.bench.plan import parse_args, readable, run

    r = run(parse_args(["--layouts", "tp=2", "--moe-layouts", "--prompt", "16", "--output", "4",
                        "--concurrency", "2", "--max-tokens-per-step", "16"]))
    (row,) = r["rows"]
    assert row["mesh"] == "tp=2" and r["choice"]["dense"]["chosen"] == "tp=2"
    for key in ("decode_step_s", "prefill_step_s", "tokens_per_s"):
        assert row["predicted"][key] > 0 and row["measured"][key] > 0
        assert row["ratio"][key] == row["measured"][key] / row["predicted"][key]
    assert "tp=2" in readable(r)
