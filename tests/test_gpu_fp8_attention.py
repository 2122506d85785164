"""FP8 attention (query, key and value of float8_e4m3fn) on the Hopper forward's e4m3 kernels
(run with `pytest -m gpu` on an H100 or H200): S = Q K^T and O += P V by wgmma's e4m3 steps,
P rounded to e4m3 in registers. Each result against the float32 reference on the dequantised
inputs: its error must stay within twice that of the same computation with P (times 256, as
the kernels scale it) rounded to e4m3 (`rounded_p_error`), plus one rounding of the output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import fp8, reference
from helpers import hopper, reads_e4m3_in_the_kernel

pytestmark = pytest.mark.gpu

E4M3 = jnp.float8_e4m3fn


def quantized(rng, shape, groups, magnitude=3.0):
    """(values, descale [B, K], dequantised float32): fresh values quantised per (batch entry,
    kv head) group; `groups` K for a query [B, T, N, H] (its N / K heads share a descale)."""
    x = rng.standard_normal(shape).astype(np.float32) * magnitude
    b, l, n, h = shape
    values, descale = jax_flashattn.quantize_fp8(x.reshape(b, l, groups, n // groups * h))
    values = values.reshape(shape)
    d = np.repeat(np.asarray(descale), n // groups, axis=1)
    return values, descale, np.asarray(values, np.float32) * d[:, None, :, None]


def rounded_p_error(q, k, v, ref, mask=None, **options):
    """||out - ref|| of attention on the dequantised float32 inputs with P = 256 exp(x - max)
    rounded to e4m3 in the weighted sum and not in the row sums (what the kernels compute, up to
    their float32 arithmetic)."""
    w = np.asarray(reference.attention_weights(jnp.asarray(q), jnp.asarray(k), None, mask,
                                               **options), np.float64)  # [B, N, T, S]
    top = w.max(axis=-1, keepdims=True)
    p = np.where(top > 0, 256.0 * w / np.where(top > 0, top, 1.0), 0.0)
    p8 = np.asarray(jnp.asarray(p, jnp.float32).astype(E4M3), np.float64)
    group = q.shape[2] // k.shape[2]
    v64 = np.repeat(np.asarray(v, np.float64), group, axis=2)  # [B, S, N, H]
    sums = p.sum(axis=-1)
    out = np.einsum("bnts,bsnh->btnh", p8, v64) / np.where(sums > 0, sums, 1.0).transpose(
        0, 2, 1)[..., None]
    return np.linalg.norm(out - ref)


def check(out, lse, q, k, v, out_dtype, mask=None, **options):
    ref, ref_lse = reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None,
                                       mask, return_residual=True, **options)
    ref = np.asarray(ref, np.float64)
    error = np.linalg.norm(np.asarray(out, np.float64) - ref)
    budget = 2 * rounded_p_error(q, k, v, ref, mask, **options)
    budget += float(jnp.finfo(out_dtype).eps) * np.linalg.norm(ref)
    assert out.dtype == out_dtype and np.all(np.isfinite(np.asarray(out, np.float32)))
    assert error <= budget, f"error {error:.3g} over {budget:.3g}"
    # The e4m3 products accumulate with fewer bits than float32 (about 2^-11 of the logits' size
    # here): lse within 2^-9 of the largest, and then within that of the reference's.
    seen = np.isfinite(np.asarray(ref_lse))
    bound = 2.0 ** -9 * max(1.0, float(np.abs(np.asarray(ref_lse)[seen]).max(initial=0)))
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(ref_lse)[seen], rtol=0,
                               atol=bound)


OPTIONS = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, local_window_size=(200, 0)),
    "bottom_right": dict(is_causal=True, diagonal_alignment="bottom_right"),
}


@pytest.fixture(autouse=True)
def _on_hopper():
    if not hopper():
        pytest.skip("FP8 attention's kernels are Hopper's")


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [128, 64, 96, 256, 144, 192])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_fp8_attention_on_the_e4m3_kernels(rng, out_dtype, head_dim, option):
    """T = 300 queries against S = 1000 keys (partial tiles; GQA 8 -> 2), each head dim
    configuration (64 and 96 zero-padded on the 128 one, 144 and 192 on the 256 one, whose
    64-key tiles read V^T in the 64-byte swizzle), bfloat16 and float16 outputs."""
    b, t, s, n, kh = 2, 300, 1000, 8, 2
    q8, dq, q = quantized(rng, (b, t, n, head_dim), kh)
    k8, dk, k = quantized(rng, (b, s, kh, head_dim), kh)
    v8, dv, v = quantized(rng, (b, s, kh, head_dim), kh)
    options = OPTIONS[option]

    def f(q8, k8, v8, dq, dk, dv):
        return jax_flashattn.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                       output_dtype=out_dtype, return_residual=True, **options)
    assert reads_e4m3_in_the_kernel(lambda *xs: f(*xs)[0], q8, k8, v8, dq, dk, dv)
    out, lse = jax.jit(f)(q8, k8, v8, dq, dk, dv)
    check(out, lse, q, k, v, out_dtype, **options)


@pytest.mark.parametrize("h", [128, 256])
@pytest.mark.parametrize("t,s", [(1, 77), (129, 4096), (64, 129)])
def test_lengths_and_short_calls(rng, t, s, h):
    """Per-entry key lengths (the values past each are zeroed in V^T: NaN there must not reach
    the output) and query lengths (the rows past them zero, lse -inf), in calls of a few rows or
    keys."""
    b, n, kh = 3, 4, 4
    q8, dq, q = quantized(rng, (b, t, n, h), kh)
    k8, dk, k = quantized(rng, (b, s, kh, h), kh)
    v8, dv, v = quantized(rng, (b, s, kh, h), kh)
    lens = np.array([s, max(1, s // 3), max(1, s - 5)], np.int32)
    q_lens = np.array([t, max(1, t // 2), t], np.int32)
    past = np.arange(s)[None, :, None, None] >= lens[:, None, None, None]
    v8_nan = jnp.where(past, jnp.asarray(np.nan, E4M3), v8)
    out, lse = jax.jit(lambda *xs: jax_flashattn.attention(
        *xs[:3], descale_q=xs[3], descale_k=xs[4], descale_v=xs[5], key_value_seq_lengths=lens,
        query_seq_lengths=q_lens, return_residual=True))(q8, k8, v8_nan, dq, dk, dv)
    rows = np.arange(t)[None, :, None] < q_lens[:, None, None]  # [B, T, 1]
    mask = (~past[:, :, 0, 0])[:, None, None, :] & rows[:, None, :, :]  # [B, 1, T, S]
    assert not np.asarray(out, np.float32)[~rows[..., 0]].any()
    assert np.all(np.isneginf(np.asarray(lse)[np.broadcast_to(~rows, (b, t, n))]))
    check(out, lse, q, k, v, jnp.bfloat16, mask=jnp.asarray(mask))


def test_descales_of_every_sign(rng):
    """A negative query descale (the scores change sign), a zero key descale (uniform weights)
    and a negative value descale, per (batch entry, kv head)."""
    b, t, s, n, kh, h = 2, 200, 500, 4, 2, 128
    q8, dq, _ = quantized(rng, (b, t, n, h), kh)
    k8, dk, _ = quantized(rng, (b, s, kh, h), kh)
    v8, dv, _ = quantized(rng, (b, s, kh, h), kh)
    dq = np.asarray(dq) * np.array([[1, -1], [-1, 1]], np.float32)
    dk = np.asarray(dk) * np.array([[1, 1], [0, 1]], np.float32)
    dv = np.asarray(dv) * np.array([[-1, 1], [1, 1]], np.float32)
    out, lse = jax.jit(lambda *xs: jax_flashattn.attention(
        *xs[:3], descale_q=xs[3], descale_k=xs[4], descale_v=xs[5], return_residual=True))(
        q8, k8, v8, dq, dk, dv)
    q = fp8.dequantize_fp8(q8.reshape(b, t, kh, -1), dq).reshape(b, t, n, h)
    k, v = fp8.dequantize_fp8(k8, dk), fp8.dequantize_fp8(v8, dv)
    check(out, lse, np.asarray(q), np.asarray(k), np.asarray(v), jnp.bfloat16)


def test_under_vmap_and_unbatched(rng):
    """A vmapped call (one kernel call over the leading dim) and an unbatched one."""
    n, kh, h = 4, 2, 128
    q8, dq, q = quantized(rng, (3, 150, n, h), kh)
    k8, dk, k = quantized(rng, (3, 260, kh, h), kh)
    v8, dv, v = quantized(rng, (3, 260, kh, h), kh)
    out = jax.jit(jax.vmap(lambda *xs: jax_flashattn.attention(
        xs[0][None], xs[1][None], xs[2][None], descale_q=xs[3][None], descale_k=xs[4][None],
        descale_v=xs[5][None])[0]))(q8, k8, v8, dq, dk, dv)
    one = jax_flashattn.attention(q8[1], k8[1], v8[1], descale_q=dq[1], descale_k=dk[1],
                                  descale_v=dv[1])
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(one, np.float32))
    _, lse = jax_flashattn.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                     return_residual=True)
    check(out, lse, q, k, v, jnp.bfloat16)


def test_calls_off_the_e4m3_kernels_are_dequantised(rng):
    """A head dim the kernels do not take (72, 264) and a soft-cap: dequantised first, then the
    2-byte kernels, as before."""
    for h, options in ((72, {}), (264, {}), (128, dict(logits_soft_cap=20.0))):
        q8, dq, _ = quantized(rng, (1, 64, 2, h), 2)
        k8, dk, _ = quantized(rng, (1, 100, 2, h), 2)
        v8, dv, _ = quantized(rng, (1, 100, 2, h), 2)
        assert not reads_e4m3_in_the_kernel(lambda *xs: jax_flashattn.attention(
            *xs[:3], descale_q=xs[3], descale_k=xs[4], descale_v=xs[5], **options),
            q8, k8, v8, dq, dk, dv)


def test_gradient_raises(rng):
    q8, dq, _ = quantized(rng, (1, 64, 2, 128), 2)
    k8, dk, _ = quantized(rng, (1, 100, 2, 128), 2)
    v8, dv, _ = quantized(rng, (1, 100, 2, 128), 2)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda dq: jnp.sum(jax_flashattn.attention(
            q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv).astype(jnp.float32)))(dq)
