"""The forward contract on the CUDA kernels (run with `pytest -m gpu` on an NVIDIA GPU).

Every case first fills freed device memory with NaN, so an output element a kernel forgot to
write shows up as NaN (XLA's allocator hands the freed block to the next allocation of that
size), then checks every element against the float32 reference with the error-ratio rule.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, _ops, reference
from helpers import (assert_attention_close, assert_lse_close, check_cuda_forward, hopper,
                     random_qkv, run_cuda_forward)

pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 160, 192, 256, 36])
def test_head_dims(rng, dtype, head_dim):
    check_cuda_forward(*random_qkv(rng, 2, 77, 131, 4, 2, head_dim, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,s", [(1, 1), (1, 300), (300, 1), (129, 65), (64, 128), (257, 513)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sizes_and_causal(rng, dtype, t, s, is_causal):
    check_cuda_forward(*random_qkv(rng, 2, t, s, 4, 4, 64, dtype), is_causal=is_causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (64, 0), (0, 100), 17])
@pytest.mark.parametrize("is_causal", [False, True])
def test_windows(rng, dtype, window, is_causal):
    check_cuda_forward(*random_qkv(rng, 2, 200, 170, 4, 1, 128, dtype), is_causal=is_causal,
          local_window_size=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seq_lengths_gqa(rng, dtype):
    q, k, v = random_qkv(rng, 4, 150, 190, 8, 2, 64, dtype)
    check_cuda_forward(q, k, v, query_seq_lengths=jnp.array([150, 0, 37, 100], jnp.int32),
          key_value_seq_lengths=jnp.array([190, 5, 0, 64], jnp.int32), is_causal=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bias_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140),
                                        (4, 100, 1), (140,)])
def test_bias(rng, dtype, bias_shape):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 2, 128, dtype)
    bias = jnp.asarray(rng.standard_normal(bias_shape), dtype)
    check_cuda_forward(q, k, v, bias, is_causal=True)


@pytest.mark.parametrize("mask_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140)])
def test_mask_and_bias(rng, mask_shape):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 4, 64, jnp.bfloat16)
    mask = jnp.asarray(rng.random(mask_shape) > 0.3)
    bias = jnp.asarray(rng.standard_normal((1, 4, 100, 140)), jnp.float32)
    check_cuda_forward(q, k, v, bias, mask)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_logits(rng, dtype, head_dim):
    """Scores far below the row maximum (exponentials that underflow to 0), on the tile
    configurations of head dims 64 and 128."""
    check_cuda_forward(*random_qkv(rng, 1, 256, 256, 2, 2, head_dim, dtype, magnitude=10.0), is_causal=True)


def test_long_sequence(rng):
    q, k, v = random_qkv(rng, 1, 32768, 32768, 2, 1, 128, jnp.bfloat16)
    out, _ = run_cuda_forward(q, k, v, is_causal=True)
    rows = np.r_[0:64, 16000:16064, 32704:32768]  # the reference on a row subset
    ref = reference.attention(q[:, rows].astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), is_causal=False,
                              mask=jnp.arange(32768)[None, None, None, :] <= rows[:, None])
    err = np.max(np.abs(np.asarray(out[:, rows], np.float32) - np.asarray(ref)))
    assert err < 2e-2, err


def test_vmap_is_one_launch(rng):
    q, k, v = random_qkv(rng, 3, 64, 64, 2, 2, 64, jnp.bfloat16)
    f = jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, implementation="cuda"))
    out = jax.jit(f)(q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0))
    assert_attention_close(out[1], q, k, v)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scale", [0.0, -0.5, 0.3])
def test_scales(rng, dtype, scale):
    """Masked scores are -inf: a zero or negative scale must not turn them into NaN or inf
    (the tensor-core softmax needs scale > 0, so the dispatcher sends the rest elsewhere)."""
    check_cuda_forward(*random_qkv(rng, 2, 100, 130, 4, 2, 128, dtype), scale=scale, is_causal=True)


def test_dispatch_is_visible():
    """forward_kernel reports the family the dispatcher launches: the Hopper kernel on compute
    capability 9.0 (when the install has sm_90a), with a bias too, at every head dim."""
    q = jax.ShapeDtypeStruct((2, 100, 4, 128), jnp.bfloat16)
    big = jax.ShapeDtypeStruct((2, 100, 4, 256), jnp.bfloat16)
    hopper_kernels = hopper()
    assert jax_flashattn.forward_kernel(q, q) == ("sm90" if hopper_kernels else "sm80")
    assert jax_flashattn.forward_kernel(q, q, bias=q) == ("sm90" if hopper_kernels else "sm80")
    assert jax_flashattn.forward_kernel(big, big) == ("sm90" if hopper_kernels else "sm80")
    f32 = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.float32)
    assert jax_flashattn.forward_kernel(f32, f32) == "simt"


@pytest.mark.parametrize("head_dim", [40, 64, 96, 136, 192, 256])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(query_seq_lengths=np.array([900, 0, 5], np.int32),
                                         key_value_seq_lengths=np.array([1000, 40, 0], np.int32),
                                         is_causal=True)])
def test_many_tiles_per_block(rng, head_dim, kwargs):
    """More query tiles than SMs, so every block of the Hopper kernel runs several: head dims
    above 128 keep one Q buffer, which each next tile's Q waits for, and stage O in the K/V
    stage the ring lends after a tile's key tiles (192 on 96-key tiles, which a 128-row block's
    causal diagonal crosses mid-tile; 136 on them, most of the last span zero-filled by TMA; 96
    runs 128's layout with S reduced over its columns and O of its columns only); head dims up
    to 64 run three consumer warpgroups (T >= 512), whose turn order must carry across
    tiles."""
    check_cuda_forward(*random_qkv(rng, 3, 1000, 1000, 48, 8, head_dim, jnp.bfloat16), **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(70, 9))])
def test_next_q_issued_ahead(rng, head_dim, kwargs):
    """The Hopper configurations with two Q buffers (head dim 64 below T = 512, 128 on 128-key
    tiles) claim each next tile and issue its Q before the current tile's loads that wait for
    buffers: T = 400 gives 4 query blocks per head, 3 x 48 x 4 tiles (more than the SMs) make
    every block run several, and the causal mask and the window give them 1-4 key tiles."""
    check_cuda_forward(*random_qkv(rng, 3, 400, 400, 48, 8, head_dim, jnp.bfloat16), **kwargs)


@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("dtype,kwargs", [
    (jnp.bfloat16, dict()), (jnp.float16, dict()), (jnp.bfloat16, dict(is_causal=True)),
    (jnp.bfloat16, dict(local_window_size=(300, 9))),
    (jnp.bfloat16, dict(query_seq_lengths=np.array([2100, 0, 700], np.int32),
                        key_value_seq_lengths=np.array([1900, 40, 0], np.int32), is_causal=True))])
def test_three_consumer_warpgroups(rng, head_dim, dtype, kwargs):
    """Head dims up to 64 with T >= 512 run the Hopper kernel's three consumer warpgroups on
    192-row query tiles: T = 2100 ends in a partial tile, and 3 x 16 x 11 tiles (more than the
    SMs) make every block run several, with the round-robin turn order carried across them."""
    check_cuda_forward(*random_qkv(rng, 3, 2100, 2100, 16, 4, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [96, 128])
@pytest.mark.parametrize("kwargs", [dict(), dict(
    query_seq_lengths=np.array([300, 0], np.int32),
    key_value_seq_lengths=np.array([16401, 700], np.int32))])
def test_wide_key_tiles(rng, dtype, head_dim, kwargs):
    """Without causal or window bounds and with S >= 16384, head dims 72-128 take the Hopper
    kernel's 160-key tiles with one Q buffer: S = 16500 ends in a partial tile, and 2 x 24 x 3
    query tiles (more than the SMs) make every block reload that buffer across tiles."""
    check_cuda_forward(*random_qkv(rng, 2, 300, 16500, 24, 8, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,t,s,kwargs", [
    (64, 512, 700, dict()), (64, 600, 1000, dict()), (64, 2200, 2200, dict(is_causal=True)),
    (64, 700, 900, dict(query_seq_lengths=np.array([700, 100], np.int32))), (64, 300, 700, dict()),
    (128, 300, 16500, dict()),
    (128, 300, 500, dict(query_seq_lengths=np.array([300, 50], np.int32))),
    (256, 180, 300, dict()), (256, 180, 60, dict()),
    (192, 180, 300, dict(is_causal=True)), (192, 180, 60, dict()),
])
def test_warpgroups_past_the_query_length(rng, dtype, head_dim, t, s, kwargs):
    """Query blocks whose last consumer warpgroups (64 rows each) start at or past the query
    length: on the Hopper kernel they go through the tile's turns and buffers without computing
    and write zeros and -inf lse for the rows between the query length and T. Head dim 64 with
    three consumers (192-row blocks: T = 512 leaves one idle, 600 two, causal 2200 one, and a
    query length of 100 one in the first block) and with two (T = 300); head dim 128 with
    160-key tiles and one Q buffer, and with two Q buffers and a query length; head dims 256
    and 192 (O staged in a K/V stage, whose ring position an idle warpgroup takes too; 192 on
    96-key tiles), with several key tiles and with one."""
    check_cuda_forward(*random_qkv(rng, 2, t, s, 4, 2, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("window", [(-3, 40), (200, -1), (None, -1), (-130, None), (10**12, 2),
                                    (-(10**12), 10**12), (5, -(10**12)), (2**31 + 5, 2**32)])
def test_kernel_windows(rng, head_dim, window):
    """Windows as ring attention's blocks hand them to the kernel (`_ops.forward`): bounds that
    leave the diagonal out (s >= t + 3, s <= t - 1), one side unbounded, and bounds far past the
    lengths, which the Hopper forward clamps into int32 (hiding no key, or every key: then every
    row is 0 with lse -inf). Checked against the reference with the window as a boolean mask;
    T = 300 and S = 333 end in partial tiles."""
    q, k, v = random_qkv(rng, 2, 300, 333, 4, 2, head_dim, jnp.bfloat16)
    out, lse = jax.jit(lambda q, k, v: _ops.forward(
        q, k, v, None, None, None, None, scale=head_dim ** -0.5, window=window,
        switches=_ffi.kernel_switches()))(q, k, v)
    left, right = (np.inf if w is None else w for w in window)
    t, s = np.arange(300)[:, None], np.arange(333)[None, :]
    keep = (s >= t - left) & (s <= t + right)
    lse_ref = assert_attention_close(out, q, k, v, mask=keep)
    assert_lse_close(np.swapaxes(np.asarray(lse), 1, 2), lse_ref)  # _ops' lse is [B, N, T]


@pytest.mark.parametrize("loads", ["default", "cp.async"])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(17, 5)),
                                    dict(key_value_seq_lengths=np.array([150, 0], np.int32))])
@pytest.mark.parametrize("head_dim", [32, 40, 72, 128, 160, 256])
def test_mma_sync_family_where_hopper_kernel_exists(rng, monkeypatch, loads, kwargs, head_dim):
    """JAX_FLASHATTN_DISABLE_SM90 sends calls to the mma.sync family, which must stay correct on
    the Hopper GPUs that would otherwise run the wgmma kernel (a no-op elsewhere). There it
    loads K and V by TMA; JAX_FLASHATTN_SM80_CP_ASYNC keeps the cp.async loads of other GPUs,
    so both run here. Every configuration: 32 (Q in registers; one 64-column box, half of it
    past the head dim), 40 on 64 (one box, 24 columns past), 72 on 96 (12 chunks per row, which
    do not divide the block's threads: load_tile's general copy path; TMA's second box holds 8
    head-dim columns), 128, 160 on 192 (32-key tiles, three boxes), 256 (four). S = 300 ends
    inside a key tile of every configuration, so its last tile's keys past S are zero-filled
    too."""
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    if loads == "cp.async":
        monkeypatch.setenv("JAX_FLASHATTN_SM80_CP_ASYNC", "1")
    q = jax.ShapeDtypeStruct((2, 100, 4, head_dim), jnp.bfloat16)
    assert jax_flashattn.forward_kernel(q, q) == "sm80"
    check_cuda_forward(*random_qkv(rng, 2, 200, 300, 4, 2, head_dim, jnp.bfloat16), **kwargs)


def test_disable_switch_reaches_the_kernels(rng, monkeypatch):
    """JAX_FLASHATTN_DISABLE_SM90, traced into the call as an attribute, must reach the
    dispatcher: on Hopper the two families add in different orders, so their outputs differ in
    some element, while each matches the reference. (A handler that read another attribute
    would run the same family twice.)"""
    if not hopper():
        pytest.skip("one family elsewhere")
    q, k, v = random_qkv(rng, 2, 200, 300, 4, 2, 128, jnp.bfloat16)

    def run_traced():  # a new function each time, so jit traces again
        return jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, implementation="cuda"))(
            q, k, v)

    monkeypatch.delenv("JAX_FLASHATTN_DISABLE_SM90", raising=False)
    wgmma = run_traced()
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    mma_sync = run_traced()
    assert not np.array_equal(np.asarray(wgmma, np.float32), np.asarray(mma_sync, np.float32))
    for out in (wgmma, mma_sync):
        assert_attention_close(out, q, k, v)


def test_command_buffers():
    """Our handlers inside XLA's command buffers: tests/command_buffer_case.py, in a process of
    its own (XLA_FLAGS is read once per process) where XLA records every op sequence into a
    CUDA graph, checks that replays on new inputs are right, for both decode merges, the
    forward and the backward."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip()
    script = os.path.join(os.path.dirname(__file__), "command_buffer_case.py")
    subprocess.run([sys.executable, script], env=env, check=True, timeout=600)


@pytest.mark.parametrize("loads", ["default", "cp.async"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mma_sync_loads_with_bias_and_mask(rng, monkeypatch, loads, dtype, head_dim):
    """The bias and mask instantiation (which a Hopper GPU runs for every call with a bias or
    mask) with either K/V load, over many key tiles: GQA, S not a whole number of tiles."""
    if loads == "cp.async":
        monkeypatch.setenv("JAX_FLASHATTN_SM80_CP_ASYNC", "1")
    q, k, v = random_qkv(rng, 2, 130, 1000, 4, 2, head_dim, dtype)
    mask = jnp.asarray(rng.random((2, 1, 130, 1000)) > 0.2)
    bias = jnp.asarray(rng.standard_normal((1, 4, 130, 1000)), jnp.float32)
    check_cuda_forward(q, k, v, bias, mask, is_causal=True)


@pytest.mark.parametrize("family", ["default", "sm80"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("ramp", [8.0, 32.0])
def test_rising_row_maxima(rng, monkeypatch, family, dtype, head_dim, is_causal, ramp):
    """Keys scaled by 1 + s / ramp, so each 64-key tile raises a row's maximum score. With
    ramp 8 the rise (~19 nats) is far beyond the headroom the mma.sync kernel allows P above a
    settled maximum (a partial row sum of 2^12): the tiles that see keys take the
    recompute-and-rescale path. A kernel that kept the stale maximum would overflow P (inf in
    fp16, NaN in the output); one that dropped the recompute would use scores it had already
    spent. With ramp 32 the rise (~5 nats) stays within it: tiles are accepted with P well
    above 1, which the output and lse must undo exactly. "default" runs the Hopper kernel on
    H100/H200, "sm80" forces the mma.sync family there."""
    if family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = random_qkv(rng, 2, 300, 333, 4, 2, head_dim, dtype)
    scale = 1.0 + jnp.arange(k.shape[1], dtype=jnp.float32) / ramp
    k = (k.astype(jnp.float32) * scale[None, :, None, None]).astype(dtype)
    check_cuda_forward(q, k, v, is_causal=is_causal)


# Query / key counts that put the Hopper kernel's every tile configuration under many K/V
# tiles: 600 x 16500 takes three consumers at head dim 64 and 160-key tiles at 128, 300 x 2000
# two consumers and 128-key tiles.
LONG_KEY_SHAPES = [(600, 16500), (300, 2000)]


def shared_direction(rng, q, head_dim):
    """Adds a component u (entries +-1, so |u|^2 = head_dim) to every query; returns u. A key
    c u then scores ~c sqrt(head_dim) nats above an ordinary one for every query."""
    u = rng.choice([-1.0, 1.0], size=head_dim).astype(np.float32)
    q += u
    return u


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", LONG_KEY_SHAPES)
@pytest.mark.parametrize("rise", ["steep", "drift"])
def test_rising_row_maxima_long_keys(rng, dtype, head_dim, t, s, rise):
    """Row maxima that rise over thousands of keys, so the K/V ring turns over many times while
    tiles are recomputed or accepted above settled maxima. "steep": keys scaled by 1 + s / 8
    (past S = 4000 by 1 + (4000 / S) s / 8, which keeps the logits below ~500x their usual
    size: the low-precision budget does not grow with the logits, whose float32 rounding
    does), so each tile's scores outrun the maxima, many by enough to overflow P (recomputed
    tiles: about half at S = 4000, a fifth at 16500).
    "drift": keys gain (s / S) c u for the queries' shared u, so maxima rise ~3 nats per 128
    keys: most tiles are accepted with P above 1."""
    q, k, v = (np.array(x, np.float32) for x in random_qkv(rng, 1, t, s, 2, 1, head_dim,
                                                             jnp.float32))
    if rise == "steep":
        ramp = 8.0 * max(1.0, s / 4000)
        k *= (1.0 + np.arange(s, dtype=np.float32) / ramp)[None, :, None, None]
    else:
        u = shared_direction(rng, q, head_dim)
        c = 3.0 * s / (128 * np.sqrt(head_dim))
        k += (c * np.arange(s, dtype=np.float32) / s)[None, :, None, None] * u
    check_cuda_forward(*(jnp.asarray(x, dtype) for x in (q, k, v)))


@pytest.mark.parametrize("family", ["default", "sm80"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("t,s", LONG_KEY_SHAPES)
def test_score_spikes_above_settled_maxima(rng, monkeypatch, family, dtype, head_dim, t, s):
    """Two keys far along S that every query favours: 20 and 128 nats above the ordinary keys
    (whose maxima lie ~5 nats up). Rows settled on ordinary keys meet the first with P far
    above the headroom, then the second ~100 nats above that, where exp2 against the stale
    maximum overflows P to inf: the kernels must recompute those tiles' scores, and the output
    is then close to the second key's value."""
    if family == "sm80":
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    q, k, v = (np.array(x, np.float32) for x in random_qkv(rng, 1, t, s, 2, 2, head_dim,
                                                             jnp.float32))
    u = shared_direction(rng, q, head_dim)
    k[:, 3 * s // 8 + 1] = 20 / np.sqrt(head_dim) * u
    k[:, 3 * s // 4 + 1] = 128 / np.sqrt(head_dim) * u
    check_cuda_forward(*(jnp.asarray(x, dtype) for x in (q, k, v)))
