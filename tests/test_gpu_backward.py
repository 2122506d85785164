"""Gradients through the CUDA kernels (run with `pytest -m gpu` on an NVIDIA GPU)."""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import hopper, poison, random_qkv

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


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_zero_and_negative_scale(rng, scale):
    check(rng, jnp.bfloat16, 2, 67, 45, 4, 2, 64, is_causal=True, scale=scale)


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


# ----------------------------------------------------------------------------------------------
# The tensor-core backward (bf16/fp16, head dims multiple of 8 up to 256, above 128 where the
# device has 163 KiB of shared memory per block; float32 runs on the CUDA-core kernels), over
# the forward tests' shape and mask matrix, in both dQ modes: float32 atomics (default) and the
# deterministic mode (on Hopper dQ added in a fixed order of key blocks, elsewhere the mma.sync
# family's dQ pass).

LOW_PRECISION = [jnp.bfloat16, jnp.float16]
# Normwise relative error against the float32 reference: P and dS are rounded to the input
# dtype before their products (as in every FlashAttention kernel), and the results once more.
NORMWISE = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 4e-3,
            jnp.dtype(jnp.float32): 1e-4}


def cuda_grads(q, k, v, bias, d_out, *args, deterministic=False, **kwargs):
    """(dq, dk, dv[, dbias]) through the CUDA kernels for the cotangent d_out."""
    def f(q, k, v, *b):  # the bias slot stays positional when there is none (mask in *args)
        return jax_flashattn.attention(q, k, v, b[0] if b else None, *args, implementation="cuda",
                                       deterministic_backward=deterministic, **kwargs)
    operands = (q, k, v) if bias is None else (q, k, v, bias)
    poison(*operands, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return jax.jit(lambda *xs: jax.vjp(f, *xs)[1](d_out))(*operands)


def reference_grads(q, k, v, bias, d_out, *args, **kwargs):
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out)]
    operands = tuple(f32[:3]) + (() if bias is None else (jnp.asarray(bias, jnp.float32),))

    def f(q, k, v, *b):
        return reference.attention(q, k, v, b[0] if b else None, *args, **kwargs)
    return jax.jit(lambda *xs: jax.vjp(f, *xs)[1](f32[3]))(*operands)


def dbias_cancellation(q, k, v, bias, d_out, *args, **kwargs):
    """The scale of the cancellation in dbias for a bias broadcast over the keys: there dbias
    sums dS = P (dP - D) over the keys, whose two terms are each about D = rowsum(dO o O) and
    cancel exactly (a per-row shift leaves the softmax unchanged), and the kernels take D from
    the output rounded to q's dtype, as FlashAttention does. Returns |D| reduced to the bias's
    shape (0 for a bias with a key dimension)."""
    shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    if shape[3] != 1 or k.shape[-3] == 1:
        return np.zeros(bias.shape)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias)]
    out = reference.attention(*f32, *args, **kwargs)
    d = np.abs(np.sum(np.asarray(out, np.float64) * np.asarray(d_out, np.float64), axis=-1))
    d = d.transpose(0, 2, 1)[..., None]  # [B, N, T, 1]
    axes = tuple(i for i in range(4) if shape[i] == 1 and d.shape[i] != 1)
    return d.sum(axis=axes, keepdims=True).reshape(bias.shape)


def check_grads(rng, q, k, v, bias=None, *args, deterministic=False, **kwargs):
    """Gradients of q, k, v (and bias) against the float32 reference; returns ours."""
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    ours = cuda_grads(q, k, v, bias, d_out, *args, deterministic=deterministic, **kwargs)
    ref = reference_grads(q, k, v, bias, d_out, *args, **kwargs)
    tol = NORMWISE[jnp.dtype(q.dtype)]
    cancelled = {"dbias": 0.0 if bias is None else
                 np.linalg.norm(dbias_cancellation(q, k, v, bias, d_out, *args, **kwargs))}
    for name, x, a, r in zip(("dq", "dk", "dv", "dbias"), (q, k, v, bias), ours, ref):
        assert a.shape == x.shape and a.dtype == x.dtype, (name, a.shape, a.dtype)
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), f"{name}: unwritten or non-finite elements"
        err = np.linalg.norm(a - r)
        # The absolute term covers gradients that are zero up to rounding (S = 1: dS = P (dP -
        # D) with D from the rounded output): 1e-5 per element, summed in quadrature.
        bound = tol * (np.linalg.norm(r) + cancelled.get(name, 0.0)) + 1e-5 * np.sqrt(r.size)
        assert err <= bound, f"{name}: normwise error {err:.3g} exceeds {bound:.3g}"
    return ours


@pytest.fixture(params=[False, True], ids=["atomic", "deterministic"])
def deterministic(request):
    return request.param


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 64, 72, 96, 128, 192, 256])
def test_tc_head_dims(rng, dtype, head_dim, deterministic):
    check_grads(rng, *random_qkv(rng, 2, 77, 131, 4, 2, head_dim, dtype),
                deterministic=deterministic)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [136, 160, 192, 256])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(query_seq_lengths=np.array([201, 0, 57], np.int32),
                                         key_value_seq_lengths=np.array([333, 40, 0], np.int32),
                                         is_causal=True)])
def test_tc_large_head_dims(rng, dtype, head_dim, kwargs, deterministic):
    """Head dims above 128: on Hopper the Hopper backward's 192 configuration (three spans, the
    first consumer two of dK, dV and dQ, the second one, dQ staged for TMA reductions; 136 and
    160 run on it, deterministic calls on 256's) and its 256 one, elsewhere the mma.sync large
    table (64-key blocks, 32-query tiles, rows padded to 256 elements; 136 and 160 run on 192):
    GQA 8 -> 2, several key blocks and query tiles, partial last ones, zero-length rows."""
    check_grads(rng, *random_qkv(rng, 3, 201, 333, 8, 2, head_dim, dtype),
                deterministic=deterministic, **kwargs)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [72, 96])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(query_seq_lengths=np.array([201, 0, 57], np.int32),
                                         key_value_seq_lengths=np.array([333, 40, 0], np.int32),
                                         is_causal=True)])
def test_tc_head_dims_72_to_96(rng, dtype, head_dim, kwargs, deterministic):
    """Head dims 72-96: on Hopper the backward's 96 configuration (128's layout, S^T and dP^T
    reduced over 96 columns, dK and dV of 96), the deterministic calls on 128's: GQA 8 -> 2,
    several key blocks and query tiles, partial last ones, zero-length rows."""
    check_grads(rng, *random_qkv(rng, 3, 201, 333, 8, 2, head_dim, dtype),
                deterministic=deterministic, **kwargs)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("t,s", [(1, 1), (1, 300), (300, 1), (129, 65), (64, 128), (257, 513)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tc_sizes_and_causal(rng, dtype, t, s, is_causal, deterministic):
    check_grads(rng, *random_qkv(rng, 2, t, s, 4, 4, 64, dtype), is_causal=is_causal,
                deterministic=deterministic)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("t,s", [(100, 230), (230, 100)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tc_gqa_causal_t_ne_s(rng, dtype, t, s, head_dim, deterministic):
    check_grads(rng, *random_qkv(rng, 2, t, s, 8, 2, head_dim, dtype), is_causal=True,
                deterministic=deterministic)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (64, 0), (0, 100), 17])
@pytest.mark.parametrize("is_causal", [False, True])
def test_tc_windows(rng, dtype, window, is_causal, deterministic):
    check_grads(rng, *random_qkv(rng, 2, 200, 170, 4, 1, 128, dtype), is_causal=is_causal,
                local_window_size=window, deterministic=deterministic)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_tc_seq_lengths_zero_rows(rng, dtype, deterministic):
    q, k, v = random_qkv(rng, 4, 150, 190, 8, 2, 64, dtype)
    q_lens = np.array([150, 0, 37, 100], np.int32)
    kv_lens = np.array([190, 5, 0, 64], np.int32)
    dq, dk, dv = (np.asarray(g, np.float32) for g in check_grads(
        rng, q, k, v, query_seq_lengths=jnp.asarray(q_lens),
        key_value_seq_lengths=jnp.asarray(kv_lens), is_causal=True,
        deterministic=deterministic))
    for b in range(4):
        # Padded query rows and keys, and everything of a batch element that sees nothing, get
        # exactly 0 (never NaN).
        assert np.all(dq[b, q_lens[b]:] == 0)
        assert np.all(dk[b, kv_lens[b]:] == 0) and np.all(dv[b, kv_lens[b]:] == 0)
        if q_lens[b] == 0 or kv_lens[b] == 0:
            assert np.all(dq[b] == 0) and np.all(dk[b] == 0) and np.all(dv[b] == 0)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tc_large_inputs(rng, dtype, head_dim, deterministic):
    check_grads(rng, *random_qkv(rng, 1, 256, 256, 2, 2, head_dim, dtype, magnitude=3.0),
                is_causal=True, deterministic=deterministic)


def test_tc_queries_past_preprocess_grid(rng):
    """More queries than the preprocess's grid has runs of rows (65535 runs of 8 rows at head
    dim 256), so its blocks stride over the rest; two heads, so each starts mid-buffer."""
    check_grads(rng, *random_qkv(rng, 1, 530_001, 16, 2, 1, 136, jnp.bfloat16))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("bias_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140),
                                        (4, 100, 1), (140,)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_tc_bias_gradient(rng, dtype, bias_shape, head_dim, deterministic):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 2, head_dim, dtype)
    bias = jnp.asarray(rng.standard_normal(bias_shape), dtype)
    check_grads(rng, q, k, v, bias, is_causal=True, deterministic=deterministic)


@pytest.mark.parametrize("bias_shape", [(2, 4, 67, 45), (1, 4, 67, 45), (2, 1, 1, 45),
                                        (4, 67, 1), (45,)])
def test_simt_bias_gradient(rng, bias_shape, deterministic):
    """float32 runs the CUDA-core backward: a full-shape dbias is stored row by row, one
    summed over broadcast dims takes atomic adds (deterministic mode: full, summed after)."""
    q, k, v = random_qkv(rng, 2, 67, 45, 4, 2, 64, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    check_grads(rng, q, k, v, bias, is_causal=True, deterministic=deterministic)


@pytest.mark.parametrize("mask_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140)])
def test_tc_mask_and_bias(rng, mask_shape, deterministic):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 4, 64, jnp.bfloat16)
    mask = jnp.asarray(rng.random(mask_shape) > 0.3)
    bias = jnp.asarray(rng.standard_normal((1, 4, 100, 140)), jnp.float32)
    check_grads(rng, q, k, v, bias, mask, local_window_size=(40, 9),
                key_value_seq_lengths=jnp.array([140, 77], jnp.int32),
                deterministic=deterministic)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_tc_mask_without_bias(rng, dtype, deterministic):
    """A mask alone: unlike a bias it lets the dK/dV pass skip tiles by causal bounds, then
    reads the mask per element on the tiles it visits."""
    q, k, v = random_qkv(rng, 2, 150, 130, 4, 2, 40, dtype)
    mask = jnp.asarray(rng.random((2, 1, 150, 130)) > 0.4)
    check_grads(rng, q, k, v, None, mask, is_causal=True,
                query_seq_lengths=jnp.array([150, 61], jnp.int32), deterministic=deterministic)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(),
                                    dict(local_window_size=(300, 40),
                                         query_seq_lengths=np.array([1100, 517], np.int32)),
                                    dict(key_value_seq_lengths=np.array([1000, 333], np.int32))],
                         ids=["causal", "full", "window_lengths", "full_lengths"])
def test_tc_deterministic_is_bit_identical(rng, head_dim, kwargs):
    """Enough key blocks per query tile (up to 18) that their dQ additions would meet in any
    order without the fixed one; on Hopper the Hopper kernel, which orders them."""
    q, k, v = random_qkv(rng, 2, 1100, 1111, 8, 2, head_dim, jnp.bfloat16)
    if hopper():
        assert jax_flashattn.backward_kernel(q, k, deterministic=True) == "sm90"
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    first = [np.asarray(g).tobytes() for g in cuda_grads(q, k, v, None, d_out, deterministic=True,
                                                          **kwargs)]
    for _ in range(3):
        again = cuda_grads(q, k, v, None, d_out, deterministic=True, **kwargs)
        assert [np.asarray(g).tobytes() for g in again] == first


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True),
                                    dict(query_seq_lengths=np.array([201, 0, 57], np.int32),
                                         local_window_size=(70, 9))])
def test_sm80_deterministic_pass(rng, monkeypatch, head_dim, kwargs):
    """The mma.sync family's deterministic dQ pass, pinned (on Hopper deterministic calls take
    the Hopper kernel; a bias, a mask or segment ids still reach this pass there)."""
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = random_qkv(rng, 3, 201, 333, 8, 2, head_dim, jnp.bfloat16)
    large_smem = jax.devices()[0].compute_capability in ("8.0", "8.7", "9.0", "10.0")
    expected = "sm80" if head_dim <= 128 or large_smem else "simt"
    assert jax_flashattn.backward_kernel(q, k, deterministic=True) == expected
    check_grads(rng, q, k, v, deterministic=True, **kwargs)


def test_tc_modes_agree(rng, monkeypatch):
    """Both dQ modes compute the same sums, in different orders. (On Hopper the atomic mode would
    run the wgmma kernel; the mma.sync family is pinned for the dK/dV bit-identity below.)"""
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = random_qkv(rng, 2, 200, 260, 4, 2, 128, jnp.float16)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    atomic = cuda_grads(q, k, v, None, d_out, deterministic=False)
    exact = cuda_grads(q, k, v, None, d_out, deterministic=True)
    for a, b in zip(atomic, exact):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2, atol=1e-3)
    # dK and dV come from the same pass in both modes.
    for a, b in zip(atomic[1:], exact[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_hopper_modes_agree(rng, head_dim, is_causal):
    """On the Hopper kernel the deterministic mode changes only the order of the dQ additions:
    dK and dV are bit-identical to the atomic mode's, dQ equal up to rounding."""
    if not hopper():
        pytest.skip("the Hopper backward runs on compute capability 9.0 with an sm_90a build")
    q, k, v = random_qkv(rng, 2, 517, 700, 8, 2, head_dim, jnp.bfloat16)
    for deterministic in (False, True):
        assert jax_flashattn.backward_kernel(q, k, deterministic=deterministic) == "sm90"
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    atomic = cuda_grads(q, k, v, None, d_out, is_causal=is_causal)
    ordered = cuda_grads(q, k, v, None, d_out, is_causal=is_causal, deterministic=True)
    np.testing.assert_allclose(np.asarray(atomic[0], np.float32),
                               np.asarray(ordered[0], np.float32), rtol=2e-2, atol=2e-3)
    for a, b in zip(atomic[1:], ordered[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_MANY_WAVES = """
import jax, jax.numpy as jnp, numpy as np
import jax_flashattn
rng = np.random.default_rng(0)
# 768 blocks, more than 4 per SM, so several waves run. 3 x 32 kv heads x 8 key blocks: more
# (batch, kv head) pairs than a quarter of the SMs, so each pair's blocks are consecutive and
# under causal the later waves hold the blocks that add first. 3 x 8 kv heads x 32 key blocks:
# fewer, so under causal the key block is outermost (reversed: the blocks that add first lead).
for t, n, kv in ((1024, 64, 32), (4096, 16, 8)):
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                      for shape in ((3, t, n, 64), (3, t, kv, 64), (3, t, kv, 64), (3, t, n, 64)))
    for causal in (True, False):
        def grads(deterministic):
            f = lambda *a: jax_flashattn.attention(*a, is_causal=causal, implementation="cuda",
                                                   deterministic_backward=deterministic)
            vjp = jax.jit(lambda *a: jax.vjp(f, *a)[1](d_out))
            return [np.asarray(g) for g in vjp(q, k, v)]
        first, again, atomic = grads(True), grads(True), grads(False)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again)), (t, causal)
        np.testing.assert_allclose(first[0].astype(np.float32), atomic[0].astype(np.float32),
                                   rtol=2e-2, atol=2e-3)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first[1:], atomic[1:])), (t, causal)
print("ok")
"""


def test_hopper_deterministic_many_waves():
    """Grids of several waves in both block orders, causal (key blocks launched in reverse)
    and full, in a subprocess with a time limit: an order that waited for a block that is never
    launched fails here instead of hanging the suite. dQ bit-identical across runs and equal to
    the atomic mode's up to rounding, dK and dV bit-identical to it."""
    import os
    import subprocess
    import sys
    if not hopper():
        pytest.skip("the Hopper backward runs on compute capability 9.0 with an sm_90a build")
    # Beside this process's own allocations: no preallocated pool in the child.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = subprocess.run([sys.executable, "-c", _MANY_WAVES], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_tc_vmap_of_grads(rng, deterministic):
    q, k, v = random_qkv(rng, 3, 64, 80, 4, 2, 64, jnp.bfloat16)
    stack = lambda x: jnp.stack([x, x * 0.5])  # noqa: E731
    d_out = jnp.asarray(rng.standard_normal((2,) + q.shape, dtype=np.float32), q.dtype)

    def f(q, k, v):
        return jax_flashattn.attention(q, k, v, is_causal=True, implementation="cuda",
                                       deterministic_backward=deterministic)
    _, vjp = jax.vjp(jax.vmap(f), stack(q), stack(k), stack(v))
    dq, dk, dv = vjp(d_out)
    _, vjp1 = jax.vjp(f, q * 0.5, k * 0.5, v * 0.5)
    for a, b in zip((dq[1], dk[1], dv[1]), vjp1(d_out[1])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------
# The Hopper backward (TMA + wgmma, one pass for dK, dV and dQ): bf16/fp16, head dims a multiple
# of 8 up to 256, on compute capability 9.0 with an sm_90a build (its bias and mask calls in
# test_gpu_bias.py). Everywhere else these run the mma.sync family and still check the
# gradients.


def tensor_core_family(head_dim):
    """The backward family of a bf16/fp16 call without bias, mask or deterministic mode: the
    Hopper kernel where it runs, else the mma.sync family, which above head dim 128 needs
    163 KiB of shared memory per block (sm_80, sm_87, sm_90, sm_100)."""
    if hopper():
        return "sm90"
    large_smem = jax.devices()[0].compute_capability in ("8.0", "8.7", "9.0", "10.0")
    return "sm80" if head_dim <= 128 or large_smem else "simt"


def test_backward_dispatch_is_visible(monkeypatch):
    """backward_kernel reports the family the dispatcher launches: the Hopper kernel where it
    applies, the mma.sync family for the other tensor-core cases, the CUDA cores for the rest."""
    tc = "sm90" if hopper() else "sm80"
    for dtype in LOW_PRECISION:
        for head_dim in (8, 32, 40, 64, 72, 128):
            q = jax.ShapeDtypeStruct((2, 100, 4, head_dim), dtype)
            assert jax_flashattn.backward_kernel(q, q) == tc, (dtype, head_dim)
    q = jax.ShapeDtypeStruct((2, 100, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
    assert jax_flashattn.backward_kernel(q, kv) == tc
    assert jax_flashattn.backward_kernel(q, kv, bias=q) == tc
    assert jax_flashattn.backward_kernel(q, kv, mask=q) == tc
    assert jax_flashattn.backward_kernel(q, kv, deterministic=True) == tc
    for head_dim in (136, 192, 256):
        assert jax_flashattn.backward_kernel(
            q.update(shape=(2, 100, 8, head_dim)),
            kv.update(shape=(2, 300, 2, head_dim))) == tensor_core_family(head_dim)
    assert jax_flashattn.backward_kernel(q.update(shape=(2, 100, 8, 264)),
                                         kv.update(shape=(2, 300, 2, 264))) == "simt"
    assert jax_flashattn.backward_kernel(q.update(dtype=jnp.float32),
                                         kv.update(dtype=jnp.float32)) == "simt"
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    assert jax_flashattn.backward_kernel(q, kv) == "sm80"


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [40, 64, 72, 128, 192, 200, 256])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(query_seq_lengths=np.array([333, 0, 41], np.int32),
                                         key_value_seq_lengths=np.array([517, 77, 0], np.int32),
                                         is_causal=True)])
def test_sm90_many_tiles(rng, dtype, head_dim, kwargs):
    """GQA (4 query heads per kv head), T != S, several key blocks and 64-query tiles, so
    every block cycles its Q/dO ring and dS^T buffers many times; head dims 40, 72 and 200 run
    zero-filled on the 64, 128 and 256 configurations (256: 64-key blocks, the head dim split
    between the consumers; 192: split unevenly, each consumer's dQ staging tile reused every
    step); rows and keys past the lengths get exactly 0."""
    q, k, v = random_qkv(rng, 3, 333, 517, 8, 2, head_dim, dtype)
    assert jax_flashattn.backward_kernel(q, k) == tensor_core_family(head_dim)
    dq, dk, dv = (np.asarray(g, np.float32) for g in check_grads(rng, q, k, v, **kwargs))
    if "query_seq_lengths" in kwargs:
        for b, (q_len, kv_len) in enumerate(zip(kwargs["query_seq_lengths"],
                                                kwargs["key_value_seq_lengths"])):
            assert np.all(dq[b, q_len:] == 0)
            assert np.all(dk[b, kv_len:] == 0) and np.all(dv[b, kv_len:] == 0)
            if q_len == 0 or kv_len == 0:
                assert np.all(dq[b] == 0) and np.all(dk[b] == 0) and np.all(dv[b] == 0)


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True)])
def test_sm90_agrees_with_mma_sync(rng, monkeypatch, kwargs):
    """The two tensor-core families compute the same sums in different orders."""
    q, k, v = random_qkv(rng, 2, 300, 260, 4, 2, 128, jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    wgmma = cuda_grads(q, k, v, None, d_out, **kwargs)
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    mma_sync = cuda_grads(q, k, v, None, d_out, **kwargs)
    for a, b in zip(wgmma, mma_sync):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


def test_check_grads_float32():
    """Finite differences on a small float32 case (the CUDA-core backward)."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 5, 7, 2, 1, 8, jnp.float32)

    def f(q, k, v):
        return jax_flashattn.attention(q, k, v, is_causal=True, implementation="cuda")

    jax.test_util.check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-2,
                              rtol=5e-2)
