"""paged_attention on the CUDA kernels (run with `pytest -m gpu` on an NVIDIA GPU): decode
steps (the split-KV decode kernels) and prefill chunks (the forward kernels) against the float64
reference of test_paged.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from test_paged import TOLERANCE, reference, scattered_cache

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
