"""Boolean masks with whole tiles hidden on the CUDA kernels (run with `pytest -m gpu`): the
Hopper forward and backward, the mma.sync family and the CUDA-core kernels narrow their tiles to
the mask's spans (segments.mask_spans), and the values, lse and gradients stay the reference's
under every structure, with warpgroups and blocks that see no key through the spans, beside
bounds, GQA and a bias, on the staged (S a multiple of 16) and the global-read mask paths. The
spans themselves and the CPU kernels: test_mask_spans.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import (assert_attention_close, assert_grads_close, check_cuda_forward, grads,
                     random_qkv, reference_grads, use_family)
from test_gpu_bias import check_backward
from test_mask_spans import KINDS, structured_mask

pytestmark = pytest.mark.gpu

# 300 queries: a last query block cut short; 701 keys: several key tiles at every head dim and
# a last one cut short; 704: the mask alone staged in shared memory.
T, S, STAGED_S = 300, 701, 704


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s", [S, STAGED_S])
def test_forward_sm90(rng, monkeypatch, head_dim, kind, s):
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, s, 4, 2, head_dim, jnp.bfloat16)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 1, T, s))
    assert jax_flashattn.forward_kernel(q, k, None, mask) == "sm90"
    check_cuda_forward(q, k, v, None, mask)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", [dict(is_causal=True), dict(local_window_size=(90, 9)),
                                     dict(query_seq_lengths=jnp.array([300, 41], jnp.int32),
                                          key_value_seq_lengths=jnp.array([650, 129],
                                                                          jnp.int32))],
                         ids=["causal", "window", "lengths"])
@pytest.mark.parametrize("kind", ["documents", "band"])
def test_forward_sm90_beside_bounds(rng, monkeypatch, head_dim, options, kind):
    """Under causal and window bounds a warpgroup's rows may see no key of the narrowed block:
    it idles, and the V rows past a length are zeroed by the lowest computing one."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, head_dim, jnp.float16)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 1, T, STAGED_S))
    check_cuda_forward(q, k, v, None, mask, **options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", KINDS)
def test_backward_sm90(rng, monkeypatch, head_dim, kind):
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, STAGED_S, 4, 2, head_dim, jnp.bfloat16)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 4, T, STAGED_S))
    check_backward(rng, q, k, v, None, mask)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_sm90_with_bias(rng, monkeypatch, deterministic):
    """A bias beside the mask: dbias (one writer per element) through the narrowed blocks, 0 at
    the pairs they skip, and the ordered-dQ mode, which does not narrow."""
    use_family("sm90", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    mask = jnp.asarray(structured_mask(rng, "documents", 2, 1, T, S))
    bias = jnp.asarray(rng.standard_normal((2, 4, T, S)), jnp.bfloat16)
    check_backward(rng, q, k, v, bias, mask, deterministic, is_causal=True)


@pytest.mark.parametrize("kind", KINDS)
def test_mma_sync_family(rng, monkeypatch, kind):
    family = use_family("sm80", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 4, T, S))
    assert jax_flashattn.forward_kernel(q, k, None, mask).startswith(family)
    check_cuda_forward(q, k, v, None, mask)
    check_backward(rng, q, k, v, None, mask, family=family)


@pytest.mark.parametrize("kind", ["documents", "keys"])
def test_mma_sync_family_with_bias(rng, monkeypatch, kind):
    """A full bias beside the mask on the mma.sync backward: its dbias has one writer per
    element, which visits every query tile whatever the spans, so the skipped pairs get 0."""
    family = use_family("sm80", monkeypatch)
    q, k, v = random_qkv(rng, 2, T, S, 4, 2, 128, jnp.bfloat16)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 1, T, S))
    bias = jnp.asarray(rng.standard_normal((2, 4, T, S)), jnp.bfloat16)
    check_backward(rng, q, k, v, bias, mask, family=family, is_causal=True)


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_core_kernels(rng, kind):
    """float32 on the CUDA-core kernels, which narrow each row's keys (each key's rows)."""
    q, k, v = random_qkv(rng, 2, 150, 171, 4, 2, 64, jnp.float32)
    mask = jnp.asarray(structured_mask(rng, kind, 2, 4, 150, 171))
    assert jax_flashattn.forward_kernel(q, k, None, mask) == "simt"
    check_cuda_forward(q, k, v, None, mask)
    check_backward(rng, q, k, v, None, mask, family="simt")


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_keys_past_every_span_are_never_read(rng, monkeypatch, family, head_dim):
    """Whole key tiles past each entry's last kept key (a cache's unfilled tail), K and V NaN
    there, are never read by the forward nor the backward (atomic dQ mode): out and the
    gradients stay the reference's on the clean cache, where a kernel that visited them would
    carry 0 x NaN into the rows."""
    use_family(family, monkeypatch)
    s = 1400
    q, k, v = random_qkv(rng, 2, T, s, 4, 2, head_dim, jnp.bfloat16)
    filled = np.array([300, 700])
    kept = np.arange(s)[None, :] < filled[:, None]
    mask = jnp.asarray(kept[:, None, None, :] & (rng.random((2, 1, T, s)) < 0.7))
    tail = (np.arange(s)[None, :] >= (filled[:, None] + 255) // 256 * 256)[:, :, None, None]
    poisoned_k, poisoned_v = (jnp.where(tail, jnp.nan, x) for x in (k, v))
    d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    got = jax.jit(lambda *a: grads(jax_flashattn.attention, *a, mask=mask,
                                   implementation="cuda"))(q, poisoned_k, poisoned_v, None,
                                                           d_out)
    assert_attention_close(got[0], q, k, v, mask=mask)
    want = reference_grads(q, k, v, None, d_out, mask=mask)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_grads_close(g, w, normwise=3e-2, name=name)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_skips_the_unfilled_cache_tail(rng, head_dim, rows):
    """A decoding call whose mask hides each entry's unfilled cache tail ([B, 1, 1, S], as a
    Flax decode cache gives it): the splits cover only the filled keys, so the tail's whole
    tiles, here NaN, are never read."""
    s = 4096
    q, k, v = random_qkv(rng, 3, rows, s, 8, 2, head_dim, jnp.bfloat16)
    filled = np.array([1, 960, 2000])
    keep = np.arange(s)[None, None, None, :] < filled[:, None, None, None]
    mask = jnp.asarray(keep)
    assert jax_flashattn.forward_kernel(q, k, None, mask).startswith("decode")
    tail = np.arange(s)[None, :, None, None] >= ((filled + 255) // 256 * 256)[:, None, None, None]
    poisoned = [jnp.where(tail, jnp.nan, x) for x in (k, v)]
    out = jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, mask=mask,
                                                          implementation="cuda"))(q, *poisoned)
    assert np.isfinite(np.asarray(out, np.float32)).all(), "a hidden tail tile was read"
    check_cuda_forward(q, k, v, None, mask)
