"""NaN and Inf on every CUDA kernel family (run with `pytest -m gpu`): a NaN or +inf visible
logit makes exactly its rows NaN (output, lse, gradients), and K/V rows past a batch entry's
length, whatever they hold, change nothing. Each family is forced where the dispatcher would
pick another (tests/test_nonfinite.py has the same semantics on the default kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, _ops
from helpers import (assert_attention_close, fill_past_lengths, gradient_nan_rows, poison,
                     random_qkv)

pytestmark = pytest.mark.gpu

DISABLE_SM90 = {"JAX_FLASHATTN_DISABLE_SM90": "1"}
CP_ASYNC = {"JAX_FLASHATTN_DISABLE_SM90": "1", "JAX_FLASHATTN_SM80_CP_ASYNC": "1"}

# family -> (environment, the name forward_kernel reports, dtype, (B, T, S, N, K, H), bias).
# Three batch entries, so that lengths can cut a key tile, land on a tile boundary and be whole.
FORWARD = {
    "sm90": ({}, "sm90", jnp.bfloat16, (3, 130, 700, 4, 2, 128), False),
    "sm90_hd64": ({}, "sm90", jnp.bfloat16, (3, 200, 333, 4, 1, 64), False),
    "sm90_hd256": ({}, "sm90", jnp.float16, (3, 130, 300, 2, 2, 256), False),
    "sm80_tma": (DISABLE_SM90, "sm80", jnp.bfloat16, (3, 130, 700, 4, 2, 128), False),
    "sm80_cp_async": (CP_ASYNC, "sm80", jnp.float16, (3, 130, 700, 4, 2, 64), False),
    "sm80_bias": ({}, "sm80", jnp.bfloat16, (3, 130, 300, 4, 2, 96), True),
    "decode_sm90": ({}, "decode_sm90", jnp.bfloat16, (3, 8, 3001, 8, 2, 128), False),
    "decode": (DISABLE_SM90, "decode", jnp.bfloat16, (3, 4, 3001, 8, 2, 64), False),
    "simt": ({}, "simt", jnp.float32, (3, 37, 300, 4, 2, 64), False),
}

# family -> (environment, the name backward_kernel reports, dtype, deterministic, bias, H).
BACKWARD = {
    "sm90": ({}, "sm90", jnp.bfloat16, False, False, 64),
    "sm90_hd256": ({}, "sm90", jnp.float16, False, False, 256),
    "sm90_deterministic": ({}, "sm90", jnp.float16, True, False, 64),
    "sm90_deterministic_hd256": ({}, "sm90", jnp.bfloat16, True, False, 256),
    "sm80": (DISABLE_SM90, "sm80", jnp.bfloat16, False, False, 64),
    "sm80_deterministic": (DISABLE_SM90, "sm80", jnp.float16, True, False, 64),
    "sm80_bias": ({}, "sm80", jnp.bfloat16, False, True, 64),
    "simt": ({}, "simt", jnp.float32, False, False, 64),
}


def setup(monkeypatch, env, rng, dtype, shape, with_bias, family, expected, deterministic=None):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    b, t, s, n, kv, h = shape
    q, k, v = random_qkv(rng, b, t, s, n, kv, h, dtype)
    bias = jnp.asarray(rng.standard_normal((b, 1, t, s)), jnp.float32) if with_bias else None
    if deterministic is None:
        got = jax_flashattn.forward_kernel(q, k, bias)
    else:
        got = jax_flashattn.backward_kernel(q, k, bias, deterministic=deterministic)
    if got != expected:
        pytest.skip(f"{family}: this GPU runs the call on {got!r}")
    return q, k, v, bias


def forward(q, k, v, bias, **kwargs):
    poison(jax.ShapeDtypeStruct(q.shape, q.dtype))
    return jax.jit(lambda q, k, v, *b: jax_flashattn.attention(
        q, k, v, *b, implementation="cuda", return_residual=True, **kwargs))(
            q, k, v, *(() if bias is None else (bias,)))


def nan_rows(x):
    return np.isnan(np.asarray(x, np.float32)).any(axis=-1)


def set_at(x, index, value):
    return x.at[index].set(jnp.asarray(value, x.dtype))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family", sorted(FORWARD))
def test_forward_non_finite_logits(rng, monkeypatch, family, is_causal):
    """NaN in one key row and one query row, +inf in another key row: exactly the rows that see
    them are NaN (lse too), the rest as the reference."""
    env, expected, dtype, shape, with_bias = FORWARD[family]
    q, k, v, bias = setup(monkeypatch, env, rng, dtype, shape, with_bias, family, expected)
    t, s = shape[1], shape[2]
    k = set_at(set_at(k, (0, s // 2, 0, 3), np.nan), (2, s - 1, 1, 0), np.inf)
    q = set_at(q, (1, t - 1, 1, 5), np.nan)
    args = () if bias is None else (bias,)
    out, lse = forward(q, k, v, bias, is_causal=is_causal)
    assert_attention_close(out, q, k, v, *args, nan_rows=True, is_causal=is_causal)
    rows = nan_rows(out)
    assert rows.any() and not rows.all()
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), rows)


def test_forward_all_logits_nan(rng):
    """A NaN in every logit of a row (a NaN query element): the maxima alone would drop them all
    and leave the row looking empty; it is NaN."""
    q, k, v = random_qkv(rng, 1, 40, 500, 4, 4, 128, jnp.bfloat16)
    q = set_at(q, (0, 17, 2, 0), np.nan)
    for family_env in ({}, DISABLE_SM90, CP_ASYNC):
        with pytest.MonkeyPatch.context() as mp:
            for name, value in family_env.items():
                mp.setenv(name, value)
            out, lse = forward(q, k, v, None)
            rows = nan_rows(out)
            assert rows[0, 17, 2] and rows.sum() == 1, family_env
            assert np.isnan(np.asarray(lse)[0, 17, 2])


@pytest.mark.parametrize("fill", [np.nan, np.inf])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(90, 40))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("family", sorted(FORWARD))
def test_forward_never_reads_keys_past_the_length(rng, monkeypatch, family, kwargs, fill):
    """Lengths inside a key tile, on a tile boundary and whole: NaN or Inf past them changes no
    bit of the output or lse."""
    env, expected, dtype, shape, with_bias = FORWARD[family]
    q, k, v, bias = setup(monkeypatch, env, rng, dtype, shape, with_bias, family, expected)
    s = shape[2]
    kv_lens = jnp.asarray([s // 3 + 5, 128 if s > 256 else s // 2, s], jnp.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, fill)
    kw = dict(key_value_seq_lengths=kv_lens, **kwargs)
    got, want = forward(q, *poisoned, bias, **kw), forward(q, k, v, bias, **kw)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    for g, w in zip(got, want):  # out, lse
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("t,s", [(128, 4096), (2048, 2048)])
def test_hopper_kernel_lengths_from_the_report(rng, t, s):
    """The shapes where the Hopper kernel once carried NaN past the length into the output."""
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 128, jnp.bfloat16)
    if jax_flashattn.forward_kernel(q, k) != "sm90":
        pytest.skip("the Hopper kernel does not run this call here")
    kv_lens = jnp.asarray([s // 3 + 5, s // 2 + 1], jnp.int32)
    out, _ = forward(q, *fill_past_lengths(k, v, kv_lens, np.nan), None,
                     key_value_seq_lengths=kv_lens)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_attention_close(out, q, k, v, key_value_seq_lengths=kv_lens)


def grads(q, k, v, bias, d_out, deterministic, **kwargs):
    def f(q, k, v, *b):
        return jax_flashattn.attention(q, k, v, *b, implementation="cuda",
                                       deterministic_backward=deterministic, **kwargs)
    operands = (q, k, v) + (() if bias is None else (bias,))
    return jax.jit(lambda *xs: jax.vjp(f, *xs)[1](d_out))(*operands)


@pytest.mark.parametrize("fill", [np.nan, np.inf])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family", sorted(BACKWARD))
def test_backward_never_reads_keys_past_the_length(rng, monkeypatch, family, is_causal, fill):
    """NaN or Inf past the lengths: gradients finite, as with finite values there, and dK, dV 0
    past the lengths."""
    env, expected, dtype, deterministic, with_bias, head_dim = BACKWARD[family]
    q, k, v, bias = setup(monkeypatch, env, rng, dtype, (3, 150, 333, 4, 2, head_dim), with_bias,
                          family, expected, deterministic=deterministic)
    kv_lens = jnp.asarray([333 // 3 + 5, 128, 333], jnp.int32)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), dtype)
    kw = dict(key_value_seq_lengths=kv_lens, is_causal=is_causal)
    got = grads(q, *fill_past_lengths(k, v, kv_lens, fill), bias, d_out, deterministic, **kw)
    want = grads(q, k, v, bias, d_out, deterministic, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2, err_msg=name)
    for name, g in zip(("dk", "dv"), got[1:3]):
        for b, length in enumerate(np.asarray(kv_lens)):
            assert (np.asarray(g, np.float32)[b, length:] == 0).all(), name


@pytest.mark.parametrize("family", sorted(BACKWARD))
def test_backward_nan_logit_rows(rng, monkeypatch, family):
    """A NaN key element: dq is NaN in the rows that see that key, dk and dv in the key rows
    those rows see, and never where jax.nn's gradients are finite (a NaN key row also reaches,
    as 0 x NaN, the dq of rows that share its key tile without seeing it, as in jax.nn)."""
    env, expected, dtype, deterministic, with_bias, head_dim = BACKWARD[family]
    q, k, v, bias = setup(monkeypatch, env, rng, dtype, (2, 70, 90, 4, 2, head_dim), with_bias,
                          family, expected, deterministic=deterministic)
    k = set_at(k, (1, 40, 0, 7), np.nan)
    args = () if bias is None else (bias,)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), dtype)
    got = grads(q, k, v, bias, d_out, deterministic, is_causal=True)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out) + args]
    want = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, *f32[4:], is_causal=True, implementation="xla"), *f32[:3])[1](f32[3])
    rows, keys = gradient_nan_rows(*f32[:2], *f32[4:], is_causal=True)
    for name, g, w, required in zip(("dq", "dk", "dv"), got, want, (rows, keys, keys)):
        assert required.any() and not required.all(), name
        assert (nan_rows(g) >= required).all(), f"{name}: a row that must be NaN is finite"
        assert (nan_rows(g) <= nan_rows(w)).all(), f"{name}: NaN where jax.nn's is finite"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(None, -70), (30, -1), (None, 100)])
def test_kernel_windows_never_read_keys_past_the_length(rng, head_dim, window):
    """Windows as ring attention's blocks hand them to the kernel, under which the lower
    warpgroups of a query block may see no key at all (s <= t - 70) or fewer tiles than the
    upper ones: with NaN past the lengths the rows that see no key stay 0 and every other row is
    as with finite values there."""
    q, k, v = random_qkv(rng, 2, 300, 333, 4, 2, head_dim, jnp.bfloat16)
    kv_lens = jnp.asarray([150, 41], jnp.int32)

    def run(k, v):
        return jax.jit(lambda q, k, v: _ops.forward(
            q, k, v, None, None, None, kv_lens, scale=head_dim ** -0.5, window=window,
            switches=_ffi.kernel_switches()))(q, k, v)

    got, want = run(*fill_past_lengths(k, v, kv_lens, np.nan)), run(k, v)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    for g, w in zip(got, want):  # out, lse
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("fill", [np.nan, np.inf])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family,head_dim", [("sm90", 64), ("sm90", 128), ("sm90", 256),
                                             ("sm80", 128)])
def test_segment_ids_never_read_keys_past_the_length(rng, monkeypatch, family, head_dim,
                                                      is_causal, fill):
    """Segment ids with key lengths inside a key tile: each query block's first 64 rows carry
    an id no key has (on the Hopper forward, its first warpgroup takes the idle path through
    the ids' spans, and the next one zeroes the V rows past the length); NaN or Inf past the
    lengths changes no bit of the output and lse, and leaves the gradients finite."""
    if family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    b, t, s = 3, 300, 333
    q, k, v = random_qkv(rng, b, t, s, 4, 2, head_dim, jnp.bfloat16)
    ids = dict(query_segment_ids=jnp.asarray(np.broadcast_to(np.arange(t) // 64 % 2, (b, t)),
                                             jnp.int32),
               key_value_segment_ids=jnp.ones((b, s), jnp.int32))
    if jax_flashattn.forward_kernel(q, k, **ids) != family:
        pytest.skip(f"{family}: this GPU runs the call on another family")
    kv_lens = jnp.asarray([s // 3 + 5, 128, s], jnp.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, fill)
    kw = dict(key_value_seq_lengths=kv_lens, is_causal=is_causal, **ids)
    got, want = forward(q, *poisoned, None, **kw), forward(q, k, v, None, **kw)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    for g, w in zip(got, want):  # out, lse
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    got = grads(q, *poisoned, None, d_out, False, **kw)
    want = grads(q, k, v, None, d_out, False, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2, err_msg=name)
