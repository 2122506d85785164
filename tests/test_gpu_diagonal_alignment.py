"""diagonal_alignment="bottom_right" on the CUDA kernels (run with `pytest -m gpu` on a GPU): the
kernels take it as a shifted window (a left side that may be negative, a right side of S - T),
so every family does, the split-KV decode kernels included. Each case runs on the Hopper kernels
and, with JAX_FLASHATTN_DISABLE_SM90, on the mma.sync family, against the float32 reference."""

import jax.numpy as jnp
import pytest

import jax_flashattn
from helpers import check_cuda_forward, random_qkv, use_family
from test_gpu_backward import check_grads

pytestmark = pytest.mark.gpu

BR = dict(diagonal_alignment="bottom_right")


@pytest.fixture(params=["sm90", "sm80"])
def family(request, monkeypatch):
    return use_family(request.param, monkeypatch)


OPTIONS = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(70, 9)),
    "causal_window": dict(is_causal=True, local_window_size=(200, 0)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", [(97, 700), (700, 97), (257, 513)])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward(rng, family, dtype, head_dim, t, s, option):
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, head_dim, dtype)
    assert jax_flashattn.forward_kernel(q, k) == family
    check_cuda_forward(q, k, v, **OPTIONS[option], **BR)


@pytest.mark.parametrize("t", [1, 4, 16])
def test_decode_kernels(rng, t):
    """A prefill's last tokens against a cache: the decode kernels with the shifted causal
    window (T queries, all but the first seeing the keys before it)."""
    q, k, v = random_qkv(rng, 2, t, 4097, 16, 4, 128, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) in ("decode", "decode_sm90")
    check_cuda_forward(q, k, v, is_causal=True, **BR)
    check_cuda_forward(q, k, v, is_causal=True, local_window_size=(1000, 0), **BR)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients(rng, family, dtype, head_dim, option, deterministic):
    q, k, v = random_qkv(rng, 2, 150, 333, 4, 2, head_dim, dtype)
    check_grads(rng, q, k, v, deterministic=deterministic, **OPTIONS[option], **BR)
    q, k, v = random_qkv(rng, 2, 333, 150, 4, 2, head_dim, dtype)
    check_grads(rng, q, k, v, deterministic=deterministic, **OPTIONS[option], **BR)


def test_float32_and_soft_cap(rng):
    """The CUDA-core kernels (float32), and the soft-capped instantiations."""
    q, k, v = random_qkv(rng, 2, 77, 131, 4, 2, 64, jnp.float32)
    check_cuda_forward(q, k, v, is_causal=True, **BR)
    check_grads(rng, q, k, v, is_causal=True, **BR)
    q, k, v = random_qkv(rng, 2, 77, 131, 4, 2, 128, jnp.bfloat16, magnitude=3.0)
    check_cuda_forward(q, k, v, is_causal=True, logits_soft_cap=5.0, **BR)
    check_grads(rng, q, k, v, is_causal=True, logits_soft_cap=5.0, **BR)
