"""jaxinfer.bench.op_profile: a traced jitted function, summed by XLA operation."""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.bench.op_profile import hlo_sources, op_times


def test_operations_are_summed_leaves_only(tmp_path):
    @jax.jit
    def f(x, w):
        y = jnp.tanh(x @ w)
        return jax.lax.cond(y.sum() > 0, lambda y: y @ w, lambda y: -y, y)

    x, w = jnp.ones((64, 64)), jnp.eye(64) * 0.5
    f(x, w).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(x, w).block_until_ready()
    ops = op_times(tmp_path, hlo_sources([f.lower(x, w).compile().as_text()]))
    assert ops and all(o.module == "jit_f" and o.seconds > 0 for o in ops), ops
    assert {o.source for o in ops if o.source.endswith("dot_general")}, ops      # the matmuls, by their code
    assert all(o.count % 3 == 0 for o in ops), ops             # three calls, each running every operation
    assert not [o for o in ops if o.name.split(".")[0] in ("cond", "while", "conditional")], ops
    assert sum(o.count for o in ops) >= 2 * 3                  # both matmuls, the second inside the cond
    assert [o.seconds for o in ops] == sorted((o.seconds for o in ops), reverse=True)


def test_no_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no profiler trace"):
        op_times(tmp_path)


def test_sources_are_op_names_or_else_opcode_and_shape():
    text = """HloModule jit_g, entry_computation_layout={(f32[2,3]{1,0})->f32[2,4]{1,0}}

ENTRY %main.1 (p.1: f32[2,3], w.1: f32[3,4]) -> f32[2,4] {
  %p.1 = f32[2,3]{1,0} parameter(0), metadata={op_name="p"}
  %w.1 = f32[3,4]{1,0} parameter(1), metadata={op_name="w"}
  %dot.7 = f32[2,4]{1,0} dot(%p.1, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh.1 = f32[2,4]{1,0} tanh(%dot.7), metadata={op_name="jit(g)/while/body/tanh" stack_frame_id=1}
}
"""
    sources = hlo_sources([text])
    assert sources[("jit_g", "dot.7")] == "dot f32[2,4]"              # no metadata kept: what it computes
    assert sources[("jit_g", "tanh.1")] == "while/body/tanh"         # the code it came from, "jit(g)/" dropped
