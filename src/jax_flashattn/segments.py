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
