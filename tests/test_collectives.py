"""collective_report against analytical counts on real XLA:CPU programs and hand-written HLO."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxinfer.collectives import KINDS, _bytes, collective_report, compiled_report, format_report

F32 = 4
X = jnp.ones((8, 16), jnp.float32)
XBYTES = 8 * 16 * F32


@pytest.fixture(scope="module")
def mesh():
    explicit = (jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((4,), ("tp",), axis_types=explicit, devices=jax.devices()[:4])


def only(report, **expected):
    """Assert the named kinds have (count, bytes) and every other kind is zero."""
    want = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for k, (count, nbytes) in expected.items():
        want[k.replace("_", "-")] = {"count": count, "bytes": nbytes}
    assert report == want


def layer(x, w):
    # The tanh between the two psums makes the second depend on the first, so XLA cannot combine them.
    y = jnp.tanh(lax.psum(x * w, "tp"))
    return jnp.tanh(lax.psum(y * w, "tp")), None


def test_scan_counts_each_iteration(mesh):
    def body(x, ws):
        return lax.scan(layer, x, ws)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    report = compiled_report(f, X, jnp.ones((3, 8, 16)))
    only(report, all_reduce=(6, 6 * XBYTES))


def test_nested_scans_multiply(mesh):
    def body(x, ws):  # ws: [2, 3, 8, 16]
        return lax.scan(lambda x, w: (lax.scan(layer, x, w)[0], None), x, ws)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    report = compiled_report(f, X, jnp.ones((2, 3, 8, 16)))
    only(report, all_reduce=(2 * 3 * 2, 2 * 3 * 2 * XBYTES))


@pytest.mark.parametrize(
    "op, kind, out_bytes",
    [
        (lambda x: lax.all_gather(x, "tp", tiled=True), "all_gather", 4 * XBYTES),  # f32[32,16]
        (lambda x: lax.psum_scatter(x, "tp", tiled=True), "reduce_scatter", XBYTES // 4),  # f32[2,16]
        # XLA:CPU lowers this to a 4-operand tuple all-to-all of f32[2,16] pieces: summed, 8*16*4.
        (lambda x: lax.all_to_all(x, "tp", 0, 0, tiled=True), "all_to_all", XBYTES),
        (lambda x: lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]), "collective_permute", XBYTES),
    ],
)
def test_each_kind_and_bytes(mesh, op, kind, out_bytes):
    f = jax.shard_map(op, mesh=mesh, in_specs=P(), out_specs=P("tp"))
    only(compiled_report(f, X), **{kind: (1, out_bytes)})


def test_int8_all_gather_in_scan(mesh):
    # int8, not bf16: XLA:CPU widens bf16 collectives to f32, and the report counts the compiled program.
    def body(x):
        def step(c, _):
            return c + lax.all_gather(c, "tp", tiled=True)[:2], None

        return lax.scan(step, lax.pcast(x, "tp", to="varying"), None, length=5)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp"))
    only(compiled_report(f, jnp.ones((2, 3), jnp.int8)), all_gather=(5, 5 * 8 * 3 * 1))  # s8[8,3]


def test_no_collectives_is_all_zero():
    only(compiled_report(lambda x: jnp.sin(x) @ x.T, X))


def test_conditional_takes_max_over_branches(mesh):
    def body(x, p):
        def two(x):
            return lax.psum(jnp.tanh(lax.psum(x, "tp")), "tp")

        return lax.cond(p, lambda x: lax.psum(x, "tp"), two, x)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    only(compiled_report(f, X, True), all_reduce=(2, 2 * XBYTES))


HAND_HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[2,3])) -> (s32[], bf16[2,3]) {
  %p = (s32[], bf16[2,3]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,3]{1,0} get-tuple-element(%p), index=1
  %ags = (bf16[2,3]{1,0}, bf16[8,3]{1,0}) all-gather-start(%x), channel_id=1, dimensions={0}
  %agd = bf16[8,3]{1,0} all-gather-done(%ags)
  %cps = (bf16[2,3]{1,0}, bf16[2,3]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={}
  %cpd = bf16[2,3]{1,0} collective-permute-done(%cps)
  %ars = (bf16[2,3]{1,0}, f32[]) all-reduce-start(%x, %f), to_apply=%add
  %ard = (bf16[2,3]{1,0}, f32[]) all-reduce-done(%ars)
  %rss = ((bf16[2,3]{1,0}), bf16[1,3]{1,0}) reduce-scatter-start(%x), dimensions={0}, to_apply=%add
  %rsd = bf16[1,3]{1,0} reduce-scatter-done(%rss)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[2,3]{1,0}) tuple(%j, %cpd)
}

%cond (q: (s32[], bf16[2,3])) -> pred[] {
  %q = (s32[], bf16[2,3]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x: bf16[2,3]) -> bf16[2,3] {
  %x = bf16[2,3]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,3]{1,0}) tuple(%zero, %x)
  %w = (s32[], bf16[2,3]{1,0}) while(%init), condition=%cond, body=%body{BACKEND}
  ROOT %out = bf16[2,3]{1,0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize("backend", [', backend_config={"known_trip_count":{"n":"7"}}', ""])
def test_async_starts_in_hand_written_hlo(backend):
    # Trip count 7 from the backend config or, without it, from `compare(i, constant(7)), direction=LT`.
    only(
        collective_report(HAND_HLO.replace("{BACKEND}", backend)),
        all_gather=(7, 7 * 8 * 3 * 2),  # output part of (operand, output)
        collective_permute=(7, 7 * 2 * 3 * 2),  # output part of (operand, output, u32[], u32[])
        all_reduce=(7, 7 * (2 * 3 * 2 + 4)),  # all-reduce-start's whole tuple is outputs
        reduce_scatter=(7, 7 * 1 * 3 * 2),  # output part of ((operands), output)
    )


def test_unknown_trip_count_raises():
    no_constant = "%n = s32[] get-tuple-element(%q), index=0"
    hlo = HAND_HLO.replace("{BACKEND}", "").replace("%n = s32[] constant(7)", no_constant)
    with pytest.raises(ValueError, match="trip count of while loop"):
        collective_report(hlo)


def test_format_report():
    rep = collective_report(HAND_HLO.replace("{BACKEND}", ', backend_config={"known_trip_count":{"n":"2"}}'))
    text = format_report({"prefill": rep, "decode": collective_report("ENTRY %e () -> f32[] {\n}\n")})
    lines = text.splitlines()
    assert len(lines) == 1 + 2 * len(KINDS)
    assert lines[0].split() == ["phase", "collective", "count", "bytes"]
    assert lines[1].split() == ["prefill", "all-reduce", "2", "32"]
    assert lines[-1].split() == ["decode", "collective-permute", "0", "0"]


CALLS_HLO = """HloModule calls

%red (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  %never = f32[] all-reduce(%a), to_apply=%red
  ROOT %s = f32[] add(%a, %b)
}

%sub (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %a2a = f32[4]{0} all-to-all(%x), dimensions={0}
}

%wrapped (y: f32[4]) -> f32[4] {
  %y = f32[4]{0} parameter(0)
  ROOT %cp = f32[4]{0} collective-permute(%y), source_target_pairs={{0,1}}
}

ENTRY main {
  %p = f32[4]{0} parameter(0)
  %c = f32[4]{0} call(%p), to_apply=%sub
  %st = ((f32[4]{0}), f32[4]{0}, s32[]) async-start(%c), calls=%wrapped
  %dn = f32[4]{0} async-done(%st), calls=%wrapped
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%dn, %z), dimensions={0}, to_apply=%red
}
"""


def test_call_and_async_wrapper_are_executed_reductions_are_not():
    # call's to_apply runs once; generic async-start runs its wrapped op once (async-done is ignored);
    # reduce's to_apply (which here even holds an all-reduce) is a reduction, not executed code.
    only(collective_report(CALLS_HLO), all_to_all=(1, 16), collective_permute=(1, 16))


@pytest.mark.parametrize(
    "shape, nbytes",
    [
        ("bf16[2,3]{1,0}", 12),
        ("f32[]", 4),
        ("pred[]", 1),
        ("s32[2]", 8),
        ("u8[5]", 5),
        ("f8e4m3fn[4,4]{1,0}", 16),
        ("s4[3]", 2),
        ("(f32[4]{0}, f32[4]{0})", 32),
        ("(f32[], /*index=1*/(s64[2], token[]), c64[1])", 4 + 16 + 8),
        ("f32[<=8,2]{1,0}", 64),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert _bytes(shape) == nbytes


def test_indented_multiline_instruction():
    hlo = """HloModule x
  ENTRY main {
    p = f32[8]{0} parameter(0)
    ag = (f32[8]{0}, f32[32]{0}) all-gather-start(
        f32[8]{0} p), dimensions={0},
        replica_groups={{0,1,2,3}}
    ROOT d = f32[32]{0} all-gather-done(ag)
    c = s32[] constant(2)
    w = (s32[]) while(c),
      condition=%cond,
      body=%body
  }
  %body (p: s32[]) -> s32[] {
    p = s32[] parameter(0)
    ROOT r = f32[4]{0} all-reduce(f32[4]{0} p), to_apply=%add
  }
  %cond (q: s32[]) -> pred[] {
    ROOT q = pred[] parameter(0)
  }
"""
    with_count = hlo.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
    only(collective_report(with_count), all_gather=(1, 32 * 4), all_reduce=(3, 3 * 16))
