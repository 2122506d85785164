"""Valid inputs at the edges of the domain, compared with jax.nn.dot_product_attention (XLA):
zero-size dimensions, sequence lengths of other integer dtypes, window sides beyond int64,
and a scale that rounds to 0 in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import random_qkv

attention = jax_flashattn.attention
B, T, S, N, K, H = 2, 5, 7, 4, 2, 8


def xla(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


def assert_same(got, want):
    """Shapes, dtypes and values (-inf at the same places) equal up to float32 rounding."""
    got, want = np.asarray(got), np.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# name -> (B, T, S, N, K, H) with one dimension 0 (K >= 1: N % K needs it, as in jax.nn)
ZERO_SHAPES = {
    "B0": (0, T, S, N, K, H),
    "T0": (B, 0, S, N, K, H),
    "S0": (B, T, 0, N, K, H),
    "N0": (B, T, S, 0, K, H),
    "H0": (B, T, S, N, K, 0),
}
# jax.nn's default scale 1/sqrt(H) is inf for H = 0 and makes its lse NaN; ours is finite.
SCALE = 0.5


def zero_size_inputs(rng, name, dtype=jnp.float32):
    b, t, s, n, k, h = ZERO_SHAPES[name]
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, dtype)
    bias = jnp.asarray(rng.standard_normal((b, n, t, s), dtype=np.float32))
    return q, kk, v, bias


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(ZERO_SHAPES), ids=str)
def test_zero_size_matches_jax_nn(rng, name, jit):
    """Empty outputs (zeros for S = 0, whose rows see no key: lse -inf), as jax.nn's."""
    q, k, v, bias = zero_size_inputs(rng, name)
    fn = lambda q, k, v, bias: attention(q, k, v, bias, scale=SCALE, return_residual=True)
    out, lse = (jax.jit(fn) if jit else fn)(q, k, v, bias)
    want_out, want_lse = xla(q, k, v, bias, scale=SCALE, return_residual=True)
    assert_same(out, want_out)
    assert_same(lse, want_lse)


@pytest.mark.parametrize("name", list(ZERO_SHAPES), ids=str)
def test_zero_size_keeps_dtype_with_default_scale(rng, name):
    """bfloat16 stays bfloat16, and the default scale (1/sqrt(0) for H = 0) does not fail.
    (These outputs are empty or 0 whatever the scale: jax.nn's runs with SCALE, its default
    being a division by zero for H = 0.)"""
    q, k, v, _ = zero_size_inputs(rng, name, jnp.bfloat16)
    assert_same(attention(q, k, v, is_causal=True), xla(q, k, v, is_causal=True, scale=SCALE))


@pytest.mark.parametrize("name", ["T0", "S0", "N0", "H0"], ids=str)
def test_zero_size_unbatched(rng, name):
    q, k, v, _ = zero_size_inputs(rng, name)
    out, lse = attention(q[0], k[0], v[0], scale=SCALE, return_residual=True)
    want_out, want_lse = xla(q[0], k[0], v[0], scale=SCALE, return_residual=True)
    assert_same(out, want_out)
    assert_same(lse, want_lse)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(ZERO_SHAPES), ids=str)
def test_zero_size_grads_are_zero(rng, name, jit):
    """Every gradient is 0 with its input's shape and dtype, as jax.nn's."""
    q, k, v, bias = zero_size_inputs(rng, name)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32))

    def loss(impl):
        return lambda q, k, v, bias: jnp.sum(impl(q, k, v, bias, scale=SCALE) * d_out)

    grad = jax.grad(loss(attention), argnums=(0, 1, 2, 3))
    grads = (jax.jit(grad) if jit else grad)(q, k, v, bias)
    want = jax.grad(loss(xla), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for got, expected in zip(grads, want):
        assert_same(got, expected)
        assert not np.asarray(got).any()


@pytest.mark.parametrize("name", list(ZERO_SHAPES), ids=str)
def test_zero_size_vmap(rng, name):
    """vmap over a leading axis (with lengths per entry) gives jax.nn's results."""
    b, t, s, n, k, h = ZERO_SHAPES[name]
    q, kk, v = random_qkv(rng, (3, b), t, s, n, k, h, jnp.float32)
    # At least one key per row where there are keys: there jax.nn's lse is not -inf (our
    # contract's) but a large negative number.
    kv_lens = jnp.asarray(rng.integers(min(1, s), s + 1, (3, b)), jnp.int32)

    def run(impl):
        fn = lambda q, k, v, n: impl(q, k, v, scale=SCALE, key_value_seq_lengths=n,
                                     return_residual=True)
        return jax.vmap(fn)(q, kk, v, kv_lens)

    out, lse = run(attention)
    want_out, want_lse = run(xla)
    assert_same(out, want_out)
    assert_same(lse, want_lse)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_zero_head_dim_lse(rng, is_causal):
    """With H = 0 every q.k is 0, so the logits are the bias alone: lse is their log-sum-exp
    over the keys a row sees (jax.nn's), and -inf on a row that sees none (our contract, where
    jax.nn's is a large negative number)."""
    q, k, v, bias = zero_size_inputs(rng, "H0")
    lens = dict(query_seq_lengths=np.array([T, 2]), key_value_seq_lengths=np.array([S, 4]))
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.7)
    kwargs = dict(scale=SCALE, is_causal=is_causal, local_window_size=(2, 1),
                  return_residual=True, **lens)
    _, lse = attention(q, k, v, bias, mask, **kwargs)
    _, want = xla(q, k, v, bias, mask, **kwargs)
    lse, want = np.asarray(lse), np.asarray(want)
    sees_a_key = want > -1e30
    assert (~sees_a_key).any() and sees_a_key.any()
    np.testing.assert_allclose(lse[sees_a_key], want[sees_a_key], rtol=1e-5, atol=1e-6)
    assert (lse[~sees_a_key] == -np.inf).all()


# --- sequence lengths of other dtypes ------------------------------------------------------------

LENGTHS = [3, 6]
# name -> the lengths LENGTHS as the caller may give them
LENGTH_FORMS = {
    "int8": lambda: jnp.asarray(LENGTHS, jnp.int8),
    "int16": lambda: jnp.asarray(LENGTHS, jnp.int16),
    "uint8": lambda: jnp.asarray(LENGTHS, jnp.uint8),
    "uint16": lambda: jnp.asarray(LENGTHS, jnp.uint16),
    "numpy_int64": lambda: np.array(LENGTHS, np.int64),
    "numpy_uint32": lambda: np.array(LENGTHS, np.uint32),
    "list": lambda: list(LENGTHS),
}


@pytest.mark.parametrize("implementation", [None, "xla"], ids=["kernels", "xla"])
@pytest.mark.parametrize("form", list(LENGTH_FORMS), ids=str)
def test_lengths_of_other_dtypes(rng, form, implementation):
    """Narrow integer arrays, and host arrays of any integer dtype whose values fit int32, act
    as int32 lengths, also where jax.nn takes int32 only."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    want = attention(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                     implementation=implementation)
    given = LENGTH_FORMS[form]()
    fn = jax.jit(lambda q, k, v: attention(q, k, v, query_seq_lengths=given,
                                           key_value_seq_lengths=given,
                                           implementation=implementation))
    assert_same(fn(q, k, v), want)


@pytest.mark.parametrize("implementation", [None, "xla"], ids=["kernels", "xla"])
def test_numpy_int64_lengths_under_x64(rng, implementation):
    """np.array([5, 7]) stays int64 under jax_enable_x64: its values fit, so it is taken."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    want = attention(q, k, v, key_value_seq_lengths=jnp.asarray([5, 7], jnp.int32),
                     implementation=implementation)
    with jax.enable_x64(True):
        got = attention(q, k, v, key_value_seq_lengths=np.array([5, 7]),
                        implementation=implementation)
    assert_same(got, want)


# --- windows and scale ---------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", [None, "xla"], ids=["kernels", "xla"])
@pytest.mark.parametrize("side", [2**31, 2**62, 2**63 - 1, 2**63, 2**100], ids=str)
def test_window_sides_beyond_every_key(rng, side, implementation):
    """A side past every key (even one too large for int64) hides nothing: a (side, side) window
    is no window, (side, 0) is causal, (2, side) is (2, S); forward and gradients."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    cases = [((side, side), {}), ((side, 0), dict(is_causal=True)),
             ((2, side), dict(local_window_size=(2, S)))]
    for window, same_as in cases:
        def loss(q, k, v, **kwargs):
            return jnp.sum(attention(q, k, v, implementation=implementation, **kwargs) ** 2)

        got = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, local_window_size=window)
        want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, **same_as)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert_same(g, w)


@pytest.mark.parametrize("scale", [1e-50, -1e-50], ids=str)
def test_scale_below_float32_is_zero(rng, scale):
    """A scale that rounds to 0 in float32 attends uniformly over the visible keys, as scale 0
    does and as jax.nn does with it (its logits are float32 too)."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    out = attention(q, k, v, scale=scale, is_causal=True)
    assert_same(out, attention(q, k, v, scale=0.0, is_causal=True))
    assert_same(out, xla(q, k, v, scale=scale, is_causal=True))
