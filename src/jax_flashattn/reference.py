"""Pure-JAX attention with jax_flashattn's exact semantics.

Materialises the [B, N, T, S] logits, so it is only for tests, the main job's check, the
benchmarks' correctness gate and the attention weights `jax_flashattn.flax` sows. It takes the
same arguments as `jax_flashattn.attention` and differs from `jax.nn.dot_product_attention` in
one deliberate way: a query row that sees no key returns 0 (and its log-sum-exp is -inf, or
with sinks the sink's logit) instead of an average of V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn import _validate


def visibility(t_size: int, s_size: int, *, batch: int, is_causal: bool, window, q_lens,
               kv_lens, mask, q_segment_ids=None, kv_segment_ids=None,
               shift: int = 0) -> jax.Array:
    """Boolean [B, N or 1, T, S]: True where query t may attend to key s. `shift`: query t's
    position for the causal mask and the window is t + shift (S - T for bottom-right
    alignment), an int or one per batch entry ([B], _validate.Normalized.diagonal_shifts)."""
    t = jnp.arange(t_size)[None, :, None] + jnp.reshape(jnp.asarray(shift), (-1, 1, 1))
    s = jnp.arange(s_size)[None, None, :]
    keep = jnp.ones((1, t_size, s_size), bool)
    if is_causal:
        keep &= s <= t
    if window is not None:
        left, right = window
        keep &= s >= t - left
        keep &= s <= t + right
    keep = jnp.broadcast_to(keep[:, None], (batch, 1, t_size, s_size))
    if q_lens is not None:
        keep &= (jnp.arange(t_size)[None, :] < q_lens[:, None])[:, None, :, None]
    if kv_lens is not None:
        keep &= (jnp.arange(s_size)[None, :] < kv_lens[:, None])[:, None, None, :]
    if mask is not None:
        keep = keep & mask
    if q_segment_ids is not None:
        keep &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    return keep


def _softmax(args: _validate.Normalized, precision_dtype):
    """(P [B, N, T, S], whether the row sees any key, row max, row sum): P normalised, and 0
    on a row that sees no key (or whose visible logits are all -inf). A NaN or +inf visible
    logit makes its row's max, hence P and the sum, NaN, as in jax.nn."""
    q, k = (x.astype(precision_dtype) for x in (args.query, args.key))
    b, t_size, n, h = q.shape
    s_size, kv_heads = k.shape[1], k.shape[2]
    k = jnp.repeat(k, n // kv_heads, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=jax.lax.Precision.HIGHEST)
    logits = logits * jnp.asarray(args.scale, precision_dtype)
    if args.soft_cap:
        cap = jnp.asarray(args.soft_cap, precision_dtype)
        logits = cap * jnp.tanh(logits / cap)
    if args.bias is not None:
        logits = logits + args.bias.astype(precision_dtype)
    if args.alibi_slopes is not None:  # -slope |t + shift - s|, on the window's diagonal
        shift = jnp.reshape(jnp.asarray(args.diagonal_shifts()), (-1, 1, 1, 1))
        distance = jnp.abs(jnp.arange(t_size)[:, None] + shift - jnp.arange(s_size)[None, :])
        slopes = args.alibi_slopes.astype(precision_dtype)[:, :, None, None]
        logits = logits - slopes * distance.astype(precision_dtype)
    keep = visibility(t_size, s_size, batch=b, is_causal=args.is_causal, window=args.window,
                      q_lens=args.query_seq_lengths, kv_lens=args.key_value_seq_lengths,
                      mask=args.mask, q_segment_ids=args.query_segment_ids,
                      kv_segment_ids=args.key_value_segment_ids, shift=args.diagonal_shifts())
    keep = jnp.broadcast_to(keep, logits.shape)
    if args.sinks is not None:  # a last key of logit sinks[n], always visible (value 0)
        sink = jnp.broadcast_to(args.sinks.astype(precision_dtype)[None, :, None, None],
                                logits.shape[:-1] + (1,))
        logits = jnp.concatenate([logits, sink], axis=-1)
        keep = jnp.concatenate([keep, jnp.ones(sink.shape, bool)], axis=-1)
    masked = jnp.where(keep, logits, -jnp.inf)
    # NaN made explicit: XLA's CPU max reduction over a row of NaN logits returned -inf (its
    # initial value), which would read as a row that sees no key.
    row_max = jnp.where(jnp.isnan(masked).any(axis=-1, keepdims=True), jnp.nan,
                        jnp.max(masked, axis=-1, keepdims=True))
    any_visible = row_max != -jnp.inf
    safe_max = jnp.where(any_visible, row_max, 0)
    p = jnp.where(keep, jnp.exp(masked - safe_max), 0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(any_visible, denom, 1)
    if args.sinks is not None:
        p = p[..., :-1]  # the sinks' weights, on values of 0
    return p, any_visible, safe_max, denom


def attention_weights(query, key, bias=None, mask=None, *, scale=None, is_causal=False,
                      local_window_size=None, query_segment_ids=None,
                      key_value_segment_ids=None, logits_soft_cap=None,
                      diagonal_alignment="top_left", sinks=None, alibi_slopes=None) -> jax.Array:
    """The float32 softmax weights [B, N, T, S] of `attention` (0 on a row that sees no key;
    with sinks, the keys' weights alone), for `jax_flashattn.flax` to sow where Flax's
    attention does."""
    args = _validate.normalize(query, key, key, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=None, key_value_seq_lengths=None,
                               local_window_size=local_window_size,
                               query_segment_ids=query_segment_ids,
                               key_value_segment_ids=key_value_segment_ids,
                               logits_soft_cap=logits_soft_cap,
                               diagonal_alignment=diagonal_alignment, sinks=sinks,
                               alibi_slopes=alibi_slopes)
    return _softmax(args, jnp.float32)[0]


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False, precision_dtype=jnp.float32,
              p_dtype=None, query_segment_ids=None, key_value_segment_ids=None,
              logits_soft_cap=None, diagonal_alignment="top_left", sinks=None,
              alibi_slopes=None):
    """Reference attention computed in `precision_dtype` (float32 by default).

    `p_dtype`, when given, rounds the probabilities P to that dtype before P.V, which models
    the rounding a tensor-core kernel does: the tests' error budget is measured with it.
    `implementation` is accepted for signature compatibility and ignored.
    """
    del implementation
    args = _validate.normalize(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=local_window_size,
                               query_segment_ids=query_segment_ids,
                               key_value_segment_ids=key_value_segment_ids,
                               logits_soft_cap=logits_soft_cap,
                               diagonal_alignment=diagonal_alignment, sinks=sinks,
                               alibi_slopes=alibi_slopes)
    p, any_visible, safe_max, denom = _softmax(args, precision_dtype)
    group = args.query.shape[2] // args.key.shape[2]
    v = jnp.repeat(args.value.astype(precision_dtype), group, axis=2)
    if p_dtype is not None:
        p = p.astype(p_dtype).astype(precision_dtype)
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision=jax.lax.Precision.HIGHEST)
    out = out.astype(args.query.dtype).reshape(args.out_shape)
    if not return_residual:
        return out
    lse = jnp.where(any_visible, safe_max + jnp.log(jnp.where(any_visible, denom, 1)), -jnp.inf)
    lse = jnp.transpose(lse[..., 0], (0, 2, 1)).astype(jnp.float32)  # [B, N, T] -> [B, T, N]
    return out, lse.reshape(args.out_shape[:-1])


def error_budget(exact, rounded, dtype, magnitude=None) -> np.ndarray:
    """The rule for low-precision results, per element: twice the largest error the float32
    reference makes when it rounds P and the output to `dtype` (`rounded`) against the
    unrounded reference (`exact`), but at least one `dtype` ulp of that element, plus a small
    absolute term.

    The floor: a result whose pre-rounding value lies near a rounding midpoint rounds to either
    neighbour, one ulp apart. Twice the reference's largest error covers that for the largest
    outputs when that error falls among them (half an ulp there is one after doubling), not when
    it falls a binade lower: then a kernel's correctly rounded neighbour failed (bf16, an output
    of -0.554 read as -0.551: 0.00354 against 0.00337, a bf16 ulp in [0.5, 1) being 0.0039).
    Per element, so that one large output does not loosen the check of the small ones.

    `magnitude`, when given, is each element's sum_j p_j |v_j| (the reference with |V|). Rounding
    every P to `dtype` moves an element by at most u * magnitude (u the dtype's unit roundoff),
    and rounding the output by half an ulp, so the budget admits that much too. The rounded
    reference is one draw of those rounding errors: where one key with a large value dominates
    a row, a kernel that rounds P relative to a running maximum (another draw, as correct) can
    err several times more on that element than the reference does on any (bf16: 0.0043 on an
    output of -0.766 whose largest term is 0.31 x -2.95, against the reference's 0.0017).
    """
    exact = np.asarray(exact, np.float64)
    err = np.max(np.abs(np.asarray(rounded, np.float64) - exact), initial=0.0)
    largest = float(np.max(np.abs(exact), initial=0.0))
    budget = np.maximum(2 * err, ulp(exact, dtype))
    if magnitude is not None:
        unit_roundoff = 2.0 ** -(jnp.finfo(dtype).nmant + 1)
        budget = np.maximum(budget, unit_roundoff * np.abs(np.asarray(magnitude, np.float64)) +
                            ulp(exact, dtype) / 2)
    return budget + 1e-5 * (largest + 1)


def worst_against_budget(error, bound) -> tuple[float, float]:
    """(error, bound) at the element whose error lies furthest past its bound (or nearest
    below it): the comparison that decides a per-element budget; (0, 0) for no elements."""
    error = np.asarray(error, np.float64)
    if error.size == 0:
        return 0.0, 0.0
    bound = np.broadcast_to(np.asarray(bound, np.float64), error.shape)
    i = np.unravel_index(np.argmax(error - bound), error.shape)
    return float(error[i]), float(bound[i])


def ulp(x, dtype) -> np.ndarray:
    """The spacing of `dtype`'s values at each magnitude |x| (its smallest normal's below that;
    at a power of two, the spacing above it)."""
    info = jnp.finfo(dtype)
    x = np.maximum(np.abs(np.asarray(x, np.float64)), float(info.smallest_normal))
    return np.exp2(np.floor(np.log2(x)) - info.nmant)
