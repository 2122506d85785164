"""paged_attention and paged_cache_update against a float64 reference that walks each
sequence's tokens through its page table (every platform; the CPU kernels in CI)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn.paged import PAGE_SIZES

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
             jnp.dtype(jnp.float16): 4e-3}


def scattered_cache(rng, batch, kv_lens, page_size, kv_heads, head_dim, max_pages, spare=3):
    """Pages [P, page_size, K, H] of float32 values and a page table whose entries point at
    pages drawn at random (no two sequences share one); table slots past a sequence's pages
    hold -1 or ids past the pool, which nothing may read."""
    needed = [(int(n) + page_size - 1) // page_size for n in kv_lens]
    pages = sum(needed) + spare
    order = rng.permutation(pages)
    table = np.full((batch, max_pages), -1, np.int32)
    start = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[start:start + n]
        table[b, n:] = rng.choice([-1, pages, pages + 7], max_pages - n)
        start += n
    shape = (pages, page_size, kv_heads, head_dim)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32), table)


def reference(q, key_cache, value_cache, table, kv_lens, q_lens=None, scale=None, window=None,
              soft_cap=None, sinks=None, descale_k=None, descale_v=None):
    """Float64 attention of query i of sequence b (position kv_len - q_len + i) to the cached
    tokens it sees, each read from its page (times the [B, K] descales when given): out
    [B, T, N, H], lse [B, T, N]."""
    q = np.asarray(q, np.float64)
    batch, t, heads, head_dim = q.shape
    page_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    lse = np.full((batch, t, heads), -np.inf)
    for b in range(batch):
        q_len = t if q_lens is None else int(q_lens[b])
        kv = int(kv_lens[b])
        j = np.arange(kv)
        pages = table[b, j // page_size]
        k = np.asarray(key_cache, np.float64)[pages, j % page_size]  # [kv, K, H]
        v = np.asarray(value_cache, np.float64)[pages, j % page_size]
        if descale_k is not None:  # [B, K]
            k = k * np.asarray(descale_k, np.float64)[b][None, :, None]
        if descale_v is not None:
            v = v * np.asarray(descale_v, np.float64)[b][None, :, None]
        for i in range(q_len):
            pos = kv - q_len + i
            seen = (j <= pos) & (j >= (pos - window if window is not None else -1))
            for n in range(heads):
                kh = n // (heads // kv_heads)
                s = scale * (k[:, kh] @ q[b, i, n])
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                s = np.where(seen, s, -np.inf)
                terms = [s] + ([] if sinks is None else [np.array([float(sinks[n])])])
                m = max(float(np.max(x)) for x in terms)
                if m == -np.inf:
                    continue
                total = sum(np.exp(x - m).sum() for x in terms)
                out[b, i, n] = (np.exp(s - m) @ v[:, kh]) / total
                lse[b, i, n] = m + np.log(total)
    return out, lse


def check(rng, dtype, batch, t, heads, kv_heads, head_dim, page_size, kv_lens, q_lens=None,
          max_pages=None, **kwargs):
    max_pages = max_pages or max((int(n) + page_size - 1) // page_size for n in kv_lens) + 1
    key_cache, value_cache, table = scattered_cache(rng, batch, kv_lens, page_size, kv_heads,
                                                    head_dim, max_pages)
    q = rng.standard_normal((batch, t, heads, head_dim)).astype(np.float32)
    casts = [jnp.asarray(x, dtype) for x in (q, key_cache, value_cache)]
    ref_inputs = [np.asarray(x.astype(jnp.float32)) for x in casts]
    out, lse = jax_flashattn.paged_attention(
        *casts, table, np.asarray(kv_lens, np.int32),
        query_seq_lengths=None if q_lens is None else np.asarray(q_lens, np.int32),
        return_residual=True, **kwargs)
    ref_out, ref_lse = reference(*ref_inputs, table, kv_lens, q_lens, scale=kwargs.get("scale"),
                                 window=None if kwargs.get("local_window_size") is None
                                 else kwargs["local_window_size"][0],
                                 soft_cap=kwargs.get("logits_soft_cap"),
                                 sinks=kwargs.get("sinks"))
    assert out.shape == q.shape and out.dtype == dtype
    out = np.asarray(out, np.float64)
    tol = TOLERANCE[jnp.dtype(dtype)]
    assert np.linalg.norm(out - ref_out) <= tol * np.linalg.norm(ref_out) + 1e-6
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=50 * tol)
    return out


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_every_page_size(rng, page_size):
    """One new token per sequence, ragged lengths (one shorter than a page, one a page
    exactly, one spilling into a last partial page), GQA 8 -> 2."""
    kv_lens = [page_size // 2 + 1, page_size, 3 * page_size + 5]
    check(rng, jnp.float32, 3, 1, 8, 2, 32, page_size, kv_lens)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_chunked_prefill_ragged(rng, dtype):
    """A chunk of 7 new tokens per sequence, fewer in some (query_seq_lengths), the rows past
    them 0: their diagonal at the bottom right of each sequence's own length."""
    out = check(rng, dtype, 4, 7, 4, 4, 16, 16, [7, 40, 100, 3], q_lens=[7, 2, 5, 3])
    assert np.all(out[1, 2:] == 0) and np.all(out[2, 5:] == 0) and np.all(out[3, 3:] == 0)


@pytest.mark.parametrize("kwargs", [dict(local_window_size=(20, 0)),
                                    dict(local_window_size=(9, 4)),
                                    dict(logits_soft_cap=5.0, scale=0.5),
                                    dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32))])
def test_options(rng, kwargs):
    check(rng, jnp.float32, 2, 3, 4, 2, 32, 32, [70, 33], **kwargs)


def test_fp8_cache_with_descales(rng):
    """An e4m3 cache: the reference dequantises the stored values with the same descales."""
    batch, heads, kv_heads, head_dim, page_size = 2, 4, 2, 32, 16
    kv_lens = [37, 20]
    key_cache, value_cache, table = scattered_cache(rng, batch, kv_lens, page_size, kv_heads,
                                                    head_dim, 4)
    k8, v8 = (jnp.asarray(x * 8, jnp.float8_e4m3fn) for x in (key_cache, value_cache))
    descale_k = jnp.asarray(rng.uniform(0.05, 0.2, (batch, kv_heads)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch, 2, heads, head_dim)), jnp.float32)
    out = jax_flashattn.paged_attention(q, k8, v8, table, np.array(kv_lens, np.int32),
                                        descale_k=descale_k, descale_v=0.125)
    kf, vf = (np.asarray(x.astype(jnp.float32)) for x in (k8, v8))
    ref, _ = reference(np.asarray(q), kf, vf, table, kv_lens, descale_k=np.asarray(descale_k),
                       descale_v=np.full((batch, kv_heads), 0.125))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def _lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels read every call")
def test_kernels_read_pages_in_place(rng):
    """The kernel call takes the page pools themselves: no gather of pages into a contiguous
    copy in the program, e4m3 pages too (dequantised as the kernels load them), but for
    e4m3 pages with a soft-cap (the GPU decode kernels' e4m3 configurations have none), which
    gather."""
    key_cache, value_cache, table = scattered_cache(rng, 2, [40, 23], 16, 2, 16, 4)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    kv = np.array([40, 23], np.int32)
    text = _lowered_text(jax_flashattn.paged_attention, q, key_cache, value_cache, table, kv)
    assert "jax_flashattn_fwd" in text and "gather" not in text
    k8, v8 = (jnp.asarray(x, jnp.float8_e4m3fn) for x in (key_cache, value_cache))
    assert "gather" not in _lowered_text(jax_flashattn.paged_attention, q, k8, v8, table, kv)
    capped = functools.partial(jax_flashattn.paged_attention, logits_soft_cap=5.0)
    assert "gather" in _lowered_text(capped, q, k8, v8, table, kv)


def test_vmap_over_a_leading_axis(rng):
    """vmap over queries, tables and lengths with shared pools: one call per element, each what
    its own call gives, the pools not copied per element."""
    key_cache, value_cache, table = scattered_cache(rng, 2, [40, 23], 16, 2, 16, 5, spare=20)
    tables = np.stack([table, table[::-1]])
    q = jnp.asarray(rng.standard_normal((2, 2, 1, 4, 16)), jnp.float32)
    kv = np.array([[40, 23], [23, 40]], np.int32)
    vmapped = jax.vmap(jax_flashattn.paged_attention, in_axes=(0, None, None, 0, 0))
    copies = "x".join(map(str, (2, *key_cache.shape)))
    assert f"tensor<{copies}x" not in _lowered_text(vmapped, q, key_cache, value_cache, tables, kv)
    out = vmapped(q, key_cache, value_cache, tables, kv)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(jax_flashattn.paged_attention(
            q[i], key_cache, value_cache, tables[i], kv[i])), rtol=1e-6, atol=1e-6)


def test_jit_matches_eager_and_poisons_bad_entries(rng):
    """Under jit the table's values are not known at trace time: a sequence whose pages or
    length are invalid gets NaN rows, the others their results."""
    key_cache, value_cache, table = scattered_cache(rng, 3, [30, 50, 17], 16, 2, 16, 5)
    q = jnp.asarray(rng.standard_normal((3, 2, 2, 16)), jnp.float32)
    kv_lens = np.array([30, 50, 17], np.int32)
    eager = jax_flashattn.paged_attention(q, key_cache, value_cache, table, kv_lens)
    f = jax.jit(jax_flashattn.paged_attention)
    np.testing.assert_allclose(f(q, key_cache, value_cache, table, kv_lens), eager, rtol=1e-6,
                               atol=1e-6)
    bad_table = table.copy()
    bad_table[1, 2] = key_cache.shape[0]  # a page the 50 tokens use, past the pool
    out = np.asarray(f(q, key_cache, value_cache, bad_table, kv_lens))
    assert np.isnan(out[1]).all()
    np.testing.assert_allclose(out[[0, 2]], np.asarray(eager)[[0, 2]], rtol=1e-6, atol=1e-6)
    out = np.asarray(f(q, key_cache, value_cache, table, np.array([30, 81, 1], np.int32)))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()  # past 5 x 16; 2 queries > 1
    assert not np.isnan(out[0]).any()


def test_cache_update_then_attention(rng):
    """Prefill sequence 0 with 37 tokens in two chunks and sequence 1 with 5, then decode one
    token each: the pages paged_cache_update wrote give what attention over the same keys and
    values laid out contiguously gives."""
    batch, kv_heads, heads, head_dim, page_size = 2, 2, 4, 16, 16
    table = np.array([[7, 2, 9, 0], [4, 11, 1, 3]], np.int32)
    shape = (batch, 38, kv_heads, head_dim)
    keys, values = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    key_cache = jnp.zeros((12, page_size, kv_heads, head_dim), jnp.float32)
    value_cache = jnp.zeros_like(key_cache)
    update = jax.jit(jax_flashattn.paged_cache_update)
    # First chunk: tokens 0-19 of sequence 0, 0-4 of sequence 1 (its other slots -1).
    positions = np.where(np.arange(20)[None, :] < np.array([[20], [5]]), np.arange(20), -1)
    key_cache, value_cache = update(key_cache, value_cache, table, positions.astype(np.int32),
                                    keys[:, :20], values[:, :20])
    # Second chunk: tokens 20-36 of sequence 0; sequence 1's slots are all -1.
    positions = np.stack([np.arange(20, 37), np.full(17, -1)]).astype(np.int32)
    key_cache, value_cache = update(key_cache, value_cache, table, positions, keys[:, 20:37],
                                    values[:, 20:37])
    # Decode: one token each at positions [B] = each sequence's length, 37 and 5.
    lengths = np.array([37, 5], np.int32)
    k_step, v_step = keys[:, 37:38], values[:, 37:38]
    key_cache, value_cache = update(key_cache, value_cache, table, lengths, k_step, v_step)
    kv_lens = lengths + 1
    contiguous_k, contiguous_v = keys.copy(), values.copy()
    contiguous_k[1, 5], contiguous_v[1, 5] = k_step[1, 0], v_step[1, 0]
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    out = jax_flashattn.paged_attention(q, key_cache, value_cache, table, kv_lens)
    expected = jax_flashattn.attention(q, jnp.asarray(contiguous_k), jnp.asarray(contiguous_v),
                                       is_causal=True, diagonal_alignment="bottom_right",
                                       key_value_seq_lengths=kv_lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # Slots no token was written to are still zeros: page 3 (sequence 1's fourth) and the
    # rest of page 4 past sequence 1's 6 tokens.
    for cache in (key_cache, value_cache):
        assert not np.asarray(cache[3]).any() and not np.asarray(cache[4, 6:]).any()


def test_cache_update_is_in_place_when_donated(rng):
    """Donated caches: the compiled update aliases its outputs to them (no copy of the pool)."""
    key_cache = jnp.zeros((8, 16, 2, 16), jnp.bfloat16)
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    new = jnp.ones((2, 1, 2, 16), jnp.bfloat16)
    update = jax.jit(jax_flashattn.paged_cache_update, donate_argnums=(0, 1))
    text = update.lower(key_cache, key_cache, table, np.array([3, 60], np.int32), new,
                        new).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text


def test_errors(rng):
    key_cache, value_cache, table = scattered_cache(rng, 2, [20, 9], 16, 2, 16, 3)
    q = jnp.zeros((2, 1, 4, 16), jnp.float32)
    kv = np.array([20, 9], np.int32)
    call = jax_flashattn.paged_attention
    with pytest.raises(ValueError, match="page size"):
        call(q, key_cache[:, :8], value_cache[:, :8], table, kv)
    with pytest.raises(ValueError, match="value_cache must have the shape"):
        call(q, key_cache, value_cache[:-1], table, kv)
    with pytest.raises(ValueError, match="head dim"):
        call(jnp.zeros((2, 1, 4, 8)), key_cache, value_cache, table, kv)
    with pytest.raises(ValueError, match="multiple of key_cache's 2"):
        call(jnp.zeros((2, 1, 3, 16)), key_cache, value_cache, table, kv)
    with pytest.raises(ValueError, match="page_table must be"):
        call(q, key_cache, value_cache, table[:1], kv)
    with pytest.raises(TypeError, match="page_table must be an integer array"):
        call(q, key_cache, value_cache, table.astype(np.float32), kv)
    with pytest.raises(TypeError, match="key_value_seq_lengths"):
        call(q, key_cache, value_cache, table, None)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths\[0\] = 49"):
        call(q, key_cache, value_cache, table, np.array([49, 9], np.int32))
    bad = table.copy()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = -1"):
        call(q, key_cache, value_cache, bad, kv)
    with pytest.raises(ValueError, match="needs query_seq_lengths <= key_value_seq_lengths"):
        call(jnp.zeros((2, 10, 4, 16)), key_cache, value_cache, table, kv)
    with pytest.raises(ValueError, match="descale_k applies to a float8_e4m3fn cache only"):
        call(q, key_cache, value_cache, table, kv, descale_k=1.0)
    with pytest.raises(TypeError, match="key_cache must have query's dtype"):
        call(q, key_cache.astype(jnp.bfloat16), value_cache.astype(jnp.bfloat16), table, kv)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda q: call(q, key_cache, value_cache, table, kv).sum())(q)
    update = jax_flashattn.paged_cache_update
    new = jnp.zeros((2, 1, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="past its page table"):
        update(key_cache, value_cache, table, np.array([3, 48], np.int32), new, new)
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = -1"):
        update(key_cache, value_cache, bad, np.array([3, 4], np.int32), new, new)
    with pytest.raises(ValueError, match="page size"):
        update(key_cache[:, :8], value_cache[:, :8], table, np.array([3, 4], np.int32), new, new)
    with pytest.raises(ValueError, match="value_cache must have the shape and dtype"):
        update(key_cache, value_cache.astype(jnp.bfloat16), table, np.array([3, 4], np.int32),
               new, new)
    with pytest.raises(ValueError, match="k_new must be"):
        update(key_cache, value_cache, table, np.array([3, 4], np.int32), new[..., :8], new)
    with pytest.raises(ValueError, match="positions must have shape"):
        update(key_cache, value_cache, table, np.array([3, 4, 5], np.int32), new, new)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("split", ["heads", "batch"])
def test_sharded_without_collectives(rng, split, explicit):
    """Query heads and the caches' kv heads split over 2 devices, the table and lengths
    replicated; or the sequences (queries, table, lengths) split, the pools replicated: each
    device attends its own heads or sequences, no collective in the program. Under Explicit
    mesh axes (jax.set_mesh) the result is typed with the queries' sharding."""
    import contextlib
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    key_cache, value_cache, table = scattered_cache(rng, 2, [40, 23], 16, 2, 16, 4)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    kv = np.array([40, 23], np.int32)
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), (split,), axis_types=(axis_type,))
    if split == "heads":
        heads = pool = NamedSharding(mesh, P(None, None, "heads", None))
        rows = NamedSharding(mesh, P())
    else:
        heads, pool = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
        rows = NamedSharding(mesh, P("batch"))
    args = (jax.device_put(q, heads), jax.device_put(key_cache, pool),
            jax.device_put(value_cache, pool), jax.device_put(table, rows),
            jax.device_put(kv, rows))
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        compiled = jax.jit(jax_flashattn.paged_attention).lower(*args).compile()
        out = compiled(*args)
        typed = tuple(jax.typeof(out).sharding.spec)
    if explicit:  # the specs padded to q's 4 dims

        def padded(spec):
            return tuple(spec) + (None,) * (4 - len(spec))
        assert padded(typed) == padded(heads.spec)
    text = compiled.as_text()
    for op in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute"):
        assert op + "(" not in text and op + "-start(" not in text, op
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax_flashattn.paged_attention(
        q, key_cache, value_cache, table, kv)), rtol=1e-6, atol=1e-6)
    assert out.sharding.is_equivalent_to(heads, 4)
