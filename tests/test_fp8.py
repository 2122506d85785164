"""quantize_fp8 / dequantize_fp8, and an e4m3 paged cache filled with them (CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn.fp8 import E4M3_MAX


def test_amax_scaling_round_trip(rng):
    """Each (batch entry, kv head) group's largest magnitude lands on 448; every element comes
    back within e4m3's rounding: 2^-4 of itself, or half its smallest step (2^-9 descale)."""
    x = rng.standard_normal((2, 37, 3, 16)).astype(np.float32)
    x *= rng.uniform(0.01, 100, (2, 1, 3, 1)).astype(np.float32)
    values, descale = jax_flashattn.quantize_fp8(x)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == x.shape
    assert descale.dtype == jnp.float32 and descale.shape == (2, 3)
    np.testing.assert_allclose(np.abs(np.asarray(values, np.float32)).max(axis=(1, 3)), E4M3_MAX)
    back = np.asarray(jax_flashattn.dequantize_fp8(values, descale))
    step = np.asarray(descale)[:, None, :, None] * 2.0 ** -10
    assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) + step)
    assert np.abs(back - x).max() > 0  # rounding happened: the check above is not vacuous


def test_zeros_nan_given_descale_and_other_axes(rng):
    values, descale = jax_flashattn.quantize_fp8(np.zeros((2, 5, 1, 4), np.float32))
    assert np.all(np.asarray(descale) == 1) and not np.asarray(values, np.float32).any()
    x = np.array([[1.0, np.nan, -3.0, 1000.0]], np.float32)
    values, descale = jax_flashattn.quantize_fp8(x, axis=1, descale=np.array([0.5], np.float32))
    assert descale.shape == (1,)
    np.testing.assert_array_equal(np.asarray(values, np.float32), [[2.0, np.nan, -6.0, 448.0]])
    # One descale per row of a [T, H] matrix (axis -1).
    x = rng.standard_normal((6, 8)).astype(np.float32)
    values, descale = jax_flashattn.quantize_fp8(x, axis=-1)
    assert descale.shape == (6,)
    np.testing.assert_allclose(np.asarray(jax_flashattn.dequantize_fp8(values, descale, axis=-1)),
                               x, rtol=2.0 ** -4, atol=float(np.asarray(descale).max()) * 2.0 ** -9)


def test_errors():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        jax_flashattn.quantize_fp8(np.ones((2, 3), np.int32), axis=1)
    with pytest.raises(ValueError, match="axis must be axes of x"):
        jax_flashattn.quantize_fp8(np.ones((2, 3), np.float32), axis=2)
    with pytest.raises(ValueError, match="descale must broadcast to the groups' shape"):
        jax_flashattn.quantize_fp8(np.ones((2, 3, 4, 5), np.float32), descale=np.ones(3))


def test_fp8_paged_cache_from_quantize(rng):
    """A prefill's keys and values quantised per (sequence, kv head), written into e4m3 pages;
    a decode token quantised with its sequence's descales and written after them: attention
    over the pages is attention over the float keys and values, within e4m3's rounding."""
    batch, s, kv_heads, heads, head_dim, page_size = 2, 40, 2, 4, 32, 16
    keys = rng.standard_normal((batch, s + 1, kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((batch, s + 1, kv_heads, head_dim)).astype(np.float32)
    table = np.array([[5, 0, 3], [1, 4, 2]], np.int32)
    k8, descale_k = jax_flashattn.quantize_fp8(keys[:, :s])
    v8, descale_v = jax_flashattn.quantize_fp8(values[:, :s])
    cache_k = jnp.zeros((6, page_size, kv_heads, head_dim), jnp.float8_e4m3fn)
    cache_v = jnp.zeros_like(cache_k)
    start = np.zeros(batch, np.int32)
    cache_k, cache_v = jax_flashattn.paged_cache_update(cache_k, cache_v, table, start, k8, v8)
    step_k, _ = jax_flashattn.quantize_fp8(keys[:, s:], descale=descale_k)
    step_v, _ = jax_flashattn.quantize_fp8(values[:, s:], descale=descale_v)
    cache_k, cache_v = jax_flashattn.paged_cache_update(cache_k, cache_v, table,
                                                        np.full(batch, s, np.int32), step_k,
                                                        step_v)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    lengths = np.full(batch, s + 1, np.int32)
    out = jax_flashattn.paged_attention(q, cache_k, cache_v, table, lengths,
                                        descale_k=descale_k, descale_v=descale_v)
    exact = jax_flashattn.attention(q, jnp.asarray(keys), jnp.asarray(values), is_causal=True,
                                    diagonal_alignment="bottom_right")
    err = np.linalg.norm(np.asarray(out) - np.asarray(exact)) / np.linalg.norm(np.asarray(exact))
    # e4m3's rounding of K and V moves the output by 3-4% here (8 seeds); a lost descale, O(1).
    assert 1e-4 < err < 0.08, err
