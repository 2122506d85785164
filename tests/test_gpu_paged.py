"""paged_attention on the CUDA kernels (run with `pytest -m gpu` on an NVIDIA GPU): decode
steps (the split-KV decode kernels, reading the pages in place) and prefill chunks (the forward
kernels, on gathered pages) against the float64 reference of test_paged.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from test_paged import TOLERANCE, check, reference, scattered_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("t", [1, 8, 16, 200])
def test_cuda_matches_reference(rng, dtype, page_size, t):
    """B = 3, N = 8 over K = 2, H = 128, ragged lengths up to 3000 tokens in scattered pages;
    T = 1, 8, 16 decode, 200 a prefill chunk (one sequence's chunk shorter)."""
    kv_lens = [3000, 1234, t + 7]
    max_pages = 3000 // page_size + 2
    key_cache, value_cache, table = scattered_cache(rng, 3, kv_lens, page_size, 2, 128,
                                                    max_pages)
    q = rng.standard_normal((3, t, 8, 128)).astype(np.float32)
    q_lens = None if t == 1 else np.array([t, t // 2, t], np.int32)
    casts = [jnp.asarray(x, dtype) for x in (q, key_cache, value_cache)]
    out = jax_flashattn.paged_attention(*casts, table, np.array(kv_lens, np.int32),
                                        query_seq_lengths=q_lens, implementation="cuda")
    ref, _ = reference(*(np.asarray(x.astype(jnp.float32)) for x in casts), table, kv_lens,
                       q_lens)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) <= TOLERANCE[jnp.dtype(dtype)] * np.linalg.norm(ref)


def test_cuda_fp8_cache(rng):
    """An e4m3 cache with [B, K] descales, decoding 4 tokens, bf16 queries."""
    kv_lens = [700, 333]
    key_cache, value_cache, table = scattered_cache(rng, 2, kv_lens, 64, 2, 128, 12)
    k8, v8 = (jnp.asarray(x * 8, jnp.float8_e4m3fn) for x in (key_cache, value_cache))
    descale = rng.uniform(0.05, 0.2, (2, 2)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, 8, 128)), jnp.bfloat16)
    out = jax_flashattn.paged_attention(q, k8, v8, table, np.array(kv_lens, np.int32),
                                        descale_k=descale, descale_v=descale,
                                        implementation="cuda")
    # The reference dequantises the stored values with the same descales (in float64).
    k_deq = np.asarray(k8.astype(jnp.float32))
    v_deq = np.asarray(v8.astype(jnp.float32))
    ref, _ = reference(np.asarray(q.astype(jnp.float32)), k_deq, v_deq, table, kv_lens,
                       descale_k=descale, descale_v=descale)
    out = np.asarray(out, np.float64)
    assert np.linalg.norm(out - ref) <= 2e-2 * np.linalg.norm(ref)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("page_size", [16, 32, 128, 256])
@pytest.mark.parametrize("t", [1, 8])
def test_decode_kernels_read_pages_in_place(rng, head_dim, page_size, t):
    """Head dims whose key tiles (128 and 32 keys on the mma.sync kernel) are longer and shorter
    than the pages, 4 and 32 query rows per kv head (the wgmma kernel at head dim 64): the call
    takes a decode kernel on the pools themselves (no gather in the program)."""
    kv_lens = [1000, 517, 300]
    max_pages = 1000 // page_size + 2
    key_cache, value_cache, table = scattered_cache(rng, 3, kv_lens, page_size, 2, head_dim,
                                                    max_pages)
    q = jnp.asarray(rng.standard_normal((3, t, 8, head_dim)), jnp.bfloat16)
    keys = jax.ShapeDtypeStruct((3, max_pages * page_size, 2, head_dim), jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, keys) in ("decode", "decode_sm90")
    caches = [jnp.asarray(x, jnp.bfloat16) for x in (key_cache, value_cache)]
    text = jax.jit(jax_flashattn.paged_attention).lower(
        q, *caches, table, np.array(kv_lens, np.int32)).as_text()
    assert "jax_flashattn_fwd" in text and "gather" not in text
    check(rng, jnp.bfloat16, 3, t, 8, 2, head_dim, page_size, kv_lens,
          q_lens=None if t == 1 else [t, 3, t], implementation="cuda")


@pytest.mark.parametrize("kwargs", [dict(local_window_size=(200, 0)),
                                    dict(logits_soft_cap=5.0, scale=0.1),
                                    dict(sinks=np.linspace(-1, 2, 8).astype(np.float32))])
@pytest.mark.parametrize("t", [1, 16])
def test_decode_options_in_place(rng, kwargs, t):
    """A window, a soft-cap (the decode kernels' instantiations for it) and sinks on pages of
    16 at head dim 128, with the lse."""
    check(rng, jnp.bfloat16, 2, t, 8, 2, 128, 16, [900, 401], **kwargs, implementation="cuda")


def test_decode_bad_entries_under_jit(rng):
    """Under jit an id past the pool among a sequence's pages makes that sequence's rows NaN
    (the kernel reads a page of the pool there, never past it); the other sequence's rows
    are its results."""
    kv_lens = np.array([900, 401], np.int32)
    key_cache, value_cache, table = scattered_cache(rng, 2, kv_lens, 16, 2, 128, 60)
    caches = [jnp.asarray(x, jnp.bfloat16) for x in (key_cache, value_cache)]
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 128)), jnp.bfloat16)
    f = jax.jit(jax_flashattn.paged_attention)
    good = np.asarray(f(q, *caches, table, kv_lens), np.float32)
    bad_table = table.copy()
    bad_table[0, 7] = 10**6
    out = np.asarray(f(q, *caches, bad_table, kv_lens), np.float32)
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(out[1], good[1])


def test_cuda_refuses_paged_calls_off_the_decode_kernels(rng):
    """The paged operands reach only the decode kernels: a paged call with more query rows
    than they take (paged_attention gathers such a call instead) is an error, not a misread."""
    from jax_flashattn import _ffi, _ops
    key_cache, value_cache, table = scattered_cache(rng, 2, [600, 300], 16, 2, 128, 40)
    caches = [jnp.asarray(x, jnp.bfloat16) for x in (key_cache, value_cache)]
    q = jnp.asarray(rng.standard_normal((2, 200, 8, 128)), jnp.bfloat16)
    with pytest.raises(jax.errors.JaxRuntimeError, match="split-KV decode kernels only"):
        jax.block_until_ready(_ops.cache_forward(
            q, *caches, jnp.asarray(table), None, jnp.array([600, 300], jnp.int32),
            scale=0.1, window=(None, 0), switches=_ffi.kernel_switches()))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("split", ["heads", "batch"])
def test_sharded_decode_on_two_gpus(rng, split):
    """Query heads and the pools' kv heads split over 2 GPUs (or the sequences: queries,
    table and lengths): each GPU's decode kernel reads its own pages in place, with no
    collective in the program, and gives what one GPU gives."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    kv_lens = np.array([1000, 517], np.int32)
    key_cache, value_cache, table = scattered_cache(rng, 2, kv_lens, 16, 2, 128, 70)
    caches = [jnp.asarray(x, jnp.bfloat16) for x in (key_cache, value_cache)]
    q = jnp.asarray(rng.standard_normal((2, 4, 8, 128)), jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), (split,))
    if split == "heads":
        rows, pool = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, None, "heads"))
        queries = pool
    else:
        rows, pool = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
        queries = rows
    args = (jax.device_put(q, queries), *(jax.device_put(c, pool) for c in caches),
            jax.device_put(table, rows), jax.device_put(kv_lens, rows))
    compiled = jax.jit(jax_flashattn.paged_attention).lower(*args).compile()
    text = compiled.as_text()
    for op in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute"):
        assert op + "(" not in text and op + "-start(" not in text, op
    assert "gather(" not in text
    out = compiled(*args)
    assert out.sharding.is_equivalent_to(queries, 4)
    # Each GPU holds half the work units, so it may plan other splits: equal up to rounding.
    single = np.asarray(jax_flashattn.paged_attention(q, *caches, table, kv_lens), np.float32)
    out = np.asarray(out, np.float32)
    assert np.linalg.norm(out - single) <= 1e-2 * np.linalg.norm(single)
