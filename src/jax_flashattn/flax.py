"""Flax integration: `attention_fn`s for Linen's and NNX's multi-head attention modules.

    import flax.linen as nn
    from flax import nnx
    import jax_flashattn.flax as jfa_flax

    nn.MultiHeadDotProductAttention(num_heads=12, attention_fn=jfa_flax.dot_product_attention)
    nnx.MultiHeadAttention(12, 768, attention_fn=jfa_flax.dot_product_attention, rngs=...)

    # causal self-attention without materialising a [B, 1, T, T] mask: Linen's module never
    # passes `is_causal`, so bake it in (NNX's `is_causal=True` call argument works as well)
    nn.MultiHeadDotProductAttention(num_heads=12,
                                    attention_fn=jfa_flax.make_attention_fn(is_causal=True))

`dot_product_attention` takes every argument that `flax.linen.dot_product_attention` and
`flax.nnx.dot_product_attention` take, under the same names, at Linen's positions (NNX's
`promote_dtype` and `is_causal`, which follow `module` there, go by keyword, as NNX's modules
pass them), and maps Flax's conventions onto `jax_flashattn.attention`:

- Layout `[batch..., T, N, H]` with any number of leading batch dims (zero included); they are
  folded into one batch dim for the kernels. Key/value may have fewer heads than the query
  (GQA/MQA, as `nnx.MultiHeadAttention(num_kv_heads=...)` produces); nothing is copied.
- `mask` broadcastable to `[batch..., N, T, S]`, any dtype, nonzero = keep (as produced by
  `flax.linen.make_attention_mask` / `make_causal_mask` / `combine_masks`, float32 by default).
  `bias` broadcastable to the same shape, added to the scaled logits.
- `dtype`: query, key and value are promoted to it (or, when None, to their common float dtype)
  and the output has that dtype, as in Flax. The kernels take bfloat16, float16 and float32.
- `precision` and `force_fp32_for_softmax` are accepted and have no effect: they steer the
  einsums and softmax of Flax's materialised path; the kernels accumulate Q.K^T and P.V in
  float32 and always run the softmax in float32.
- `module` (Flax's `sow_weights=True`): the attention weights are computed separately (this
  materialises `[batch..., N, T, S]`, so use it for inspection only) and sown under
  'attention_weights', into 'intermediates' for a Linen module or `nnx.Intermediate` for an NNX
  one, exactly where Flax's own function puts them (for NNX, collect them with
  `nnx.capture(nnx.Intermediate)`: Flax deprecates sowing outside it).
- Attention dropout is not implemented: `dropout_rate > 0` with `deterministic=False` raises
  `NotImplementedError` (it is never silently skipped). With `deterministic=True` (evaluation)
  the rate is irrelevant and the call runs. Dropout elsewhere in a model is unaffected.
- Custom einsums (`einsum_dot_general`, `qk_attn_weights_einsum`, `attn_weights_value_einsum`,
  used for quantised attention such as AQT) cannot run inside the fused kernel and raise
  `NotImplementedError`.

One semantic difference, inherited from `jax_flashattn.attention`: a query row whose mask hides
every key returns 0 here, where Flax's default returns the average of V (its softmax over
`finfo.min` logits is uniform). A padding mask built from the same validity vector for queries
and keys (`make_attention_mask(valid, valid)`) hides whole rows at padded query positions, so
those rows differ; every row that sees at least one key agrees.
"""

from __future__ import annotations

import functools
import inspect
import math

import flax.linen
import jax
import jax.numpy as jnp

from jax_flashattn import _validate, reference
from jax_flashattn.attention import attention as _attention

__all__ = ["dot_product_attention", "make_attention_fn"]


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, force_fp32_for_softmax=False,
                          einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None, promote_dtype=None, is_causal=False,
                          *, scale=None, local_window_size=None, implementation=None,
                          deterministic_backward=False, query_segment_ids=None,
                          key_value_segment_ids=None, logits_soft_cap=None,
                          diagonal_alignment="top_left", sinks=None, alibi_slopes=None):
    """Flax-compatible attention through `jax_flashattn.attention` (see the module docstring).

    Positional and keyword arguments are those of `flax.linen.dot_product_attention` and
    `flax.nnx.dot_product_attention`: query `[batch..., T, N, H]`, key/value
    `[batch..., S, K, H]` with `N % K == 0`, bias/mask broadcastable to `[batch..., N, T, S]`
    (mask nonzero = keep), `is_causal` (top-left aligned), `dtype` (promote q/k/v to it),
    `promote_dtype` (NNX's promotion hook, called as `promote_dtype((q, k, v), dtype=dtype)`).
    Keyword-only extras: `scale` (default 1/sqrt(H), as in Flax), `local_window_size`,
    `implementation`, `deterministic_backward`, the packed sequences' `query_segment_ids`
    `[batch..., T]` and `key_value_segment_ids` `[batch..., S]`, `logits_soft_cap`,
    `diagonal_alignment`, `sinks` `[N]` (a module's learnable parameter) and `alibi_slopes`
    `[N]` or `[batch..., N]`, passed to `jax_flashattn.attention`.

    Returns `[batch..., T, N, H]` in the promoted dtype.
    """
    _check_no_dropout(dropout_rate, deterministic)
    _check_no_custom_einsum(einsum_dot_general=einsum_dot_general,
                            qk_attn_weights_einsum=qk_attn_weights_einsum,
                            attn_weights_value_einsum=attn_weights_value_einsum)
    # Dropout is off (checked above); the kernels fix their own precision and softmax dtype.
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax

    query, key, value = _promote(query, key, value, dtype, promote_dtype)
    lead = _batch_dims(query, key, value)
    folded = (math.prod(lead),)
    q, k, v = (x.reshape(folded + x.shape[-3:]) for x in (query, key, value))
    bias = _fold_batch(bias, lead, "bias")
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = _fold_batch(mask if mask.dtype == jnp.bool_ else mask != 0, lead, "mask")

    q_ids, kv_ids = (None if ids is None else _fold_ids(ids, lead, name)
                     for ids, name in ((query_segment_ids, "query_segment_ids"),
                                       (key_value_segment_ids, "key_value_segment_ids")))
    slopes = alibi_slopes
    if slopes is not None and jnp.ndim(slopes) > 1:  # [batch..., N], folded as the batch
        slopes = jnp.broadcast_to(slopes, lead + jnp.shape(slopes)[-1:]).reshape(
            folded + jnp.shape(slopes)[-1:])
    out = _attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal,
                     local_window_size=local_window_size, implementation=implementation,
                     deterministic_backward=deterministic_backward, query_segment_ids=q_ids,
                     key_value_segment_ids=kv_ids, logits_soft_cap=logits_soft_cap,
                     diagonal_alignment=diagonal_alignment, sinks=sinks, alibi_slopes=slopes)
    if module is not None:
        weights = reference.attention_weights(q, k, bias, mask, scale=scale,
                                              is_causal=is_causal,
                                              local_window_size=local_window_size,
                                              query_segment_ids=q_ids,
                                              key_value_segment_ids=kv_ids,
                                              logits_soft_cap=logits_soft_cap,
                                              diagonal_alignment=diagonal_alignment,
                                              sinks=sinks, alibi_slopes=slopes)
        _sow(module, weights.astype(q.dtype).reshape(lead + weights.shape[1:]))
    return out.reshape(query.shape[:-1] + value.shape[-1:])


_SIGNATURE = inspect.signature(dot_product_attention)


def make_attention_fn(*, is_causal=False, scale=None, local_window_size=None,
                      implementation=None, deterministic_backward=False, logits_soft_cap=None,
                      diagonal_alignment="top_left", alibi_slopes=None):
    """An `attention_fn` for Flax modules with these options fixed.

    `is_causal=True` makes every call causal (OR-ed with a call's own `is_causal`, since NNX
    passes `is_causal=False` unless asked), so Linen's `MultiHeadDotProductAttention`, which
    never passes `is_causal`, gets the kernels' causal path without a materialised mask.
    `scale`, `local_window_size`, `implementation`, `deterministic_backward` (bit-identical
    GPU gradients, see `jax_flashattn.attention`), `logits_soft_cap`, `diagonal_alignment` and
    `alibi_slopes` (a model's fixed slopes, [N]) apply unless a call passes its own.
    The returned function has `dot_product_attention`'s signature, which Linen inspects to
    decide which arguments to pass.
    """
    _validate.check_options(is_causal=is_causal, implementation=implementation,
                            deterministic_backward=deterministic_backward)
    _validate.check_diagonal_alignment(diagonal_alignment)
    defaults = dict(scale=scale, local_window_size=local_window_size,
                    implementation=implementation, deterministic_backward=deterministic_backward,
                    logits_soft_cap=logits_soft_cap, diagonal_alignment=diagonal_alignment,
                    alibi_slopes=alibi_slopes)

    @functools.wraps(dot_product_attention)
    def attention_fn(*args, **kwargs):
        arguments = _SIGNATURE.bind(*args, **kwargs).arguments
        arguments["is_causal"] = is_causal or arguments.get("is_causal", False)
        for name, value in defaults.items():
            arguments.setdefault(name, value)
        return dot_product_attention(**arguments)

    return attention_fn


def _check_no_dropout(dropout_rate, deterministic):
    try:
        rate = float(dropout_rate)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError("jax_flashattn.flax: dropout_rate must be a static Python number, got a "
                        "traced value") from e
    if rate == 0.0:
        return
    try:
        deterministic = bool(deterministic)
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError("jax_flashattn.flax: with dropout_rate > 0, deterministic must be a "
                        "static Python bool, got a traced value") from e
    if not deterministic:
        raise NotImplementedError(
            f"jax_flashattn.flax: attention dropout (dropout_rate={rate}, deterministic=False) "
            "is not implemented by the FlashAttention kernels, and it is not skipped silently. "
            "Set dropout_rate=0 on the attention module (dropout on the residual stream is "
            "unaffected), call it with deterministic=True, or keep Flax's default attention_fn "
            "for modules that train with attention dropout.")


def _check_no_custom_einsum(**einsums):
    given = [name for name, fn in einsums.items() if fn is not None]
    if given:
        raise NotImplementedError(
            f"jax_flashattn.flax: {', '.join(given)} cannot be honoured: the fused kernel does "
            "not materialise the attention weights, so no custom einsum (e.g. AQT quantisation) "
            "can be applied to them. Use Flax's default attention_fn for this module.")


def _promote(query, key, value, dtype, promote_dtype):
    """Flax's dtype rule: all three cast to `dtype`, or to their common inexact dtype."""
    if promote_dtype is not None:
        return promote_dtype((query, key, value), dtype=dtype)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    return tuple(x.astype(dtype) for x in (query, key, value))


def _batch_dims(query, key, value) -> tuple[int, ...]:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(f"jax_flashattn.flax: {name} must be [batch..., length, heads, "
                             f"head_dim], got shape {tuple(x.shape)}")
    lead = tuple(query.shape[:-3])
    if not (tuple(key.shape[:-3]) == tuple(value.shape[:-3]) == lead):
        raise ValueError("jax_flashattn.flax: query, key and value must share their batch dims, "
                         f"got shapes {tuple(query.shape)}, {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    return lead


def _fold_batch(x, lead: tuple[int, ...], name: str):
    """Reshapes x, broadcastable to lead + (N, T, S), to be broadcastable to (prod(lead), N, T,
    S); a dim that is 1 (or absent) stays 1, so nothing is materialised that was not already."""
    if x is None:
        return None
    x = jnp.asarray(x)
    rank = len(lead) + 3
    if x.ndim > rank:
        if any(d != 1 for d in x.shape[:x.ndim - rank]):
            raise ValueError(f"jax_flashattn.flax: {name} of shape {tuple(x.shape)} has more "
                             f"batch dims than the query's batch dims {lead}")
        x = x.reshape(x.shape[x.ndim - rank:])
    x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
    batch, rest = tuple(x.shape[:len(lead)]), tuple(x.shape[len(lead):])
    if all(d == 1 for d in batch):
        return x.reshape((1,) + rest)
    for got, want in zip(batch, lead):
        if got not in (1, want):
            raise ValueError(f"jax_flashattn.flax: {name} of shape {tuple(x.shape)} is not "
                             f"broadcastable to the batch dims {lead} of the query")
    return jnp.broadcast_to(x, lead + rest).reshape((math.prod(lead),) + rest)


def _fold_ids(ids, lead: tuple[int, ...], name: str):
    """Segment ids [batch..., L] as [prod(batch), L] (attention checks their length and
    dtype; host ids have their values checked to fit int32 first, as attention does)."""
    if not isinstance(ids, jax.Array):
        ids = _validate.host_integers(ids, name)
    ids = jnp.asarray(ids)
    if tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"jax_flashattn.flax: {name} must be [batch..., length] with the "
                         f"query's batch dims {lead}, got shape {tuple(ids.shape)}")
    return ids.reshape((math.prod(lead),) + ids.shape[-1:])


def _sow(module, weights):
    """Sows where Flax's own dot_product_attention does, for a Linen or an NNX module."""
    if isinstance(module, flax.linen.Module):
        module.sow("intermediates", "attention_weights", weights)
    else:
        from flax import nnx
        module.sow(nnx.Intermediate, "attention_weights", weights)
