"""LLM.random: weights drawn on the devices have the loader's layout (shapes, dtypes, shardings), the random
checkpoint's statistics, copies for replicated KV heads and zeros where the loader reads zeros."""

import jax
import numpy as np
import pytest

from jaxinfer.checkpoint import unfuse
from jaxinfer.llm import LLM
from jaxinfer.random_model import DEFAULT, ensure

SMALL_VOCAB = {**DEFAULT, "vocab_size": 260}  # padded to 264 under tp=8


def leaves(llm: LLM) -> dict[str, jax.Array]:
    """Every weight by its path, e.g. "layers.0.weights.attn.k"."""
    flat = jax.tree_util.tree_leaves_with_path(llm.weights)
    return {jax.tree_util.keystr(path, simple=True, separator="."): x for path, x in flat}


def q_and_k(qkv: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """The q and k parts of a fused qkv weight [layers, E, G, (H + 2 KV) / G, D], [layers, E, heads, D] each."""
    groups, cols = qkv.shape[2:4]
    kv_cols = (cols - heads // groups) // 2
    q, k, _ = unfuse(qkv, (heads // groups, kv_cols, kv_cols), axis=2)
    return np.asarray(q), np.asarray(k)


@pytest.mark.parametrize("mesh", ["tp=8", "pp=3"])
def test_layout_matches_the_checkpoint_loader(mesh: str):
    """tp=8: 4 KV heads replicated twice, the vocabulary 260 padded to 264; pp=3: 4 layers in 3 stages of 2
    slots, two of them padding."""
    loaded = leaves(LLM(ensure("small-vocab-random-llama", SMALL_VOCAB), mesh=mesh, dtype="float32", num_pages=8,
                        compilation_cache=False))
    llm = LLM.random(SMALL_VOCAB, mesh=mesh, dtype="float32", num_pages=8, compilation_cache=False)
    drawn = leaves(llm)
    assert llm.path is None and llm.tokenizer is None and llm.source == "random weights"
    assert drawn.keys() == loaded.keys()
    for name, x in drawn.items():
        want = loaded[name]
        assert (x.shape, x.dtype) == (want.shape, want.dtype), name
        assert x.sharding.is_equivalent_to(want.sharding, x.ndim), name
        a, w = np.asarray(x), np.asarray(want)
        np.testing.assert_array_equal(a == 0, w == 0, err_msg=f"{name}: zeros exactly where the loader's are")
        if name.endswith("norm"):
            np.testing.assert_array_equal(a[w != 0], 1.0)
    q, k = q_and_k(np.asarray(drawn["layers.0.weights.attn.qkv"]), SMALL_VOCAB["num_attention_heads"])
    if mesh == "tp=8":   # replicated KV heads are consecutive copies, as np.repeat makes them on load
        assert k.shape[2] == 2 * SMALL_VOCAB["num_key_value_heads"]    # [layers, E, KV * 2, D]
        np.testing.assert_array_equal(k[:, :, 0::2], k[:, :, 1::2])
        assert not np.array_equal(k[:, :, 0], k[:, :, 2])
        assert drawn["embed.table"].shape[0] == 264
    q = q[np.any(q != 0, axis=(1, 2, 3))]                     # the real layer slots; HF q_proj: std 1/sqrt(E)
    np.testing.assert_allclose(q.std(), 1 / np.sqrt(DEFAULT["hidden_size"]), rtol=0.05)
    llm.close()


def test_seeded():
    a, b, c = (LLM.random(DEFAULT, dtype="float32", seed=s, num_pages=4, compilation_cache=False) for s in (0, 0, 1))
    x, y, z = (np.asarray(m.weights.layers[0].weights.mlp.gate_up) for m in (a, b, c))
    np.testing.assert_array_equal(x, y)
    assert not np.allclose(x, z)
