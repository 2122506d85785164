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
from helpers import assert_attention_close, fill_past_lengths, poison, random_qkv

pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def run(q, k, v, *args, **kwargs):
    out_like = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    poison(*out_like)
    out, lse = jax.jit(lambda q, k, v: jax_flashattn.attention(
        q, k, v, *args, implementation="cuda", return_residual=True, **kwargs))(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all(), "unwritten or NaN output"
    return out, lse


def check(q, k, v, *args, **kwargs):
    out, lse = run(q, k, v, *args, **kwargs)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, *args, **kwargs))


def assert_lse_close(lse, lse_ref):
    """lse [B, T, N] against the reference's: -inf exactly where it is, close elsewhere."""
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 160, 192, 256, 36])
def test_head_dims(rng, dtype, head_dim):
    check(*random_qkv(rng, 2, 77, 131, 4, 2, head_dim, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,s", [(1, 1), (1, 300), (300, 1), (129, 65), (64, 128), (257, 513)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sizes_and_causal(rng, dtype, t, s, is_causal):
    check(*random_qkv(rng, 2, t, s, 4, 4, 64, dtype), is_causal=is_causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (64, 0), (0, 100), 17])
@pytest.mark.parametrize("is_causal", [False, True])
def test_windows(rng, dtype, window, is_causal):
    check(*random_qkv(rng, 2, 200, 170, 4, 1, 128, dtype), is_causal=is_causal,
          local_window_size=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seq_lengths_gqa(rng, dtype):
    q, k, v = random_qkv(rng, 4, 150, 190, 8, 2, 64, dtype)
    check(q, k, v, query_seq_lengths=jnp.array([150, 0, 37, 100], jnp.int32),
          key_value_seq_lengths=jnp.array([190, 5, 0, 64], jnp.int32), is_causal=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bias_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140),
                                        (4, 100, 1), (140,)])
def test_bias(rng, dtype, bias_shape):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 2, 128, dtype)
    bias = jnp.asarray(rng.standard_normal(bias_shape), dtype)
    check(q, k, v, bias, is_causal=True)


@pytest.mark.parametrize("mask_shape", [(2, 4, 100, 140), (1, 1, 100, 140), (2, 1, 1, 140)])
def test_mask_and_bias(rng, mask_shape):
    q, k, v = random_qkv(rng, 2, 100, 140, 4, 4, 64, jnp.bfloat16)
    mask = jnp.asarray(rng.random(mask_shape) > 0.3)
    bias = jnp.asarray(rng.standard_normal((1, 4, 100, 140)), jnp.float32)
    check(q, k, v, bias, mask)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_logits(rng, dtype, head_dim):
    """Scores far below the row maximum (exponentials that underflow to 0), on the tile
    configurations of head dims 64 and 128."""
    check(*random_qkv(rng, 1, 256, 256, 2, 2, head_dim, dtype, magnitude=10.0), is_causal=True)


def test_long_sequence(rng):
    q, k, v = random_qkv(rng, 1, 32768, 32768, 2, 1, 128, jnp.bfloat16)
    out, _ = run(q, k, v, is_causal=True)
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
    check(*random_qkv(rng, 2, 100, 130, 4, 2, 128, dtype), scale=scale, is_causal=True)


def hopper():
    """Whether the first device runs the Hopper (sm_90a) kernels of this install."""
    device = jax.devices()[0]
    return device.compute_capability == "9.0" and "90a" in jax_flashattn.cuda_architectures()


def test_dispatch_is_visible():
    """forward_kernel reports the family the dispatcher launches: the Hopper kernel on compute
    capability 9.0 (when the install has sm_90a) without bias or mask, at every head dim."""
    q = jax.ShapeDtypeStruct((2, 100, 4, 128), jnp.bfloat16)
    big = jax.ShapeDtypeStruct((2, 100, 4, 256), jnp.bfloat16)
    hopper_kernels = hopper()
    assert jax_flashattn.forward_kernel(q, q) == ("sm90" if hopper_kernels else "sm80")
    assert jax_flashattn.forward_kernel(q, q, bias=q) == "sm80"
    assert jax_flashattn.forward_kernel(big, big) == ("sm90" if hopper_kernels else "sm80")
    f32 = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.float32)
    assert jax_flashattn.forward_kernel(f32, f32) == "simt"


@pytest.mark.parametrize("head_dim", [40, 64, 136, 256])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(70, 9)),
                                    dict(query_seq_lengths=np.array([900, 0, 5], np.int32),
                                         key_value_seq_lengths=np.array([1000, 40, 0], np.int32),
                                         is_causal=True)])
def test_many_tiles_per_block(rng, head_dim, kwargs):
    """More query tiles than SMs, so every block of the Hopper kernel runs several: head dims
    above 128 keep one Q buffer, which each next tile's Q waits for, and stage O in the K/V
    stage the ring lends after a tile's key tiles (at 136 most of the padded head dim is
    zero-filled by TMA); head dims up to 64 run three consumer warpgroups (T >= 512), whose
    turn order must carry across tiles."""
    check(*random_qkv(rng, 3, 1000, 1000, 48, 8, head_dim, jnp.bfloat16), **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(local_window_size=(70, 9))])
def test_next_q_issued_ahead(rng, head_dim, kwargs):
    """The Hopper configurations with two Q buffers (head dim 64 below T = 512, 128 on 128-key
    tiles) claim each next tile and issue its Q before the current tile's loads that wait for
    buffers: T = 400 gives 4 query blocks per head, 3 x 48 x 4 tiles (more than the SMs) make
    every block run several, and the causal mask and the window give them 1-4 key tiles."""
    check(*random_qkv(rng, 3, 400, 400, 48, 8, head_dim, jnp.bfloat16), **kwargs)


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
    check(*random_qkv(rng, 3, 2100, 2100, 16, 4, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [96, 128])
@pytest.mark.parametrize("kwargs", [dict(), dict(
    query_seq_lengths=np.array([300, 0], np.int32),
    key_value_seq_lengths=np.array([16401, 700], np.int32))])
def test_wide_key_tiles(rng, dtype, head_dim, kwargs):
    """Without causal or window bounds and with S >= 16384, head dims 72-128 take the Hopper
    kernel's 160-key tiles with one Q buffer: S = 16500 ends in a partial tile, and 2 x 24 x 3
    query tiles (more than the SMs) make every block reload that buffer across tiles."""
    check(*random_qkv(rng, 2, 300, 16500, 24, 8, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,t,s,kwargs", [
    (64, 512, 700, dict()), (64, 600, 1000, dict()), (64, 2200, 2200, dict(is_causal=True)),
    (64, 700, 900, dict(query_seq_lengths=np.array([700, 100], np.int32))), (64, 300, 700, dict()),
    (128, 300, 16500, dict()),
    (128, 300, 500, dict(query_seq_lengths=np.array([300, 50], np.int32))),
    (256, 180, 300, dict()), (256, 180, 60, dict()),
])
def test_warpgroups_past_the_query_length(rng, dtype, head_dim, t, s, kwargs):
    """Query blocks whose last consumer warpgroups (64 rows each) start at or past the query
    length: on the Hopper kernel they go through the tile's turns and buffers without computing
    and write zeros and -inf lse for the rows between the query length and T. Head dim 64 with
    three consumers (192-row blocks: T = 512 leaves one idle, 600 two, causal 2200 one, and a
    query length of 100 one in the first block) and with two (T = 300); head dim 128 with
    160-key tiles and one Q buffer, and with two Q buffers and a query length; head dim 256
    (O staged in a K/V stage, whose ring position an idle warpgroup takes too), with several
    key tiles and with one."""
    check(*random_qkv(rng, 2, t, s, 4, 2, head_dim, dtype), **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
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
    check(*random_qkv(rng, 2, 200, 300, 4, 2, head_dim, jnp.bfloat16), **kwargs)


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
    check(q, k, v, bias, mask, is_causal=True)


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
    check(q, k, v, is_causal=is_causal)


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
    check(*(jnp.asarray(x, dtype) for x in (q, k, v)))


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
    check(*(jnp.asarray(x, dtype) for x in (q, k, v)))


# ----------------------------------------------------------------------------- split-KV decode


def decode_kernel(q, k):
    """The decode family the dispatcher must pick for a decoding shape: on Hopper the wgmma one
    for 32 or more query rows per kv head (T * N / K) at head dims up to 128, unless
    JAX_FLASHATTN_DISABLE_SM90 is set; else the mma.sync one."""
    t, n, h = q.shape[-3:]
    wgmma = (hopper() and t * n // k.shape[-2] >= 32 and h <= 128
             and os.environ.get("JAX_FLASHATTN_DISABLE_SM90", "0") in ("", "0"))
    return "decode_sm90" if wgmma else "decode"


def check_decode(q, k, v, **kwargs):
    """check() for a shape the dispatcher must send to a split-KV decode kernel (decode_kernel);
    also poisons out, lse and the decode workspace, so a split partial the combine reads without
    it having been written, or a row neither merge writes, shows up as NaN."""
    assert jax_flashattn.forward_kernel(q, k) == decode_kernel(q, k)
    *lead, t, n, _ = q.shape
    floats = _ffi.decode_workspace_size(q.shape, k.shape, q.dtype, scale=q.shape[-1] ** -0.5,
                                        has_bias=False, has_mask=False)
    poison(jax.ShapeDtypeStruct((floats,), jnp.float32),
           jax.ShapeDtypeStruct((*lead, n, t), jnp.float32), jax.ShapeDtypeStruct(q.shape, q.dtype))
    check(q, k, v, **kwargs)


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
    for got, want in zip(run(q, *poisoned, **kw), run(q, k, v, **kw)):  # out, lse
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_large_logits(rng, dtype):
    """Splits whose maxima differ widely: the merge through the lse must not overflow."""
    check_decode(*random_qkv(rng, 2, 4, 5000, 8, 2, 128, dtype, magnitude=8.0))


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


def test_decode_dispatch(monkeypatch):
    """forward_kernel reports a decode kernel for decoding shapes only: few query rows per kv
    head (T * N / K <= 64), enough keys, bf16/fp16, no bias or mask; on Hopper the wgmma one
    from 32 rows at head dims up to 128, unless JAX_FLASHATTN_DISABLE_SM90."""
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
    assert kernel(1, 32, 8, 65536, bias=bias) == "sm80"
    monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    assert kernel(16, 32, 8, 65536) == "decode"
