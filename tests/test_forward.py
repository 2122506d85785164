"""Forward values of `attention` against the float32 reference (and jax.nn as a drop-in check)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import assert_attention_close, fill_past_lengths, random_qkv

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


# The reference stays eager where checks share shapes (its small programs shared: jitting every
# check made this file 66 -> 72 s on 2 CPU cores); the few checks whose shapes are their own
# jit it, one compilation where eagerly each of its operations took one.
def check(query, key, value, *args, jit_reference=False, **kwargs):
    """Runs `attention`, asserts the result is finite and within the error-ratio rule
    (`jit_reference`: as assert_attention_close's, for shapes no other check shares)."""
    out = jax_flashattn.attention(query, key, value, *args, **kwargs)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert np.isfinite(np.asarray(out, np.float32)).all(), "non-finite values in output"
    assert_attention_close(out, query, key, value, *args, jit_reference=jit_reference, **kwargs)
    return out


def lse_close(lse, want, dtype):
    """lse must match the float32 reference, including -inf exactly where it is -inf."""
    lse = np.asarray(lse)
    want = np.asarray(want)
    assert not np.isnan(lse).any(), "NaN in lse"
    assert not np.isposinf(lse).any(), "+inf in lse"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want))
    tol = 1e-5 if dtype == jnp.float32 else 1e-4
    finite = np.isfinite(want)
    np.testing.assert_allclose(lse[finite], want[finite], rtol=tol, atol=tol, equal_nan=False)


# (B, T, S, N, K, H): T = 1, S = 1, odd sizes, T != S both ways, GQA, MQA, head dims 1..200.
SHAPES = [
    (2, 16, 16, 2, 2, 32),
    (1, 1, 1, 1, 1, 8),
    (2, 1, 37, 4, 2, 16),
    (2, 37, 1, 2, 1, 16),
    (1, 37, 61, 3, 3, 7),
    (2, 61, 37, 4, 1, 64),
    (1, 129, 65, 2, 2, 1),
    (1, 33, 17, 2, 1, 200),
    (3, 24, 40, 6, 2, 40),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}S{}N{}K{}H{}".format(*s))
def test_shapes(rng, shape, is_causal, dtype):
    b, t, s, n, k, h = shape
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, dtype)
    check(q, kk, v, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [0, 3, (0, 5), (7, 0), (2, 9), (100, 100), (0, 0), [4, 1]],
                         ids=str)
def test_local_window(rng, window, is_causal):
    q, k, v = random_qkv(rng, 2, 37, 53, 4, 2, 16, jnp.float32)
    out = check(q, k, v, is_causal=is_causal, local_window_size=window)
    # A window covering everything is the same as no window.
    if window == (100, 100):
        np.testing.assert_allclose(out, jax_flashattn.attention(q, k, v, is_causal=is_causal),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t,s", [(45, 29), (29, 45)])
def test_causal_window_low_precision(rng, dtype, t, s):
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 32, dtype)
    check(q, k, v, is_causal=True, local_window_size=(6, 3))
    check(q, k, v, local_window_size=(2, 11))


def test_window_matches_explicit_mask(rng):
    """(l, r) lets query i see exactly keys [i - l, i + r]: compare with an explicit mask."""
    t, s, (left, right) = 23, 31, (4, 2)
    q, k, v = random_qkv(rng, 1, t, s, 2, 2, 8, jnp.float32)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = jnp.asarray((j >= i - left) & (j <= i + right))
    got = jax_flashattn.attention(q, k, v, local_window_size=(left, right))
    want = jax_flashattn.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    causal = jax_flashattn.attention(q, k, v, is_causal=True)
    want_causal = jax_flashattn.attention(q, k, v, mask=jnp.asarray(j <= i))
    np.testing.assert_allclose(causal, want_causal, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_seq_lengths(rng, dtype):
    b, t, s = 4, 21, 27
    q, k, v = random_qkv(rng, b, t, s, 4, 2, 16, dtype)
    q_lens = jnp.asarray([t, 0, 5, t + 10], jnp.int32)
    kv_lens = jnp.asarray([s, 3, 0, s + 7], jnp.int32)
    out = check(q, k, v, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
    out = np.asarray(out, np.float32)
    assert (out[1] == 0).all() and (out[2] == 0).all()  # q_len 0, and kv_len 0
    assert (out[0] != 0).any() and (out[3] != 0).any()
    check(q, k, v, query_seq_lengths=q_lens)
    check(q, k, v, key_value_seq_lengths=kv_lens, is_causal=True)


def test_seq_lengths_padding_rows_are_zero(rng):
    q, k, v = random_qkv(rng, 3, 13, 19, 2, 1, 8, jnp.float32)
    q_lens = np.array([13, 6, 1], np.int16)  # any integer dtype is accepted
    out = np.asarray(check(q, k, v, query_seq_lengths=q_lens, jit_reference=True))
    for bi, length in enumerate(q_lens):
        assert (out[bi, length:] == 0).all()
        assert (out[bi, :length] != 0).all()


def test_seq_lengths_beyond_size_equal_none(rng):
    q, k, v = random_qkv(rng, 2, 11, 17, 2, 2, 8, jnp.float32)
    got = jax_flashattn.attention(q, k, v, query_seq_lengths=jnp.asarray([11, 50]),
                                  key_value_seq_lengths=jnp.asarray([17, 1000]))
    np.testing.assert_allclose(got, jax_flashattn.attention(q, k, v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_cpu_kernel_never_reads_keys_past_the_length(rng, fill):
    """The CPU kernel reads K/V rows [0, kv_len) only: NaN or Inf past a length changes nothing
    (tests/test_nonfinite.py and tests/test_gpu_nonfinite.py: every family, forward and
    backward)."""
    if jax.default_backend() != "cpu":
        pytest.skip("implementation='cpu' needs the CPU backend")
    q, k, v = random_qkv(rng, 3, 20, 40, 4, 2, 16, jnp.bfloat16)
    kv_lens = np.array([13, 40, 1], np.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, fill)
    for is_causal in (False, True):
        kw = dict(key_value_seq_lengths=jnp.asarray(kv_lens), is_causal=is_causal,
                  implementation="cpu")
        np.testing.assert_array_equal(jax_flashattn.attention(q, *poisoned, **kw),
                                      jax_flashattn.attention(q, k, v, **kw))


def test_negative_seq_lengths_mean_empty(rng):
    """Lengths are runtime values: a negative one hides everything, like 0 (no crash, no
    out-of-bounds read)."""
    q, k, v = random_qkv(rng, 2, 9, 12, 2, 1, 8, jnp.float32)
    out = check(q, k, v, query_seq_lengths=jnp.asarray([-3, 9]),
                key_value_seq_lengths=jnp.asarray([12, -1]), jit_reference=True)
    assert (np.asarray(out) == 0).all()
    out = np.asarray(check(q, k, v, key_value_seq_lengths=jnp.asarray([-(2 ** 31), 5]),
                           jit_reference=True))
    assert (out[0] == 0).all() and (out[1] != 0).any()


B, N, T, S = 2, 4, 19, 23
BROADCAST_SHAPES = [
    (B, N, T, S), (1, 1, T, S), (B, 1, 1, S), (1, N, 1, 1), (B, N, T, 1), (B, 1, T, 1),
    (N, T, S), (T, S), (1, S), (S,), (1, 1, 1, 1),
]


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=str)
def test_bias_broadcast(rng, shape):
    q, k, v = random_qkv(rng, B, T, S, N, 2, 16, jnp.float32)
    bias = jnp.asarray(2 * rng.standard_normal(shape, dtype=np.float32))
    out = check(q, k, v, bias, is_causal=True)
    # Same as the explicitly broadcast bias.
    full = jnp.broadcast_to(bias, (B, N, T, S))
    np.testing.assert_allclose(out, jax_flashattn.attention(q, k, v, full, is_causal=True),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias_dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_dtypes(rng, dtype, bias_dtype):
    q, k, v = random_qkv(rng, B, T, S, N, 2, 16, dtype)
    bias = jnp.asarray(2 * rng.standard_normal((B, 1, T, S), dtype=np.float32), bias_dtype)
    check(q, k, v, bias)


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=str)
def test_mask_broadcast(rng, shape):
    q, k, v = random_qkv(rng, B, T, S, N, 1, 16, jnp.float32)
    mask = jnp.asarray(rng.random(shape) < 0.7)
    out = check(q, k, v, mask=mask)
    full = jnp.broadcast_to(mask, (B, N, T, S))
    np.testing.assert_allclose(out, jax_flashattn.attention(q, k, v, mask=full),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("t,s", [(29, 29), (37, 22), (22, 37)])
def test_everything_together(rng, dtype, t, s):
    """bias + mask + causal + window + seq lengths + GQA in one call."""
    q, k, v = random_qkv(rng, 3, t, s, 6, 2, 24, dtype)
    bias = jnp.asarray(rng.standard_normal((3, 6, t, s), dtype=np.float32), dtype)
    mask = jnp.asarray(rng.random((1, 6, t, s)) < 0.8)
    q_lens = jnp.asarray([t, t // 2, 0])
    kv_lens = jnp.asarray([s, 1, s // 3])
    check(q, k, v, bias, mask, is_causal=True)
    check(q, k, v, bias, mask, is_causal=True, local_window_size=(9, 2),
          query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)


@pytest.mark.parametrize("scale", [0.3, 2.0, 1, np.float32(0.05), -0.5])
def test_custom_scale(rng, scale):
    q, k, v = random_qkv(rng, 2, 17, 25, 2, 1, 16, jnp.float32)
    check(q, k, v, scale=scale, is_causal=True)


def test_scale_zero_averages_visible_values(rng):
    """scale=0 makes every visible key equally likely: the output is the mean of visible V."""
    q, k, v = random_qkv(rng, 1, 9, 9, 2, 2, 8, jnp.float32)
    out = np.asarray(jax_flashattn.attention(q, k, v, scale=0.0, is_causal=True))
    want = np.cumsum(np.asarray(v), axis=1) / np.arange(1, 10)[None, :, None, None]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = random_qkv(rng, 1, 8, 8, 2, 2, 32, jnp.float32)
    np.testing.assert_allclose(jax_flashattn.attention(q, k, v),
                               jax_flashattn.attention(q, k, v, scale=32 ** -0.5),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_large_magnitude(rng, dtype, is_causal):
    """x10 inputs make the softmax very peaked: tests the online max rescaling."""
    q, k, v = random_qkv(rng, 2, 67, 83, 2, 1, 32, dtype, magnitude=10.0)
    check(q, k, v, is_causal=is_causal)


def test_large_bias(rng):
    """Logits spanning +-1e4: no overflow, and the result still matches the reference."""
    q, k, v = random_qkv(rng, 1, 33, 47, 2, 2, 16, jnp.float32)
    bias = jnp.asarray(1e4 * rng.standard_normal((1, 2, 33, 47), dtype=np.float32))
    check(q, k, v, bias, jit_reference=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unbatched(rng, dtype):
    t, s, n, k, h = 23, 31, 4, 2, 16
    q, kk, v = random_qkv(rng, None, t, s, n, k, h, dtype)
    bias = jnp.asarray(rng.standard_normal((n, t, s), dtype=np.float32))
    mask = jnp.asarray(rng.random((t, s)) < 0.8)
    out = check(q, kk, v, bias, mask, is_causal=True)
    assert out.shape == (t, n, h)
    batched = jax_flashattn.attention(q[None], kk[None], v[None], bias, mask, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(batched[0], np.float32))
    out2, lse = jax_flashattn.attention(q, kk, v, is_causal=True, return_residual=True)
    assert out2.shape == (t, n, h) and lse.shape == (t, n) and lse.dtype == jnp.float32
    _, want = reference.attention(q, kk, v, is_causal=True, return_residual=True)
    lse_close(lse, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(2, 29, 41, 4, 2, 16), (1, 1, 1, 2, 1, 8),
                                   (2, 45, 13, 3, 1, 7)],
                         ids=lambda s: "B{}T{}S{}N{}K{}H{}".format(*s))
def test_return_residual(rng, dtype, shape):
    b, t, s, n, k, h = shape
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, dtype)
    bias = jnp.asarray(rng.standard_normal((1, n, t, s), dtype=np.float32))
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([s] + [max(s - 3, 1)] * (b - 1)))
    out, lse = jax_flashattn.attention(q, kk, v, bias, return_residual=True, **kw)
    assert lse.shape == (b, t, n) and lse.dtype == jnp.float32
    want = assert_attention_close(out, q, kk, v, bias, **kw)
    assert np.isfinite(np.asarray(want)).all()
    lse_close(lse, want, dtype)
    # out without the residual is the same computation.
    np.testing.assert_array_equal(
        np.asarray(out, np.float32),
        np.asarray(jax_flashattn.attention(q, kk, v, bias, **kw), np.float32))


def test_lse_definition(rng):
    """lse is the natural log of sum_j exp(scale * q.k_j + bias) over visible keys."""
    q, k, v = random_qkv(rng, 1, 5, 7, 1, 1, 4, jnp.float32)
    _, lse = jax_flashattn.attention(q, k, v, scale=0.7, is_causal=True, return_residual=True)
    logits = 0.7 * np.einsum("th,sh->ts", np.asarray(q[0, :, 0], np.float64),
                             np.asarray(k[0, :, 0], np.float64))
    logits[np.triu_indices(5, 1, 7)] = -np.inf
    want = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(np.asarray(lse)[0, :, 0], want, rtol=1e-5, atol=1e-5)


EMPTY_ROW_CASES = {
    "q_len_0": dict(query_seq_lengths=np.array([0, 7])),
    "kv_len_0": dict(key_value_seq_lengths=np.array([13, 0])),
    "window_past_end": dict(local_window_size=(0, 0)),   # rows i >= S see nothing
    "causal_window_past_end": dict(is_causal=True, local_window_size=(2, 0)),
    "mask_rows": "mask",
    "neg_inf_bias_rows": "bias",
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(EMPTY_ROW_CASES), ids=str)
def test_rows_without_keys(rng, case, dtype):
    """A row that sees no key returns exactly 0, with lse -inf, and never NaN."""
    b, t, s, n = 2, 21, 13, 2
    q, k, v = random_qkv(rng, b, t, s, n, 1, 8, dtype)
    args, kw = (), EMPTY_ROW_CASES[case]
    if case == "mask_rows":
        mask = rng.random((b, n, t, s)) < 0.7
        mask[:, :, ::3] = False
        args = (None, jnp.asarray(mask))
        kw = {}
    elif case == "neg_inf_bias_rows":
        # The usual additive-mask idiom: -inf where masked, including whole rows.
        keep = rng.random((b, 1, t, s)) < 0.7
        keep[:, :, 1::4] = False
        args = (jnp.asarray(np.where(keep, 0.0, -np.inf), np.float32),)
        kw = {}
    out, lse = jax_flashattn.attention(q, k, v, *args, return_residual=True, **kw)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    _, want_lse = reference.attention(q32, k32, v32, *args, return_residual=True, **kw)
    empty = np.isneginf(np.asarray(want_lse))  # [B, T, N]
    assert empty.any() and not empty.all(), "the case must have both empty and non-empty rows"
    out32 = np.asarray(out, np.float32)
    assert np.isfinite(out32).all(), "non-finite values in output"
    assert (out32[empty] == 0).all(), "rows that see no key must be exactly 0"
    assert not (out32[~empty] == 0).all()
    lse_close(lse, want_lse, dtype)
    assert_attention_close(out, q, k, v, *args, **kw)


# A few configurations without empty rows, where jax.nn and jax_flashattn must agree.
XLA_CASES = {
    "plain": dict(),
    "causal_T>S": dict(is_causal=True),
    "window": dict(local_window_size=(12, 2)),
    "bias_mask": "bias_mask",
    "seq_lengths": dict(query_seq_lengths=np.array([30, 11], np.int32),
                        key_value_seq_lengths=np.array([20, 1], np.int32)),
}


@pytest.mark.parametrize("case", list(XLA_CASES), ids=str)
def test_matches_jax_nn_xla(rng, case):
    b, t, s, n, k, h = 2, 30, 20, 6, 2, 16
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, jnp.float32)
    args, kw = (), XLA_CASES[case]
    if case == "bias_mask":
        mask = rng.random((b, 1, t, s)) < 0.7
        mask[..., 0] = True  # no empty rows: jax.nn would average V there
        args = (jnp.asarray(rng.standard_normal((1, n, t, s), dtype=np.float32)),
                jnp.asarray(mask))
        kw = {}
    got = jax_flashattn.attention(q, kk, v, *args, **kw)
    # Full float32 products: on a GPU, XLA's float32 dots default to TF32 (~1e-3).
    with jax.default_matmul_precision("highest"):
        want = jax.nn.dot_product_attention(q, kk, v, *args, implementation="xla", **kw)
        # implementation="xla" delegates to jax.nn.
        delegated = jax_flashattn.attention(q, kk, v, *args, implementation="xla", **kw)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(delegated, want)


def test_jax_nn_differs_only_on_empty_rows(rng):
    """The one deliberate difference: jax.nn averages V on a fully masked row, we return 0."""
    q, k, v = random_qkv(rng, 1, 6, 5, 2, 2, 8, jnp.float32)
    mask = np.ones((1, 1, 6, 5), bool)
    mask[..., 2, :] = False
    got = np.asarray(jax_flashattn.attention(q, k, v, mask=jnp.asarray(mask)))
    want = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)))
    assert (got[:, 2] == 0).all()
    keep = np.arange(6) != 2
    np.testing.assert_allclose(got[:, keep], want[:, keep], rtol=2e-5, atol=2e-5)


def test_implementation_cpu_is_default_on_cpu(rng):
    if jax.default_backend() != "cpu":
        pytest.skip("needs the CPU backend")
    q, k, v = random_qkv(rng, 1, 9, 12, 2, 1, 8, jnp.float32)
    np.testing.assert_array_equal(jax_flashattn.attention(q, k, v, implementation="cpu"),
                                  jax_flashattn.attention(q, k, v))
    check(q, k, v, implementation="cpu", is_causal=True, jit_reference=True)


def test_numpy_inputs(rng):
    q, k, v = (np.asarray(x) for x in random_qkv(rng, 1, 7, 9, 2, 2, 8, jnp.float32))
    out = jax_flashattn.attention(q, k, v)
    assert isinstance(out, jax.Array)
    assert_attention_close(out, q, k, v)


def test_forward_kernel_query_on_cpu():
    q = jax.ShapeDtypeStruct((2, 10, 4, 64), jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, q, device=jax.devices("cpu")[0]) == "cpu"


def test_plan_of_a_call():
    """One planning call answers the workspace (no device needed) and, on a device, the
    kernel families; the call shape is set by field name, and a misspelt field is an error."""
    from jax_flashattn import _ffi
    call = _ffi.call_shape((8, 1, 32, 128), (8, 65536, 8, 128), jnp.bfloat16,
                           has_kv_seqlens=True)
    # B * K work units, the ragged split count at 256 SMs (4 * 256 / 64 = 16 splits), T * N / K
    # rows, each H partial values and an lse.
    floats = 8 * 8 * 16 * (1 * 32 // 8) * (128 + 1)
    # The ALiBi slopes' gradient: 4 partial sums per 16 keys.
    slots = 65536 // 16 * 4
    assert _ffi.plan(call) == _ffi.CallPlan(floats, 0, slots, 1, 0, "", "", 0, "")
    assert _ffi.plan(call, jax.devices("cpu")[0]) == _ffi.CallPlan(floats, 0, slots, 1, 0,
                                                                   "cpu", "cpu", 0, "")
    # The decode kernels have instantiations for the elementwise terms (a bias, mask, ALiBi or
    # segment ids) and for the soft-cap, but not for both together, nor for segment ids beside
    # ALiBi: no workspace then.
    call.has_bias = call.has_mask = True
    assert _ffi.plan(call).decode_workspace_floats == floats
    call.logits_soft_cap = 5.0
    assert _ffi.plan(call).decode_workspace_floats == 0
    call.has_bias = call.has_mask = False
    assert _ffi.plan(call).decode_workspace_floats == floats
    call.has_segment_ids = True
    assert _ffi.plan(call).decode_workspace_floats == 0
    call.logits_soft_cap = 0.0
    assert _ffi.plan(call).decode_workspace_floats == floats
    call.has_alibi = True
    assert _ffi.plan(call).decode_workspace_floats == 0
    call.has_alibi = False
    # The tile counter, then with segment ids one tile order entry per (batch entry, query
    # head, 64 queries); the backward's block order one per (batch entry, kv head, 64 keys).
    assert _ffi.plan(call).forward_workspace_ints == 1 + 8 * 32 * 1
    assert _ffi.plan(call).backward_workspace_ints == 8 * 8 * 1024
    call.has_segment_ids = False
    assert _ffi.plan(call).forward_workspace_ints == 1
    assert _ffi.plan(call).backward_workspace_ints == 0
    # A deterministic backward: one dQ semaphore per (batch entry, query head, 64 queries).
    wide = _ffi.call_shape((3, 130, 4, 64), (3, 200, 2, 64), jnp.bfloat16, deterministic=True)
    assert _ffi.plan(wide).dq_semaphores == 3 * 4 * 3
    assert _ffi.plan(wide).backward_workspace_ints == 3 * 4 * 3
    wide.has_segment_ids = True
    assert _ffi.plan(wide).backward_workspace_ints == 3 * 4 * 3 + 3 * 2 * 4
    wide.has_segment_ids = False
    wide.deterministic = False
    assert _ffi.plan(wide).dq_semaphores == 0
    with pytest.raises(AttributeError):
        call.seqlen = 4


def test_kernel_queries_flag_a_bias_of_one_key():
    """forward_kernel / backward_kernel tell the planner whether a bias or mask is one key
    broadcast over S > 1 keys (the Hopper forward reads keys at unit stride and leaves such
    calls to the mma.sync family)."""
    from jax_flashattn import _ffi
    k = jax.ShapeDtypeStruct((2, 50, 4, 64), jnp.bfloat16)
    one = jax.ShapeDtypeStruct((2, 1, 1), jnp.float32)
    flags = _ffi._bias_and_mask(jnp.zeros((4, 10, 1)), jnp.zeros((50,), bool), k)
    assert flags == dict(has_bias=True, has_mask=True, bias_broadcasts_keys=True,
                         mask_broadcasts_keys=False)
    assert _ffi._bias_and_mask(None, one, k)["mask_broadcasts_keys"]
    assert _ffi._bias_and_mask(jnp.float32(0.5), None, k)["bias_broadcasts_keys"]  # 0-d
    assert _ffi._bias_and_mask(0.5, None, k)["bias_broadcasts_keys"]
    single_key = jax.ShapeDtypeStruct((2, 1, 4, 64), jnp.bfloat16)
    assert not _ffi._bias_and_mask(one, None, single_key)["bias_broadcasts_keys"]
    shape = _ffi.call_shape((2, 10, 4, 64), k.shape, jnp.bfloat16, has_bias=True,
                            bias_broadcasts_keys=True)
    assert shape.bias_broadcasts_keys and not shape.mask_broadcasts_keys


def _traced_switches(fn, *args):
    """{attribute: values} of the kernel switches in fn's lowered program, one value per
    custom call (the forward, and the backward when fn differentiates)."""
    text = jax.jit(fn).lower(*args).as_text()
    found = {}
    for name, value in re.findall(r"(disable_sm90|sm80_cp_async) = (\d+)", text):
        found.setdefault(name, []).append(int(value))
    return found


@pytest.mark.parametrize("setting", [None, "", "0", "1", "yes"])
@pytest.mark.parametrize("variable, attribute", [
    ("JAX_FLASHATTN_DISABLE_SM90", "disable_sm90"),
    ("JAX_FLASHATTN_SM80_CP_ASYNC", "sm80_cp_async")])
def test_kernel_switches_are_traced_into_every_call(monkeypatch, variable, attribute, setting):
    """The environment's kernel switches travel as attributes of the forward and backward custom
    calls, read at trace time (so that a call XLA replays from a CUDA graph keeps the kernels it
    was traced with): on for any value but unset, "" and "0"; the other switch stays off."""
    for name in ("JAX_FLASHATTN_DISABLE_SM90", "JAX_FLASHATTN_SM80_CP_ASYNC"):
        monkeypatch.delenv(name, raising=False)
    if setting is not None:
        monkeypatch.setenv(variable, setting)
    q = jnp.zeros((1, 5, 2, 8), jnp.float32)
    on = int(setting not in (None, "", "0"))
    other = "sm80_cp_async" if attribute == "disable_sm90" else "disable_sm90"
    forward = _traced_switches(lambda q: jax_flashattn.attention(q, q, q), q)
    assert forward == {attribute: [on], other: [0]}
    both = _traced_switches(jax.grad(lambda q: jax_flashattn.attention(q, q, q).sum()), q)
    assert both == {attribute: [on, on], other: [0, 0]}


# The split-KV decode kernel's workspace: sized at trace time by the C++ rule at the most SMs
# it sizes for (_ffi), while the C++ plan (ffi/decode_plan.h) decides how much of it
# a call on a given device uses. These run on CPU.
DECODE_SHAPES = [
    # (lead, T, S, N, K, H)
    ((8,), 1, 65536, 32, 8, 128),
    ((8,), 16, 65536, 32, 8, 128),
    ((1,), 1, 131072, 8, 1, 128),
    ((2,), 3, 4097, 8, 2, 72),
    ((3,), 5, 256, 4, 4, 256),
    ((2, 3), 2, 3000, 8, 2, 64),
    ((700,), 1, 1000, 64, 8, 128),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_workspace_holds_every_split_the_cpp_rule_runs(shape):
    """The size is the C++ rule at the most SMs it is sized for, whole splits, and holds every
    split the C++ rule runs on a device with fewer SMs; under vmap (the same size per vmapped
    element) it still holds what the C++ rule asks for the combined batch."""
    from jax_flashattn import _ffi
    lead, t, s, n, kv, h = shape
    call = _ffi.call_shape((*lead, t, n, h), (*lead, s, kv, h), jnp.bfloat16, scale=0.1)
    size = _ffi.plan(call).decode_workspace_floats
    batch = int(np.prod(lead))

    def cpp(batch, sms):
        call.batch = batch
        return _ffi._ext.decode_workspace_floats(call, sms)
    assert size > 0 and size == cpp(batch, _ffi._ext.DECODE_MAX_MULTIPROCESSORS)
    assert size % (batch * kv * t * (n // kv) * (h + 1)) == 0  # whole splits
    for sms in (1, 46, 108, 132, 170, 256):
        assert cpp(batch, sms) <= size
        assert cpp(4 * batch, sms) <= 4 * size  # vmap over 4


@pytest.mark.parametrize("change", [
    dict(dtype=jnp.float32), dict(has_segment_ids=True, soft_cap=5.0),
    dict(has_segment_ids=True, has_alibi=True), dict(has_bias=True, soft_cap=5.0),
    dict(has_mask=True, soft_cap=5.0), dict(scale=0.0), dict(t=17), dict(s=255), dict(h=12),
    dict(h=264)], ids=str)
def test_decode_workspace_is_empty_when_the_kernel_cannot_run(change):
    """Shapes and options the decode kernel never takes get a zero-size workspace, in Python and
    in the C++ rule alike."""
    from jax_flashattn import _ffi
    args = dict(dtype=jnp.float16, has_bias=False, has_mask=False, has_segment_ids=False,
                has_alibi=False, soft_cap=0.0, scale=0.1, t=16, s=4096, h=128)
    args.update(change)
    t, s, h, n, kv = args["t"], args["s"], args["h"], 8, 2
    call = _ffi.call_shape((2, t, n, h), (2, s, kv, h), args["dtype"], scale=args["scale"],
                           has_bias=args["has_bias"], has_mask=args["has_mask"],
                           has_segment_ids=args["has_segment_ids"], has_alibi=args["has_alibi"],
                           soft_cap=args["soft_cap"])
    size = _ffi.plan(call).decode_workspace_floats
    assert size == 0 and _ffi._ext.decode_workspace_floats(call, 132) == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_shaped_call_with_workspace(rng, dtype):
    """A call whose shape gets a decode workspace runs on the CPU kernels (which ignore it), jit
    and vmap included."""
    q, k, v = random_qkv(rng, (2, 3), 2, 300, 8, 2, 64, dtype)
    from jax_flashattn import _ffi
    call = _ffi.call_shape(q.shape[1:], k.shape[1:], dtype, scale=0.125, has_kv_seqlens=True)
    assert _ffi.plan(call).decode_workspace_floats > 0
    out = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(
        q, k, v, key_value_seq_lengths=jnp.array([300, 0, 123], jnp.int32))))(q, k, v)
    for i in range(2):
        assert_attention_close(out[i], q[i], k[i], v[i],
                               key_value_seq_lengths=jnp.array([300, 0, 123], jnp.int32),
                               jit_reference=True)
