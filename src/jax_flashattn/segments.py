"""Segment ids for packed sequences, from document lengths or cu_seqlens-style offsets.

A packed row holds several documents one after another; `attention(...,
query_segment_ids=ids, key_value_segment_ids=ids)` keeps each document's queries on its own
keys. Documents are numbered 0, 1, ... in row order; the positions after the last document
(padding) get the id M, the number of documents given, so they see only each other.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def segment_ids_from_lengths(lengths, total: int) -> jax.Array:
    """int32 ids [..., total] of rows packed with documents of `lengths` [..., M] (integers
    >= 0, in row order; zeros are allowed for unused slots): position i of a row gets the
    index of the document that holds it, or M past the last one. Works under jit."""
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.ndim < 1:
        raise TypeError(f"lengths must be an integer array [..., M], got shape "
                        f"{tuple(lengths.shape)} and dtype {lengths.dtype}")
    ends = jnp.cumsum(lengths.astype(jnp.int32), axis=-1)
    return _ids_from_ends(ends, _total(total))


def segment_ids_from_offsets(offsets, total: int) -> jax.Array:
    """int32 ids [..., total] from cu_seqlens-style `offsets` [..., M + 1] (non-decreasing,
    normally starting at 0): document j holds positions [offsets[j], offsets[j + 1]). Positions
    at or past offsets[M] get M; positions before offsets[0] belong to document 0."""
    offsets = jnp.asarray(offsets)
    if not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.ndim < 1 or \
            offsets.shape[-1] < 1:
        raise TypeError(f"offsets must be an integer array [..., M + 1], got shape "
                        f"{tuple(offsets.shape)} and dtype {offsets.dtype}")
    return _ids_from_ends(offsets[..., 1:].astype(jnp.int32), _total(total))


def _total(total) -> int:
    """The packed row length, a static integer >= 0."""
    if isinstance(total, (bool, np.bool_)) or not isinstance(total, numbers.Integral):
        raise TypeError(f"total must be an integer (the packed row length), got {total!r}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return int(total)


def _ids_from_ends(ends, total: int) -> jax.Array:
    """Position i's id: how many document ends are <= i (ends non-decreasing)."""
    positions = jnp.arange(total, dtype=jnp.int32)
    return jnp.sum(ends[..., None, :] <= positions[:, None], axis=-1, dtype=jnp.int32)


# Positions per span entry: ffi/params.h's kSegmentGranule.
GRANULE = 16


def spans(q_ids, kv_ids):
    """The spans the kernels narrow their tiles to (ffi/params.h q_key_spans, kv_query_spans):
    for q_ids [..., T] and kv_ids [..., S], int32 [..., ceil(T / GRANULE), 2] giving, for each
    GRANULE query rows, [lo, hi) holding every key whose id lies in the range of the rows' ids,
    and int32 [..., ceil(S / GRANULE), 2] the same for each GRANULE keys over the query rows;
    lo >= hi where there is none. Exact on granule bounds where each granule's ids are a run of
    integers that both sides number alike (rows packed with documents 0, 1, ...): then a
    block's keys are the documents its rows are in, and a causal packed row costs about the sum
    of its documents' causal work. Otherwise wider, never narrower (the kernels test each pair
    on the ids themselves). O(T S / GRANULE^2)."""
    q_lo, q_hi = _granule_ranges(q_ids)
    kv_lo, kv_hi = _granule_ranges(kv_ids)
    return (_overlapping(q_lo, q_hi, kv_lo, kv_hi, kv_ids.shape[-1]),
            _overlapping(kv_lo, kv_hi, q_lo, q_hi, q_ids.shape[-1]))


def mask_spans(mask, t: int, s: int):
    """The spans (as `spans` gives them) that a boolean mask [..., Bm, Nm, Tm, Sm] (Tm 1 or t,
    Sm 1 or s) allows, int32 [..., Bm, ceil(t / GRANULE), 2] and [..., Bm, ceil(s / GRANULE),
    2]: each row's kept keys, over every head, are taken as the range from its first to its
    last, so a span excludes the keys before a granule's first kept key and after its last
    (documents, causal or banded masks, padding); it never excludes a kept key. One pass over
    the mask, then O(t s / GRANULE) on the rows' ranges."""
    keep = jnp.any(mask, axis=-3)
    if keep.shape[-1] == 1:
        row_lo = jnp.where(keep[..., 0], 0, s).astype(jnp.int32)
        row_hi = jnp.where(keep[..., 0], s, 0).astype(jnp.int32)
    else:
        key = lax.broadcasted_iota(jnp.int32, keep.shape, keep.ndim - 1)
        row_lo = jnp.min(jnp.where(keep, key, np.int32(s)), axis=-1, initial=np.int32(s))
        row_hi = jnp.max(jnp.where(keep, key + 1, np.int32(0)), axis=-1, initial=np.int32(0))
    row_lo = jnp.broadcast_to(row_lo, (*row_lo.shape[:-1], t))
    row_hi = jnp.broadcast_to(row_hi, (*row_hi.shape[:-1], t))
    key_spans = jnp.stack([_granule_reduce(row_lo, jnp.min, s),
                           _granule_reduce(row_hi, jnp.max, 0)], axis=-1)
    # Granule g of the keys, [g GRANULE, min((g + 1) GRANULE, s)), meets row r's range where
    # row_lo < its end and row_hi > its start; an empty range (s, 0) meets none.
    start = jnp.arange(0, s, GRANULE, dtype=jnp.int32)
    end = jnp.minimum(start + GRANULE, s)
    meets = (row_lo[..., :, None] < end) & (row_hi[..., :, None] > start)
    row = lax.broadcasted_iota(jnp.int32, meets.shape, meets.ndim - 2)
    query_spans = jnp.stack(
        [jnp.min(jnp.where(meets, row, np.int32(t)), axis=-2, initial=np.int32(t)),
         jnp.max(jnp.where(meets, row + 1, np.int32(0)), axis=-2, initial=np.int32(0))], axis=-1)
    return key_spans.astype(jnp.int32), query_spans.astype(jnp.int32)


def intersect(a, b):
    """Spans [..., G, 2] that both a and b allow: [max of the los, min of the his)."""
    return jnp.stack([jnp.maximum(a[..., 0], b[..., 0]), jnp.minimum(a[..., 1], b[..., 1])],
                     axis=-1)


def _granule_reduce(x, op, identity):
    """op over each GRANULE positions of x [..., L] ([..., ceil(L / GRANULE)]; a last partial
    granule padded with the identity)."""
    length = x.shape[-1]
    granules = -(-length // GRANULE)
    padding = [(0, 0)] * (x.ndim - 1) + [(0, granules * GRANULE - length)]
    x = jnp.pad(x, padding, constant_values=identity)
    return op(x.reshape(*x.shape[:-1], granules, GRANULE), axis=-1)


def _granule_ranges(ids):
    """Per GRANULE positions, the least and greatest id ([..., G] each; a last partial granule
    is padded with the identities of min and max, which widen nothing)."""
    length = ids.shape[-1]
    granules = -(-length // GRANULE)
    if granules == 0:
        return ids, ids
    window = (1,) * (ids.ndim - 1) + (GRANULE,)
    padding = [(0, 0)] * (ids.ndim - 1) + [(0, granules * GRANULE - length)]
    info = np.iinfo(np.int32)
    lo = lax.reduce_window(ids, np.int32(info.max), lax.min, window, window, padding)
    hi = lax.reduce_window(ids, np.int32(info.min), lax.max, window, window, padding)
    return lo, hi


def ranges_meet(lo, hi, other_lo, other_hi):
    """Whether the id ranges [lo, hi] and [other_lo, other_hi] share a value (elementwise): where
    they do not, no position of the one sees a position of the other."""
    return (lo <= other_hi) & (other_lo <= hi)


def _overlapping(lo, hi, other_lo, other_hi, other_length):
    """For each granule of one side, [first, last + 1) in positions of the granules of the
    other side whose id range meets its own, clipped to other_length; (other_length, 0) when
    none does."""
    meets = ranges_meet(lo[..., :, None], hi[..., :, None], other_lo[..., None, :],
                        other_hi[..., None, :])
    index = jnp.arange(other_lo.shape[-1], dtype=jnp.int32)
    count = np.int32(other_lo.shape[-1])
    first = jnp.min(jnp.where(meets, index, count), axis=-1, initial=count)
    last = jnp.max(jnp.where(meets, index, -1), axis=-1, initial=-1)
    begin = jnp.minimum(first * GRANULE, other_length)
    end = jnp.minimum((last + 1) * GRANULE, other_length)
    return jnp.stack([begin, end], axis=-1).astype(jnp.int32)
