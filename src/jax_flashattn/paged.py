"""Attention over a paged KV cache, and the cache's update.

A server keeps each sequence's keys and values in fixed-size pages of one pool, [P, page_size,
K, H], and a page table [B, max_pages] of int32 page ids: sequence b's token j lives in page
page_table[b, j // page_size] at slot j % page_size. `paged_attention` attends each sequence's
newest tokens (a decode step, T = 1, or a chunk of a prefill) to its first kv_len cached tokens,
causal with the diagonal at the bottom right of each sequence (query i of entry b at position
kv_len_b - q_len_b + i); `paged_cache_update` writes new tokens into their pages.

The kernels read the pages in place where they can: the CPU kernels always, on a GPU the
split-KV decode kernels (a decode step or a short chunk: T (N / K) <= 64 query rows per kv head,
bf16 or float16, head dims up to 256, a table reaching 256 keys or more; an FP8 (e4m3) cache
too, dequantised as the kernels load it, on a GPU at head dims a multiple of 16). Elsewhere (a
longer prefill chunk, an e4m3 cache with a soft-cap, implementation="xla" or "cudnn") the pages
are gathered into one contiguous [B, max_pages x page_size, K, H] view per call (three times
the bytes the in-place read moves) and attended by `attention`, an FP8 cache with its descales
as attention's FP8 keys and values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn import _cache_kernel, _ffi, _forward_only, _sinks, _validate, fp8
from jax_flashattn.attention import _check_implementation, attention

# Page sizes: a power of two from 16 to 256 tokens.
PAGE_SIZES = tuple(2**i for i in range(4, 9))
# The dtypes of a cache beside q's own: stored e4m3 values times a float32 descale.
FP8_DTYPES = (jnp.float8_e4m3fn,)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_pool(key_cache, value_cache):
    """The caches as a pool of pages: [P, page_size, K, H] each, alike, page_size one of
    PAGE_SIZES, at least one page."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.ndim != 4:
            raise ValueError(f"{name} must be [P, page_size, K, H], got "
                             f"{_validate._describe(cache)}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"value_cache must have the shape and dtype of key_cache "
                         f"({_validate._describe(key_cache)}), got "
                         f"{_validate._describe(value_cache)}")
    pages, page_size = key_cache.shape[:2]
    if page_size not in PAGE_SIZES:
        raise ValueError(f"key_cache's page size (its axis 1) must be a power of two from 16 to "
                         f"256, got {page_size}")
    if pages < 1:
        raise ValueError(f"key_cache must hold at least one page, got "
                         f"{_validate._describe(key_cache)}")


def _check_cache(key_cache, value_cache, query):
    """The pool (_check_pool) as paged_attention reads it with `query`."""
    _check_pool(key_cache, value_cache)
    if key_cache.dtype != query.dtype and key_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"key_cache must have query's dtype ({query.dtype}) or be "
                        f"float8_e4m3fn with a descale, got {_validate._describe(key_cache)}")
    kv_heads, head_dim = key_cache.shape[2:]
    if head_dim != query.shape[-1]:
        raise ValueError(f"key_cache's head dim {head_dim} must equal query's "
                         f"{query.shape[-1]}")
    if kv_heads < 1 or query.shape[2] % kv_heads:
        raise ValueError(f"query's {query.shape[2]} heads must be a multiple of key_cache's "
                         f"{kv_heads} (GQA/MQA)")


def _descale(x, name: str, cache, batch: int):
    """A float32 descale as [B, K] (from a scalar or [B, K]); None without one."""
    if x is None:
        return None
    if cache.dtype not in FP8_DTYPES:
        raise ValueError(f"{name} applies to a float8_e4m3fn cache only, got a "
                         f"{cache.dtype} cache")
    return fp8.group_descale(x, name, batch, cache.shape[2])


def _page_table(page_table, batch: int):
    """page_table as int32 [B, max_pages]; a TypeError or ValueError naming it otherwise."""
    if page_table is None:
        raise TypeError("page_table must be an int32 array [B, max_pages], got None")
    if not isinstance(page_table, jax.Array):
        page_table = _validate.host_integers(page_table, "page_table")
    page_table = _validate._as_array(page_table, "page_table")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [B, max_pages] with B = {batch}, got "
                         f"{_validate._describe(page_table)}")
    return _validate._int32_array(page_table, "page_table", tuple(page_table.shape),
                                  "page ids of each sequence", "page ids")


def _check_table_values(page_table, kv_lens, q_lens, pages: int, page_size: int, t: int):
    """A ValueError naming the first bad entry of concrete operands: a length past the table or
    below the queries', a page id outside [0, P) among a sequence's pages (under jit,
    _invalid_entries turns the same conditions into NaN rows)."""
    table = np.asarray(page_table)
    kv = np.asarray(kv_lens)
    q = np.full(kv.shape, t) if q_lens is None else np.asarray(q_lens)
    capacity = table.shape[1] * page_size
    for b in range(table.shape[0]):
        if not 0 <= kv[b] <= capacity:
            raise ValueError(f"key_value_seq_lengths[{b}] = {kv[b]} must be in [0, max_pages x "
                             f"page_size] = [0, {capacity}]")
        if q_lens is not None and not 0 <= q[b] <= t:
            raise ValueError(f"query_seq_lengths[{b}] = {q[b]} must be in [0, T] = [0, {t}]")
        if q[b] > kv[b]:
            raise ValueError(f"sequence {b} has {q[b]} new queries but {kv[b]} cached tokens: "
                             "the cache holds the new tokens too (key_value_seq_lengths counts "
                             "them), so it needs query_seq_lengths <= key_value_seq_lengths")
        used = table[b, :(int(kv[b]) + page_size - 1) // page_size]
        bad = (used < 0) | (used >= pages)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"page_table[{b}, {j}] = {used[j]} is not a page of the cache "
                             f"([0, {pages})), and sequence {b}'s {kv[b]} tokens use it")


def _invalid_entries(page_table, kv_lens, q_lens, pages: int, page_size: int, t: int):
    """bool [B]: the entries _check_table_values would refuse, computed on the device."""
    capacity = page_table.shape[1] * page_size
    q = jnp.full_like(kv_lens, t) if q_lens is None else q_lens
    used = jnp.arange(page_table.shape[1])[None, :] * page_size < kv_lens[:, None]
    bad_page = jnp.any(used & ((page_table < 0) | (page_table >= pages)), axis=1)
    return (bad_page | (kv_lens < 0) | (kv_lens > capacity) | (q < 0) | (q > t)
            | (q > kv_lens))


def _gather(cache, page_table):
    """[P, page_size, K, H] pages -> [B, max_pages x page_size, K, H], in the cache's dtype
    (an e4m3 cache stays e4m3: `attention` takes it with its descales); page ids outside
    [0, P) read page 0 (their entries are NaN'd by the caller)."""
    pages, page_size, kv_heads, head_dim = cache.shape
    batch, max_pages = page_table.shape
    ids = jnp.where((page_table >= 0) & (page_table < pages), page_table, 0)
    return jnp.take(cache, ids, axis=0).reshape(batch, max_pages * page_size, kv_heads,
                                                head_dim)


def _reads_pages_in_place(query, key_cache, page_table, q_lens, implementation, scale: float,
                          soft_cap: float, switches) -> bool:
    """Whether the kernels read this call's pages in place (the module's docstring says
    where); False sends it through the gather."""
    batch, t, n, h = query.shape
    pages, page_size, kv_heads = key_cache.shape[:3]
    if (min(batch, t, n, h, page_table.shape[1]) == 0
            or _check_implementation(implementation) != "kernels"):
        return False
    keys = (batch, page_table.shape[1] * page_size, kv_heads, h)
    if key_cache.dtype in FP8_DTYPES:
        return not soft_cap and fp8.kernels_take(
            query.shape, query.dtype, keys, scale=scale, has_q_lens=q_lens is not None,
            has_kv_lens=True, switches=switches)
    if jax.default_backend() == "cpu":  # implementation="cpu" needs it too
        return True
    shape = _ffi.call_shape(query.shape, keys, query.dtype, scale=scale,
                            has_q_seqlens=q_lens is not None, has_kv_seqlens=True,
                            soft_cap=soft_cap, switches=switches)
    return _ffi.plan(shape).decode_workspace_floats > 0


def _attend_pages(query, key_cache, value_cache, page_table, kv_lens, q_lens, sinks,
                  descales, *, scale, soft_cap, window, switches):
    """(out [B, T, N, H], lse [B, T, N]) by the kernels that read the pages in place;
    descales: (k_descale, v_descale) float32 [B, K] of an e4m3 cache, as
    fp8.kernel_descales makes them; else None."""
    kernel = functools.partial(_cache_kernel.forward, scale=scale,
                               window=_validate.kernel_window(window, True), switches=switches,
                               soft_cap=soft_cap)
    k_descale, v_descale = (None, None) if descales is None else descales
    out, lse = _forward_only.call(_NO_GRADIENT, kernel, query, key_cache, value_cache,
                                  page_table, kv_lens, q_lens, k_descale, v_descale)
    out, lse = _sinks.apply(out, lse, sinks)
    return out, jnp.swapaxes(lse, -1, -2)


_NO_GRADIENT = ("paged_attention is forward-only (inference): it has no gradient; train "
                "with jax_flashattn.attention on contiguous keys and values")


def _no_grad(x):
    return _forward_only.identity(_NO_GRADIENT, x)


def paged_attention(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
                    scale=None, query_seq_lengths=None, local_window_size=None,
                    logits_soft_cap=None, sinks=None, descale_k=None, descale_v=None,
                    implementation=None, return_residual=False):
    """Attention of each sequence's newest tokens to its paged KV cache (forward only).

    query [B, T, N, H]: each sequence's T newest tokens (T = 1 to decode, more for a chunk of
    a prefill), or its first query_seq_lengths[b] rows of them ([B] int32, for ragged chunks;
    the rows past it return 0). key_cache, value_cache [P, page_size, K, H] (page_size a power
    of two from 16 to 256, N a multiple of K): pages of query's dtype, or float8_e4m3fn with
    descale_k / descale_v (float32 scalars or [B, K]; the value is stored x descale).
    page_table int32 [B, max_pages]: sequence b's token j is in page page_table[b, j //
    page_size], slot j % page_size. key_value_seq_lengths int32 [B]: the tokens in sequence b's
    cache, the new ones included (paged_cache_update writes them first).

    Causal with the diagonal at the bottom right of each sequence: query i of entry b sits at
    position kv_len_b - q_len_b + i and sees the cached tokens up to it, and with
    local_window_size (left, right) as in `attention` no further back than left tokens (being
    causal, the right side changes nothing). scale, logits_soft_cap, sinks and implementation
    as in `attention`. Returns [B, T, N, H] in query's dtype, and with
    return_residual the lse [B, T, N] (float32) too.

    Checks: shapes and dtypes raise at trace time. With concrete page_table and lengths, a
    length past max_pages x page_size, query_seq_lengths > key_value_seq_lengths, or a page id
    outside [0, P) among a sequence's pages raise a ValueError; under jit, where their values
    are not known until the call runs, they make that sequence's output rows NaN (no page is
    read out of bounds). jax.grad through it raises a TypeError.
    """
    query = _validate._as_array(query, "query")
    key_cache = _validate._as_array(key_cache, "key_cache")
    value_cache = _validate._as_array(value_cache, "value_cache")
    if query.ndim != 4:
        raise ValueError(f"query must be [B, T, N, H], got {_validate._describe(query)}")
    _check_cache(key_cache, value_cache, query)
    batch, t = query.shape[:2]
    pages, page_size = key_cache.shape[:2]
    table_arg = page_table
    page_table = _page_table(page_table, batch)
    if key_value_seq_lengths is None:
        raise TypeError("key_value_seq_lengths must be an int32 array [B] (each sequence's "
                        "cached tokens), got None")
    lengths_args = (key_value_seq_lengths, query_seq_lengths)
    kv_lens = _validate._seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch)
    q_lens = _validate._seq_lengths(query_seq_lengths, "query_seq_lengths", batch)
    descale_k = _descale(descale_k, "descale_k", key_cache, batch)
    descale_v = _descale(descale_v, "descale_v", value_cache, batch)
    # Checked here where the values are known; under jit, bad entries are NaN'd below instead.
    checked = all(_is_concrete(x) for x in (table_arg, *lengths_args))
    if checked:
        _check_table_values(page_table, kv_lens, q_lens, pages, page_size, t)
    if sinks is not None:
        sinks = _no_grad(_validate._as_array(sinks, "sinks"))
    _validate.check_options(implementation=implementation)
    switches = _ffi.kernel_switches()
    kernel_scale = _validate._scale(scale, query.shape[-1])
    soft_cap = _validate._soft_cap(logits_soft_cap)
    if _reads_pages_in_place(query, key_cache, page_table, q_lens, implementation,
                             kernel_scale, soft_cap, switches):
        descales = None
        if key_cache.dtype in FP8_DTYPES:
            descales = fp8.kernel_descales(descale_k, descale_v, query.shape[0],
                                           key_cache.shape[2])
        out = _attend_pages(query, key_cache, value_cache, page_table, kv_lens, q_lens,
                            _validate._sinks(sinks, query.shape[2]), descales,
                            scale=kernel_scale,
                            soft_cap=soft_cap, window=_validate._window(local_window_size),
                            switches=switches)
        if not return_residual:
            out = out[0]
    else:
        keys, values = (_gather(cache, page_table) for cache in (key_cache, value_cache))
        out = attention(_no_grad(query), _no_grad(keys), _no_grad(values),
                        scale=scale, is_causal=True, diagonal_alignment="bottom_right",
                        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                        local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                        sinks=sinks, implementation=implementation,
                        return_residual=return_residual, descale_k=descale_k,
                        descale_v=descale_v)
    if checked:
        return out
    invalid = _invalid_entries(page_table, kv_lens, q_lens, pages, page_size, t)
    if return_residual:
        out, lse = out
        return (jnp.where(invalid[:, None, None, None], jnp.nan, out).astype(out.dtype),
                jnp.where(invalid[:, None, None], jnp.nan, lse))
    return jnp.where(invalid[:, None, None, None], jnp.nan, out).astype(out.dtype)


def paged_cache_update(key_cache, value_cache, page_table, positions, k_new, v_new):
    """(key_cache, value_cache) with k_new, v_new [B, T_new, K, H] written at their positions.

    positions: int32 [B] (the position of each sequence's first new token; its T_new tokens
    follow it) or [B, T_new] (each token's own; a negative one is not written, for ragged
    chunks). Token j of sequence b goes to page page_table[b, j // page_size], slot j %
    page_size. k_new and v_new are cast to the cache's dtype (an FP8 cache: quantise them
    first, with quantize_fp8 and the sequence's descale). In place under jit when the caches
    are donated (jax.jit(..., donate_argnums=...)).

    With concrete page_table and positions, a position past max_pages x page_size or a page id
    outside [0, P) raises a ValueError; under jit such tokens are not written.
    """
    key_cache = _validate._as_array(key_cache, "key_cache")
    value_cache = _validate._as_array(value_cache, "value_cache")
    k_new = _validate._as_array(k_new, "k_new")
    v_new = _validate._as_array(v_new, "v_new")
    _check_pool(key_cache, value_cache)
    pages, page_size, kv_heads, head_dim = key_cache.shape
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.ndim != 4 or tuple(x.shape[2:]) != (kv_heads, head_dim):
            raise ValueError(f"{name} must be [B, T_new, K, H] with K, H = {kv_heads}, "
                             f"{head_dim} (the cache's), got {_validate._describe(x)}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"v_new must have the shape of k_new {tuple(k_new.shape)}, got "
                         f"{tuple(v_new.shape)}")
    batch, t_new = k_new.shape[:2]
    table_arg, positions_arg = page_table, positions
    page_table = _page_table(page_table, batch)
    if positions is None:
        raise TypeError("positions must be an int32 array [B] or [B, T_new], got None")
    if not isinstance(positions, jax.Array):
        positions = _validate.host_integers(positions, "positions")
    positions = _validate._as_array(positions, "positions")
    if positions.ndim == 1:
        positions = _validate._int32_array(positions, "positions", (batch,),
                                           "each sequence's first new position", "positions")
        positions = positions[:, None] + jnp.arange(t_new, dtype=jnp.int32)[None, :]
    else:
        positions = _validate._int32_array(positions, "positions", (batch, t_new),
                                           "each new token's position", "positions")
    max_pages = page_table.shape[1]
    if _is_concrete(table_arg) and _is_concrete(positions_arg):
        table, pos = np.asarray(page_table), np.asarray(positions)
        for b, j in zip(*np.nonzero(pos >= max_pages * page_size)):
            raise ValueError(f"position {pos[b, j]} of sequence {b} is past its page table "
                             f"({max_pages} pages of {page_size})")
        written = pos >= 0
        page_ids = table[np.arange(batch)[:, None], np.where(written, pos // page_size, 0)]
        bad = written & ((page_ids < 0) | (page_ids >= pages))
        for b, j in zip(*np.nonzero(bad)):
            raise ValueError(f"page_table[{b}, {pos[b, j] // page_size}] = {page_ids[b, j]} is "
                             f"not a page of the cache ([0, {pages})), and position "
                             f"{pos[b, j]} of sequence {b} is written there")
    in_table = (positions >= 0) & (positions < max_pages * page_size)
    slot_page = jnp.where(in_table, positions // page_size, 0)
    page_ids = jnp.take_along_axis(page_table, slot_page, axis=1)
    # Tokens not written go to page P, which mode="drop" leaves out.
    page_ids = jnp.where(in_table & (page_ids >= 0) & (page_ids < pages), page_ids, pages)
    slots = positions % page_size

    def write(cache, new):
        return cache.at[page_ids, slots].set(new.astype(cache.dtype), mode="drop")
    return write(key_cache, k_new), write(value_cache, v_new)
