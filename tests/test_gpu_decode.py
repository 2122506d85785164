"""The split-KV decode kernels on the CUDA backend (run with `pytest -m gpu` on an NVIDIA GPU):
shapes, head dims, masks, the two ways splits merge, dispatch and gradients. Every case poisons
freed device memory first, as tests/test_gpu_forward.py does.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, reference
from helpers import (assert_attention_close, check_cuda_forward, fill_past_lengths, hopper,
                     poison, random_qkv, run_cuda_forward)

pytestmark = pytest.mark.gpu


def decode_kernel(q, k):
    """The decode family the dispatcher must pick for a decoding shape: on Hopper the wgmma one
    for 32 or more query rows per kv head (T * N / K) at head dims up to 128, unless
    JAX_FLASHATTN_DISABLE_SM90 is set; else the mma.sync one."""
    t, n, h = q.shape[-3:]
    wgmma = (hopper() and t * n // k.shape[-2] >= 32 and h <= 128
             and os.environ.get("JAX_FLASHATTN_DISABLE_SM90", "0") in ("", "0"))
    return "decode_sm90" if wgmma else "decode"


def check_decode(q, k, v, *args, **kwargs):
    """check_cuda_forward() for a shape the dispatcher must send to a split-KV decode kernel (decode_kernel);
    also poisons out, lse and the decode workspace, so a split partial the combine reads without
    it having been written, or a row neither merge writes, shows up as NaN. args: the bias and
    mask, if any."""
    assert jax_flashattn.forward_kernel(q, k, *args) == decode_kernel(q, k)
    *lead, t, n, _ = q.shape
    floats = _ffi.plan(_ffi.call_shape(q.shape, k.shape, q.dtype)).decode_workspace_floats
    poison(jax.ShapeDtypeStruct((floats,), jnp.float32),
           jax.ShapeDtypeStruct((*lead, n, t), jnp.float32), jax.ShapeDtypeStruct(q.shape, q.dtype))
    check_cuda_forward(q, k, v, *args, **kwargs)


# "sm80" sends every decoding shape to the mma.sync decode kernel (on Hopper the wgmma one
# takes the shapes with the most rows by default).
DECODE_FAMILIES = ["default", "sm80"]


def pick_decode_family(monkeypatch, family):
    if family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")


@pytest.mark.parametrize("family", DECODE_FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [1, 3, 8, 9, 13, 16])
@pytest.mark.parametrize("n,kv", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_decode_shapes(rng, monkeypatch, family, dtype, t, n, kv):
    """T * N / K query rows per block from 1 to 64 (one to four 16-row slabs, padded; 36, 52
    and 64 on the wgmma kernel), an odd key count that leaves a partial last tile."""
    pick_decode_family(monkeypatch, family)
    check_decode(*random_qkv(rng, 2, t, 4097, n, kv, 128, dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [3, 16])
@pytest.mark.parametrize("head_dim", [40, 64, 72, 128, 200, 256])
@pytest.mark.parametrize("s", [1111, 4097])
def test_decode_head_dims(rng, dtype, t, head_dim, s):
    """The instantiations (64, 128, 256; wgmma: 64 and 128, at T = 16) and head dims padded up
    to them, with 5 splits per kv head (on Hopper merged in their cluster) and 17 (through the
    workspace and the combine)."""
    check_decode(*random_qkv(rng, 3, t, s, 8, 2, head_dim, dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True),
    dict(local_window_size=(1000, 0)),
    dict(local_window_size=(40, 3)),
    dict(local_window_size=300, is_causal=True),
    dict(key_value_seq_lengths=np.array([33333, 0, 17, 20000], np.int32)),
    dict(key_value_seq_lengths=np.array([5000, 1, 33000, 257], np.int32),
         query_seq_lengths=np.array([8, 3, 0, 8], np.int32)),
    dict(key_value_seq_lengths=np.array([9000, 0, 300, 33333], np.int32),
         local_window_size=(8000, 5000)),
], ids=["causal", "window_left", "window_both", "window_causal", "kv_lengths",
        "kv_and_q_lengths", "kv_lengths_window"])
@pytest.mark.parametrize("t,head_dim,family", [(8, 128, "default"), (16, 64, "default"),
                                                (16, 128, "default"), (16, 128, "sm80")])
def test_decode_masks(rng, monkeypatch, dtype, kwargs, t, head_dim, family):
    """Causal is top-left aligned (query t sees keys <= t), so with T << S only the first split
    has keys; windows and lengths leave many splits empty, and zero-length rows give 0 / -inf.
    T = 8 runs 32 rows per block, T = 16 64 (both on Hopper the wgmma one,
    with 128-key tiles at head dim 64 and 64-key tiles at 128; "sm80": the mma.sync kernel's
    whole-tile steps)."""
    pick_decode_family(monkeypatch, family)
    check_decode(*random_qkv(rng, 4, t, 33333, 8, 2, head_dim, dtype), **kwargs)


# Key counts that give 4 kv heads (B = 2, K = 2) 3, 8 and 17 splits (at least 256 keys each;
# a GPU of at least 68 SMs asks for more): on Hopper the first two merge in their thread block
# cluster, the last through the combine kernel; below compute capability 9.0 all three do.
MERGE_KEYS = {"cluster3": (700, 3), "cluster8": (2048, 8), "combine17": (4097, 17)}


def multiprocessors():
    return getattr(jax.devices()[0], "core_count", 0)


@pytest.mark.parametrize("family", DECODE_FAMILIES)
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("merge", MERGE_KEYS)
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(is_causal=True),
    dict(key_value_seq_lengths=np.array([100, 0], np.int32)),
    dict(key_value_seq_lengths=np.array([699, 1500], np.int32), local_window_size=(300, 0)),
], ids=["full", "causal", "short_and_empty", "lengths_window"])
def test_decode_merges(rng, monkeypatch, family, t, merge, kwargs):
    """Both merges of the splits at 4 and 64 query rows per kv head (T * 4), on both decode
    kernels. Causal (top-left) leaves one split with keys, short lengths leave most splits
    empty and the zero length every one (its rows 0 with lse -inf); the cluster merge deals
    rows to the blocks in shares that do not divide evenly (64 over 3, 4 over 8)."""
    if multiprocessors() < 68:
        pytest.skip("the split counts assume at least 68 SMs")
    pick_decode_family(monkeypatch, family)
    s, splits = MERGE_KEYS[merge]
    q, k, v = random_qkv(rng, 2, t, s, 8, 2, 128, jnp.bfloat16)
    got = _ffi.decode_layout(q, k, key_value_seq_lengths="key_value_seq_lengths" in kwargs)
    assert got[0] == splits
    if hopper():
        assert got[1] == ("cluster" if merge.startswith("cluster") else "combine")
    elif float(jax.devices()[0].compute_capability) < 9.0:
        assert got[1] == "combine"
    check_decode(q, k, v, **kwargs)


def test_decode_preset_layout():
    """The decode preset's layout on Hopper: one 16-row slab (T = 1) gives each of the 64 kv
    heads one split per 64 SMs (one block per SM), whose clusters are all resident at once: the
    cluster merge. 64 rows (T = 16) give two per 64 SMs, four on 128-191 SMs, as two-per-SM
    blocks 64 clusters of 4, more than an H100 or H200 holds at once (62 on an H200); the wgmma
    kernel then runs them two per block, 64 clusters of 2 one-per-SM blocks, which it holds."""
    if not hopper():
        pytest.skip("the layout checked is Hopper's")
    k = jax.ShapeDtypeStruct((8, 8192, 8, 128), jnp.bfloat16)
    q1, q16 = (jax.ShapeDtypeStruct((8, t, 32, 128), jnp.bfloat16) for t in (1, 16))
    assert _ffi.decode_layout(q1, k) == (max(1, multiprocessors() // 64), "cluster")
    if multiprocessors() < 128:
        assert _ffi.decode_layout(q16, k)[0] == max(1, 2 * multiprocessors() // 64)
    else:
        assert _ffi.decode_layout(q16, k) == (4, "paired_cluster")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("t", [9, 16])
@pytest.mark.parametrize("s,kwargs", [
    (1500, dict()),
    (1500, dict(is_causal=True)),
    (1500, dict(local_window_size=(1000, 600))),
    (1024, dict(key_value_seq_lengths=np.array([1024, 0, 1, 300, 700, 555, 1023, 64],
                                                np.int32))),
], ids=["full", "causal", "window", "lengths"])
def test_decode_paired_splits(rng, s, kwargs, t, head_dim):
    """The wgmma decode kernel with two splits per block (one per warpgroup) merged in the
    unit's cluster of such blocks: the decode preset's 64 kv heads at 36 and 64 rows with four
    splits. Causal (top-left) and the window leave splits, and so warpgroups beside a busy one,
    without keys; the lengths leave whole blocks (and a whole unit: length 0) without."""
    if not hopper() or multiprocessors() < 128:
        pytest.skip("four splits of 64 units pair up on Hopper with at least 128 SMs")
    q, k, v = random_qkv(rng, 8, t, s, 32, 8, head_dim, jnp.bfloat16)
    assert _ffi.decode_layout(
        q, k, key_value_seq_lengths="key_value_seq_lengths" in kwargs) == (4, "paired_cluster")
    check_decode(q, k, v, **kwargs)


@pytest.mark.parametrize("t", [8, 9, 16])
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(key_value_seq_lengths=np.array([1000, 0], np.int32)),
], ids=["full", "lengths"])
def test_decode_paired_clusters_of_six(rng, t, kwargs):
    """Paired blocks in clusters of six (16 kv heads, twelve splits each): each block merges a
    sixth of the rows, in shares that do not divide evenly (32 and 36 rows: shares of 6, the
    last block's 2 and 6; 64 rows: shares of 11, the last block's 9), loading five other
    blocks' partials. Lengths leave a whole unit, and a third of the other's splits, without
    keys."""
    if not hopper() or multiprocessors() < 128:
        pytest.skip("twelve splits of 16 units pair up on Hopper with at least 128 SMs")
    q, k, v = random_qkv(rng, 2, t, 3000, 32, 8, 128, jnp.bfloat16)
    assert _ffi.decode_layout(
        q, k, key_value_seq_lengths="key_value_seq_lengths" in kwargs) == (12, "paired_cluster")
    check_decode(q, k, v, **kwargs)


@pytest.mark.parametrize("fill", [np.nan, np.inf])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t", [4, 16])
def test_decode_never_reads_keys_past_the_length(rng, fill, head_dim, t):
    """A padded cache may hold anything past a batch entry's length: the decode kernels
    zero-fill those rows instead of reading them, so NaN or Inf there changes nothing (the
    other families: tests/test_gpu_nonfinite.py)."""
    q, k, v = random_qkv(rng, 3, t, 3001, 8, 2, head_dim, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) == decode_kernel(q, k)
    kv_lens = np.array([1000, 3001, 77], np.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, fill)
    kw = dict(key_value_seq_lengths=jnp.asarray(kv_lens))
    for got, want in zip(run_cuda_forward(q, *poisoned, **kw), run_cuda_forward(q, k, v, **kw)):  # out, lse
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_large_logits(rng, dtype):
    """Splits whose maxima differ widely: the merge through the lse must not overflow."""
    check_decode(*random_qkv(rng, 2, 4, 5000, 8, 2, 128, dtype, magnitude=8.0))


@pytest.mark.parametrize("family", DECODE_FAMILIES)
@pytest.mark.parametrize("t,n", [(1, 16), (16, 64)])
def test_decode_equal_large_logits_over_many_steps(rng, monkeypatch, family, t, n):
    """Every logit the same large value (q . k = 3 x 254 x 248 exactly, head dim 64: the
    softmax's offset, scale * log2(e) times it, rounds off by half its ulp) over 8192 keys in
    one split per unit (272 units): each step's correction must be exactly 1, or the
    probabilities of the first keys drift from the last ones' (a few percent of output error
    here, with the values of the first half of the keys +1 in column 0, the second half's -1
    and every other column 0)."""
    pick_decode_family(monkeypatch, family)
    b, s, kv, h = 17, 8192, 16, 64
    q = jnp.zeros((b, t, n, h), jnp.bfloat16).at[..., :3].set(254)
    k = jnp.zeros((b, s, kv, h), jnp.bfloat16).at[..., :3].set(248)
    v = jnp.zeros((b, s, kv, h), jnp.bfloat16)
    v = v.at[:, : s // 2, :, 0].set(1).at[:, s // 2 :, :, 0].set(-1)
    check_decode(q, k, v)


def test_decode_long_keys(rng):
    """S = 131072 with one work unit per batch element (MQA) and per-batch key lengths (the
    whole S), which aim at the most blocks per SM: the most splits per unit."""
    check_decode(*random_qkv(rng, 1, 1, 131072, 8, 1, 128, jnp.bfloat16),
                 key_value_seq_lengths=np.array([131072], np.int32))


def test_decode_one_split_per_unit(rng):
    """More work units (batch x kv heads) than SMs, equal key lengths and one 16-row slab of
    rows: one block per SM leaves each unit a single split, whose result the merge passes
    through."""
    check_decode(*random_qkv(rng, 64, 1, 1000, 16, 4, 128, jnp.bfloat16))


@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_decode_preset_shape(rng, monkeypatch, family):
    """The benchmark's decode shape (B=8, N=32, K=8, H=128) at T=16 with a shorter S."""
    pick_decode_family(monkeypatch, family)
    check_decode(*random_qkv(rng, 8, 16, 8191, 32, 8, 128, jnp.bfloat16))


@pytest.mark.parametrize("t", [2, 16])
def test_decode_vmap(rng, t):
    """A vmapped decode call is one launch over the extra batch dim, its workspace scaled up."""
    q, k, v = random_qkv(rng, (2, 3), t, 3000, 8, 2, 64, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) == decode_kernel(q, k)
    f = jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, implementation="cuda"))
    out = jax.jit(f)(q, k, v)
    for i in range(2):
        assert_attention_close(out[i], q[i], k[i], v[i])


@pytest.mark.parametrize("t", [3, 16])
def test_decode_gradients(rng, t):
    """The backward reads the decode kernel's out and lse."""
    q, k, v = random_qkv(rng, 2, t, 2000, 8, 2, 64, jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, k) == decode_kernel(q, k)

    def loss(fn, q, k, v):
        out = fn(q, k, v, key_value_seq_lengths=jnp.array([2000, 700], jnp.int32))
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1])))

    ours = jax.jit(jax.grad(lambda *a: loss(
        lambda *x, **kw: jax_flashattn.attention(*x, implementation="cuda", **kw), *a),
        argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda *a: loss(reference.attention, *a), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, r in zip("qkv", ours, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), f"d{name} not finite"
        err = np.linalg.norm(a - r) / (np.linalg.norm(r) + 1e-6)
        assert err < 3e-2, f"d{name}: relative error {err:.3g}"


# A serving bias and a cache's mask, on the decode kernels' instantiations for them: each
# thread reads its two rows' elements at the keys they see, or, where every term is the same for
# every query, at unit stride in whole 16-byte pieces and fits the stage (at S = 700 the f32
# bias; at S = 4112 the [B,N,1,S] biases and the [B,1,1,S] mask at every T and the others at
# T = 1, with more splits than a cluster holds, so through the combine, the last tile part past
# S and the second entry's length inside a tile), from a copy staged in shared memory with each
# tile: each of the bias's element types, alone and beside a mask, and the mask alone, since the
# staged kernels take each kind of terms in a run of its own. (bias shape, bias dtype, mask
# shape) with B = 2, N = 8, T, S; None for an absent term.
DECODE_TERMS = {
    "bias [B,N,1,S] f32": ((2, 8, 1, "S"), jnp.float32, None),
    "bias [B,N,1,S] bf16": ((2, 8, 1, "S"), jnp.bfloat16, None),
    "bias [B,N,1,S] f16": ((2, 8, 1, "S"), jnp.float16, None),
    "bias [B,N,1,S] f32 + mask [B,1,1,S]": ((2, 8, 1, "S"), jnp.float32, (2, 1, 1, "S")),
    "bias [1,N,T,S] bf16": ((1, 8, "T", "S"), jnp.bfloat16, None),
    "mask [B,1,1,S]": (None, None, (2, 1, 1, "S")),
    "bias [N,1,S] f16 + mask [B,1,T,S]": ((8, 1, "S"), jnp.float16, (2, 1, "T", "S")),
}


@pytest.mark.parametrize("family", DECODE_FAMILIES)
@pytest.mark.parametrize("t,head_dim", [(1, 128), (16, 64), (16, 128), (3, 256)])
@pytest.mark.parametrize("terms", DECODE_TERMS)
@pytest.mark.parametrize("s,kwargs", [
    (700, dict()),
    (4097, dict(is_causal=True, key_value_seq_lengths=np.array([4097, 1500], np.int32))),
    (4112, dict(key_value_seq_lengths=np.array([4112, 333], np.int32))),
], ids=["cluster", "combine_lengths", "staged_lengths"])
def test_decode_bias_and_mask(rng, monkeypatch, family, t, head_dim, terms, s, kwargs):
    """Both merges, GQA 4:1, a mask that keeps about 70% of the keys and hides every key of
    the second batch entry's first query (its row 0 with lse -inf), against the reference."""
    pick_decode_family(monkeypatch, family)
    q, k, v = random_qkv(rng, 2, t, s, 8, 2, head_dim, jnp.bfloat16)
    bias_shape, bias_dtype, mask_shape = DECODE_TERMS[terms]
    size = {"T": t, "S": s}
    bias = mask = None
    if bias_shape is not None:
        shape = tuple(size.get(d, d) for d in bias_shape)
        bias = jnp.asarray(2.0 * rng.standard_normal(shape), bias_dtype)
    if mask_shape is not None:
        keep = rng.random(tuple(size.get(d, d) for d in mask_shape)) < 0.7
        keep[1, :, 0] = False
        mask = jnp.asarray(keep)
    check_decode(q, k, v, bias, mask, **kwargs)


@pytest.mark.parametrize("family", DECODE_FAMILIES)
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("n,kv,with_mask", [(8, 8, True), (8, 4, True), (16, 2, True),
                                            (16, 2, False), (32, 2, False)],
                         ids=["g1", "g2", "g8", "g8_bias", "g16_bias"])
def test_decode_staged_terms_group_sizes(rng, monkeypatch, family, t, n, kv, with_mask):
    """A serving bias [B, N, 1, S] (bf16) and a mask [B, N, 1, S], the same for every query and
    different for every head, for GQA groups of 1, 2, 8 and 16, at T = 1 (one slab, its second
    half of rows padding) and T = 4, past a length inside a tile. S = 2112 keeps the rows in
    whole 16-byte pieces, so each call whose group's rows fit the stage (decode_terms_stage:
    1 KiB a stage on the mma.sync kernel, e.g. a group of 8 with the bias alone; 4 KiB on the
    wgmma one) copies them into shared memory with each tile, and the others read them
    element by element."""
    pick_decode_family(monkeypatch, family)
    s = 2112
    q, k, v = random_qkv(rng, 2, t, s, n, kv, 128, jnp.bfloat16)
    bias = jnp.asarray(2.0 * rng.standard_normal((2, n, 1, s)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((2, n, 1, s)) < 0.7) if with_mask else None
    check_decode(q, k, v, bias, mask, key_value_seq_lengths=np.array([s, 1000], np.int32))


def test_decode_dispatch(monkeypatch):
    """forward_kernel reports a decode kernel for decoding shapes only: few query rows per kv
    head (T * N / K <= 64), enough keys, bf16/fp16, a soft-cap or the elementwise terms (a bias,
    mask, ALiBi or segment ids) but not both, nor segment ids beside ALiBi; on Hopper the wgmma
    one from 32 rows at head dims up to 128, unless JAX_FLASHATTN_DISABLE_SM90."""
    monkeypatch.delenv("JAX_FLASHATTN_DISABLE_SM90", raising=False)

    def kernel(t, n, kv, s, h=128, dtype=jnp.bfloat16, **kwargs):
        return jax_flashattn.forward_kernel(jax.ShapeDtypeStruct((8, t, n, h), dtype),
                                            jax.ShapeDtypeStruct((8, s, kv, h), dtype), **kwargs)
    wgmma = "decode_sm90" if hopper() else "decode"
    for dtype in (jnp.bfloat16, jnp.float16):
        assert kernel(1, 32, 8, 65536, dtype=dtype) == "decode"
        assert kernel(7, 32, 8, 65536, dtype=dtype) == "decode"  # 28 rows
        assert kernel(8, 32, 8, 65536, dtype=dtype) == wgmma  # 32 rows
        assert kernel(16, 32, 8, 65536, dtype=dtype) == wgmma
    assert kernel(1, 32, 8, 65536, h=72) == "decode"
    assert kernel(16, 32, 8, 65536, h=72) == wgmma
    assert kernel(16, 32, 8, 65536, h=64) == wgmma
    assert kernel(16, 32, 8, 65536, h=136) == "decode"  # past the wgmma kernel's head dims
    assert kernel(17, 32, 8, 65536) != "decode"  # 68 rows per kv head
    assert kernel(1, 32, 8, 100) != "decode"  # too few keys to split
    assert kernel(1, 32, 8, 65536, dtype=jnp.float32) == "simt"
    bias = jax.ShapeDtypeStruct((8, 32, 1, 65536), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((8, 1, 16, 65536), jnp.bool_)
    assert kernel(1, 32, 8, 65536, bias=bias) == "decode"
    assert kernel(16, 32, 8, 65536, bias=bias, mask=mask) == wgmma
    assert kernel(16, 32, 8, 65536, logits_soft_cap=30.0) == wgmma
    assert kernel(1, 32, 8, 65536, bias=bias, logits_soft_cap=30.0) == "sm80"

    def ids(t):
        return dict(query_segment_ids=jax.ShapeDtypeStruct((8, t), jnp.int32),
                    key_value_segment_ids=jax.ShapeDtypeStruct((8, 65536), jnp.int32))
    assert kernel(1, 32, 8, 65536, **ids(1)) == "decode"
    assert kernel(16, 32, 8, 65536, **ids(16)) == wgmma
    assert kernel(16, 32, 8, 65536, bias=bias, **ids(16)) == wgmma
    assert kernel(16, 32, 8, 65536, logits_soft_cap=30.0, **ids(16)) == "sm80"
    assert kernel(16, 32, 8, 65536, alibi_slopes=True, **ids(16)) == "sm80"
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    assert kernel(16, 32, 8, 65536) == "decode"
