"""diagonal_alignment="bottom_right": query i sits at position i + S - T for the causal mask and
the window, with seq lengths at i + kv_len - q_len of its batch entry. Checked against an
independent mask, then the kernels (values, lse, gradients) against the float32 reference with
every option it combines with, through implementation="xla", the Flax adapters, batch and
sequence sharding and ring attention, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn
from jax_flashattn import flax as jfa_flax
from jax_flashattn import reference, sharding
from helpers import (assert_attention_close, assert_grads_close, assert_lse_close, grads,
                     random_qkv, reference_grads)

N, K, H = 4, 2, 24
BR = dict(diagonal_alignment="bottom_right")
# (T, S): a prefill against a longer cache, more queries than keys, one query (decoding).
SHAPES = [(37, 70), (70, 37), (1, 53)]
OPTIONS = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(9, 4)),
    "causal_window": dict(is_causal=True, local_window_size=(30, 2)),
}


def shifted_mask(t, s, shift, is_causal=False, window=None):
    """[T, S] with numpy: key j visible from query i at position i + shift."""
    pos = np.arange(t)[:, None] + shift
    j = np.arange(s)[None, :]
    keep = np.ones((t, s), bool)
    if is_causal:
        keep &= j <= pos
    if window is not None:
        keep &= (pos - window[0] <= j) & (j <= pos + window[1])
    return keep


def bottom_right_mask(t, s, is_causal=False, window=None):
    """[T, S]: key j visible from query i at position i + S - T, built with numpy."""
    return shifted_mask(t, s, s - t, is_causal, window)


def lengths_mask(t, s, q_lens, kv_lens, is_causal=False, window=None):
    """[B, 1, T, S] for bottom-right alignment with seq lengths, built with numpy, entry by
    entry: query i of entry b sits at i + kv_len - q_len (each length clamped to [0, T] or
    [0, S], T or S where None), sees keys below kv_len, and rows from q_len on see nothing."""
    b = len(q_lens if q_lens is not None else kv_lens)
    keep = np.zeros((b, 1, t, s), bool)
    for e in range(b):
        q_len = t if q_lens is None else min(max(int(q_lens[e]), 0), t)
        kv_len = s if kv_lens is None else min(max(int(kv_lens[e]), 0), s)
        keep[e, 0, :q_len, :kv_len] = shifted_mask(q_len, kv_len, kv_len - q_len, is_causal,
                                                   window)
    return keep


def random_lengths(rng, t, s, b=4):
    """Per-entry (q_lens, kv_lens): the full lengths; an entry without queries or one without
    keys (drawn which); both lengths drawn, each at least 1, so that a shift kv_len - q_len of
    either sign meets a query length below T; more queries than keys, both drawn (where T > 1:
    the first rows see nothing under a causal mask); the rest drawn."""
    q_lens = rng.integers(0, t + 1, b)
    kv_lens = rng.integers(0, s + 1, b)
    no_queries = rng.integers(2) == 0
    q_more = int(rng.integers(min(2, t), t + 1))
    q_lens[:4] = t, 0 if no_queries else rng.integers(1, t + 1), rng.integers(1, t + 1), q_more
    kv_lens[:4] = (s, rng.integers(1, s + 1) if no_queries else 0, rng.integers(1, s + 1),
                   rng.integers(1, max(1, min(s, q_more - 1)) + 1))
    return q_lens.astype(np.int32), kv_lens.astype(np.int32)


def out_and_grads(fn):
    """fn's output and its vjp of d_out with respect to q, k, v, as one function."""
    def f(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)
    return f


def check_partitioned(kwargs, want, operands, devices):
    """attention(**kwargs) on operands (q, k, v, d_out) split over `devices` devices along the
    batch, then along the sequence: values and gradients as `want`. Returns the mesh."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    attention = jax.jit(out_and_grads(lambda q, k, v: jax_flashattn.attention(q, k, v,
                                                                              **kwargs)))
    for spec in (P("d"), P(None, "d")):
        got = attention(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in operands))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    return mesh


LENGTHS = ["both", "query", "key_value"]
# Left-only and two-sided windows, with and without a causal mask.
LENGTH_OPTIONS = dict(OPTIONS, left=dict(local_window_size=(6, 0)))


def lengths_case(rng, kind, t, s, b=4):
    """(kwargs of attention's lengths, the numpy mask's q_lens and kv_lens) of kind `kind`."""
    q_lens, kv_lens = random_lengths(rng, t, s, b)
    q_lens = None if kind == "key_value" else q_lens
    kv_lens = None if kind == "query" else kv_lens
    kwargs = {}
    if q_lens is not None:
        kwargs["query_seq_lengths"] = jnp.asarray(q_lens)
    if kv_lens is not None:
        kwargs["key_value_seq_lengths"] = jnp.asarray(kv_lens)
    return kwargs, q_lens, kv_lens


@pytest.mark.parametrize("t,s", SHAPES)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_reference_is_the_shifted_mask(rng, t, s, option):
    """The reference's bottom-right alignment is the top-left call with the mask above."""
    q, k, v = random_qkv(rng, 2, t, s, N, K, H, jnp.float32)
    kwargs = OPTIONS[option]
    mask = bottom_right_mask(t, s, kwargs.get("is_causal", False),
                             kwargs.get("local_window_size"))
    want = reference.attention(q, k, v, None, jnp.asarray(mask))
    got = reference.attention(q, k, v, **kwargs, **BR)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", LENGTHS)
@pytest.mark.parametrize("t,s", SHAPES + [(33, 33)])
@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
def test_reference_with_lengths_is_the_shifted_mask(rng, kind, t, s, option):
    """The reference's per-entry alignment is the top-left call with lengths_mask: rows that
    see nothing (padding, q_len > kv_len under a causal mask) give 0 and lse -inf."""
    q, k, v = random_qkv(rng, 4, t, s, N, K, H, jnp.float32)
    kwargs = LENGTH_OPTIONS[option]
    lengths, q_lens, kv_lens = lengths_case(rng, kind, t, s)
    mask = lengths_mask(t, s, q_lens, kv_lens, kwargs.get("is_causal", False),
                        kwargs.get("local_window_size"))
    want, want_lse = reference.attention(q, k, v, None, jnp.asarray(mask), return_residual=True)
    got, got_lse = reference.attention(q, k, v, **kwargs, **lengths, **BR, return_residual=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", LENGTHS)
@pytest.mark.parametrize("t,s", SHAPES + [(33, 33)])
@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
def test_forward_with_lengths(rng, dtype, kind, t, s, option):
    """The kernels against the top-left reference with lengths_mask: values and lse, 0 and
    -inf exactly on the rows that see no key, no NaN."""
    q, k, v = random_qkv(rng, 4, t, s, N, K, H, dtype)
    kwargs = LENGTH_OPTIONS[option]
    lengths, q_lens, kv_lens = lengths_case(rng, kind, t, s)
    mask = jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, kwargs.get("is_causal", False),
                                    kwargs.get("local_window_size")))
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True, **kwargs, **lengths, **BR)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, None, mask))
    unseen = ~np.asarray(mask).any(-1)[:, 0]  # [B, T]
    assert (np.asarray(out, np.float32)[unseen] == 0).all()
    assert np.isneginf(np.asarray(lse)[unseen]).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", LENGTHS)
@pytest.mark.parametrize("t,s", SHAPES[:2] + [(33, 33)])
@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
def test_gradients_with_lengths(rng, dtype, kind, t, s, option):
    q, k, v = random_qkv(rng, 4, t, s, N, K, H, dtype)
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    kwargs = LENGTH_OPTIONS[option]
    lengths, q_lens, kv_lens = lengths_case(rng, kind, t, s)
    mask = jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, kwargs.get("is_causal", False),
                                    kwargs.get("local_window_size")))
    got = grads(jax_flashattn.attention, q, k, v, None, d_out, **kwargs, **lengths, **BR)
    want = reference_grads(q, k, v, None, d_out, mask)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv"), got[:4], want[:4]):
        assert_grads_close(g, w, normwise=normwise, name=name)


def test_lengths_with_mqa_odd_sizes_and_lengths_past_the_sequences(rng):
    """MQA (K = 1), H = 5, and lengths outside [0, T] and [0, S], which the kernels clamp
    (the shift is that of the clamped lengths), values and gradients."""
    t, s = 19, 11
    q, k, v = random_qkv(rng, 3, t, s, 3, 1, 5, jnp.float32)
    q_lens, kv_lens = np.array([t + 4, -2, 7], np.int32), np.array([-1, s + 9, 3], np.int32)
    kwargs = dict(is_causal=True, local_window_size=(4, 1), query_seq_lengths=q_lens,
                  key_value_seq_lengths=kv_lens, **BR)
    mask = jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, True, (4, 1)))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = grads(jax_flashattn.attention, q, k, v, None, d_out, **kwargs)
    want = reference_grads(q, k, v, None, d_out, mask)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got[:4], want[:4]):
        assert_grads_close(g, w, name=name)


def test_lengths_combine_with_bias_mask_segment_ids_and_soft_cap(rng):
    t, s = 30, 50
    q, k, v = random_qkv(rng, 2, t, s, 8, 2, H, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 8, t, s)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, t, s)) > 0.2)
    q_ids = jnp.asarray(np.arange(2 * t).reshape(2, t) // 12, jnp.int32)
    kv_ids = jnp.asarray(np.arange(2 * s).reshape(2, s) // 20, jnp.int32)
    q_lens, kv_lens = np.array([25, 30], np.int32), np.array([50, 17], np.int32)
    kwargs = dict(is_causal=True, local_window_size=(25, 0), logits_soft_cap=3.0,
                  query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
                  query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, **BR)
    keep = mask & jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, True, (25, 0)))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = grads(jax_flashattn.attention, q, k, v, bias, d_out, mask, **kwargs)
    want = reference_grads(q, k, v, bias, d_out, keep, logits_soft_cap=3.0,
                           query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert_grads_close(g, w, name=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,s", SHAPES)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward_matches_reference(rng, dtype, t, s, option):
    q, k, v = random_qkv(rng, 2, t, s, N, K, H, dtype)
    kwargs = dict(OPTIONS[option], **BR)
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True, **kwargs)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, **kwargs))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,s", SHAPES[:2])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gradients_match_reference(rng, dtype, t, s, option):
    q, k, v = random_qkv(rng, 2, t, s, N, K, H, dtype)
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    kwargs = dict(OPTIONS[option], **BR)
    got = grads(jax_flashattn.attention, q, k, v, None, d_out, **kwargs)
    want = reference_grads(q, k, v, None, d_out, **kwargs)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv"), got[:4], want[:4]):
        assert_grads_close(g, w, normwise=normwise, name=name)


def test_what_it_moves(rng):
    """With T < S the last query of a causal call sees every key (a prefill's last token);
    with T > S the first T - S queries see none (out 0, lse -inf); with T == S both alignments
    agree bit for bit."""
    q, k, v = random_qkv(rng, 2, 13, 40, N, K, H, jnp.float32)
    causal = jax_flashattn.attention(q, k, v, is_causal=True, **BR)
    np.testing.assert_array_equal(np.asarray(causal[:, -1:]),
                                  np.asarray(jax_flashattn.attention(q[:, -1:], k, v)))
    top_left = jax_flashattn.attention(q, k, v, is_causal=True)
    assert float(jnp.max(jnp.abs(causal - top_left))) > 1e-2
    q, k, v = random_qkv(rng, 2, 40, 13, N, K, H, jnp.float32)
    out, lse = jax_flashattn.attention(q, k, v, is_causal=True, return_residual=True, **BR)
    assert (np.asarray(out[:, :27]) == 0).all() and np.isneginf(np.asarray(lse[:, :27])).all()
    q, k, v = random_qkv(rng, 2, 33, 33, N, K, H, jnp.float32)
    for kwargs in OPTIONS.values():
        np.testing.assert_array_equal(
            np.asarray(jax_flashattn.attention(q, k, v, **kwargs, **BR)),
            np.asarray(jax_flashattn.attention(q, k, v, **kwargs)))


def test_combines_with_bias_mask_segment_ids_soft_cap_and_gqa(rng):
    q, k, v = random_qkv(rng, 2, 30, 50, 8, 2, H, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 8, 30, 50)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 30, 50)) > 0.2)
    q_ids = jnp.asarray(np.arange(2 * 30).reshape(2, 30) // 12, jnp.int32)
    kv_ids = jnp.asarray(np.arange(2 * 50).reshape(2, 50) // 20, jnp.int32)
    kwargs = dict(is_causal=True, local_window_size=(25, 0), logits_soft_cap=3.0,
                  query_segment_ids=q_ids, key_value_segment_ids=kv_ids, **BR)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = grads(jax_flashattn.attention, q, k, v, bias, d_out, mask, **kwargs)
    want = reference_grads(q, k, v, bias, d_out, mask, **kwargs)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert_grads_close(g, w, name=name)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_xla_implementation_agrees(rng, option):
    """jax.nn has no alignment option: it gets the bottom-right bounds as a mask."""
    q, k, v = random_qkv(rng, 2, 21, 45, N, K, H, jnp.float32)
    kwargs = dict(OPTIONS[option], **BR)
    mask = jnp.asarray(rng.random((2, 1, 21, 45)) > 0.2)
    for args in ((), (None, mask)):
        ours = jax_flashattn.attention(q, k, v, *args, **kwargs)
        xla = jax_flashattn.attention(q, k, v, *args, implementation="xla", **kwargs)
        np.testing.assert_allclose(np.asarray(xla), np.asarray(ours), rtol=2e-5, atol=2e-5)
    unbatched = jax_flashattn.attention(q[0], k[0], v[0], implementation="xla", **kwargs)
    np.testing.assert_allclose(np.asarray(unbatched),
                               np.asarray(jax_flashattn.attention(q, k, v, **kwargs)[0]),
                               rtol=2e-5, atol=2e-5)


def test_under_jit_and_vmap(rng):
    q, k, v = random_qkv(rng, 2, 17, 41, N, K, H, jnp.float32)
    f = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=True, **BR)))
    out = f(q[:, None], k[:, None], v[:, None])[:, 0]
    want = reference.attention(q, k, v, is_causal=True, **BR)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_zero_size_inputs(rng):
    q, k, v = random_qkv(rng, 2, 5, 0, N, K, H, jnp.float32)
    out, lse = jax_flashattn.attention(q, k, v, is_causal=True, return_residual=True, **BR)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_flax_adapters_pass_it_on(rng):
    q, k, v = random_qkv(rng, 2, 12, 30, N, K, H, jnp.float32)
    want = reference.attention(q, k, v, is_causal=True, **BR)
    out = jfa_flax.dot_product_attention(q, k, v, is_causal=True, **BR)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    fn = jfa_flax.make_attention_fn(is_causal=True, **BR)
    np.testing.assert_allclose(np.asarray(fn(q, k, v)), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="diagonal_alignment"):
        jfa_flax.make_attention_fn(diagonal_alignment="bottom-right")


def test_sharded_batch_sequence_and_ring_attention(rng):
    """The global S - T, in the partitioned call (batch or sequence split over 4 devices) and
    in ring attention's steps, both layouts, values and gradients as unsharded. (One test: the
    reference and the partitioned calls do not depend on the ring's layout.)"""
    devices = 4
    q, k, v = random_qkv(rng, 4, 32, 64, N, K, 16, jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(is_causal=True, local_window_size=(40, 0), **BR)

    want = jax.jit(out_and_grads(lambda q, k, v: reference.attention(q, k, v, **kwargs)))(
        q, k, v, d_out)
    mesh = check_partitioned(kwargs, want, (q, k, v, d_out), devices)

    spec = P(None, "d")
    for layout in ("contiguous", "zigzag"):
        ring = jax.jit(jax.shard_map(out_and_grads(
            lambda q, k, v: sharding.ring_attention(q, k, v, axis_name="d", layout=layout,
                                                    **kwargs)),
            mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, (spec,) * 3)))
        operands = (q, k, v, d_out)
        if layout == "zigzag":
            operands = tuple(sharding.zigzag(x, devices) for x in operands)
        got = ring(*operands)
        if layout == "zigzag":
            got = jax.tree.map(lambda x: sharding.unzigzag(x, devices), got)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                       err_msg=layout)


@pytest.mark.parametrize("value,error", [("bottom-right", ValueError), ("BOTTOM_RIGHT", ValueError),
                                         (None, TypeError), (1, TypeError), (True, TypeError)])
def test_bad_values_raise_naming_the_option(rng, value, error):
    q, k, v = random_qkv(rng, 2, 5, 9, N, K, H, jnp.float32)
    for fn in (jax_flashattn.attention, reference.attention):
        with pytest.raises(error, match="diagonal_alignment"):
            fn(q, k, v, diagonal_alignment=value)


def test_seq_lengths_move_each_entry(rng):
    """With lengths each entry's diagonal sits at its own kv_len - q_len: an entry with the
    full lengths is the call without them, T == S included (where the lengths still move the
    others); without a causal mask or window the alignment moves nothing."""
    lens = np.array([9, 4], np.int32)
    for t in (5, 9):
        q, k, v = random_qkv(rng, 2, t, 9, N, K, H, jnp.float32)
        for kwargs in (dict(is_causal=True), dict(local_window_size=(3, 2))):
            whole = jax_flashattn.attention(q, k, v, **kwargs, **BR)
            for lengths in (dict(key_value_seq_lengths=lens),
                            dict(query_seq_lengths=np.minimum(lens, t))):
                out = jax_flashattn.attention(q, k, v, **kwargs, **lengths, **BR)
                np.testing.assert_allclose(np.asarray(out[0]), np.asarray(whole[0]), rtol=1e-6,
                                           atol=1e-6)
                mask = lengths_mask(t, 9, lengths.get("query_seq_lengths"),
                                    lengths.get("key_value_seq_lengths"),
                                    kwargs.get("is_causal", False),
                                    kwargs.get("local_window_size"))
                # Shapes of its own: the reference as one program per t, not ~35 eager ones.
                assert_attention_close(out, q, k, v, None, jnp.asarray(mask), jit_reference=True)
        np.testing.assert_array_equal(
            np.asarray(jax_flashattn.attention(q, k, v, key_value_seq_lengths=lens, **BR)),
            np.asarray(jax_flashattn.attention(q, k, v, key_value_seq_lengths=lens)))


def test_seq_lengths_under_jit_vmap_and_xla(rng):
    """Traced lengths (one compiled call for every value), a vmapped call, and jax.nn's path,
    which gets the per-entry bounds as a [B, 1, T, S] mask (an unbatched call's as [1, T, S]);
    jax.nn averages V on rows that see no key, so those are left out of its comparison."""
    t, s = 21, 45
    q, k, v = random_qkv(rng, 4, t, s, N, K, H, jnp.float32)
    kwargs = dict(is_causal=True, local_window_size=(7, 3), **BR)
    f = jax.jit(lambda q, k, v, ql, kl: jax_flashattn.attention(
        q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, **kwargs))
    for _ in range(2):
        q_lens, kv_lens = random_lengths(rng, t, s)
        mask = jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, True, (7, 3)))
        out = f(q, k, v, q_lens, kv_lens)
        assert_attention_close(out, q, k, v, None, mask, jit_reference=True)  # shapes of its own
        seen = np.asarray(mask).any(-1)[:, 0, :, None, None]
        xla = jax_flashattn.attention(q, k, v, query_seq_lengths=q_lens,
                                      key_value_seq_lengths=kv_lens, implementation="xla",
                                      **kwargs)
        np.testing.assert_allclose(np.where(seen, np.asarray(xla), 0), np.asarray(out),
                                   rtol=2e-5, atol=2e-5)
        vmapped = jax.vmap(lambda q, k, v, ql, kl: jax_flashattn.attention(
            q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, **kwargs))(
            q[:, None], k[:, None], v[:, None], q_lens[:, None], kv_lens[:, None])[:, 0]
        np.testing.assert_allclose(np.asarray(vmapped), np.asarray(out), rtol=1e-6, atol=1e-6)
    unbatched = jax_flashattn.attention(q[1], k[1], v[1], query_seq_lengths=q_lens[1:2],
                                        key_value_seq_lengths=kv_lens[1:2],
                                        implementation="xla", **kwargs)
    mask1 = np.asarray(lengths_mask(t, s, q_lens[1:2], kv_lens[1:2], True, (7, 3)))
    np.testing.assert_allclose(np.where(mask1.any(-1)[0, 0, :, None, None], unbatched, 0),
                               np.asarray(f(q, k, v, q_lens, kv_lens)[1]), rtol=2e-5, atol=2e-5)


def test_seq_lengths_on_sharded_sequences_and_ring_attention(rng):
    """A sequence-sharded call with per-entry alignment runs on the gathered sequences (values
    and gradients as unsharded, batch split too); ring_attention refuses it, naming the way
    out."""
    devices = 4
    t, s = 32, 64
    q, k, v = random_qkv(rng, 4, t, s, N, K, 16, jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    q_lens, kv_lens = random_lengths(rng, t, s)
    kwargs = dict(is_causal=True, local_window_size=(40, 0), query_seq_lengths=q_lens,
                  key_value_seq_lengths=kv_lens, **BR)

    mask = jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, True, (40, 0)))
    want = jax.jit(out_and_grads(lambda q, k, v: reference.attention(q, k, v, None, mask)))(
        q, k, v, d_out)
    mesh = check_partitioned(kwargs, want, (q, k, v, d_out), devices)

    spec = P(None, "d")
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: sharding.ring_attention(q, k, v, axis_name="d", **kwargs),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    with pytest.raises(ValueError, match="ring_attention.*bottom_right.*jax_flashattn.attention"):
        ring(q, k, v)


def test_ring_schedule_takes_the_alignment():
    """ring_schedule plans the pairs a bottom-right causal call sees: row i of T = 32 against
    S = 64 sees i + 33 keys."""
    bottom = sharding.ring_schedule(4, 32, 64, is_causal=True, diagonal_alignment="bottom_right")
    assert sum(bottom.work()) == sum(i + 33 for i in range(32))
    top = sharding.ring_schedule(4, 32, 64, is_causal=True)
    assert sum(top.work()) == sum(i + 1 for i in range(32))
    with pytest.raises(ValueError, match="diagonal_alignment"):
        sharding.ring_schedule(4, 32, 64, diagonal_alignment="bottom")
