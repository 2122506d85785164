"""Packed sequences: `attention` with query_segment_ids / key_value_segment_ids against the
float32 reference (values, lse and gradients), combined with every other option, under jit and
vmap, through implementation="xla", and the errors of bad ids (the id helpers and the spans:
test_segment_id_helpers.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_flashattn
from jax_flashattn import reference
from helpers import assert_grads_close, assert_lse_close, grads, random_qkv, reference_grads
from packing import ids_from_lengths, packed_ids, row_ids, segs

# The float32 reference jitted, one program per check: this file's checks mostly have shapes
# (and ids options) of their own, where the eager reference compiles each of its operations
# anew (measured: the file 76 s -> 51 s on 2 CPU cores).
assert_attention_close = functools.partial(helpers.assert_attention_close, jit_reference=True)

DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]

def check_forward(q, k, v, *args, **kwargs):
    """`attention` (out and lse) against the float32 reference; returns (out, reference lse)."""
    out, lse = jax_flashattn.attention(q, k, v, *args, return_residual=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(out, np.float32)).all(), "non-finite values in output"
    ref_lse = assert_attention_close(out, q, k, v, *args, **kwargs)
    assert_lse_close(lse, ref_lse)
    return out, ref_lse


def check_grads(rng, q, k, v, bias=None, *args, **kwargs):
    """out, dq, dk, dv (and dbias) against the reference's; returns the kernels' values."""
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    got = grads(jax_flashattn.attention, q, k, v, bias, d_out, *args, **kwargs)
    want = reference_grads(q, k, v, bias, d_out, *args, **kwargs)
    normwise = None if q.dtype == jnp.float32 else 2e-2
    for name, x, g, w in zip(("out", "dq", "dk", "dv", "dbias"), (q, q, k, v, bias), got, want):
        if x is None:
            continue
        assert g.dtype == x.dtype, f"{name}: dtype {g.dtype}, want {x.dtype}"
        assert_grads_close(g, w, normwise=normwise, name=name)
    return got


def visible(q_ids, kv_ids):
    """numpy [B, T, S]: where the ids alone let query t see key s."""
    return np.asarray(q_ids)[..., :, None] == np.asarray(kv_ids)[..., None, :]


# (B, T, S, N, K, H, kinds): T = S, T > S, T < S, a single query, GQA, MQA, odd sizes.
SHAPES = [
    (3, 37, 37, 4, 2, 16, ("random", "whole", "scattered")),
    (4, 61, 29, 2, 1, 8, ("random", "singles", "extreme", "random")),
    (2, 23, 83, 3, 3, 40, ("random", "scattered")),
    (2, 1, 19, 2, 2, 8, ("scattered", "random")),
    (1, 130, 130, 6, 2, 32, ("random",)),
]
SHAPE_IDS = ["B{}T{}S{}N{}K{}H{}".format(*s[:6]) for s in SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward(rng, shape, dtype):
    """Out and lse against the reference, causal and not, for packings with length-1
    documents, a document spanning the row, padding tails, T != S packed differently, and ids
    in no order."""
    b, t, s, n, kh, h, kinds = shape
    q, k, v = random_qkv(rng, b, t, s, n, kh, h, dtype)
    ids = segs(*packed_ids(rng, kinds, t, s))
    check_forward(q, k, v, **ids)
    check_forward(q, k, v, is_causal=True, **ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2]], ids=SHAPE_IDS[:3])
def test_grads(rng, shape, dtype):
    """dq, dk, dv against jax.vjp of the reference, causal and not."""
    b, t, s, n, kh, h, kinds = shape
    q, k, v = random_qkv(rng, b, t, s, n, kh, h, dtype)
    ids = segs(*packed_ids(rng, kinds, t, s))
    check_grads(rng, q, k, v, **ids)
    check_grads(rng, q, k, v, is_causal=True, **ids)


def test_ids_change_the_result(rng):
    """Kernels that ignored the ids would fail: the result matches the reference with ids,
    differs from attention without them by far more than rounding, and equals attention with
    the ids' equality as an explicit mask."""
    b, t, s = 2, 40, 40
    q, k, v = random_qkv(rng, b, t, s, 4, 2, 16, jnp.float32)
    q_ids = jnp.asarray(np.stack([ids_from_lengths([7, 1, 12, 20], t),
                                  ids_from_lengths([1, 1, 30, 3], t)]))
    ids = segs(q_ids, q_ids)
    for kw in (dict(), dict(is_causal=True)):
        out, _ = check_forward(q, k, v, **kw, **ids)
        plain = np.asarray(jax_flashattn.attention(q, k, v, **kw))
        assert np.max(np.abs(np.asarray(out) - plain)) > 0.1
        mask = jnp.asarray(visible(q_ids, q_ids)[:, None])
        np.testing.assert_allclose(out, jax_flashattn.attention(q, k, v, None, mask, **kw),
                                   rtol=1e-5, atol=1e-6)
    # Each document alone, as its own unpacked call, gives the same rows.
    out = np.asarray(jax_flashattn.attention(q, k, v, is_causal=True, **ids))
    start = 0
    for length in (7, 1, 12, 20):
        piece = slice(start, start + length)
        alone = jax_flashattn.attention(q[:1, piece], k[:1, piece], v[:1, piece], is_causal=True)
        np.testing.assert_allclose(out[:1, piece], alone, rtol=1e-5, atol=1e-6)
        start += length
    grads_with = jax.grad(lambda q: jnp.sum(jax_flashattn.attention(q, k, v, **ids) ** 2))(q)
    grads_without = jax.grad(lambda q: jnp.sum(jax_flashattn.attention(q, k, v) ** 2))(q)
    assert np.max(np.abs(np.asarray(grads_with) - np.asarray(grads_without))) > 0.1


@pytest.mark.parametrize("t,s,dtype", [(33, 33, jnp.float32), (47, 26, jnp.bfloat16),
                                       (26, 47, jnp.float32)], ids=["T=S-f32", "T>S-bf16",
                                                                    "T<S-f32"])
def test_with_causal_window_lengths_gqa(rng, dtype, t, s):
    """Segments with is_causal (absolute positions), a window, both seq lengths and GQA:
    values, lse and gradients."""
    b, n, kh = 3, 6, 2
    q, k, v = random_qkv(rng, b, t, s, n, kh, 24, dtype)
    ids = segs(*packed_ids(rng, ("random", "scattered", "random"), t, s))
    kw = dict(is_causal=True, local_window_size=(9, 2), query_seq_lengths=jnp.asarray([t, 5, 0]),
              key_value_seq_lengths=jnp.asarray([s - 4, s, 3]), **ids)
    check_forward(q, k, v, **kw)
    check_forward(q, k, v, local_window_size=(3, 11), **ids)
    check_grads(rng, q, k, v, **kw)


@pytest.mark.parametrize("bias_shape,dtype", [((3, 4, 29, 35), jnp.float32),
                                              ((1, 4, 29, 35), jnp.bfloat16),
                                              ((3, 1, 1, 35), jnp.float32),
                                              ((35,), jnp.bfloat16)],
                         ids=["full-f32", "heads-bf16", "keys-f32", "S-bf16"])
def test_with_bias_and_mask(rng, dtype, bias_shape):
    """Segments with a bias and a mask: values, lse, and dq, dk, dv, dbias (in the bias's
    shape) against the reference."""
    b, t, s, n = 3, 29, 35, 4
    q, k, v = random_qkv(rng, b, t, s, n, 2, 16, dtype)
    bias = jnp.asarray(rng.standard_normal(bias_shape, dtype=np.float32), dtype)
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.75)
    ids = segs(*packed_ids(rng, ("random", "whole", "scattered"), t, s))
    check_forward(q, k, v, bias, mask, **ids)
    got = check_grads(rng, q, k, v, bias, mask, is_causal=True, **ids)
    assert got[4].shape == bias_shape and got[4].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_that_see_no_key(rng, dtype):
    """A query whose id no key has, or whose document's keys all lie after it (causal), returns
    exactly 0 with lse -inf; its dq is 0, and keys no query sees get dk = dv = 0."""
    t, s = 9, 11
    q, k, v = random_qkv(rng, 2, t, s, 2, 1, 8, dtype)
    q_ids = jnp.asarray([[0, 0, 5, 5, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3, 3]], jnp.int32)
    kv_ids = jnp.asarray([[1, 1, 0, 0, 0, 2, 2, 7, 7, 2, 1],
                          [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]], jnp.int32)
    ids = segs(q_ids, kv_ids)
    out, lse = jax_flashattn.attention(q, k, v, is_causal=True, return_residual=True, **ids)
    _, want_lse = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                      is_causal=True, return_residual=True, **ids)
    empty = np.isneginf(np.asarray(want_lse))  # [B, T, N]
    # Row 0: ids 0 (keys 2-4 lie after queries 0-1), 5 (no key); row 1 sees every key.
    np.testing.assert_array_equal(empty[..., 0], [[1, 1, 1, 1, 0, 0, 0, 0, 0], [0] * t])
    out32 = np.asarray(out, np.float32)
    assert np.isfinite(out32).all() and (out32[empty] == 0).all()
    assert (out32[~empty] != 0).any(axis=-1).all()
    assert_lse_close(lse, want_lse)
    assert_attention_close(out, q, k, v, is_causal=True, **ids)
    _, dq, dk, dv, _ = check_grads(rng, q, k, v, is_causal=True, **ids)
    dq, dk, dv = (np.asarray(x, np.float32) for x in (dq, dk, dv))
    assert (dq[empty[..., 0]] == 0).all()
    unseen = [2, 3, 4, 7, 8, 9, 10]  # after every query of their id, or (7) an id no query has
    assert (dk[0, unseen] == 0).all() and (dv[0, unseen] == 0).all()
    assert (dk[0, [0, 1, 5, 6]] != 0).any() and (dv[1] != 0).any()
    # Every row empty: all zeros, every lse -inf, every gradient 0.
    none = segs(jnp.zeros((2, t), jnp.int32), jnp.ones((2, s), jnp.int32))
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True, **none)
    assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
    for g in jax.grad(lambda q, k, v: jnp.sum(jax_flashattn.attention(q, k, v, **none)),
                      argnums=(0, 1, 2))(q, k, v):
        assert (np.asarray(g, np.float32) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_documents_longer_than_tiles(rng, dtype):
    """Documents of 59 to 104 positions, so that whole blocks of rows and keys share no id,
    and rows (96 on) whose id no key has: values, lse and every gradient (a full-shape bias's
    included) against the reference, exactly 0 wherever the ids hide a pair."""
    t = s = 200
    q, k, v = random_qkv(rng, 2, t, s, 2, 1, 16, dtype)
    q_ids = np.stack([ids_from_lengths([70, 1, 59, 70], t), np.repeat([0, 9], [96, 104])])
    kv_ids = np.stack([q_ids[0], np.repeat([0, 3], [64, 136])])
    ids = segs(jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
    bias = jnp.asarray(rng.standard_normal((2, 2, t, s), dtype=np.float32), dtype)
    for kw in (dict(), dict(is_causal=True)):
        out, ref_lse = check_forward(q, k, v, bias, **kw, **ids)
        empty = np.isneginf(ref_lse)
        assert empty[1, 96:].all() and not empty[:, :96].any()
        assert (np.asarray(out, np.float32)[empty] == 0).all()
    _, dq, dk, dv, dbias = check_grads(rng, q, k, v, bias, **ids)
    hidden = ~visible(q_ids, kv_ids)[:, None]
    assert (np.asarray(dbias, np.float32)[np.broadcast_to(hidden, dbias.shape)] == 0).all()
    assert (np.asarray(dq, np.float32)[1, 96:] == 0).all()
    assert (np.asarray(dk, np.float32)[1, 64:] == 0).all()
    assert (np.asarray(dv, np.float32)[1, 64:] == 0).all()


def test_zero_size(rng):
    """Empty calls with ids of the matching (empty) shapes: S = 0 rows see no key (0, lse
    -inf), T = 0 gives empty results; with H = 0 every logit is 0, so lse is the log of the
    number of keys the ids (and causality) let a row see."""
    q, k, v = random_qkv(rng, 2, 5, 0, 2, 1, 8, jnp.float32)
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True,
                                       **segs(jnp.zeros((2, 5), jnp.int32),
                                              jnp.zeros((2, 0), jnp.int32)))
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    q, k, v = random_qkv(rng, 2, 0, 6, 2, 1, 8, jnp.float32)
    out = jax_flashattn.attention(q, k, v, **segs(jnp.zeros((2, 0), jnp.int32),
                                                  jnp.zeros((2, 6), jnp.int32)))
    assert out.shape == q.shape
    t, s = 7, 9
    q, k, v = random_qkv(rng, 2, t, s, 2, 1, 0, jnp.float32)
    q_ids, kv_ids = packed_ids(rng, ("random", "scattered"), t, s)
    out, lse = jax_flashattn.attention(q, k, v, is_causal=True, return_residual=True,
                                       **segs(q_ids, kv_ids))
    seen = visible(q_ids, kv_ids) & (np.arange(s)[None, :] <= np.arange(t)[:, None])
    with np.errstate(divide="ignore"):
        want = np.log(seen.sum(-1).astype(np.float64))  # [B, T]
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(lse), np.repeat(want[..., None], 2, -1), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unbatched(rng, dtype):
    """[T] and [S] ids with [T, N, H] inputs: the batched call's values, the reference's, and
    the reference's gradients."""
    t, s = 31, 22
    q, k, v = random_qkv(rng, None, t, s, 4, 2, 16, dtype)
    q_ids, kv_ids = (x[0] for x in packed_ids(rng, ("random",), t, s))
    ids = segs(q_ids, kv_ids)
    out, lse = check_forward(q, k, v, is_causal=True, **ids)
    assert out.shape == (t, 4, 16) and lse.shape == (t, 4)
    batched = jax_flashattn.attention(q[None], k[None], v[None], is_causal=True,
                                      **segs(q_ids[None], kv_ids[None]))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(batched[0], np.float32))
    check_grads(rng, q, k, v, **ids)


def test_jit(rng):
    """Ids as traced arguments of a jitted function: the eager values and gradients."""
    q, k, v = random_qkv(rng, 2, 27, 35, 4, 2, 16, jnp.float32)
    q_ids, kv_ids = packed_ids(rng, ("random", "scattered"), 27, 35)

    def loss(q, k, v, qi, ki):
        return jnp.sum(jnp.sin(jax_flashattn.attention(q, k, v, is_causal=True, **segs(qi, ki))))

    fn = lambda q, k, v, qi, ki: jax_flashattn.attention(  # noqa: E731
        q, k, v, is_causal=True, return_residual=True, **segs(qi, ki))
    got = jax.jit(fn)(q, k, v, q_ids, kv_ids)
    want = fn(q, k, v, q_ids, kv_ids)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert_attention_close(got[0], q, k, v, is_causal=True, **segs(q_ids, kv_ids))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    for g, w in zip(jax.jit(grad)(q, k, v, q_ids, kv_ids), grad(q, k, v, q_ids, kv_ids)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Other ids, same shapes: the same compiled function, other results.
    other = jax.jit(fn)(q, k, v, jnp.zeros_like(q_ids), jnp.zeros_like(kv_ids))
    np.testing.assert_allclose(other[0], jax_flashattn.attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)


def test_vmap(rng):
    """vmap over an extra leading dim of q, k, v and both ids (values, lse and gradients equal
    the per-slice calls); and over the ids alone (on other axes), q, k, v shared."""
    lead, b, t, s = 3, 2, 19, 25
    q, k, v = random_qkv(rng, (lead, b), t, s, 4, 2, 8, jnp.float32)
    pairs = [packed_ids(rng, kinds, t, s) for kinds in
             (("random", "whole"), ("scattered", "random"), ("singles", "extreme"))]
    q_ids, kv_ids = (jnp.stack(x) for x in zip(*pairs))

    def fn(q, k, v, qi, ki):
        return jax_flashattn.attention(q, k, v, is_causal=True, local_window_size=(6, 2),
                                       return_residual=True, **segs(qi, ki))

    out, lse = jax.vmap(fn)(q, k, v, q_ids, kv_ids)
    for i in range(lead):
        want_out, want_lse = fn(q[i], k[i], v[i], q_ids[i], kv_ids[i])
        np.testing.assert_allclose(out[i], want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-5, atol=1e-6)
        assert_attention_close(out[i], q[i], k[i], v[i], is_causal=True,
                               local_window_size=(6, 2), **segs(q_ids[i], kv_ids[i]))

    def loss(q, k, v, qi, ki):
        return jnp.sum(jnp.sin(fn(q, k, v, qi, ki)[0]))

    got = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, q_ids, kv_ids)
    for i in range(lead):
        want = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], q_ids[i], kv_ids[i])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-6)
    shared = jax.vmap(fn, in_axes=(None, None, None, 1, 2))(
        q[0], k[0], v[0], jnp.moveaxis(q_ids, 0, 1), jnp.moveaxis(kv_ids, 0, 2))
    for i in range(lead):
        np.testing.assert_allclose(shared[0][i], fn(q[0], k[0], v[0], q_ids[i], kv_ids[i])[0],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, "host_int64",
                                   "list"], ids=str)
def test_id_dtypes(rng, dtype):
    """int8, int16, uint8, uint16 JAX arrays and host int64 / Python lists give what int32 ids
    give."""
    q, k, v = random_qkv(rng, 2, 13, 17, 2, 1, 8, jnp.float32)
    q_ids = rng.integers(0, 4, (2, 13)).astype(np.int32)
    kv_ids = rng.integers(0, 4, (2, 17)).astype(np.int32)
    want = jax_flashattn.attention(q, k, v, **segs(jnp.asarray(q_ids), jnp.asarray(kv_ids)))
    if dtype == "host_int64":
        given = (q_ids.astype(np.int64), kv_ids.astype(np.int64))
    elif dtype == "list":
        given = (q_ids.tolist(), kv_ids.tolist())
    else:
        given = (jnp.asarray(q_ids, dtype), jnp.asarray(kv_ids, dtype))
    np.testing.assert_array_equal(jax_flashattn.attention(q, k, v, **segs(*given)), want)
    assert_attention_close(want, q, k, v, **segs(q_ids, kv_ids))


@pytest.mark.parametrize("case", ["causal", "window_bias_mask", "gqa_unbatched"])
def test_xla_agrees_with_kernels(rng, case):
    """implementation="xla" (the ids as a mask for jax.nn) against the kernels, values and
    gradients; the query and key ids are equal, so every row sees at least its own key."""
    b, t, n, kh = 2, 29, 4, 2
    args, kw = (), dict(is_causal=case == "causal")
    if case == "gqa_unbatched":
        q, k, v = random_qkv(rng, None, t, t, 6, 2, 16, jnp.float32)
        ids = jnp.asarray(row_ids(rng, "random", t))
    else:
        q, k, v = random_qkv(rng, b, t, t, n, kh, 16, jnp.float32)
        ids = packed_ids(rng, ("random", "scattered"), t, t)[0]
    if case == "window_bias_mask":
        mask = rng.random((b, 1, t, t)) < 0.7
        mask[..., np.arange(t), np.arange(t)] = True
        args = (jnp.asarray(rng.standard_normal((1, n, t, t), dtype=np.float32)),
                jnp.asarray(mask))
        kw = dict(local_window_size=(5, 3))

    @jax.jit
    def run(q, k, v, ids):
        def loss(impl):
            def f(q, k, v):
                out = jax_flashattn.attention(q, k, v, *args, implementation=impl,
                                              **segs(ids, ids), **kw)
                return jnp.sum(jnp.sin(out)), out
            return jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return loss(None), loss("xla")

    with jax.default_matmul_precision("highest"):
        (got_grads, got), (want_grads, want) = run(q, k, v, ids)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert_attention_close(got, q, k, v, *args, **segs(ids, ids), **kw)


def test_kernel_family_queries():
    """forward_kernel / backward_kernel take the ids and answer "cpu" on the host."""
    q = jax.ShapeDtypeStruct((2, 10, 4, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 10), jnp.int32)
    cpu = jax.devices("cpu")[0]
    assert jax_flashattn.forward_kernel(q, q, query_segment_ids=ids, key_value_segment_ids=ids,
                                        device=cpu) == "cpu"
    assert jax_flashattn.backward_kernel(q, q, query_segment_ids=ids, key_value_segment_ids=ids,
                                         device=cpu) == "cpu"


# ----------------------------------------------------------------------------------------------
# Errors


def _wide_ids(shape):
    with jax.enable_x64(True):
        ids = jnp.zeros(shape, jnp.int64)
    assert ids.dtype == jnp.int64
    return ids


B, T, S = 2, 7, 9


def _z(*shape, dtype=np.int32):
    return np.zeros(shape, dtype)


# name -> (q_ids, kv_ids, unbatched inputs, exception, the argument the message names); "wide"
# stands for an int64 JAX array of the right shape.
ERROR_CASES = {
    "query_missing": (None, _z(B, S), False, ValueError, "query_segment_ids"),
    "key_missing": (_z(B, T), None, False, ValueError, "key_value_segment_ids"),
    "query_length": (_z(B, T + 1), _z(B, S), False, ValueError, "query_segment_ids"),
    "key_length": (_z(B, T), _z(B, T), False, ValueError, "key_value_segment_ids"),
    "query_batch": (_z(1, T), _z(B, S), False, ValueError, "query_segment_ids"),
    "key_rank": (_z(B, T), _z(B, S, 1), False, ValueError, "key_value_segment_ids"),
    "unbatched_given_batched": (_z(1, T), _z(S), True, ValueError, "query_segment_ids"),
    "batched_given_unbatched": (_z(B, T), _z(S), False, ValueError, "key_value_segment_ids"),
    "query_float": (_z(B, T, dtype=np.float32), _z(B, S), False, TypeError,
                    "query_segment_ids"),
    "key_bool": (_z(B, T), _z(B, S, dtype=bool), False, TypeError, "key_value_segment_ids"),
    "query_int64_jax": ("wide", _z(B, S), False, TypeError, "query_segment_ids"),
    "key_int64_jax": (_z(B, T), "wide", False, TypeError, "key_value_segment_ids"),
    "key_host_too_wide": (_z(B, T), np.full((B, S), 2**31), False, ValueError,
                          "key_value_segment_ids"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(ERROR_CASES), ids=str)
def test_bad_ids_raise(rng, case, jit):
    """Each bad pair of ids raises the documented exception, naming the argument, at trace time
    (eagerly and under jit); an int64 JAX array is refused for its dtype alone."""
    q_ids, kv_ids, unbatched, error, name = ERROR_CASES[case]
    q, k, v = random_qkv(rng, None if unbatched else B, T, S, 2, 1, 8, jnp.float32)
    if isinstance(q_ids, str):
        q_ids = _wide_ids((B, T))
    if isinstance(kv_ids, str):
        kv_ids = _wide_ids((B, S))
    fn = lambda q, k, v: jax_flashattn.attention(q, k, v, **segs(q_ids, kv_ids))  # noqa: E731
    with pytest.raises(error, match=name) as info:
        (jax.jit(fn) if jit else fn)(q, k, v)
    if case.endswith("missing"):
        assert "missing" in str(info.value)


def test_missing_ids_raise_in_reference_and_ring_paths(rng):
    """The reference takes the ids with the same checks as the kernels."""
    q, k, v = random_qkv(rng, B, T, S, 2, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="key_value_segment_ids"):
        reference.attention(q, k, v, query_segment_ids=jnp.zeros((B, T), jnp.int32))
    with pytest.raises(TypeError, match="query_segment_ids"):
        reference.attention(q, k, v, **segs(jnp.zeros((B, T)), jnp.zeros((B, S), jnp.int32)))
