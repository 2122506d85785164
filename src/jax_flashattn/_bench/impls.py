"""The implementations a case times (ours, cuDNN, XLA through jax.nn; cuDNN's packed path on
the packed rows) and the inputs it draws. (Method: the package docstring.)"""

from __future__ import annotations

import functools
import gc
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn._bench.configs import ALL_IMPLS, Config, document_ids
from jax_flashattn._bench.packed import (
    CUDNN_PACKED_EXTRA, Unavailable, cudnn_packed_arrays, cudnn_packed_attention, packed_rows,
    without_extra)

_GPU_ONLY = ("cudnn", "cudnn-packed")
# The extras of a paged decode row (`Inputs._draw_extras`), which only its call reads.
PAGED_EXTRAS = ("key_cache", "value_cache", "page_table")
# The extras of an e4m3 decode row (`Inputs._draw_extras`), which only its call reads.
FP8_EXTRAS = ("key_e4m3", "value_e4m3", "descale_k", "descale_v")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def ours_implementation() -> str:
    """Our kernels for the default backend, by name, so a missing build raises rather than
    silently falling back to XLA."""
    return "cuda" if on_gpu() else "cpu"


def available_impls(requested: Sequence[str]) -> list[str]:
    """The requested implementations that can run here (cuDNN needs a GPU)."""
    unknown = [i for i in requested if i not in ALL_IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; choose from {ALL_IMPLS}")
    return [i for i in requested if i not in _GPU_ONLY or on_gpu()]


def attention_fn(impl: str, causal: bool, window: tuple[int, int] | None = None,
                 soft_cap: float | None = None, bottom_right: bool = False) -> Callable:
    """(q, k, v, **extras) -> out for one implementation; `extras` are `Inputs.extras` (bias,
    mask, lengths), the same keywords for every implementation. A soft-cap only ours takes
    (Unavailable for the others: jax.nn has no soft-capping); bottom-right alignment reaches
    jax.nn as the causal mask it stands for."""
    options = dict(is_causal=causal)
    if window is not None:
        options["local_window_size"] = window
    if impl in ("ours", "ours-deterministic"):
        import jax_flashattn
        alignment = "bottom_right" if bottom_right else "top_left"
        return functools.partial(jax_flashattn.attention, implementation=ours_implementation(),
                                 deterministic_backward=impl == "ours-deterministic",
                                 logits_soft_cap=soft_cap, diagonal_alignment=alignment,
                                 **options)
    if soft_cap is not None:
        raise Unavailable("jax.nn.dot_product_attention has no soft-capping")
    if bottom_right:
        if window is not None:
            raise Unavailable("a bottom-right window reaches jax.nn only as a mask, not built here")
        options = dict(bottom_right_causal=causal)
    return functools.partial(_jax_nn, implementation=impl, **options)


def _jax_nn(q, k, v, *, query_segment_ids=None, key_value_segment_ids=None,
            bottom_right_causal=False, alibi_slopes=None, **kwargs):
    """jax.nn.dot_product_attention; segment ids, a causal mask with the diagonal at the
    bottom right, and ALiBi slopes [N], which it does not take, as the boolean masks and the
    additive bias they stand for ([B, 1, T, S], [T, S], [1, N, T, S] in q's dtype, added to
    the call's bias), built inside the call."""
    if alibi_slopes is not None:
        t, s = q.shape[-3], k.shape[-3]
        distance = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(s)[None, :]).astype(jnp.float32)
        dense = -alibi_slopes[None, :, None, None] * distance
        if kwargs.get("bias") is not None:
            dense = dense + kwargs["bias"].astype(jnp.float32)
        kwargs["bias"] = dense.astype(q.dtype)
    if query_segment_ids is not None:
        kwargs["mask"] = (query_segment_ids[:, None, :, None] ==
                          key_value_segment_ids[:, None, None, :])
    if bottom_right_causal:
        t, s = q.shape[-3], k.shape[-3]
        keep = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
        kwargs["mask"] = keep if kwargs.get("mask") is None else kwargs["mask"] & keep
    return jax.nn.dot_product_attention(q, k, v, **kwargs)


def config_attention_fn(impl: str, cfg: Config) -> Callable:
    """`attention_fn` with the config's static options; "cudnn-packed" for the packed rows
    (`packed.cudnn_packed_attention`, which raises `Unavailable` elsewhere), whose extra
    argument the other implementations do not see."""
    if impl == "cudnn-packed":
        return cudnn_packed_attention(cfg)
    if cfg.page_size is not None:
        if impl != "ours":
            raise Unavailable("jax.nn.dot_product_attention reads no paged KV cache")
        return functools.partial(_paged, soft_cap=cfg.soft_cap)
    if cfg.kv_fp8:
        if impl != "ours":
            raise Unavailable("jax.nn.dot_product_attention takes no e4m3 K/V with descales")
        return functools.partial(_e4m3, soft_cap=cfg.soft_cap)
    if cfg.sinks and impl not in ("ours", "ours-deterministic"):
        raise Unavailable("jax.nn.dot_product_attention has no attention sinks")
    fn = attention_fn(impl, cfg.causal, cfg.window, cfg.soft_cap, cfg.bottom_right)
    return without_extra(fn) if cfg.kind == "packed" else fn


def _paged(q, k, v, *, key_cache, value_cache, page_table, key_value_seq_lengths,
           soft_cap=None):
    """paged_attention of q against the pages that hold k and v (`Inputs._draw_extras`):
    each sequence's tokens, causal at the bottom right, as in the "contiguous" row."""
    import jax_flashattn
    del k, v  # the same values, in the pages
    return jax_flashattn.paged_attention(q, key_cache, value_cache, page_table,
                                         key_value_seq_lengths,
                                         logits_soft_cap=soft_cap,
                                         implementation=ours_implementation())


def _e4m3(q, k, v, *, key_e4m3, value_e4m3, descale_k, descale_v, soft_cap=None,
          **extras):
    """attention of q against the e4m3 copies of k and v and their descales
    (`Inputs._draw_extras`), otherwise the plain decode row's call (its bias, where given)."""
    import jax_flashattn
    del k, v  # the same values, stored as e4m3
    return jax_flashattn.attention(q, key_e4m3, value_e4m3, descale_k=descale_k,
                                   descale_v=descale_v, logits_soft_cap=soft_cap,
                                   implementation=ours_implementation(), **extras)


def call_once(fn, mode, q, k, v, g, extras=None):
    """The outputs one call produces: (out,) or (out, dq, dk, dv); the gradients are those of
    q, k and v only (none of a bias)."""
    extras = extras or {}
    if mode == "fwd":
        return (fn(q, k, v, **extras),)
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **extras), q, k, v)
    return (out, *vjp(g))


# ----------------------------------------------------------------------------- inputs


@functools.partial(jax.jit, static_argnums=(1, 2))
def _flat_normal(key, size, dtype):
    return jax.random.normal(key, (size,), jnp.float32).astype(dtype)


def _normal(key, shape, dtype):
    """Standard normal `shape` array. Drawn flat, so that every config with the same element
    count (the whole standard grid has B*T*N*H = tokens*hidden) shares one compiled draw."""
    return _flat_normal(key, math.prod(shape), dtype).reshape(shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _document_mask(ids, seqlen_q, seqlen_k):
    """bool [B, 1, T, S]: query t sees key s where both lie in one document."""
    return (ids[:, None, :seqlen_q, None] == ids[:, None, None, :seqlen_k])


def _paged_cache(k, v, page_size: int, seed: int) -> dict:
    """k and v [B, S, K, H] as pages of `page_size` tokens in pools [P, page_size, K, H] (the
    last page of a sequence zero-filled past S), scattered over them by a random permutation,
    and the page table int32 [B, S / page_size rounded up]."""
    batch, s, kv_heads, head_dim = k.shape
    per_sequence = -(-s // page_size)
    order = np.random.default_rng(seed).permutation(batch * per_sequence)
    table = jnp.asarray(order.reshape(batch, per_sequence).astype(np.int32))

    def pool(x):
        x = jnp.pad(x, ((0, 0), (0, per_sequence * page_size - s), (0, 0), (0, 0)))
        pages = x.reshape(batch * per_sequence, page_size, kv_heads, head_dim)
        return jnp.zeros_like(pages).at[jnp.asarray(order)].set(pages)
    return dict(key_cache=pool(k), value_cache=pool(v), page_table=table)


def _e4m3_kv(k, v) -> dict:
    """k and v [B, S, K, H] as float8_e4m3fn values and their float32 [B, K] descales
    (jax_flashattn.quantize_fp8's amax scaling per batch entry and kv head)."""
    import jax_flashattn
    key, descale_k = jax_flashattn.quantize_fp8(k)
    value, descale_v = jax_flashattn.quantize_fp8(v)
    return dict(key_e4m3=key, value_e4m3=value, descale_k=descale_k, descale_v=descale_v)


class Inputs:
    """`n_sets` independent (q, k, v) sets plus a cotangent g, drawn on the device.

    Runs donate the sets and hand them back; `ensure_alive` redraws them (same seed, same
    values) when a failed run left them deleted."""

    def __init__(self, cfg: Config, n_sets: int, seed: int = 0):
        self.cfg, self.n_sets, self.seed = cfg, n_sets, seed
        self._suspect = False
        self.sets, self.g = self._draw()
        self.extras = self._draw_extras()

    def _draw_extras(self) -> dict:
        """The config's extra arguments, by `attention`'s keyword: bias (standard normal, the
        input dtype), mask, query/key_value_segment_ids, query_seq_lengths and
        key_value_seq_lengths (int32), sinks (float32 [N], 2 + standard normal: a weight of
        the order of a tenth of a row's at these sizes), alibi_slopes (float32 [N], BLOOM's
        2^(-8 (i + 1) / N)), and on the packed rows cuDNN's lengths
        and offsets (CUDNN_PACKED_EXTRA, for "cudnn-packed" only), on the paged decode rows
        the pages of set 0's k and v with their page table (PAGED_EXTRAS, `_paged_cache`), and
        on the e4m3 decode rows set 0's k and v as e4m3 with their descales (FP8_EXTRAS,
        `_e4m3_kv`). One copy for every set; never donated."""
        cfg, extras = self.cfg, {}
        if cfg.bias_shape is not None:
            key = jax.random.fold_in(jax.random.key(self.seed), 1 << 20)
            extras["bias"] = _normal(key, cfg.bias_shape, jnp.dtype(cfg.jnp_dtype))
        if cfg.mask_docs is not None:
            ids = np.stack([document_ids(d, cfg.mask_length) for d in cfg.mask_docs])
            extras["mask"] = _document_mask(jnp.asarray(ids), cfg.seqlen_q, cfg.seqlen_k)
        if cfg.segment_docs is not None:
            ids = jnp.asarray(np.stack([document_ids(d, cfg.mask_length)
                                        for d in cfg.segment_docs]))
            extras["query_segment_ids"] = ids[:, :cfg.seqlen_q]
            extras["key_value_segment_ids"] = ids[:, :cfg.seqlen_k]
        if cfg.kind == "packed":
            extras[CUDNN_PACKED_EXTRA] = tuple(
                jnp.asarray(x) for x in cudnn_packed_arrays(packed_rows(cfg), cfg.mask_length))
        if cfg.q_lens is not None:
            extras["query_seq_lengths"] = jnp.asarray(cfg.q_lens, jnp.int32)
        if cfg.kv_lens is not None:
            extras["key_value_seq_lengths"] = jnp.asarray(cfg.kv_lens, jnp.int32)
        if cfg.sinks:
            key = jax.random.fold_in(jax.random.key(self.seed), 1 << 21)
            extras["sinks"] = 2.0 + _normal(key, (cfg.num_heads,), jnp.dtype(jnp.float32))
        if cfg.alibi:
            extras["alibi_slopes"] = jnp.asarray(
                2.0 ** (-8.0 * np.arange(1, cfg.num_heads + 1) / cfg.num_heads), jnp.float32)
        if cfg.page_size is not None:
            extras.update(_paged_cache(self.sets[0][1], self.sets[0][2], cfg.page_size,
                                       self.seed))
        if cfg.kv_fp8:
            extras.update(_e4m3_kv(self.sets[0][1], self.sets[0][2]))
        return extras

    def _draw(self):
        cfg = self.cfg
        keys = jax.random.split(jax.random.key(self.seed), 3 * self.n_sets + 1)

        dtype = jnp.dtype(cfg.jnp_dtype)
        sets = [tuple(_normal(keys[3 * i + j], shape, dtype) for j, shape in
                      enumerate((cfg.q_shape, cfg.kv_shape, cfg.kv_shape)))
                for i in range(self.n_sets)]
        return sets, _normal(keys[-1], cfg.q_shape, dtype)

    def ensure_alive(self):
        leaves = jax.tree.leaves((self.sets, self.g))
        if self._suspect or any(x.is_deleted() for x in leaves):
            self.sets = self.g = None
            gc.collect()
            self.sets, self.g = self._draw()
            self._suspect = False

    def invalidate(self):
        """After a failed run: the sets it handed back may carry its error (PJRT propagates an
        asynchronous failure into the outputs), so the next use redraws them."""
        self._suspect = True
