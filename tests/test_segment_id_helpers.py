"""The segment-id helpers segment_ids_from_lengths / _offsets, the spans the kernels narrow
their tiles to, and the memory a packed call costs (no [T, S] tensor)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import jaxpr_sizes, random_qkv
from packing import ids_from_lengths, packed_ids, segs


def test_ids_from_lengths_exact():
    """Documents numbered in row order, zero-length documents taking no position, the padding
    past the last document getting M; batched lengths give batched ids; int32."""
    f = jax_flashattn.segment_ids_from_lengths
    cases = [
        ([3, 0, 1, 2], 9, [0, 0, 0, 2, 3, 3, 4, 4, 4]),
        ([0, 2], 3, [1, 1, 2]),
        ([4], 4, [0, 0, 0, 0]),
        ([1, 1, 1], 5, [0, 1, 2, 3, 3]),
        ([2, 5], 4, [0, 0, 1, 1]),  # longer than the row: cut at `total`
        ([0, 0], 2, [2, 2]),
    ]
    for lengths, total, want in cases:
        got = f(jnp.asarray(lengths, jnp.int32), total)
        assert got.dtype == jnp.int32 and got.shape == (total,)
        np.testing.assert_array_equal(got, want, err_msg=str(lengths))
    batched = f(np.array([[[2, 3], [5, 0]], [[0, 1], [6, 0]]], np.int64), 6)
    np.testing.assert_array_equal(batched, [[[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 2]],
                                            [[1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0]]])
    np.testing.assert_array_equal(f(jnp.asarray([2, 1], jnp.uint8), 0), np.zeros(0, np.int32))


def test_ids_from_offsets_exact():
    """Document j holds [offsets[j], offsets[j + 1]); positions at or past offsets[M] get M;
    positions before offsets[0] belong to document 0; batched offsets give batched ids."""
    f = jax_flashattn.segment_ids_from_offsets
    cases = [
        ([0, 3, 3, 4, 6], 8, [0, 0, 0, 2, 3, 3, 4, 4]),
        ([0, 0, 2], 3, [1, 1, 2]),
        ([0, 5], 5, [0, 0, 0, 0, 0]),
        ([2, 4], 5, [0, 0, 0, 0, 1]),
        ([0], 3, [0, 0, 0]),
        ([0, 1, 2, 3], 3, [0, 1, 2]),
    ]
    for offsets, total, want in cases:
        got = f(jnp.asarray(offsets, jnp.int32), total)
        assert got.dtype == jnp.int32 and got.shape == (total,)
        np.testing.assert_array_equal(got, want, err_msg=str(offsets))
    batched = f(jnp.asarray([[0, 2, 5], [0, 0, 4]], jnp.int16), 5)
    np.testing.assert_array_equal(batched, [[0, 0, 1, 1, 1], [1, 1, 1, 1, 2]])


def test_ids_helpers_agree_and_jit(rng):
    """For random lengths (zeros included), the two helpers agree with each other and with
    the ids built by hand, eagerly and under jit (total static)."""
    lengths = rng.integers(0, 6, (3, 7)).astype(np.int32)
    lengths[:, 2] = 0
    total = 30
    offsets = np.concatenate([np.zeros((3, 1), np.int32), np.cumsum(lengths, -1)], -1)
    want = np.stack([ids_from_lengths(row[row > 0], total) for row in lengths])
    # ids_from_lengths numbers only the non-empty documents: renumber to the slots given.
    for i, row in enumerate(lengths):
        slots = np.flatnonzero(row > 0)
        want[i] = np.where(want[i] < len(slots), slots[np.minimum(want[i], len(slots) - 1)],
                           len(row))
    from_lengths = jax.jit(jax_flashattn.segment_ids_from_lengths, static_argnums=1)
    from_offsets = jax.jit(jax_flashattn.segment_ids_from_offsets, static_argnums=1)
    for got in (from_lengths(lengths, total), from_offsets(offsets, total),
                jax_flashattn.segment_ids_from_lengths(lengths, total),
                jax_flashattn.segment_ids_from_offsets(offsets, total)):
        np.testing.assert_array_equal(got, want)


def test_ids_helpers_feed_attention(rng):
    """Ids from document lengths in a jitted training step: each document attends alone, as
    its own causal call does."""
    t, lengths = 24, [5, 1, 0, 11]
    q, k, v = random_qkv(rng, 1, t, t, 2, 2, 8, jnp.float32)

    @jax.jit
    def step(q, k, v, lengths):
        ids = jax_flashattn.segment_ids_from_lengths(lengths, t)[None]
        return jax_flashattn.attention(q, k, v, is_causal=True, **segs(ids, ids))

    out = np.asarray(step(q, k, v, jnp.asarray(lengths, jnp.int32)))
    start = 0
    for length in lengths + [t - sum(lengths)]:  # the padding tail is a document too
        piece = slice(start, start + length)
        if length:
            alone = jax_flashattn.attention(q[:, piece], k[:, piece], v[:, piece], is_causal=True)
            np.testing.assert_allclose(out[:, piece], alone, rtol=1e-5, atol=1e-6)
        start += length


@pytest.mark.parametrize("call", [
    lambda: jax_flashattn.segment_ids_from_lengths(jnp.asarray([1.0, 2.0]), 4),
    lambda: jax_flashattn.segment_ids_from_lengths(jnp.asarray(3), 4),
    lambda: jax_flashattn.segment_ids_from_lengths(jnp.asarray([1, 2]), 4.0),
    lambda: jax_flashattn.segment_ids_from_offsets(jnp.asarray([0.0, 2.0]), 4),
    lambda: jax_flashattn.segment_ids_from_offsets(jnp.zeros((2, 0), jnp.int32), 4),
    lambda: jax_flashattn.segment_ids_from_offsets(jnp.asarray([0, 2]), True),
], ids=["float_lengths", "scalar_lengths", "float_total", "float_offsets", "empty_offsets",
        "bool_total"])
def test_ids_helpers_reject_bad_input(call):
    """Non-integer or scalar lengths/offsets and a total that is not an integer raise
    TypeError."""
    with pytest.raises(TypeError, match="lengths|offsets|total"):
        call()


def test_ids_helpers_total():
    """A negative total is a ValueError; a numpy integer total is taken."""
    with pytest.raises(ValueError, match="total"):
        jax_flashattn.segment_ids_from_lengths(jnp.asarray([1, 2]), -1)
    np.testing.assert_array_equal(
        jax_flashattn.segment_ids_from_lengths(jnp.asarray([1, 2]), np.int64(4)), [0, 1, 1, 2])


@pytest.mark.parametrize("kinds", [("random", "whole", "singles"), ("scattered", "extreme")])
@pytest.mark.parametrize("t,s", [(37, 37), (64, 100), (129, 16), (1, 33)])
def test_spans_hold_every_visible_pair(rng, kinds, t, s):
    """segments.spans, which the kernels narrow their tiles to: each granule's span holds every
    position of the other side that one of its positions sees, and where the ids do not
    decrease ("random", "whole", "singles": each granule's ids a run of integers) it is the
    visible positions' extent rounded out to granules, empty where there are none."""
    from jax_flashattn import segments
    q_ids, kv_ids = packed_ids(rng, kinds, t, s)
    key_spans, query_spans = (np.asarray(x) for x in segments.spans(q_ids, kv_ids))
    g = segments.GRANULE
    assert key_spans.shape == (len(kinds), -(-t // g), 2)
    assert query_spans.shape == (len(kinds), -(-s // g), 2)
    sees = q_ids[:, :, None] == kv_ids[:, None, :]
    for spans, visible, length in ((key_spans, sees, s),
                                   (query_spans, sees.transpose(0, 2, 1), t)):
        for b, kind in enumerate(kinds):
            for i, (lo, hi) in enumerate(spans[b]):
                seen = np.flatnonzero(visible[b, i * g:(i + 1) * g].any(axis=0))
                if seen.size == 0:
                    if kind in ("random", "whole", "singles"):
                        assert lo >= hi, (b, i, lo, hi)
                    continue
                assert lo <= seen[0] and seen[-1] < hi, (b, i, lo, hi, seen)
                if kind in ("random", "whole", "singles"):  # each granule's ids: a run
                    assert lo == seen[0] - seen[0] % g, (b, i, lo, seen[0])
                    assert hi == min(length, seen[-1] - seen[-1] % g + g), (b, i, hi, seen[-1])


def test_no_t_by_s_tensor(rng):
    """Packed rows cost no [B, T, S] mask: nothing in the gradient computation with segment ids
    is as large as T S / 16 (the ids' spans are [T / 16, S / 16] per row), and the compiled
    gradient's temporary memory stays below one byte per (t, s) pair."""
    b, t, s, n, h = 1, 512, 640, 2, 8
    q, k, v = random_qkv(rng, b, t, s, n, n, h, jnp.float32)
    q_ids, kv_ids = packed_ids(rng, ["random"], t, s)

    def loss(q, k, v):
        out = jax_flashattn.attention(q, k, v, is_causal=True, query_segment_ids=q_ids,
                                      key_value_segment_ids=kv_ids)
        return jnp.sum(out ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    jaxpr = jax.make_jaxpr(grad)(q, k, v)

    big = [(size, prim) for size, prim in jaxpr_sizes(jaxpr.jaxpr) if size >= b * t * s // 16]
    assert not big, f"[T, S]-sized intermediates: {big}"
    temp = jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    assert temp < b * t * s, temp
