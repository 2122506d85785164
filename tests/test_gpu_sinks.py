"""Attention sinks on the CUDA kernels (run with `pytest -m gpu` on a GPU): the kernels run
without them and the result is rescaled after, so every family takes them, the split-KV decode
kernels included. Values, lse and gradients (the sinks' too) against the float32 reference, on
the Hopper kernels and, with JAX_FLASHATTN_DISABLE_SM90, on the mma.sync family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import assert_dsinks_close, check_cuda_forward, random_qkv, use_family

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["sm90", "sm80"])
def family(request, monkeypatch):
    return use_family(request.param, monkeypatch)


OPTIONS = {
    "plain": {},
    "causal_lengths": dict(is_causal=True, key_value_seq_lengths=np.array([333, 0], np.int32)),
    "window_soft_cap": dict(local_window_size=(70, 9), logits_soft_cap=5.0),
}
NORMWISE = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 4e-3,
            jnp.dtype(jnp.float32): 1e-4}


def sinks_for(rng, n):
    return jnp.asarray(rng.standard_normal(n) * 2, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward(rng, family, dtype, head_dim, option):
    q, k, v = random_qkv(rng, 2, 150, 333, 4, 2, head_dim, dtype)
    kwargs = OPTIONS[option]
    cap = kwargs.get("logits_soft_cap")
    assert jax_flashattn.forward_kernel(q, k, logits_soft_cap=cap) == family
    check_cuda_forward(q, k, v, sinks=sinks_for(rng, 4), **kwargs)


@pytest.mark.parametrize("t", [1, 16])
def test_decode_kernels(rng, t):
    q, k, v = random_qkv(rng, 2, t, 4097, 16, 4, 128, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) in ("decode", "decode_sm90")
    check_cuda_forward(q, k, v, sinks=sinks_for(rng, 16),
                       key_value_seq_lengths=np.array([4097, 1000], np.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients(rng, family, dtype, option, deterministic):
    kwargs = OPTIONS[option]
    q, k, v = random_qkv(rng, 2, 150, 333, 4, 2, 128, dtype)
    assert jax_flashattn.backward_kernel(q, k, deterministic=deterministic,
                                         logits_soft_cap=kwargs.get("logits_soft_cap")) == family
    check_sinks_grads(rng, q, k, v, deterministic, kwargs)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gradients_float32(rng, option):
    """The CUDA-core kernels."""
    q, k, v = random_qkv(rng, 2, 150, 333, 4, 2, 64, jnp.float32)
    assert jax_flashattn.backward_kernel(q, k) == "simt"
    check_sinks_grads(rng, q, k, v, False, OPTIONS[option])


def check_sinks_grads(rng, q, k, v, deterministic, kwargs):
    """dq, dk, dv and d sinks through the CUDA kernels against the float32 reference."""
    dtype = q.dtype
    sinks = sinks_for(rng, q.shape[-2])
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)

    def grads(fn, *operands, **extra):
        def f(q, k, v, s):
            return fn(q, k, v, sinks=s, **kwargs, **extra)

        def vjp(*xs):
            out, pullback = jax.vjp(f, *xs)
            return pullback(d_out.astype(out.dtype))
        return jax.jit(vjp)(*operands)

    ours = grads(jax_flashattn.attention, q, k, v, sinks, implementation="cuda",
                 deterministic_backward=deterministic)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    want = grads(reference.attention, *f32, sinks)
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), name
        if name == "dsinks" and dtype != jnp.float32:
            assert_dsinks_close(a, q, k, v, None, sinks, d_out,
                                relative=NORMWISE[jnp.dtype(dtype)], **kwargs)
            continue
        err = np.linalg.norm(a - r)
        bound = NORMWISE[jnp.dtype(dtype)] * np.linalg.norm(r) + 1e-5 * np.sqrt(r.size)
        assert err <= bound, f"{name}: normwise error {err:.3g} exceeds {bound:.3g}"
