"""Calls with an additive bias or a boolean mask on the Hopper kernels (run with `pytest -m gpu`;
skipped off an H100/H200): the dispatcher's choice, out and lse against the float32 reference
over the bias's shapes and element types, masks, every bound (causal, windows, lengths), GQA,
each head dim's tiles and their edges, and biases that move the row maxima; then the Hopper
backward's gradients (dbias of every broadcast shape included). The mma.sync family's bias and
mask kernels are tested in test_gpu_forward.py and test_gpu_backward.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import (assert_grads_close, check_cuda_forward, grads, random_qkv, reference_grads,
                     use_family)

pytestmark = pytest.mark.gpu

# 701 keys: several key tiles at every head dim (128 keys at 64 and 128, 64 at 256) and a last
# one cut short; 300 queries: a last query block cut short.
T, S = 300, 701
# 704 keys, a whole number of 16-byte chunks of bf16/fp16 elements and of mask bytes: a bias of
# those types alone, or a mask alone, is staged in shared memory (the forward's WithStagedTerm,
# the backward's BackwardWithStagedTerm), its last key tile's chunks past S zero-filled (a
# 128-key tile cut short; 720 keys cut the backward's 64-key blocks at head dim 256 short too).
STAGED_S = 704


def bias_of(rng, shape, dtype, magnitude=2.0):
    return jnp.asarray(magnitude * rng.standard_normal(shape), dtype)


def mask_of(rng, shape, keep=0.7):
    return jnp.asarray(rng.random(shape) < keep)


def terms_of(rng, terms, s=S):
    """(bias, mask) of a test's terms, e.g. "bias f32 + mask": a bias [1, 4, T, s] over the
    heads of the named element type, a mask [2, 1, T, s] per batch entry, or None for each."""
    bias_dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
    bias = (bias_of(rng, (1, 4, T, s), bias_dtype[terms.split()[1]])
            if terms.startswith("bias") else None)
    return bias, mask_of(rng, (2, 1, T, s)) if "mask" in terms else None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("terms", ["bias f32", "bias bf16", "bias f16", "mask",
                                   "bias f32 + mask"])
@pytest.mark.parametrize("s", [S, STAGED_S])
def test_bias_and_mask(rng, monkeypatch, head_dim, dtype, terms, s):
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, s, 4, 2, head_dim, dtype)
    bias, mask = terms_of(rng, terms, s)
    assert jax_flashattn.forward_kernel(q, k, bias, mask) == "sm90"
    check_cuda_forward(q, k, v, bias, mask)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bounds", [dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(local_window_size=17, is_causal=True),
                                    dict(is_causal=True,
                                         query_seq_lengths=jnp.array([300, 41], jnp.int32),
                                         key_value_seq_lengths=jnp.array([650, 0], jnp.int32)),
                                    dict(key_value_seq_lengths=jnp.array([129, 701], jnp.int32))])
def test_bounds(rng, monkeypatch, head_dim, bounds):
    """The bias and mask read only where the bounds leave a pair visible; the tiles a bound
    crosses take their element test together with the terms."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 1, head_dim, jnp.bfloat16)
    bias = bias_of(rng, (2, 1, T, S), jnp.bfloat16)
    mask = mask_of(rng, (1, 4, T, S), keep=0.9)
    check_cuda_forward(q, k, v, bias, mask, **bounds)
    # The staged terms, one at a time (keys a whole number of chunks), under the same bounds.
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 1, head_dim, jnp.bfloat16)
    check_cuda_forward(q, k, v, bias_of(rng, (2, 1, T, STAGED_S), jnp.bfloat16), **bounds)
    check_cuda_forward(q, k, v, None, mask_of(rng, (1, 4, T, STAGED_S), keep=0.9), **bounds)


@pytest.mark.parametrize("bias_shape", [(2, 4, T, S), (1, 1, T, S), (2, 1, 1, S), (4, T, S),
                                        (S,), (T, S)])
@pytest.mark.parametrize("mask_shape", [None, (2, 4, T, S), (1, 1, 1, S), (T, S)])
def test_broadcast_shapes(rng, monkeypatch, bias_shape, mask_shape):
    """Broadcast dimensions (stride 0) of the batch, heads and queries."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.float16)
    bias = bias_of(rng, bias_shape, jnp.float32)
    mask = None if mask_shape is None else mask_of(rng, mask_shape)
    assert jax_flashattn.forward_kernel(q, k, bias, mask) == "sm90"
    check_cuda_forward(q, k, v, bias, mask, is_causal=True)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("terms", ["bias bf16", "mask"])
def test_backward_staged_key_tail(rng, monkeypatch, head_dim, terms):
    """720 keys: the last key block cut short at both block sizes (128 keys, and 64 at head
    dim 256), its tile's chunks past S zero-filled."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, 720, 4, 2, head_dim, jnp.bfloat16)
    bias, mask = terms_of(rng, terms, 720)
    check_backward(rng, q, k, v, bias, mask)


@pytest.mark.parametrize("shape", [(2, 4, T, STAGED_S), (1, 1, T, STAGED_S),
                                   (2, 1, 1, STAGED_S), (4, T, STAGED_S), (STAGED_S,)])
@pytest.mark.parametrize("term", ["bias bf16", "mask"])
def test_staged_broadcast_shapes(rng, monkeypatch, shape, term):
    """A staged bias or mask, each warp's rows copied from the broadcast dimensions' offsets."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, 128, jnp.float16)
    bias = bias_of(rng, shape, jnp.bfloat16) if term == "bias bf16" else None
    mask = mask_of(rng, shape) if term == "mask" else None
    check_cuda_forward(q, k, v, bias, mask, is_causal=True)


def test_one_key_broadcast_takes_mma_sync(rng, monkeypatch):
    """A bias or mask of one key broadcast over the keys (shape [..., 1]) is read per row by
    the mma.sync family, not the Hopper kernel, which reads keys at unit stride; the planner
    reports what runs."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    bias = bias_of(rng, (4, T, 1), jnp.float32)
    mask = mask_of(rng, (2, 1, T, 1))
    assert jax_flashattn.forward_kernel(q, k, bias) == "sm80"
    assert jax_flashattn.forward_kernel(q, k, None, mask) == "sm80"
    assert jax_flashattn.forward_kernel(q, k, bias_of(rng, (4, T, S), jnp.float32)) == "sm90"
    check_cuda_forward(q, k, v, bias, is_causal=True)
    check_cuda_forward(q, k, v, None, mask, is_causal=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_that_see_no_key(rng, monkeypatch, head_dim):
    """Rows and whole (batch, head) pairs the mask hides entirely: out 0, lse -inf, and the
    rows beside them unchanged."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, head_dim, jnp.bfloat16)
    mask = np.array(mask_of(rng, (2, 4, T, S)))
    mask[0, 1] = False
    mask[1, :, 5:70] = False
    mask[1, 2, :, 128:] = False
    check_cuda_forward(q, k, v, bias_of(rng, (1, 4, T, S), jnp.float32), jnp.asarray(mask))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rise", ["ramp", "spikes"])
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bias_moves_row_maxima(rng, monkeypatch, head_dim, rise, bias_dtype):
    """Biases that move the row maxima after they have settled. "ramp": the bias rises by 0.02
    per key (2.56 per 128-key tile), so the maxima keep rising and tiles outrun them, some by
    more than P may grow (those tiles' scores are recomputed, and the bias added again).
    "spikes": two keys far along S with bias 20 and 120 over the rest. A bf16 bias is staged in
    shared memory at head dims 64 and 128, where the recompute reads the staged tile again."""
    use_family("sm90", monkeypatch)
    t, s = 200, 2000
    q, k, v = random_qkv(rng, 1, t, s, 2, 2, head_dim, jnp.bfloat16)
    if rise == "ramp":
        bias = jnp.broadcast_to(0.02 * jnp.arange(s, dtype=jnp.float32), (t, s))
    else:
        bias = np.zeros((t, s), np.float32)
        bias[:, 3 * s // 8 + 1] = 20.0
        bias[:, 3 * s // 4 + 1] = 120.0
        bias = jnp.asarray(bias)
    check_cuda_forward(q, k, v, bias.astype(bias_dtype))
    check_cuda_forward(q, k, v, bias.astype(bias_dtype), is_causal=True)


def test_grad_and_vmap(rng, monkeypatch):
    """Gradients (q, k, v and the bias) from the Hopper forward's out and lse; and vmap with the
    bias broadcast over the mapped axis."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, 130, 260, 4, 2, 64, jnp.bfloat16)
    bias = bias_of(rng, (1, 4, 130, 260), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    ours = jax.jit(lambda *a: grads(jax_flashattn.attention, *a, is_causal=True,
                                    implementation="cuda"))(q, k, v, bias, d_out)
    want = reference_grads(q, k, v, bias, d_out, is_causal=True)
    for name, got, ref in zip(["out", "dq", "dk", "dv", "dbias"], ours, want):
        assert_grads_close(got, ref, normwise=3e-2, name=name)
    batched = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(
        q, k, v, bias, implementation="cuda")))(*(x[None].repeat(2, 0) for x in (q, k, v)))
    single = jax.jit(lambda q, k, v: jax_flashattn.attention(
        q, k, v, bias, implementation="cuda"))(q, k, v)
    np.testing.assert_array_equal(np.asarray(batched[1], np.float32),
                                  np.asarray(single, np.float32))


# The Hopper backward with the terms: each consumer thread reads its elements of the bias and
# mask as S^T lands and writes its elements of dS^T into dbias.

def seen_by_bias(q, k, v, bias, mask, **kwargs):
    """Which elements of the bias feed a pair the reference's softmax weighs (P > 0): the
    gradient of the finite lse with respect to the bias is P summed over its broadcast dims
    (dS = P (dP - D) is no test: a row that sees one key has dS = 0 there)."""
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias)]

    def total_lse(b):
        _, lse = reference.attention(*f32[:3], b, mask, return_residual=True, **kwargs)
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return np.nan_to_num(np.asarray(jax.jit(jax.grad(total_lse))(f32[3]))) > 0


def check_backward(rng, q, k, v, bias, mask, deterministic=False, family="sm90", **kwargs):
    """Gradients of a call on `family`'s backward (the Hopper one by default) against the
    float32 reference; dbias also exactly 0 at the elements that feed no visible pair (a bound,
    a length or the mask hides them; the Hopper kernel does not write them, the dispatcher
    zeroes dbias for them)."""
    assert jax_flashattn.backward_kernel(q, k, bias, mask,
                                         deterministic=deterministic).startswith(family)
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    ours = jax.jit(lambda *a: grads(jax_flashattn.attention, *a, mask=mask,
                                    implementation="cuda", deterministic_backward=deterministic,
                                    **kwargs))(q, k, v, bias, d_out)
    want = reference_grads(q, k, v, bias, d_out, mask=mask, **kwargs)
    for name, got, ref in zip(["out", "dq", "dk", "dv", "dbias"], ours, want):
        if ref is not None:
            assert_grads_close(got, ref, normwise=3e-2, name=name)
    if bias is not None:
        unseen = ~seen_by_bias(q, k, v, bias, mask, **kwargs)
        assert (np.asarray(ours[4], np.float32)[unseen] == 0).all(), "dbias: unseen pairs"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("terms", ["bias f32", "bias bf16", "mask", "bias f16 + mask"])
def test_backward(rng, monkeypatch, head_dim, dtype, terms):
    """GQA (4 query heads over 2), T != S with last tiles cut short; a bias over the heads,
    whose dbias sums over the batch (atomic adds), and a mask per batch entry."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, head_dim, dtype)
    bias, mask = terms_of(rng, terms)
    check_backward(rng, q, k, v, bias, mask)


@pytest.mark.parametrize("bias_shape", [(2, 4, T, S), (1, 1, T, S), (2, 1, 1, S), (4, T, S),
                                        (S,), (T, S)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_dbias_shapes(rng, monkeypatch, bias_shape, is_causal):
    """dbias of every broadcast: one writer per element (the full shape; zeroed first where a
    bound hides pairs), sums over the batch, heads or queries by atomic adds, one per key and
    quad where every query shares the bias."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    check_backward(rng, q, k, v, bias_of(rng, bias_shape, jnp.float32), None,
                   is_causal=is_causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bounds", [dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(is_causal=True,
                                         query_seq_lengths=jnp.array([300, 41], jnp.int32),
                                         key_value_seq_lengths=jnp.array([650, 0], jnp.int32)),
                                    dict(key_value_seq_lengths=jnp.array([129, 701], jnp.int32)),
                                    dict(is_causal=True, diagonal_alignment="bottom_right",
                                         query_seq_lengths=jnp.array([77, 300], jnp.int32),
                                         key_value_seq_lengths=jnp.array([600, 129], jnp.int32))])
def test_backward_bounds(rng, monkeypatch, head_dim, bounds):
    """The terms read only where the bounds leave a pair visible; dbias with one writer per
    element is 0 at the pairs the bounds and the mask hide and the blocks do not visit."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 1, head_dim, jnp.bfloat16)
    check_backward(rng, q, k, v, bias_of(rng, (2, 4, T, S), jnp.bfloat16),
                   mask_of(rng, (1, 4, T, S), keep=0.9), **bounds)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bias_shape", [(1, 4, T, S), (2, 1, 1, S)])
def test_backward_deterministic(rng, monkeypatch, head_dim, bias_shape):
    """deterministic_backward: dQ added in a fixed order of key blocks and dbias at the full
    [B, N, T, S] (one writer per element, summed to the bias's shape after), against the
    reference and with the same bits on every run."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, head_dim, jnp.bfloat16)
    bias, mask = bias_of(rng, bias_shape, jnp.float32), mask_of(rng, (2, 1, T, S))
    check_backward(rng, q, k, v, bias, mask, deterministic=True, is_causal=True)
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    run = jax.jit(lambda *a: grads(jax_flashattn.attention, *a, mask=mask, is_causal=True,
                                   implementation="cuda", deterministic_backward=True))
    first = run(q, k, v, bias, d_out)
    for _ in range(3):
        for a, b in zip(first, run(q, k, v, bias, d_out)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# The Hopper backward at head dims 128 and 256 stages a 2-byte bias alone or a mask alone
# (BackwardWithStagedTerm): each step's tile lands in shared memory beside Q and dO, its rows past
# T and chunks past S zero-filled.
STAGED_BOUNDS = [dict(), dict(is_causal=True), dict(local_window_size=(70, 9)),
                 dict(is_causal=True, query_seq_lengths=jnp.array([300, 41], jnp.int32),
                      key_value_seq_lengths=jnp.array([650, 0], jnp.int32)),
                 dict(is_causal=True, diagonal_alignment="bottom_right",
                      query_seq_lengths=jnp.array([77, 300], jnp.int32),
                      key_value_seq_lengths=jnp.array([600, 129], jnp.int32))]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("terms", ["bias bf16", "bias f16", "mask"])
@pytest.mark.parametrize("bounds", STAGED_BOUNDS)
def test_backward_staged_term(rng, monkeypatch, head_dim, dtype, terms, bounds):
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, head_dim, dtype)
    bias, mask = terms_of(rng, terms, STAGED_S)
    check_backward(rng, q, k, v, bias, mask, **bounds)


@pytest.mark.parametrize("shape", [(2, 4, T, STAGED_S), (1, 1, T, STAGED_S),
                                   (2, 1, 1, STAGED_S), (STAGED_S,)])
@pytest.mark.parametrize("term", ["bias bf16", "mask"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_backward_staged_broadcast_shapes(rng, monkeypatch, shape, term, head_dim):
    """Broadcast over the batch, the heads and (row stride 0) the queries: every row of a
    tile copied from the one row."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, head_dim, jnp.bfloat16)
    bias = bias_of(rng, shape, jnp.bfloat16) if term.startswith("bias") else None
    mask = mask_of(rng, shape) if term == "mask" else None
    check_backward(rng, q, k, v, bias, mask, is_causal=True)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("term", ["bias bf16", "mask"])
def test_backward_staged_deterministic(rng, monkeypatch, head_dim, term):
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, head_dim, jnp.bfloat16)
    bias, mask = terms_of(rng, term, STAGED_S)
    check_backward(rng, q, k, v, bias, mask, deterministic=True, is_causal=True)
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    run = jax.jit(lambda *a: grads(jax_flashattn.attention, *a, mask=mask, is_causal=True,
                                   implementation="cuda", deterministic_backward=True))
    first = run(q, k, v, bias, d_out)
    for a, b in zip(first, run(q, k, v, bias, d_out)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_backward_takes_mma_sync_beside_other_options(rng, monkeypatch):
    """With a soft-cap, segment ids or a bias broadcast over the keys, a call with a bias or mask
    keeps the mma.sync backward."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    bias, mask = bias_of(rng, (1, 4, T, S), jnp.float32), mask_of(rng, (2, 1, T, S))
    ids = np.zeros((2, T), np.int32), np.zeros((2, S), np.int32)
    assert jax_flashattn.backward_kernel(q, k, bias, logits_soft_cap=5.0) == "sm80"
    assert jax_flashattn.backward_kernel(q, k, None, mask, query_segment_ids=ids[0],
                                         key_value_segment_ids=ids[1]) == "sm80"
    assert jax_flashattn.backward_kernel(q, k, bias_of(rng, (4, T, 1), jnp.float32)) == "sm80"
