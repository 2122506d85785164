"""ALiBi (alibi_slopes) on the CUDA kernels (run with `pytest -m gpu` on a GPU): out, lse and the
gradients of q, k, v, the bias and the slopes against the float32 reference.

Calls with ALiBi take the instantiations for the elementwise terms: the Hopper kernels' (the
forward's own for ALiBi alone, which visits the key tiles from the diagonal on; with a bias or
mask; the backward in both dQ modes), the mma.sync family's (with
JAX_FLASHATTN_DISABLE_SM90, and for ALiBi beside a soft-cap or segment ids; K/V by cp.async
alone), the split-KV decode kernels' (the wgmma and the mma.sync one) and the CUDA-core
kernels (float32, other head dims). The slopes' gradient comes from partial sums with one
writer each: bit-identical across runs in either dQ mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import check_cuda_forward, fill_past_lengths, poison, random_qkv, use_family
# (out, dq, dk, dv, dbias or None, dslopes), and dslopes against its rounding model.
from test_alibi import alibi_grads, assert_dslopes_close
from test_gpu_backward import NORMWISE
from test_gpu_forward import shared_direction
# The families a case runs on (fixtures) and the options, as the soft-cap's tests take them
# (their lengths are for these shapes).
from test_gpu_soft_cap import OPTIONS as SOFT_CAP_OPTIONS, backward_family, family  # noqa: F401

pytestmark = pytest.mark.gpu

B, T, S, N, K = 2, 97, 150, 4, 2
OPTIONS = dict(
    SOFT_CAP_OPTIONS,
    # Each entry's diagonal at its kv_len - q_len (70 and 52).
    bottom_right_causal_lengths=dict(is_causal=True, diagonal_alignment="bottom_right",
                                     query_seq_lengths=np.array([80, 9], np.int32),
                                     key_value_seq_lengths=np.array([150, 61], np.int32)),
)


def slopes_of(rng, shape=(B, N)):
    """Slopes of BLOOM's range (2^-8 to 2^-1): over 150 keys, terms of -0.6 to -75."""
    return jnp.asarray(2.0 ** -rng.uniform(1, 8, shape), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward(rng, family, dtype, head_dim, option):
    q, k, v = random_qkv(rng, B, T, S, N, K, head_dim, dtype)
    slopes = slopes_of(rng)
    assert jax_flashattn.forward_kernel(q, k, alibi_slopes=slopes) == family
    check_cuda_forward(q, k, v, alibi_slopes=slopes, **OPTIONS[option])


def test_forward_slopes_per_head_and_steep(rng, family):
    """Slopes [N] (shared by the batch), and slopes so steep that each row sees its diagonal
    key alone."""
    q, k, v = random_qkv(rng, B, T, S, N, K, 128, jnp.bfloat16)
    check_cuda_forward(q, k, v, alibi_slopes=slopes_of(rng, (N,)), is_causal=True)
    check_cuda_forward(q, k, v, alibi_slopes=jnp.full((N,), 64.0), is_causal=True)


@pytest.mark.parametrize("terms", ["bias", "mask", "bias + mask"])
def test_forward_with_bias_and_mask(rng, family, terms):
    q, k, v = random_qkv(rng, B, T, S, N, K, 128, jnp.bfloat16)
    bias = (jnp.asarray(rng.standard_normal((1, N, T, S)) * 2, jnp.float32)
            if "bias" in terms else None)
    mask = jnp.asarray(rng.random((B, 1, T, S)) > 0.3) if "mask" in terms else None
    slopes = slopes_of(rng)
    assert jax_flashattn.forward_kernel(q, k, bias, mask, alibi_slopes=slopes) == family
    check_cuda_forward(q, k, v, bias, mask, alibi_slopes=slopes, is_causal=True)


def test_forward_with_soft_cap_and_segment_ids(rng):
    """Beside a soft-cap (ALiBi added after the cap) or segment ids: the mma.sync family."""
    q, k, v = random_qkv(rng, B, T, S, N, K, 64, jnp.bfloat16, magnitude=3.0)
    slopes = slopes_of(rng)
    assert jax_flashattn.forward_kernel(q, k, logits_soft_cap=4.0, alibi_slopes=slopes) == "sm80"
    check_cuda_forward(q, k, v, alibi_slopes=slopes, logits_soft_cap=4.0, is_causal=True)
    q_ids = jnp.asarray(np.arange(B * T).reshape(B, T) // 20, jnp.int32)
    kv_ids = jnp.asarray(np.arange(B * S).reshape(B, S) * T // S // 20, jnp.int32)
    check_cuda_forward(q, k, v, alibi_slopes=slopes, query_segment_ids=q_ids,
                       key_value_segment_ids=kv_ids)


# Rows long enough for the Hopper kernel of ALiBi alone to visit many key tiles of many query
# blocks from the diagonal on (alibi_tile_order.cuh): the diagonal on tile boundaries (causal)
# and across them (bottom-right, 701 keys up), a window, and lengths under which the block's last
# key tile (whose V rows past the length hold NaN here) falls anywhere in the order.
LONG_ROWS = {
    "causal": (777, 777, dict(is_causal=True), None),
    "bottom_right_causal": (300, 1001, dict(is_causal=True, diagonal_alignment="bottom_right"),
                            None),
    "window": (900, 900, dict(local_window_size=(300, 50)), None),
    "lengths": (700, 1001, dict(query_seq_lengths=np.array([700, 333], np.int32)),
                np.array([1001, 517], np.int32)),
    # Entry 1's block of rows 512-639 starts its order at its last key tile (keys 512-516).
    "lengths_last_tile_first": (700, 1001, dict(query_seq_lengths=np.array([700, 700], np.int32)),
                                np.array([1001, 517], np.int32)),
    "bottom_right_causal_lengths": (
        700, 1001, dict(is_causal=True, diagonal_alignment="bottom_right",
                        query_seq_lengths=np.array([650, 200], np.int32)),
        np.array([777, 390], np.int32)),
}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", sorted(LONG_ROWS))
@pytest.mark.parametrize("signs", ["positive", "mixed"])
def test_forward_long_rows(rng, monkeypatch, head_dim, case, signs):
    """Slopes of both signs ("mixed": every other head's negative, so its logits grow away
    from the diagonal and the rows' maxima move on later tiles)."""
    assert use_family("sm90", monkeypatch) == "sm90"
    t, s, kwargs, kv_lens = LONG_ROWS[case]
    q, k, v = random_qkv(rng, B, t, s, N, K, head_dim, jnp.bfloat16)
    if kv_lens is not None:
        k, v = fill_past_lengths(k, v, kv_lens, np.nan)
        kwargs = dict(kwargs, key_value_seq_lengths=kv_lens)
    slopes = slopes_of(rng)
    if signs == "mixed":
        slopes = slopes * jnp.asarray([1.0, -1.0] * (N // 2), jnp.float32)
    check_cuda_forward(q, k, v, alibi_slopes=slopes, **kwargs)


@pytest.mark.parametrize("terms", ["bias", "mask"])
def test_forward_with_a_staged_term(rng, monkeypatch, terms):
    """ALiBi beside a bf16 bias or a mask that the Hopper forward stages in shared memory (keys
    a whole number of 16-byte chunks)."""
    assert use_family("sm90", monkeypatch) == "sm90"
    s = 704
    q, k, v = random_qkv(rng, B, T, s, N, K, 128, jnp.bfloat16)
    bias = (jnp.asarray(rng.standard_normal((1, N, T, s)) * 2, jnp.bfloat16)
            if terms == "bias" else None)
    mask = jnp.asarray(rng.random((B, 1, T, s)) > 0.3) if terms == "mask" else None
    check_cuda_forward(q, k, v, bias, mask, alibi_slopes=slopes_of(rng), is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_score_spikes(rng, monkeypatch, is_causal):
    """Two keys that every query favours, 20 and 128 nats above the others, far from most rows'
    diagonals: rows settled on their diagonal tile meet them with P past the headroom (and
    overflowing), so those tiles' scores are recomputed, and ALiBi's term added again."""
    assert use_family("sm90", monkeypatch) == "sm90"
    t = s = 1000
    q, k, v = (np.array(x, np.float32) for x in random_qkv(rng, B, t, s, N, K, 128,
                                                             jnp.float32))
    u = shared_direction(rng, q, 128)
    k[:, 3 * s // 8 + 1] = 20 / np.sqrt(128) * u
    k[:, 3 * s // 4 + 1] = 128 / np.sqrt(128) * u
    slopes = jnp.asarray(2.0 ** -rng.uniform(7, 9, (B, N)), jnp.float32)
    check_cuda_forward(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
                       alibi_slopes=slopes, is_causal=is_causal)


@pytest.mark.parametrize("head_dim", [64, 33])
def test_forward_float32(rng, head_dim):
    q, k, v = random_qkv(rng, B, T, S, N, K, head_dim, jnp.float32)
    slopes = slopes_of(rng)
    assert jax_flashattn.forward_kernel(q, k, alibi_slopes=slopes) == "simt"
    check_cuda_forward(q, k, v, alibi_slopes=slopes, is_causal=True)
    check_cuda_forward(q, k, v, alibi_slopes=slopes, **OPTIONS["bottom_right_causal_lengths"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", [(1, 4097), (3, 1001), (16, 2000)])
@pytest.mark.parametrize("bounds", ["lengths", "causal_bottom_right"])
@pytest.mark.parametrize("decode_family", ["default", "sm80"])
def test_decode_kernels(rng, monkeypatch, dtype, head_dim, t, s, bounds, decode_family):
    """Decoding shapes on the split-KV decode kernels' instantiations for the terms: on Hopper
    the wgmma one from 32 rows per kv head (head dims up to 128), else and with
    JAX_FLASHATTN_DISABLE_SM90 the mma.sync one; each packed row (a query position of one
    head of the group) with its own slope and diagonal."""
    if decode_family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = random_qkv(rng, 2, t, s, 8, 2, head_dim, dtype)
    slopes = slopes_of(rng, (2, 8)) / 8  # terms of a few units over the keys near the diagonal
    kernel = jax_flashattn.forward_kernel(q, k, alibi_slopes=slopes)
    assert kernel == jax_flashattn.forward_kernel(q, k)
    assert kernel in ("decode", "decode_sm90")
    kwargs = (dict(key_value_seq_lengths=np.array([s, s // 3], np.int32))
              if bounds == "lengths" else dict(is_causal=True, diagonal_alignment="bottom_right"))
    check_cuda_forward(q, k, v, alibi_slopes=slopes, **kwargs)


def check_alibi_grads(rng, q, k, v, slopes, bias=None, *, deterministic=False, **kwargs):
    """Gradients of q, k, v, the bias and the slopes against the float32 reference, normwise
    (the slopes' relative to slopes_terms's scale, and against its model); returns ours
    (out first)."""
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    operands = [x for x in (q, k, v, bias) if x is not None]
    poison(*operands, slopes, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    ours = jax.jit(lambda q, k, v, b, sl: alibi_grads(
        jax_flashattn.attention, q, k, v, b, sl, d_out, implementation="cuda",
        deterministic_backward=deterministic, **kwargs))(q, k, v, bias, slopes)
    f32 = [None if x is None else jnp.asarray(x, jnp.float32) for x in (q, k, v, bias, d_out)]
    ref = jax.jit(lambda q, k, v, b, sl, d: alibi_grads(reference.attention, q, k, v, b, sl, d,
                                                        **kwargs))(*f32[:4], slopes, f32[4])
    tol = NORMWISE[jnp.dtype(q.dtype)]
    for name, a, r in zip(("dq", "dk", "dv", "dbias"), ours[1:5], ref[1:5]):
        if r is None:
            continue
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), f"{name}: unwritten or non-finite elements"
        err, bound = np.linalg.norm(a - r), tol * np.linalg.norm(r) + 1e-5 * np.sqrt(r.size)
        assert err <= bound, f"{name}: normwise error {err:.3g} exceeds {bound:.3g}"
    assert_dslopes_close(ours[5], ref[5], q, k, v, bias, slopes, d_out, ours[0], relative=tol,
                         **kwargs)
    return ours


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients(rng, backward_family, dtype, head_dim, option, deterministic):
    q, k, v = random_qkv(rng, B, T, S, N, K, head_dim, dtype)
    slopes = slopes_of(rng)
    family = jax_flashattn.backward_kernel(q, k, deterministic=deterministic,
                                           alibi_slopes=slopes)
    # mma.sync above 128 only where the device has the large table's shared memory.
    assert family == backward_family or (head_dim > 128 and family == "simt")
    check_alibi_grads(rng, q, k, v, slopes, deterministic=deterministic, **OPTIONS[option])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_with_bias_and_mask(rng, backward_family, deterministic):
    q, k, v = random_qkv(rng, B, T, S, N, K, 128, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((B, N, T, S)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 1, T, S)) > 0.3)
    check_alibi_grads(rng, q, k, v, slopes_of(rng), bias, mask=mask, deterministic=deterministic,
                      is_causal=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_with_soft_cap_and_segment_ids(rng, deterministic):
    """dslopes takes dS itself, dq and dk the cap's slope (the mma.sync family)."""
    q, k, v = random_qkv(rng, B, T, S, N, K, 64, jnp.bfloat16, magnitude=3.0)
    slopes = slopes_of(rng)
    check_alibi_grads(rng, q, k, v, slopes, deterministic=deterministic, logits_soft_cap=3.0,
                      is_causal=True)
    q_ids = jnp.asarray(np.arange(B * T).reshape(B, T) // 20, jnp.int32)
    kv_ids = jnp.asarray(np.arange(B * S).reshape(B, S) * T // S // 20, jnp.int32)
    check_alibi_grads(rng, q, k, v, slopes, deterministic=deterministic,
                      query_segment_ids=q_ids, key_value_segment_ids=kv_ids)


@pytest.mark.parametrize("head_dim", [64, 33])
def test_gradients_float32(rng, head_dim):
    q, k, v = random_qkv(rng, B, T, S, N, K, head_dim, jnp.float32)
    slopes = slopes_of(rng)
    assert jax_flashattn.backward_kernel(q, k, alibi_slopes=slopes) == "simt"
    check_alibi_grads(rng, q, k, v, slopes, **OPTIONS["bottom_right_causal_lengths"])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_slopes_gradient_is_bit_identical_across_runs(rng, backward_family, deterministic):
    """Every slot of the slopes' gradient has one writer, so even the default (atomic dQ) mode
    gives the same dslopes on every run; the deterministic mode all gradients."""
    q, k, v = random_qkv(rng, B, 500, 700, N, K, 128, jnp.bfloat16)
    slopes = slopes_of(rng)
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    run = jax.jit(lambda q, k, v, sl: alibi_grads(
        jax_flashattn.attention, q, k, v, None, sl, d_out, implementation="cuda",
        deterministic_backward=deterministic, is_causal=True))
    first = run(q, k, v, slopes)
    for _ in range(3):
        again = run(q, k, v, slopes)
        np.testing.assert_array_equal(np.asarray(again[5]), np.asarray(first[5]))
        if deterministic:
            for a, b in zip(again[1:4], first[1:4]):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
