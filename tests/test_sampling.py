"""SamplingParams validation and the on-device sampler, on small hand-made logits (no model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import GREEDY_BELOW, MAX_LOGPROBS, SamplingArrays, SamplingParams, argmax
from jaxinfer.sampling import filter_logits as _filter_logits
from jaxinfer.sampling import sample as _sample

# Jitted once per shape: eager calls would recompile the lax.cond branches every time.
sample, filter_logits = jax.jit(_sample), jax.jit(_filter_logits)

# ---- SamplingParams validation ----------------------------------------------------------------------------


def draw(logits, arrays, positions):
    """The tokens of sample() (its log-probabilities have their own tests)."""
    return sample(logits, arrays, positions)[0]


@pytest.mark.parametrize("kw, names", [
    (dict(max_tokens=0), ["max_tokens=0", "[1, 2**31)"]),
    (dict(max_tokens=2.5), ["max_tokens=2.5", "integer"]),
    (dict(max_tokens=True), ["max_tokens=True", "integer"]),
    (dict(temperature=-1), ["temperature=-1", ">= 0"]),
    (dict(temperature=float("nan")), ["temperature=nan", "finite"]),
    (dict(temperature=float("inf")), ["temperature=inf", "finite"]),
    (dict(temperature="1"), ["temperature='1'", "finite number"]),
    (dict(top_p=0), ["top_p=0", "(0, 1]"]),
    (dict(top_p=1.01), ["top_p=1.01", "(0, 1]"]),
    (dict(top_p=float("nan")), ["top_p=nan", "(0, 1]"]),
    (dict(top_k=-2), ["top_k=-2", "[-1, 2**31)"]),
    (dict(top_k=2**31), [f"top_k={2**31}", "[-1, 2**31)"]),   # the device holds it as an int32
    (dict(max_tokens=2**31), [f"max_tokens={2**31}", "[1, 2**31)"]),
    (dict(temperature=1e39), ["temperature=1e+39", "float32"]),
    (dict(stop_token_ids=[5, 2**31]), [f"[{2**31}]", "[0, 2**31)"]),
    (dict(top_k=1.5), ["top_k=1.5", "integer"]),
    (dict(top_k=True), ["top_k=True", "integer"]),
    (dict(min_p=2), ["min_p=2", "[0, 1]"]),
    (dict(min_p=-0.1), ["min_p=-0.1", "[0, 1]"]),
    (dict(seed=-1), ["seed=-1", "an integer in [0, 2**32)"]),
    (dict(seed=2**32), [f"seed={2**32}", "[0, 2**32)"]),
    (dict(seed=1.0), ["seed=1.0", "integer"]),
    (dict(seed=True), ["seed=True", "integer"]),
    (dict(seed=False), ["seed=False", "integer"]),
    (dict(stop=""), ["stop strings", "empty"]),
    (dict(stop=["ok", ""]), ["stop strings", "empty"]),
    (dict(stop=["ok", 3]), ["stop strings", "str"]),
    (dict(stop_token_ids=[2, -1]), ["stop_token_ids=[2, -1]", "[-1]", "[0, 2**31)"]),
    (dict(stop_token_ids=[2, 1.0]), ["stop_token_ids", "integers"]),
    (dict(stop_token_ids=[True]), ["stop_token_ids", "integers"]),
])
def test_sampling_params_rejects(kw, names):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    for n in names:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("kw", [
    dict(max_tokens=1), dict(max_tokens=np.int64(3)), dict(temperature=0), dict(temperature=1e-38),
    dict(temperature=np.float32(0.7)), dict(top_p=1), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0),
    dict(top_k=1), dict(min_p=0), dict(min_p=1), dict(seed=None), dict(seed=0), dict(seed=2**32 - 1),
    dict(seed=np.uint32(5)), dict(stop_token_ids=[0, 7]),
])
def test_sampling_params_accepts(kw):
    p = SamplingParams(**kw)
    assert all(getattr(p, k) == v for k, v in kw.items())


def test_sampling_params_defaults_unchanged():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (16, 1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output) == ([], [], False, False)


# ---- the sampler ------------------------------------------------------------------------------------------


def _arrays(n: int, seeds=None, **kw) -> SamplingArrays:
    seeds = list(range(n)) if seeds is None else seeds
    return SamplingArrays.from_params([SamplingParams(**kw)] * n, n, seeds)


def _draws(logits: list[float], n: int = 256, **kw) -> np.ndarray:
    """n draws from one row of logits, one seed each."""
    x = jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1))
    return np.asarray(draw(x, _arrays(n, **kw), jnp.zeros(n, jnp.int32)))


def _kept(logits: list[float], **kw) -> set[int]:
    """The tokens that filter_logits leaves drawable for one row."""
    x = filter_logits(jnp.asarray([logits], jnp.float32), _arrays(1, **kw))
    return set(np.flatnonzero(np.isfinite(np.asarray(x[0]))).tolist())


def test_greedy_below_is_vllms_eps():
    assert GREEDY_BELOW == 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-6])
def test_tiny_temperature_is_greedy(temperature):
    s = _arrays(64, temperature=temperature)
    out = draw(jnp.tile(jnp.asarray([1.0, 3.0, 2.0, -1.0]), (64, 1)), s, jnp.arange(64))
    assert np.asarray(out).tolist() == [1] * 64


@pytest.mark.parametrize("temperature", [1e-38, 1e-37, 1e-6])
def test_tiny_temperature_row_is_greedy_in_a_sampled_batch(temperature):
    # the odd rows draw, so the per-row choice must send the even rows to the argmax; 300 / 1e-37 overflows
    # to inf, which made the old sampler draw token 0
    logits = jnp.asarray([[100.0, 300.0, 200.0, -100.0], [0.0, 0.0, 0.0, 0.0]] * 16)
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)] * 16
    s = SamplingArrays.from_params(params, 32, list(range(32)))
    out = np.asarray(draw(logits, s, jnp.arange(32)))
    assert out[0::2].tolist() == [1] * 16 and len(set(out[1::2].tolist())) > 1


def test_temperature_above_threshold_still_samples():
    # logits 5e-5 apart become 0.5 apart at temperature 1e-4: both tokens must come up
    draws = _draws([0.0, 5e-5], temperature=1e-4)
    assert set(draws.tolist()) == {0, 1}


def test_padding_rows_are_greedy_and_unfiltered():
    s = SamplingArrays.from_params([SamplingParams(temperature=0)], 4, [9])
    assert s.temperature.tolist() == [0.0] * 4 and s.seed.tolist() == [9, 0, 0, 0]
    s = SamplingArrays.from_params([SamplingParams(temperature=0.5, top_k=-1)], 2, [2**32 - 1])
    assert s.temperature.tolist() == [0.5, 0.0] and s.top_k.tolist() == [0, 0] and s.seed.tolist() == [2**32 - 1, 0]
    assert s.top_p.tolist() == [1.0, 1.0] and s.min_p.tolist() == [0.0, 0.0]


def test_min_p_applies_before_top_p():
    # probs 0.45, 0.30, 0.15, 0.10. min_p=0.3 drops token 3 (0.10 < 0.135); top-p on what is left,
    # renormalised (0.5, 0.333, 0.167), keeps 0 and 1 (mass before token 2 is 0.833 >= 0.8).
    # The old order (top-p on the unfiltered probs: mass before token 2 is 0.75 < 0.8) kept {0, 1, 2}.
    logits = np.log([0.45, 0.30, 0.15, 0.10]).tolist()
    kw = dict(temperature=1.0, min_p=0.3, top_p=0.8)
    assert _kept(logits, **kw) == {0, 1}
    assert set(_draws(logits, **kw).tolist()) == {0, 1}
    assert _kept(logits, temperature=1.0, top_p=0.8) == {0, 1, 2}      # top-p alone
    assert _kept(logits, temperature=1.0, min_p=0.3) == {0, 1, 2}      # min_p alone


def test_min_p_then_top_p_can_leave_only_the_top_token():
    # min_p=0.5 keeps 0.5 and 0.3; renormalised 0.625 >= top_p 0.6, so only token 0 stays (old order: {0, 1})
    logits = np.log([0.5, 0.3, 0.2]).tolist()
    assert _kept(logits, temperature=1.0, min_p=0.5, top_p=0.6) == {0}
    assert set(_draws(logits, temperature=1.0, min_p=0.5, top_p=0.6).tolist()) == {0}


def test_top_p_is_computed_after_top_k():
    # top_k=2 leaves 0.4, 0.3 -> 0.571, 0.429; with top_p 0.5 only token 0 stays (mass before token 1 is 0.571)
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    assert _kept(logits, temperature=1.0, top_k=2, top_p=0.5) == {0}
    assert _kept(logits, temperature=1.0, top_k=3, top_p=0.9) == {0, 1, 2}
    assert _kept(logits, temperature=1.0, top_k=3) == {0, 1, 2}


def test_temperature_applies_before_min_p():
    # logits 0, -1: prob ratio e^-1 = 0.37 at temperature 1 (dropped by min_p 0.5), e^-0.5 = 0.61 at 2 (kept)
    assert _kept([0.0, -1.0], temperature=1.0, min_p=0.5) == {0}
    assert _kept([0.0, -1.0], temperature=2.0, min_p=0.5) == {0, 1}


def test_filters_on_unsorted_logits_keep_token_ids():
    logits = np.log([0.10, 0.45, 0.15, 0.30]).tolist()   # the case above, shuffled
    assert _kept(logits, temperature=1.0, min_p=0.3, top_p=0.8) == {1, 3}
    assert _kept(logits, temperature=1.0, top_p=1.0) == {0, 1, 2, 3}
    assert _kept(logits, temperature=1.0, top_p=1e-9) == {1}       # at least the top token
    assert _kept(logits, temperature=1.0, min_p=1.0) == {1}


def _vllm_kept(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """vLLM v1's filters written out in numpy (min_p mask, then apply_top_k_top_p on an ascending sort)."""
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    x = np.where(p < min_p * p.max(), -np.inf, x)
    order = np.argsort(x)                                     # ascending, as vLLM sorts
    xs = x[order].copy()
    if 0 < top_k < len(xs):
        xs[xs < xs[-top_k]] = -np.inf
    ps = np.exp(xs - xs.max()) / np.exp(xs - xs.max()).sum()
    drop = np.cumsum(ps) <= 1 - top_p
    drop[-1] = False
    xs[drop] = -np.inf
    return set(order[np.isfinite(xs)].tolist())


def test_filters_match_vllm_reference_on_random_rows():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(64):
        rows.append((rng.normal(size=32) * 2, int(rng.choice([0, 1, 3, 8, 40])),
                     float(rng.choice([1.0, 0.9, 0.5, 0.2])), float(rng.choice([0.0, 0.02, 0.1, 0.3]))))
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for _, k, p, m in rows]
    s = SamplingArrays.from_params(params, len(rows), list(range(len(rows))))
    out = np.asarray(filter_logits(jnp.asarray(np.stack([r[0] for r in rows]), jnp.float32), s))
    for i, (x, k, p, m) in enumerate(rows):
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == _vllm_kept(x.astype(np.float32), k, p, m), i


def test_filters_match_vllm_reference_on_a_wide_padded_vocabulary():
    """Thresholds found by bisection, not a sort: exact on long rows whose padded entries are -inf."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(24, 1024)) * 3).astype(np.float32)
    x[:, 1000:] = -np.inf                                        # vocabulary rows padded for tp
    ks, ps, ms = [0, 1, 7, 50, 999, 1024] * 4, [1.0, 0.95, 0.5, 0.05] * 6, [0.0, 0.0, 0.01, 0.2] * 6
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=p, min_p=m) for k, p, m in zip(ks, ps, ms, strict=True)]
    s = SamplingArrays.from_params(params, len(params), list(range(len(params))))
    out = np.asarray(filter_logits(jnp.asarray(x), s))
    for i, (k, p, m) in enumerate(zip(ks, ps, ms, strict=True)):
        assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == _vllm_kept(x[i] / np.float32(0.7), k, p, m), i


def test_tokens_tied_at_a_threshold_stay_together():
    assert _kept([3.0, 2.0, 2.0, 1.0], temperature=1.0, top_k=2) == {0, 1, 2}   # as vLLM's top-k
    assert _kept([2.0, 1.0, 1.0, 0.0], temperature=1.0, top_p=0.6) == {0, 1, 2}  # mass above 1.0 is 0.58


def test_top_k_1_is_argmax():
    assert set(_draws([0.5, 0.1, 2.0, 1.9, -3.0], temperature=1.5, top_k=1).tolist()) == {2}


def test_argmax_is_jnp_argmax_with_ties_and_infinities():
    rows = np.random.default_rng(0).standard_normal((9, 1000)).astype(np.float32)
    rows[1, [3, 700]] = 9.0                          # ties: the first wins
    rows[2] = 1.0                                    # all equal
    rows[3] = -np.inf                                # nothing finite
    rows[4, [10, 20]] = np.inf
    rows[5, 999] = 50.0                              # the last entry
    rows[6] = -np.inf
    rows[6, 500] = -1e30
    rows[7] = -1.0 - np.abs(rows[7])
    rows[7, [3, 8]] = [-0.0, 0.0]                    # -0.0 and 0.0 tie
    rows[8, [400, 600]] = np.nan
    x = jnp.asarray(rows)
    np.testing.assert_array_equal(jax.jit(argmax)(x)[:8], jnp.argmax(x, axis=-1)[:8])
    np.testing.assert_array_equal(argmax(x)[:8], [int(np.argmax(r)) for r in rows[:8]])
    assert [int(i) for i in argmax(x)[1:8]] == [3, 0, 0, 10, 999, 500, 3]
    assert int(argmax(x)[8]) in {400, int(np.nanargmax(rows[8]))}   # garbage in, still a token id out


def test_top_k_off_samples_every_token():
    for top_k in (0, -1):
        assert set(_draws([0.0, 0.1, 0.2, -0.1], temperature=1.0, top_k=top_k).tolist()) == {0, 1, 2, 3}


def test_same_seed_and_position_same_token():
    x = jnp.zeros((8, 1000))
    s = SamplingArrays.from_params([SamplingParams()] * 8, 8, [7] * 8)
    out = np.asarray(draw(x, s, jnp.asarray([3, 3, 0, 1, 2, 4, 5, 6]))).tolist()
    assert out[0] == out[1]                                              # same (seed, position), same draw
    assert len(set(out[1:])) > 1                                         # the position changes the key


def test_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(5, 50)), jnp.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.5, top_k=5, top_p=0.7, min_p=0.05)]
    seeds, positions = [11, 0, 3, 2**32 - 1, 11], jnp.asarray([4, 9, 0, 17, 4])
    batch = np.asarray(draw(logits, SamplingArrays.from_params(params, 5, seeds), positions))
    assert batch[1] == int(jnp.argmax(logits[1]))
    for i in range(5):
        alone = draw(logits[i: i + 1], SamplingArrays.from_params([params[i]], 1, [seeds[i]]), positions[i: i + 1])
        assert int(alone[0]) == batch[i], i
    # reversed and padded with greedy rows, the rows still draw the same tokens
    padded = jnp.concatenate([logits[::-1], jnp.zeros((3, 50))])
    s = SamplingArrays.from_params(params[::-1], 8, seeds[::-1])
    out = np.asarray(draw(padded, s, jnp.concatenate([positions[::-1], jnp.zeros(3, jnp.int32)])))
    assert out[:5].tolist() == batch[::-1].tolist()


def test_sample_runs_eagerly():
    s = _arrays(3, temperature=0.7, top_k=2)
    x = jnp.asarray([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [1.0, 2.0, 0.0]])
    out, logprobs = _sample(x, s, jnp.arange(3))
    assert out.dtype == jnp.int32 and all(int(o) in k for o, k in zip(out, [{1, 2}, {0, 1}, {0, 1}], strict=True))
    assert logprobs.shape == (3, 1) and bool(jnp.isfinite(logprobs).all())   # the drawn tokens: finite


def test_temperature_without_filters_skips_the_filters_and_draws_the_same_tokens():
    """With no top-k, top-p or min-p on a row the sampler only divides by the temperature; the tokens and
    log-probabilities are those the filters (all off) give for the same seeds."""
    logits = jax.random.normal(jax.random.key(0), (32, 384)) * 3
    params = [SamplingParams(temperature=t) for t in (0.3, 0.7, 1.0, 1.6)] * 7 + [SamplingParams(temperature=0)] * 4
    s = SamplingArrays.from_params(params, 32, list(range(100, 132)))
    x = jnp.where((s.temperature > 0)[:, None], filter_logits(logits, s), logits)
    for step in range(3):
        positions = jnp.arange(32) + 7 * step
        tokens, logprobs = sample(logits, s, positions)
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, positions)
        drawn = np.where(s.temperature > 0, jax.vmap(jax.random.categorical)(keys, x), np.argmax(logits, -1))
        np.testing.assert_array_equal(tokens, drawn)
        expected = jnp.take_along_axis(jax.nn.log_softmax(x), jnp.asarray(drawn)[:, None], -1)
        np.testing.assert_allclose(logprobs, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_logprobs", [None, 3])
def test_row_by_row_draws_what_one_pass_draws(top_logprobs):
    """Rows drawn one at a time (the CPU's way) give the tokens and log-probabilities of one pass over
    them all, greedy rows, filters and padding mixed."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(8, 300)) * 3, jnp.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logprobs=top_logprobs),
              SamplingParams(temperature=0, top_k=4), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.6, min_p=0.05), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=1)]
    s = SamplingArrays.from_params(params, 8, [1, 2, 3, 4, 5, 6])
    positions = jnp.arange(8, dtype=jnp.int32) * 3
    one_pass = sample(logits, s, positions)
    by_row = jax.jit(_sample, static_argnums=3)(logits, s, positions, True)
    np.testing.assert_array_equal(by_row[0], one_pass[0])
    np.testing.assert_allclose(by_row[1], one_pass[1], rtol=1e-6, atol=1e-6)
    tokens = np.asarray(by_row[0])
    greedy = np.argmax(np.asarray(logits), -1)
    assert tokens[[1, 4, 5, 6, 7]].tolist() == greedy[[1, 4, 5, 6, 7]].tolist()   # greedy, top-k 1, padding
    assert by_row[1].shape == (8, 1 + 2 * (MAX_LOGPROBS if top_logprobs else 0))
