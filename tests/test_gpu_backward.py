"""Gradients through the CUDA kernels (run with `pytest -m gpu` on an NVIDIA GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import random_qkv

pytestmark = pytest.mark.gpu


def grads(fn, q, k, v, bias, **kwargs):
    def loss(q, k, v, bias):
        out = fn(q, k, v, bias, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1])))
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    return jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)


def check(rng, dtype, b, t, s, n, kv, h, with_bias=False, **kwargs):
    q, k, v = random_qkv(rng, b, t, s, n, kv, h, dtype)
    bias = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32) if with_bias else None
    ours = grads(lambda *a, **kw: jax_flashattn.attention(*a, implementation="cuda", **kw),
                 q, k, v, bias, **kwargs)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = grads(reference.attention, *f32, bias, **kwargs)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    for name, a, r in zip("qkvb", ours, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), f"d{name} not finite"
        err = np.linalg.norm(a - r) / (np.linalg.norm(r) + 1e-6)
        assert err < tol, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_odd_sizes(rng, dtype, is_causal):
    check(rng, dtype, 2, 67, 45, 4, 2, 64, is_causal=is_causal)


def test_bias_window_seq_lengths(rng):
    check(rng, jnp.bfloat16, 2, 50, 70, 2, 1, 40, with_bias=True, local_window_size=(9, 4),
          key_value_seq_lengths=jnp.array([70, 0], jnp.int32),
          query_seq_lengths=jnp.array([31, 50], jnp.int32))


def test_zero_length_rows_give_zero_gradients(rng):
    q, k, v = random_qkv(rng, 2, 16, 16, 2, 2, 32, jnp.bfloat16)
    lens = jnp.array([0, 16], jnp.int32)
    dq, dk, dv = grads(lambda *a, **kw: jax_flashattn.attention(*a, implementation="cuda", **kw),
                       q, k, v, None, key_value_seq_lengths=lens)
    for g in (dq, dk, dv):
        assert np.all(np.asarray(g[0], np.float32) == 0)


def test_deterministic(rng):
    q, k, v = random_qkv(rng, 1, 130, 130, 4, 1, 64, jnp.bfloat16)
    f = lambda *a, **kw: jax_flashattn.attention(*a, implementation="cuda", **kw)
    first = grads(f, q, k, v, None, is_causal=True)
    for _ in range(3):
        again = grads(f, q, k, v, None, is_causal=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
