"""Attention sinks as a rescaling of the kernels' results: each head's sink is a key of logit
sinks[n] and value 0 that every row's softmax takes, so a call runs the kernels without it and
`apply` moves (out, lse) to the softmax with it; the backward kernels, given those, recompute
the sinks' softmax as any other (P = e^(s - lse')), and `gradient` is the sinks' own."""

from __future__ import annotations

import jax.numpy as jnp


def apply(out, lse, sinks):
    """(out [..., B, T, N, H], lse [..., B, N, T]) of the keys alone -> those with the sinks:
    lse' = log(e^lse + e^sink), out' = out e^(lse - lse') (one pass over the output, rounded
    to out's dtype a second time: up to 1 ulp, where the kernels' own epilogue would round
    once). A row that sees no key keeps out 0 and gets lse' = sink. Unchanged without sinks."""
    if sinks is None:
        return out, lse
    merged = jnp.logaddexp(lse, sinks[:, None])  # [N, 1] against lse's [..., N, T]
    # exp(-inf - -inf) would be NaN where a row sees no key and the sink is -inf too.
    factor = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - merged))
    scaled = out.astype(jnp.float32) * jnp.swapaxes(factor, -1, -2)[..., None]
    return scaled.astype(out.dtype), merged


def gradient(sinks, out, lse, d_out):
    """d sinks [N] from the results with the sinks: a sink is a key of value 0, so its dP is 0
    and its dS = P (0 - D), with P = e^(sink - lse) and D = dO . O per row, summed over the
    batch and the rows (of this call: a sharded caller sums the devices' parts)."""
    delta = jnp.einsum("...tnh,...tnh->...nt", d_out.astype(jnp.float32),
                       out.astype(jnp.float32))
    # [..., N, T]; 0 where lse is -inf (a row that sees no key, and a sink of -inf).
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sinks[:, None] - lse))
    heads = lse.ndim - 2
    return -jnp.sum(weight * delta, axis=tuple(i for i in range(lse.ndim) if i != heads))
