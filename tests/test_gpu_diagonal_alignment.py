"""diagonal_alignment="bottom_right" on the CUDA kernels (run with `pytest -m gpu` on a GPU): the
kernels take it as a shifted window (a left side that may be negative, a right side of S - T),
so every family does, the split-KV decode kernels included; with seq lengths each batch entry's
window moves by its own kv_len - q_len (AttentionParams::align_window_to_lengths). Each case runs
on the Hopper kernels and, with JAX_FLASHATTN_DISABLE_SM90, on the mma.sync family, against the
float32 reference; the cases with lengths against the top-left reference with the numpy mask of
tests/test_diagonal_alignment.py, values and gradients."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import (assert_attention_close, assert_lse_close, check_cuda_forward, hopper,
                     random_qkv, run_cuda_forward, use_family)
from test_diagonal_alignment import lengths_case, lengths_mask
from test_gpu_backward import NORMWISE, check_grads, cuda_grads, reference_grads

pytestmark = pytest.mark.gpu

BR = dict(diagonal_alignment="bottom_right")


@pytest.fixture(params=["sm90", "sm80"])
def family(request, monkeypatch):
    return use_family(request.param, monkeypatch)


OPTIONS = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(70, 9)),
    "causal_window": dict(is_causal=True, local_window_size=(200, 0)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", [(97, 700), (700, 97), (257, 513)])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward(rng, family, dtype, head_dim, t, s, option):
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, head_dim, dtype)
    assert jax_flashattn.forward_kernel(q, k) == family
    check_cuda_forward(q, k, v, **OPTIONS[option], **BR)


@pytest.mark.parametrize("t", [1, 4, 16])
def test_decode_kernels(rng, t):
    """A prefill's last tokens against a cache: the decode kernels with the shifted causal
    window (T queries, all but the first seeing the keys before it)."""
    q, k, v = random_qkv(rng, 2, t, 4097, 16, 4, 128, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) in ("decode", "decode_sm90")
    check_cuda_forward(q, k, v, is_causal=True, **BR)
    check_cuda_forward(q, k, v, is_causal=True, local_window_size=(1000, 0), **BR)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients(rng, family, dtype, head_dim, option, deterministic):
    q, k, v = random_qkv(rng, 2, 150, 333, 4, 2, head_dim, dtype)
    check_grads(rng, q, k, v, deterministic=deterministic, **OPTIONS[option], **BR)
    q, k, v = random_qkv(rng, 2, 333, 150, 4, 2, head_dim, dtype)
    check_grads(rng, q, k, v, deterministic=deterministic, **OPTIONS[option], **BR)


def test_float32_and_soft_cap(rng):
    """The CUDA-core kernels (float32), and the soft-capped instantiations."""
    q, k, v = random_qkv(rng, 2, 77, 131, 4, 2, 64, jnp.float32)
    check_cuda_forward(q, k, v, is_causal=True, **BR)
    check_grads(rng, q, k, v, is_causal=True, **BR)
    q, k, v = random_qkv(rng, 2, 77, 131, 4, 2, 128, jnp.bfloat16, magnitude=3.0)
    check_cuda_forward(q, k, v, is_causal=True, logits_soft_cap=5.0, **BR)
    check_grads(rng, q, k, v, is_causal=True, logits_soft_cap=5.0, **BR)


# ----------------------------------------------------------------------------------------------
# With seq lengths: each entry's diagonal at its own kv_len - q_len. The lengths hold the full
# lengths, an entry without queries or without keys, one with both drawn, one with more queries
# than keys (rows that see nothing: out 0, lse -inf, never NaN) (lengths_case).

LENGTH_OPTIONS = dict(OPTIONS, left=dict(local_window_size=(40, 0)))


def mask_of(t, s, q_lens, kv_lens, option):
    return jnp.asarray(lengths_mask(t, s, q_lens, kv_lens, option.get("is_causal", False),
                                    option.get("local_window_size")))


def without_bounds(kwargs):
    """kwargs less the bounds that `mask` (from lengths_mask) stands for in the reference."""
    return {key: x for key, x in kwargs.items() if key not in
            ("is_causal", "local_window_size", "query_seq_lengths", "key_value_seq_lengths")}


def check_forward_with_lengths(q, k, v, mask, *args, **kwargs):
    """Our kernels (poisoned outputs, every element written and finite) against the top-left
    reference with `mask` (and the other options in args, kwargs that it takes)."""
    out, lse = run_cuda_forward(q, k, v, *args, **kwargs, **BR)
    ref_kwargs = without_bounds(kwargs)
    bias = args[0] if args else None
    keep = mask if len(args) < 2 else jnp.logical_and(mask, args[1])
    assert_lse_close(lse, assert_attention_close(out, q, k, v, bias, keep, **ref_kwargs))
    unseen = ~np.asarray(mask).any(-1)[:, 0]
    assert (np.asarray(out, np.float32)[unseen] == 0).all()
    assert np.isneginf(np.asarray(lse)[unseen]).all()


def check_grads_with_lengths(rng, q, k, v, mask, *, deterministic=False, **kwargs):
    """Our gradients against those of the top-left reference with `mask`."""
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    ours = cuda_grads(q, k, v, None, d_out, deterministic=deterministic, **kwargs, **BR)
    ref_kwargs = without_bounds(kwargs)
    ref = reference_grads(q, k, v, None, d_out, mask, **ref_kwargs)
    tol = NORMWISE[jnp.dtype(q.dtype)]
    for name, x, a, r in zip(("dq", "dk", "dv"), (q, k, v), ours, ref):
        assert a.shape == x.shape and a.dtype == x.dtype, (name, a.shape, a.dtype)
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), f"{name}: unwritten or non-finite elements"
        err = np.linalg.norm(a - r)
        bound = tol * np.linalg.norm(r) + 1e-5 * np.sqrt(r.size)
        assert err <= bound, f"{name}: normwise error {err:.3g} exceeds {bound:.3g}"


@pytest.mark.parametrize("dtype,kind", [(jnp.bfloat16, "both"), (jnp.float16, "both"),
                                        (jnp.bfloat16, "query"), (jnp.bfloat16, "key_value")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", [(97, 700), (700, 97), (257, 513)])
@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
def test_forward_with_lengths(rng, family, dtype, kind, head_dim, t, s, option):
    q, k, v = random_qkv(rng, 4, t, s, 4, 2, head_dim, dtype)
    assert jax_flashattn.forward_kernel(q, k) == family
    lengths, q_lens, kv_lens = lengths_case(rng, kind, t, s)
    check_forward_with_lengths(q, k, v, mask_of(t, s, q_lens, kv_lens, LENGTH_OPTIONS[option]),
                               **LENGTH_OPTIONS[option], **lengths)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_with_lengths(rng, family, dtype, head_dim, option, deterministic):
    """Both backward families, each in both dQ modes (on Hopper the deterministic mode's dQ
    writer counts each entry's key blocks with the entry's window), T < S and T > S."""
    for t, s in ((150, 333), (333, 150)):
        q, k, v = random_qkv(rng, 4, t, s, 4, 2, head_dim, dtype)
        assert jax_flashattn.backward_kernel(q, k, deterministic=deterministic) == family
        lengths, q_lens, kv_lens = lengths_case(rng, "both", t, s)
        check_grads_with_lengths(rng, q, k, v,
                                 mask_of(t, s, q_lens, kv_lens, LENGTH_OPTIONS[option]),
                                 deterministic=deterministic, **LENGTH_OPTIONS[option],
                                 **lengths)


@pytest.mark.parametrize("option", sorted(LENGTH_OPTIONS))
def test_cp_async_loads_with_lengths(rng, monkeypatch, option):
    """The mma.sync forward with cp.async K/V loads (its TMA loads are the default on
    Hopper)."""
    use_family("sm80_cp_async", monkeypatch)
    t, s = 190, 411
    q, k, v = random_qkv(rng, 4, t, s, 4, 2, 128, jnp.bfloat16)
    lengths, q_lens, kv_lens = lengths_case(rng, "both", t, s)
    check_forward_with_lengths(q, k, v, mask_of(t, s, q_lens, kv_lens, LENGTH_OPTIONS[option]),
                               **LENGTH_OPTIONS[option], **lengths)


@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("kind", ["both", "key_value"])
def test_decode_kernels_with_lengths(rng, family, t, kind):
    """Decoding against caches of per-entry lengths: the split-KV decode kernels (wgmma on
    Hopper from 32 rows, mma.sync otherwise and under "sm80"), the last query of each entry
    at its cache's end."""
    s = 4097
    q, k, v = random_qkv(rng, 4, t, s, 16, 4, 128, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) in ("decode", "decode_sm90")
    lengths, q_lens, kv_lens = lengths_case(rng, kind, t, s)
    for option in (dict(is_causal=True), dict(is_causal=True, local_window_size=(1000, 0)),
                   dict(local_window_size=(300, 2))):
        check_forward_with_lengths(q, k, v, mask_of(t, s, q_lens, kv_lens, option), **option,
                                   **lengths)


@pytest.mark.parametrize("head_dim", [20, 64])
def test_cuda_core_kernels_with_lengths(rng, head_dim):
    """The CUDA-core kernels: float32, and a head dim that is not a multiple of 8 in bf16."""
    t, s = 77, 131
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v = random_qkv(rng, 4, t, s, 4, 2, head_dim, dtype)
        if dtype == jnp.bfloat16 and head_dim % 8 == 0:
            continue
        assert jax_flashattn.forward_kernel(q, k) == "simt"
        assert jax_flashattn.backward_kernel(q, k) == "simt"
        for option in (dict(is_causal=True), dict(local_window_size=(9, 4))):
            lengths, q_lens, kv_lens = lengths_case(rng, "both", t, s)
            mask = mask_of(t, s, q_lens, kv_lens, option)
            check_forward_with_lengths(q, k, v, mask, **option, **lengths)
            check_grads_with_lengths(rng, q, k, v, mask, **option, **lengths)


def test_instantiations_with_lengths(rng, family):
    """The families' instantiations of their own: soft-cap, segment ids, and (forward) a bias
    and mask, whose backward runs on the mma.sync family."""
    t, s = 150, 333
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 128, jnp.bfloat16, magnitude=3.0)
    q_lens, kv_lens = np.array([150, 60], np.int32), np.array([200, 333], np.int32)
    lengths = dict(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
    option = dict(is_causal=True, local_window_size=(120, 0))
    mask = mask_of(t, s, q_lens, kv_lens, option)
    check_forward_with_lengths(q, k, v, mask, logits_soft_cap=5.0, **option, **lengths)
    check_grads_with_lengths(rng, q, k, v, mask, logits_soft_cap=5.0, **option, **lengths)
    q_ids = jnp.asarray(np.arange(2 * t).reshape(2, t) // 50, jnp.int32)
    kv_ids = jnp.asarray(np.arange(2 * s).reshape(2, s) // 111, jnp.int32)
    ids = dict(query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
    assert jax_flashattn.forward_kernel(q, k, **ids) == family
    check_forward_with_lengths(q, k, v, mask, **ids, **option, **lengths)
    check_grads_with_lengths(rng, q, k, v, mask, **ids, **option, **lengths)
    bias = jnp.asarray(rng.standard_normal((1, 4, t, s)), jnp.bfloat16)
    keep = jnp.asarray(rng.random((2, 1, t, s)) > 0.2)
    assert jax_flashattn.forward_kernel(q, k, bias, keep) == family
    check_forward_with_lengths(q, k, v, mask, bias, keep, **option, **lengths)
    # Against the reference's own alignment (tests/test_diagonal_alignment.py checks it against
    # the numpy mask), for check_grads's dbias rule.
    check_grads(rng, q, k, v, bias, keep, **option, **lengths, **BR)


def test_hopper_tiles_of_entries_with_different_shifts(rng):
    """On the Hopper kernels, entries whose shifts differ by more than a tile within one call
    (the forward's tile slot carries each entry's lengths, the consumers move the window to
    them; the backward's blocks and dQ turns take each entry's): long causal rows at 2100 x
    2100 with lengths far apart, both dQ modes."""
    if not hopper():
        pytest.skip("the Hopper kernels need an sm_90a build on an H100/H200")
    t = s = 2100
    q, k, v = random_qkv(rng, 3, t, s, 2, 1, 128, jnp.bfloat16)
    q_lens, kv_lens = np.array([2100, 300, 1999], np.int32), np.array([700, 2100, 2050], np.int32)
    lengths = dict(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
    option = dict(is_causal=True)
    mask = mask_of(t, s, q_lens, kv_lens, option)
    check_forward_with_lengths(q, k, v, mask, **option, **lengths)
    for deterministic in (False, True):
        check_grads_with_lengths(rng, q, k, v, mask, deterministic=deterministic, **option,
                                 **lengths)
