"""Boolean masks with whole tiles hidden: the spans the kernels narrow their tiles to
(segments.mask_spans: each granule of 16 rows' keys from the first kept key to the last, and
each granule of keys' rows), that every masked call hands them to the kernels, and values and
gradients of such calls against the float32 reference (the CPU kernels narrow their tiles to the
spans as the CUDA kernels do; the GPU versions are in test_gpu_mask_spans.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import segments
from helpers import assert_attention_close, assert_grads_close, grads, random_qkv, reference_grads
from packing import ids_from_lengths, random_lengths
from test_segment_ids import check_forward, check_grads


def structured_mask(rng, kind, b, n, t, s):
    """bool [b, n, t, s] of one structure: "documents" (block diagonal, random lengths, a
    padding tail), "prefix" (prefix-LM: a random prefix seen by all, causal after it), "band"
    (a window around a diagonal that may leave the keys), "rows" (random rows and heads hidden
    whole, the rest random), "keys" (each batch entry's keys past a random length hidden)."""
    rows, keys = np.arange(t)[:, None], np.arange(s)[None, :]
    mask = np.zeros((b, n, t, s), bool)
    for i in range(b):
        for h in range(n):
            if kind == "documents":
                lengths = random_lengths(rng, min(t, s))
                q_ids = ids_from_lengths(lengths, t)
                kv_ids = ids_from_lengths(lengths, s)
                mask[i, h] = q_ids[:, None] == kv_ids[None, :]
            elif kind == "prefix":
                prefix = int(rng.integers(0, s + 1))
                mask[i, h] = (keys < prefix) | (keys <= rows + (s - t))
            elif kind == "band":
                centre = rows * s // max(t, 1) + int(rng.integers(-40, 41))
                width = int(rng.integers(1, 60))
                mask[i, h] = np.abs(keys - centre) <= width
            elif kind == "rows":
                mask[i, h] = rng.random((t, s)) < 0.5
                mask[i, h, rng.random(t) < 0.3] = False
                if rng.random() < 0.3:
                    mask[i, h] = False
            elif kind == "keys":
                mask[i, h] = keys < int(rng.integers(0, s + 1))
    return mask


KINDS = ["documents", "prefix", "band", "rows", "keys"]


def spans_of(mask, t, s):
    """The spans as the kernels take them from a bool mask [..., Bm, Nm, Tm, Sm]."""
    return tuple(np.asarray(x) for x in segments.mask_spans(jnp.asarray(mask), t, s))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t,s", [(37, 37), (64, 100), (129, 16), (1, 33), (200, 45)])
def test_mask_spans_are_each_granules_kept_extent(rng, kind, t, s):
    """Each granule of 16 rows: [first kept key, last kept key + 1) over its rows and every
    head, (s, 0) where it keeps none; each granule of keys: the rows whose extent (first to
    last kept key) meets it, first to last + 1, (t, 0) for none. So every kept pair lies in
    both spans, and a key granule's span holds exactly the rows that keep one of its keys
    where each row's kept keys are contiguous (all kinds but "documents" and "rows")."""
    mask = structured_mask(rng, kind, 2, 3, t, s)
    key_spans, query_spans = spans_of(mask, t, s)
    g = segments.GRANULE
    assert key_spans.shape == (2, -(-t // g), 2) and key_spans.dtype == np.int32
    assert query_spans.shape == (2, -(-s // g), 2) and query_spans.dtype == np.int32
    keep = mask.any(axis=1)
    for b in range(2):
        first = np.where(keep[b].any(axis=1), keep[b].argmax(axis=1), s)
        last = np.where(keep[b].any(axis=1), s - keep[b][:, ::-1].argmax(axis=1), 0)
        for i, (lo, hi) in enumerate(key_spans[b]):
            seen = np.flatnonzero(keep[b, i * g:(i + 1) * g].any(axis=0))
            want = (seen[0], seen[-1] + 1) if seen.size else (s, 0)
            assert (lo, hi) == want, (b, i, lo, hi, want)
        for j, (lo, hi) in enumerate(query_spans[b]):
            meets = np.flatnonzero((first < min(s, (j + 1) * g)) & (last > j * g))
            want = (meets[0], meets[-1] + 1) if meets.size else (t, 0)
            assert (lo, hi) == want, (b, j, lo, hi, want)
            kept = np.flatnonzero(keep[b, :, j * g:(j + 1) * g].any(axis=1))
            assert kept.size == 0 or (lo <= kept[0] and kept[-1] < hi), (b, j, lo, hi)
            if kind in ("prefix", "band", "keys") and kept.size:
                assert (lo, hi) == (kept[0], kept[-1] + 1), (b, j, lo, hi, kept)


@pytest.mark.parametrize("shape", [(2, 3, 40, 50), (1, 1, 40, 50), (2, 1, 1, 50),
                                   (1, 3, 40, 1), (2, 1, 40, 50)])
def test_mask_spans_of_broadcast_masks(rng, shape):
    """A mask broadcast over rows, keys, heads or batch gives the spans of its full form."""
    t, s = 40, 50
    mask = rng.random(shape) < 0.05
    mask[..., :3, :] = False
    full = np.broadcast_to(mask, (shape[0], 3, t, s))
    for got, want in zip(spans_of(mask, t, s), spans_of(full, t, s)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("t,s", [(0, 20), (20, 0), (0, 0)])
def test_mask_spans_of_no_rows_or_no_keys(t, s):
    """No query rows, or no keys: spans of their granules' count (none, or all empty)."""
    key_spans, query_spans = spans_of(np.ones((2, 1, t, s), bool), t, s)
    assert key_spans.shape == (2, -(-t // 16), 2) and query_spans.shape == (2, -(-s // 16), 2)
    assert (key_spans[..., 0] >= key_spans[..., 1]).all()
    assert (query_spans[..., 0] >= query_spans[..., 1]).all()


def test_masked_call_hands_the_kernel_its_spans(rng):
    """A masked call's custom call carries the spans (has_spans, two more int32 operands of
    the documented shapes); a call without a mask or segment ids carries none."""
    q, k, v = random_qkv(rng, 2, 40, 50, 2, 2, 16, jnp.float32)
    mask = jnp.asarray(structured_mask(rng, "documents", 2, 1, 40, 50))
    masked = jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, mask=mask))
    text = masked.lower(q, k, v).as_text()
    assert "has_spans = 1" in text
    assert "tensor<2x3x2xi32>" in text and "tensor<2x4x2xi32>" in text
    plain = jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v)).lower(q, k, v).as_text()
    assert "has_spans = 0" in plain


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_structured_masks(rng, kind, dtype):
    """Values, lse and gradients under each structure, a mask per batch entry and head, GQA,
    T != S, neither a multiple of the tiles."""
    t, s = 150, 171
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 32, dtype)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 4, t, s))
    check_forward(q, k, v, mask=mask)
    check_grads(rng, q, k, v, mask=mask)


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(local_window_size=(30, 5)),
                                     dict(query_seq_lengths=jnp.array([150, 61], jnp.int32),
                                          key_value_seq_lengths=jnp.array([90, 171], jnp.int32)),
                                     dict(bias=True)],
                         ids=["causal", "window", "lengths", "bias"])
def test_structured_masks_beside_other_options(rng, options):
    """The spans beside the bounds, the lengths and a bias (whose gradient is 0 at the pairs
    of the tiles the spans skip)."""
    t, s = 150, 171
    options = dict(options)
    q, k, v = random_qkv(rng, 2, t, s, 2, 2, 32, jnp.float32)
    mask = jnp.asarray(structured_mask(rng, "documents", 2, 1, t, s))
    bias = None
    if options.pop("bias", False):
        bias = jnp.asarray(rng.standard_normal((2, 2, t, s)), jnp.float32)
    check_forward(q, k, v, bias, mask=mask, **options)
    check_grads(rng, q, k, v, bias, mask=mask, **options)


def test_mask_beside_segment_ids(rng):
    """Segment ids and a mask together: the kernels take the keys and rows both allow."""
    t = 150
    q, k, v = random_qkv(rng, 2, t, t, 2, 2, 32, jnp.float32)
    ids = jnp.asarray(np.stack([ids_from_lengths(random_lengths(rng, t), t) for _ in range(2)]))
    mask = jnp.asarray(structured_mask(rng, "band", 2, 1, t, t))
    options = dict(query_segment_ids=ids, key_value_segment_ids=ids, is_causal=True)
    check_forward(q, k, v, mask=mask, **options)
    check_grads(rng, q, k, v, mask=mask, **options)


def test_structured_mask_under_vmap(rng):
    """A vmapped masked call: each mapped entry's own spans."""
    t, s = 70, 90
    q, k, v = random_qkv(rng, (3, 2), t, s, 2, 2, 16, jnp.float32)
    mask = jnp.asarray(np.stack([structured_mask(rng, kind, 2, 1, t, s)
                                 for kind in ("documents", "band", "keys")]))
    got = jax.vmap(lambda q, k, v, m: jax_flashattn.attention(q, k, v, mask=m))(q, k, v, mask)
    for i in range(3):  # shapes of its own: the reference as one program, for the three entries
        assert_attention_close(got[i], q[i], k[i], v[i], mask=mask[i], jit_reference=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_keys_past_every_span_are_never_read(rng, dtype):
    """Keys that no row keeps past each entry's last kept one (a cache's unfilled tail) are
    never read: with K and V NaN there, values and gradients stay the reference's on the clean
    cache (a kernel that visited those keys would carry 0 x NaN into the rows)."""
    t, s = 70, 200
    q, k, v = random_qkv(rng, 2, t, s, 2, 2, 16, dtype)
    filled = np.array([37, 130])
    kept = np.arange(s)[None, :] < filled[:, None]
    mask = jnp.asarray(kept[:, None, None, :] & (rng.random((2, 1, t, s)) < 0.7))
    tail = ~kept[:, :, None, None]
    poisoned_k, poisoned_v = (jnp.where(tail, jnp.nan, x) for x in (k, v))
    out = jax_flashattn.attention(q, poisoned_k, poisoned_v, mask=mask)
    assert_attention_close(out, q, k, v, mask=mask, jit_reference=True)  # shapes of its own
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), dtype)
    got = grads(jax_flashattn.attention, q, poisoned_k, poisoned_v, None, d_out, mask=mask)
    want = reference_grads(q, k, v, None, d_out, mask=mask)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_grads_close(g, w, normwise=normwise, name=name)
