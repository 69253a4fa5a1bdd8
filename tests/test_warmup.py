"""Start-up: the warm-up compiles the buckets serving hits before any request, and the compilation cache
lets a fresh process load its executables instead of compiling them."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.device import compilation_cache
from jaxinfer.device.compilation_cache import compilation_cache_dir
from jaxinfer.device.runner import ModelRunner, compiler_options
from jaxinfer.engine.packer import GREEDY as GREEDY_ARRAYS
from jaxinfer.engine.packer import pack, prefill_sizes
from jaxinfer.engine.scheduler import ScheduledSequence, SchedulerOutput
from jaxinfer.engine.warmup import warmup_shapes
from jaxinfer.models import Llama

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_tiny):
    llm = LLM(hf_tiny / "llama", dtype="float32", max_tokens_per_step=16, max_num_seqs=2, compilation_cache=False)
    yield llm
    llm.close()


def test_warmup_compiles_the_serving_buckets_and_generate_compiles_nothing_new(llm):
    shapes = warmup_shapes(llm.engine)
    # decodes of 1 and 2 sequences, and prompt steps of the 16-token budget with both sequence slots (a lone
    # prompt too); one page-table width (the 512-token context's 32 entries) for every sequence length
    assert shapes == [(1, 1, False, True), (2, 2, False, True), (16, 2, False, True)]
    assert llm.engine.packer.table_width == 32
    assert llm.warmup(progress=False) == len(shapes) == llm.engine.compilations
    prompts = [list(range(10, 17)), list(range(20, 28))]   # one 15-token prefill step, then decodes of 2
    out = llm.generate(prompts, [GREEDY, SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)])
    assert [len(c.token_ids) for c in out] == [3, 3]
    lone = llm.generate([list(range(30, 33))], GREEDY)[0]    # a 3-token prompt step pads to the 16 of the budget
    assert len(lone.token_ids) == 3
    long = llm.generate([list(range(1, 113))], GREEDY)[0]    # 7 full 16-token chunks, then 8 pages of decode
    assert len(long.token_ids) == 3
    assert llm.engine.compilations == len(shapes)
    assert llm.warmup(progress=False) == 0


def test_programs_compiled_with_other_options_are_kept_apart(llm):
    """ModelRunner.compiled_with (a GPU profile without CUDA graphs): its steps compile anew with the options
    and give the same tokens; after it the runner's own executables, and only those, are back."""
    runner, prompts = llm.engine.runner, [list(range(40, 47))]
    tokens = llm.generate(prompts, GREEDY)[0].token_ids
    own = dict(runner.executables)
    with runner.compiled_with(xla_gpu_enable_command_buffer=""):
        assert runner.executables == {} and runner.compiler_options["xla_gpu_enable_command_buffer"] == ""
        assert llm.generate(prompts, GREEDY)[0].token_ids == tokens
        apart = list(runner.executables.values())
        assert apart and not {id(x) for x in apart} & {id(x) for x in own.values()}
    assert runner.executables == own and "xla_gpu_enable_command_buffer" not in runner.compiler_options
    assert all(exe in own.values() for exe in runner.last.values())
    assert llm.generate(prompts, GREEDY)[0].token_ids == tokens and runner.executables == own


def test_cpu_steps_compile_at_o2_unless_xla_flags_names_a_level(llm, monkeypatch):
    assert llm.engine.runner.compiler_options == {}          # conftest's XLA_FLAGS name -O0 for every program
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert compiler_options("cpu") == {"xla_backend_optimization_level": 2} and compiler_options("gpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert compiler_options("cpu") == {}


def test_a_sequence_wider_than_the_page_table_is_refused():
    seq = ScheduledSequence("a", [1], 40, list(range(3)), GREEDY_ARRAYS, 0, samples=True, prefill=False)
    pack([SchedulerOutput([seq])], 16, 8, width=3)
    with pytest.raises(ValueError, match="holds 3 pages, more than the page table's 2 entries"):
        pack([SchedulerOutput([seq])], 16, 8, width=2)


CHILD = """
import json, sys
from jaxinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], mesh="dp=2,tp=2", dtype="float32", max_tokens_per_step=16, quantization="int8")
at_start = llm.engine.runner.loaded
out = llm.generate([[1, 5, 6, 7], [9, 8]], SamplingParams(max_tokens=2, temperature=0))
print(json.dumps({"tokens": [c.token_ids for c in out], "compiled": llm.engine.compilations,
                  "loaded": llm.engine.runner.loaded, "at_start": at_start}))
llm.close()
"""


def fresh_process(hf_tiny, cache) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(hf_tiny / "llama")], check=True, capture_output=True,
                         text=True, env=env | {"JAXINFER_CACHE": str(cache)}).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_restart_loads_its_step_executables_and_compiles_nothing(hf_tiny, tmp_path, monkeypatch, put_cpu_kernel):
    put_cpu_kernel(tmp_path)     # the C++ kernel a machine already has (tests/conftest.py); the XLA cache starts empty
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    cold = fresh_process(hf_tiny, tmp_path)
    entries = sorted(compilation_cache_dir().rglob("*"))
    steps = list((compilation_cache_dir() / "executables").iterdir())
    assert cold["compiled"] == len(steps) == 2 and cold["loaded"] == 0    # a prefill and a decode step, 4 devices
    warm = fresh_process(hf_tiny, tmp_path)
    # read back while the weights loaded, before the first request
    assert warm["at_start"] == warm["loaded"] == warm["compiled"] == 2 and warm["tokens"] == cold["tokens"]
    assert sorted(compilation_cache_dir().rglob("*")) == entries        # nothing compiled afresh
    shutil.rmtree(compilation_cache_dir() / "executables")
    again = fresh_process(hf_tiny, tmp_path)   # both programs come out of JAX's cache, and are not stored:
    assert again["loaded"] == 0 and again["tokens"] == cold["tokens"]   # XLA:CPU's copy of one would not run
    assert not list((compilation_cache_dir() / "executables").glob("*"))


class Registered(Llama):
    """An architecture defined outside jaxinfer: its source is not part of the executables' key."""


@pytest.fixture
def without_jax_cache():
    """JAX's persistent cache off (the suite shares one, tests/conftest.py): the engine stores only executables
    XLA has just compiled, never one JAX read back from its cache. JAX decides once whether its cache is in use,
    so the decision is reset on the way in and out."""
    import jax
    from jax._src import compilation_cache as jax_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        jax_cache.reset_cache()


@pytest.mark.usefixtures("without_jax_cache")
def test_a_step_executable_is_kept_under_everything_it_depends_on(llm, tmp_path, monkeypatch, caplog):
    engine, runner = llm.engine, llm.engine.runner
    batch = engine.packer.pack([SchedulerOutput([])], (1, 1))

    def fresh(model=llm.model) -> ModelRunner:
        return ModelRunner(model, llm.layout, runner.weights, runner.cache, runner.backend, engine.packer.max_seqs,
                           executables=tmp_path)

    first = fresh()
    first.compile("step", batch)
    (stored,) = tmp_path.iterdir()
    again = fresh()
    again.compile("step", batch)
    assert (first.loaded, again.loaded, list(tmp_path.iterdir())) == (0, 1, [stored])
    monkeypatch.setattr(compilation_cache, "source_digest", lambda: "other source")
    fresh().compile("step", batch)                                       # another jaxinfer: another key
    monkeypatch.undo()
    monkeypatch.setattr(compilation_cache, "host_cpu", lambda: "another processor")
    fresh().compile("step", batch)                                       # another CPU: another key
    monkeypatch.undo()
    assert len(list(tmp_path.iterdir())) == 3
    stored.write_bytes(b"not an executable")
    damaged = fresh()
    damaged.compile("step", batch)                                       # compiled again, and stored again
    assert damaged.loaded == 0 and "ignoring the cached executable" in caplog.text
    assert fresh().compile("step", batch) and len(list(tmp_path.iterdir())) == 3
    assert fresh(Registered(llm.model.cfg)).executables_dir is None


def test_the_cache_can_be_turned_off(hf_tiny, tmp_path, monkeypatch):
    import jax

    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)   # as outside the suite (conftest gives JAX the run's own)
    try:
        LLM(hf_tiny / "llama", dtype="float32", compilation_cache=False).close()
        chosen = jax.config.jax_compilation_cache_dir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert chosen is None and not (tmp_path / "xla").exists()


@pytest.mark.parametrize("budget, sp, sizes", [(256, 1, [16, 64, 256]), (16, 1, [16]), (2048, 1, [32, 128, 512, 2048]),
                                               (256, 16, [32, 64, 256])])
def test_prompt_steps_take_a_few_sizes(budget, sp, sizes):
    assert prefill_sizes(budget, sp) == sizes
