"""Packed rows of segment ids for the tests: documents of random lengths, whole rows, one
document per position, and ids in no order."""

import jax.numpy as jnp
import numpy as np

INT32 = np.iinfo(np.int32)


def ids_from_lengths(lengths, total):
    """The ids of a row holding documents of `lengths` in order, M past the last one."""
    ids = np.repeat(np.arange(len(lengths)), lengths)[:total]
    return np.concatenate([ids, np.full(total - len(ids), len(lengths))]).astype(np.int32)


def random_lengths(rng, total):
    """Document lengths >= 1 filling `total` positions, about a third of them of length 1;
    half the time the last document is dropped (a padding tail)."""
    lengths, left = [], total
    while left > 0:
        n = 1 if rng.random() < 0.35 else int(rng.integers(2, max(3, total // 3) + 1))
        lengths.append(min(n, left))
        left -= lengths[-1]
    if len(lengths) > 1 and rng.random() < 0.5:
        lengths.pop()
    return lengths


def row_ids(rng, kind, total):
    """int32 ids [total] of one row packed as `kind` says: "random" documents of random lengths
    (many of length 1) in row order, sometimes with a padding tail (id M); "whole" one document
    spanning the row; "singles" a document per position; "scattered" small ids in no order,
    negatives included; "extreme" ids at the ends of int32, in no order."""
    if kind == "random":
        return ids_from_lengths(random_lengths(rng, total), total)
    if kind == "whole":
        return np.zeros(total, np.int32)
    if kind == "singles":
        return np.arange(total, dtype=np.int32)
    if kind == "scattered":
        return rng.integers(-2, 3, total).astype(np.int32)
    if kind == "extreme":
        return rng.choice(np.array([INT32.min, -1, 0, INT32.max], np.int32), total)
    raise ValueError(kind)


def packed_ids(rng, kinds, t, s):
    """(query ids [B, T], key ids [B, S]) int32, one packing kind per batch row; with T != S
    the two sides are packed independently (their documents matched by number)."""
    q_ids = np.stack([row_ids(rng, kind, t) for kind in kinds])
    kv_ids = q_ids.copy() if t == s else np.stack([row_ids(rng, kind, s) for kind in kinds])
    if t == s:  # the same packing on both sides, but random rows repacked independently
        for i, kind in enumerate(kinds):
            if kind == "random" and rng.random() < 0.5:
                kv_ids[i] = row_ids(rng, kind, s)
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def segs(q_ids, kv_ids):
    """The keyword arguments of `attention` that pass the ids."""
    return dict(query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
