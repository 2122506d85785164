"""logits_soft_cap on the CUDA kernels (run with `pytest -m gpu` on a GPU), forward and gradients,
against the float32 reference.

Capped calls take the Hopper kernels' instantiations for them on an H100/H200 (without segment
ids; the backward in both dQ modes), the mma.sync family's (bf16/fp16, head dims that are a
multiple of 8 up to 256; the forward's K/V by TMA on Hopper, by cp.async elsewhere or with
JAX_FLASHATTN_SM80_CP_ASYNC; the backward in both dQ modes), the split-KV decode kernels' (the
wgmma and the mma.sync one) and the CUDA-core kernels (float32, other head dims). Each case runs
on the Hopper kernels and, with JAX_FLASHATTN_DISABLE_SM90, on the mma.sync family.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi
from helpers import check_cuda_forward, random_qkv, use_family
from test_gpu_backward import check_grads

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["sm90", "sm80_tma", "sm80_cp_async"])
def family(request, monkeypatch):
    """The forward family a case runs on: the Hopper kernel (skipped off Hopper), or the
    mma.sync one with K/V by TMA (cp.async off Hopper) or by cp.async."""
    return use_family(request.param, monkeypatch)


@pytest.fixture(params=["sm90", "sm80"])
def backward_family(request, monkeypatch):
    """The backward family a case runs on: the Hopper kernel (skipped off Hopper) or the
    mma.sync one."""
    return use_family(request.param, monkeypatch)


def capped_qkv(rng, b, t, s, n, kv, h, dtype):
    """Inputs whose logits (standard deviation ~9) reach well past the caps below."""
    return random_qkv(rng, b, t, s, n, kv, h, dtype, magnitude=3.0)


OPTIONS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_lengths": dict(local_window_size=(40, 7),
                           query_seq_lengths=np.array([97, 0], np.int32),
                           key_value_seq_lengths=np.array([150, 33], np.int32)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 40])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward(rng, family, dtype, head_dim, option):
    q, k, v = capped_qkv(rng, 2, 97, 150, 4, 2, head_dim, dtype)
    kwargs = dict(OPTIONS[option], logits_soft_cap=5.0)
    assert jax_flashattn.forward_kernel(q, k, logits_soft_cap=5.0) == family
    check_cuda_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("cap", [0.5, 30.0, 1e4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_caps(rng, family, cap, dtype):
    """A cap far below the logits (nearly uniform weights), about their size, and far above
    them (the identity): each as the reference has it."""
    q, k, v = capped_qkv(rng, 2, 130, 130, 4, 4, 128, dtype)
    check_cuda_forward(q, k, v, is_causal=True, logits_soft_cap=cap)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_forward_float32(rng, head_dim):
    q, k, v = capped_qkv(rng, 2, 77, 131, 4, 2, head_dim, jnp.float32)
    assert jax_flashattn.forward_kernel(q, k, logits_soft_cap=5.0) == "simt"
    check_cuda_forward(q, k, v, is_causal=True, logits_soft_cap=5.0)


def test_forward_with_bias_mask_and_segment_ids(rng):
    """The bias is added after the cap, the mask and the ids hide after it (on the mma.sync
    family: the Hopper kernel takes none of them with a cap)."""
    q, k, v = capped_qkv(rng, 2, 120, 120, 4, 2, 64, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((1, 4, 120, 120)) * 3, jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 120, 120)) > 0.3)
    check_cuda_forward(q, k, v, bias, mask, logits_soft_cap=4.0)
    ids = jnp.asarray(np.arange(2 * 120).reshape(2, 120) // 25, jnp.int32)
    assert jax_flashattn.forward_kernel(q, k, query_segment_ids=ids,
                                        logits_soft_cap=4.0) == "sm80"
    check_cuda_forward(q, k, v, is_causal=True, logits_soft_cap=4.0, query_segment_ids=ids,
                       key_value_segment_ids=ids)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", [(1, 4097), (3, 1001), (16, 2000)])
@pytest.mark.parametrize("bounds", ["lengths", "causal_bottom_right"])
@pytest.mark.parametrize("decode_family", ["default", "sm80"])
def test_decode_kernels(rng, monkeypatch, dtype, head_dim, t, s, bounds, decode_family):
    """Decoding shapes on the split-KV decode kernels' capped instantiations, the same kernel a
    call without the cap takes: on Hopper the wgmma one from 32 rows per kv head (16 queries of
    a group of 4; head dims up to 128), else and with JAX_FLASHATTN_DISABLE_SM90 ("sm80") the
    mma.sync one; splits merged as the plan has it (in their cluster, or through the combine
    kernel), the same plan as without the cap."""
    if decode_family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = capped_qkv(rng, 2, t, s, 8, 2, head_dim, dtype)
    kernel = jax_flashattn.forward_kernel(q, k, logits_soft_cap=5.0)
    assert kernel == jax_flashattn.forward_kernel(q, k)
    assert kernel in ("decode", "decode_sm90")
    assert _ffi.decode_layout(q, k, logits_soft_cap=5.0)[0] == _ffi.decode_layout(q, k)[0]
    kwargs = (dict(key_value_seq_lengths=np.array([s, s // 3], np.int32))
              if bounds == "lengths" else dict(is_causal=True, diagonal_alignment="bottom_right"))
    check_cuda_forward(q, k, v, logits_soft_cap=5.0, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients(rng, backward_family, dtype, head_dim, option, deterministic):
    q, k, v = capped_qkv(rng, 2, 97, 150, 4, 2, head_dim, dtype)
    family = jax_flashattn.backward_kernel(q, k, deterministic=deterministic,
                                           logits_soft_cap=5.0)
    # mma.sync above 128 only where the device has the large table's shared memory.
    assert family == backward_family or (head_dim > 128 and family == "simt")
    check_grads(rng, q, k, v, deterministic=deterministic, logits_soft_cap=5.0,
                **OPTIONS[option])


@pytest.mark.parametrize("head_dim", [64, 40])
def test_gradients_float32(rng, head_dim):
    q, k, v = capped_qkv(rng, 2, 77, 131, 4, 2, head_dim, jnp.float32)
    assert jax_flashattn.backward_kernel(q, k, logits_soft_cap=5.0) == "simt"
    check_grads(rng, q, k, v, is_causal=True, logits_soft_cap=5.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_with_bias_mask_and_segment_ids(rng, dtype, deterministic):
    """dbias is dS itself (the bias is added after the cap), dq and dk take the cap's slope (on
    the mma.sync family, or the CUDA-core kernels for float32)."""
    q, k, v = capped_qkv(rng, 2, 90, 110, 4, 2, 64, dtype)
    bias = jnp.asarray(rng.standard_normal((2, 1, 90, 110)) * 3, jnp.float32)
    mask = jnp.asarray(rng.random((1, 1, 90, 110)) > 0.3)
    check_grads(rng, q, k, v, bias, mask, deterministic=deterministic, logits_soft_cap=3.0)
    q_ids = jnp.asarray(np.arange(2 * 90).reshape(2, 90) // 20, jnp.int32)
    kv_ids = jnp.asarray(np.arange(2 * 110).reshape(2, 110) * 90 // 110 // 20, jnp.int32)
    check_grads(rng, q, k, v, deterministic=deterministic, logits_soft_cap=3.0, is_causal=True,
                query_segment_ids=q_ids, key_value_segment_ids=kv_ids)


def test_nan_at_a_masked_key_stays_out_of_its_gradients(rng):
    """A key the mask hides from every row, whose q.k is NaN (float32: the CUDA-core kernels,
    which read no hidden key's row): the cap's slope there is NaN, but dS is 0 there, so its
    dk and dv rows stay 0 and every other gradient finite."""
    q, k, v = capped_qkv(rng, 2, 64, 80, 4, 2, 64, jnp.float32)
    k = k.at[:, 5].set(jnp.nan)
    mask = jnp.ones((1, 1, 64, 80), bool).at[..., 5].set(False)
    check_nan_key_gradients(rng, q, k, v, [5], mask)


def test_nan_past_the_key_length_stays_out_of_the_gradients(rng, backward_family):
    """Keys past a batch entry's length holding NaN (a padded cache), on the tensor-core
    kernels: their capped scores are NaN, their slopes too, their dS 0: every gradient stays
    finite."""
    q, k, v = capped_qkv(rng, 2, 64, 80, 4, 2, 64, jnp.bfloat16)
    k = k.at[:, 70:].set(jnp.nan)
    v = v.at[:, 70:].set(jnp.nan)
    check_nan_key_gradients(rng, q, k, v, list(range(70, 80)),
                            key_value_seq_lengths=np.array([70, 70], np.int32))


def check_nan_key_gradients(rng, q, k, v, hidden, *args, **kwargs):
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)

    def f(q, k, v):
        return jax_flashattn.attention(q, k, v, None, *args, implementation="cuda",
                                       logits_soft_cap=2.0, **kwargs)
    def out_and_grads(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)
    out, (dq, dk, dv) = jax.jit(out_and_grads)(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert np.isfinite(np.asarray(dq, np.float32)).all(), "dq"
    for name, g in (("dk", dk), ("dv", dv)):
        g = np.asarray(g, np.float32)
        assert (g[:, hidden] == 0).all(), name
        assert np.isfinite(np.delete(g, hidden, axis=1)).all(), name


@pytest.mark.parametrize("key", [5, 130])
def test_nan_key_makes_the_rows_that_see_it_nan(rng, family, key):
    """A NaN key makes exactly the causal rows that see it NaN, capped (tanh(NaN) is NaN, and
    so is its exp2), in the first key tile or a later one; the rows before it come out as they
    do with the key finite."""
    q, k, v = capped_qkv(rng, 1, 200, 200, 2, 2, 128, jnp.bfloat16)
    poisoned = k.at[:, key].set(jnp.nan)
    out = np.asarray(jax_flashattn.attention(q, poisoned, v, is_causal=True,
                                             logits_soft_cap=30.0), np.float32)
    clean = np.asarray(jax_flashattn.attention(q, k, v, is_causal=True, logits_soft_cap=30.0),
                       np.float32)
    assert np.isnan(out[:, key:]).all()
    np.testing.assert_array_equal(out[:, :key], clean[:, :key])
