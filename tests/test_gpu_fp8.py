"""FP8 (float8_e4m3fn) keys and values beside a bfloat16 or float16 query on the CUDA kernels
(run with `pytest -m gpu` on an NVIDIA GPU): the split-KV decode kernels read the e4m3 cache as
it is stored and widen it in registers, contiguous or paged; every other call is dequantised
first. Each result against the float32 reference on the dequantised inputs, with the error-ratio
rule of a bfloat16 or float16 call (the kernels widen e4m3 exactly and round P as they do, in
float16 where the hardware widens e4m3 to it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi
from helpers import assert_attention_close, hopper, reads_e4m3_in_the_kernel
from test_paged import TOLERANCE, reference, scattered_cache

pytestmark = pytest.mark.gpu

B, N, K = 2, 8, 2
E4M3 = jnp.float8_e4m3fn


def quantized_cache(rng, b, s, k, h, magnitude=1.0):
    """(k8, v8, k_descale, v_descale, k_deq, v_deq): fresh keys and values quantised per (batch
    entry, kv head) by quantize_fp8, and their dequantised float32 values."""
    out = []
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal((b, s, k, h)) * magnitude, jnp.float32)
        values, descale = jax_flashattn.quantize_fp8(x)
        out.append((values, descale, jax_flashattn.dequantize_fp8(values, descale)))
    (k8, kd, k_deq), (v8, vd, v_deq) = out
    return k8, v8, kd, vd, k_deq, v_deq


OPTIONS = {
    "plain": dict(),
    "lengths": dict(key_value_seq_lengths=np.array([1000, 301], np.int32)),
    "bottom_right_causal": dict(is_causal=True, diagonal_alignment="bottom_right"),
    "window_lengths": dict(is_causal=True, diagonal_alignment="bottom_right",
                           local_window_size=(200, 0),
                           key_value_seq_lengths=np.array([777, 1000], np.int32)),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("t", [1, 5, 8, 16])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_decode_reads_the_e4m3_cache(rng, dtype, head_dim, t, option):
    """T = 1, 5, 8, 16 (4, 20, 32, 64 rows per kv head: widened in registers, in the mma.sync
    kernel's shared memory in both warp steps, and from 32 rows at head dims up to 128 on Hopper
    in the wgmma kernel's) over S = 1000 keys (a partial last tile), every head dim
    configuration (80 on the 128 one), bf16 and float16 queries, [B, K] descales of each
    group's amax."""
    q = jnp.asarray(rng.standard_normal((B, t, N, head_dim)), dtype)
    k8, v8, kd, vd, k_deq, v_deq = quantized_cache(rng, B, 1000, K, head_dim)
    kwargs = OPTIONS[option]

    def f(q, k8, v8, kd, vd):
        return jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd,
                                       return_residual=True, **kwargs)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, kd, vd)
    out, lse = jax.jit(f)(q, k8, v8, kd, vd)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:-1]
    ref_lse = assert_attention_close(out, q, k_deq, v_deq, **kwargs)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("t", [1, 16])
def test_descales_scale_scores_and_values(rng, t):
    """Descales far from 1, negative and zero (different per batch entry and kv head): the
    scores take the key's (its sign folded into the kernel's query fragments), the output the
    value's; a value descale of 0 zeroes that kv head's rows."""
    q = jnp.asarray(rng.standard_normal((B, t, N, 128)), jnp.bfloat16)
    k8, v8, _, _, _, _ = quantized_cache(rng, B, 2048, K, 128)
    kd = jnp.asarray([[0.01, -0.2], [0.0, 0.003]], jnp.float32)
    vd = jnp.asarray([[3.0, 0.0], [-0.5, 40.0]], jnp.float32)

    def f(q, k8, v8, kd, vd):
        return jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, kd, vd)
    out = jax.jit(f)(q, k8, v8, kd, vd)
    k_deq, v_deq = (jax_flashattn.dequantize_fp8(x, d) for x, d in ((k8, kd), (v8, vd)))
    assert_attention_close(out, q, k_deq, v_deq)
    assert (np.asarray(out, np.float32)[0, :, N // K:] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,q_lens", [(1, None), (5, None), (16, None), (16, [9, 16])],
                         ids=["t1", "t5", "t16", "t16_query_lengths"])
def test_nan_key_descale(rng, t, q_lens, dtype):
    """A NaN key descale makes exactly its (batch entry, kv head)'s rows that see a key NaN,
    in every configuration (4 rows widen in registers, 20 in the mma.sync kernel's shared
    memory, 64 in the wgmma kernel's on Hopper); rows past a query length see none and give 0;
    the negative and the zero one beside it give the reference."""
    q = jnp.asarray(rng.standard_normal((B, t, N, 128)), dtype)
    k8, v8, _, _, _, _ = quantized_cache(rng, B, 700, K, 128)
    kd = jnp.asarray([[0.02, np.nan], [-0.05, 0.0]], jnp.float32)
    vd = jnp.asarray([[3.0, 0.5], [-0.5, 2.0]], jnp.float32)
    lens = None if q_lens is None else np.asarray(q_lens, np.int32)

    def f(q, k8, v8, kd, vd):
        return jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd,
                                       query_seq_lengths=lens)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, kd, vd)
    out = jax.jit(f)(q, k8, v8, kd, vd)
    nan_rows = np.zeros((B, t, N), bool)
    nan_rows[0, :t if q_lens is None else q_lens[0], N // K:] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).any(axis=-1), nan_rows)
    k_deq, v_deq = (jax_flashattn.dequantize_fp8(x, d) for x, d in ((k8, kd), (v8, vd)))
    assert_attention_close(out, q, k_deq, v_deq, nan_rows=True, query_seq_lengths=lens)


@pytest.mark.parametrize("t", [1, 5, 16])
def test_query_rows_of_far_apart_magnitudes(rng, t):
    """bfloat16 query heads of one group (rows of one block): one 2^40 times the others in
    the head dims where every key is 0 (its logits stay 0), one of unit size, and ones 2^-60
    and 2^-110 times it. Where the kernels multiply in float16 (the hardware widens e4m3 to
    it), one power of two for the block's rows would flush the unit head's elements (2^-40 of
    the largest) and lose its logits; each row converted with its own keeps every row at the
    reference."""
    h = 128
    q = rng.standard_normal((B, t, N, h))
    head = np.arange(N) % (N // K)
    q[:, :, head == 0, : h // 2] = 0.0
    q = q * np.exp2(np.array([40.0, 0.0, -60.0, -110.0]))[head][:, None]
    q = jnp.asarray(q, jnp.bfloat16)
    k8, v8, kd, vd, k_deq, v_deq = quantized_cache(rng, B, 900, K, h)
    k8 = k8.at[..., h // 2:].set(jnp.zeros((), E4M3))
    k_deq = k_deq.at[..., h // 2:].set(0.0)

    def f(q, k8, v8, kd, vd):
        return jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, kd, vd)
    assert_attention_close(jax.jit(f)(q, k8, v8, kd, vd), q, k_deq, v_deq)


def e4m3_bits(byte):
    return jax.lax.bitcast_convert_type(jnp.uint8(byte), E4M3)


@pytest.mark.parametrize("t", [1, 16])
def test_nan_in_the_cache(rng, t):
    """e4m3 NaNs (0x7f and 0xff) at keys some rows see make exactly those rows NaN, in K and
    in V, whether widened in registers (T = 1) or in shared memory (T = 16); one past a batch
    entry's length, inside its last tile, is never read."""
    q = jnp.asarray(rng.standard_normal((B, t, N, 128)), jnp.bfloat16)
    k8, v8, kd, vd, _, _ = quantized_cache(rng, B, 1024, K, 128)
    k8 = k8.at[0, 500, 1, 7].set(e4m3_bits(0x7f))  # seen by entry 0's kv head 1
    v8 = v8.at[1, 100, 0, 3].set(e4m3_bits(0xff))  # seen by entry 1's kv head 0
    k8 = k8.at[1, 620, 1, 9].set(e4m3_bits(0x7f))  # past entry 1's length, in its last tile
    v8 = v8.at[1, 630, 1, 2].set(e4m3_bits(0xff))
    lens = np.array([1024, 600], np.int32)
    out = np.asarray(jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd,
                                             key_value_seq_lengths=lens), np.float32)
    rows_nan = np.isnan(out).any(axis=-1)  # [B, T, N]
    want = np.zeros_like(rows_nan)
    want[0, :, N // K:] = True
    want[1, :, :N // K] = True
    np.testing.assert_array_equal(rows_nan, want)


def test_gradient_raises(rng):
    """Forward only: jax.grad of the query or the descales raises the FP8 TypeError."""
    q = jnp.asarray(rng.standard_normal((B, 1, N, 64)), jnp.bfloat16)
    k8, v8, kd, vd, _, _ = quantized_cache(rng, B, 512, K, 64)

    def loss(q, kd):
        out = jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd)
        return jnp.sum(out.astype(jnp.float32))
    for argnum in (0, 1):
        with pytest.raises(TypeError, match="forward-only"):
            jax.grad(loss, argnums=argnum)(q, kd)


@pytest.mark.parametrize("case", ["head_dim_72", "soft_cap", "prefill"])
def test_calls_the_kernels_do_not_take_are_dequantised(rng, case):
    """A head dim that is not a multiple of 16, a soft-cap, a prefill: dequantised first, then
    the bf16 kernels; the same values as the reference."""
    h, t, kwargs = {"head_dim_72": (72, 1, {}), "soft_cap": (128, 1, dict(logits_soft_cap=5.0)),
                    "prefill": (128, 300, dict(is_causal=True))}[case]
    q = jnp.asarray(rng.standard_normal((B, t, N, h)), jnp.bfloat16)
    k8, v8, kd, vd, k_deq, v_deq = quantized_cache(rng, B, 700, K, h)

    def f(q, k8, v8, kd, vd):
        return jax_flashattn.attention(q, k8, v8, descale_k=kd, descale_v=vd, **kwargs)
    assert not reads_e4m3_in_the_kernel(f, q, k8, v8, kd, vd)
    assert_attention_close(jax.jit(f)(q, k8, v8, kd, vd), q, k_deq, v_deq, **kwargs)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("t", [1, 16])
def test_paged_e4m3_cache_in_place(rng, page_size, t):
    """paged_attention on e4m3 pages: read in place by the decode kernels (pages shorter and
    longer than their 128-key tiles), against the float64 reference on the dequantised pages."""
    kv_lens = [1500, 333]
    max_pages = 1600 // page_size + 1
    key_cache, value_cache, table = scattered_cache(rng, 2, kv_lens, page_size, K, 128,
                                                    max_pages)
    (k8, kd), (v8, vd) = (jax_flashattn.quantize_fp8(jnp.asarray(x), axis=(0, 1, 3))
                          for x in (key_cache, value_cache))
    # Per entry, the second entry's key descale negative (its sign folded into the query
    # fragments).
    kd, vd = (jnp.broadcast_to(d, (2, K)) * jnp.asarray([[1.0], [f]])
              for d, f in ((kd, -0.5), (vd, 0.5)))
    q = jnp.asarray(rng.standard_normal((2, t, N, 128)), jnp.bfloat16)
    q_lens = None if t == 1 else np.array([t, t // 2], np.int32)

    def f(q, k8, v8, table, lens, kd, vd):
        return jax_flashattn.paged_attention(q, k8, v8, table, lens, descale_k=kd,
                                             descale_v=vd, query_seq_lengths=q_lens)
    lens = np.array(kv_lens, np.int32)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, table, lens, kd, vd)
    out = np.asarray(jax.jit(f)(q, k8, v8, table, lens, kd, vd), np.float64)
    ref, _ = reference(np.asarray(q.astype(jnp.float32)), np.asarray(k8.astype(jnp.float32)),
                       np.asarray(v8.astype(jnp.float32)), table, kv_lens, q_lens,
                       descale_k=np.asarray(kd), descale_v=np.asarray(vd))
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) <= TOLERANCE[jnp.dtype(jnp.bfloat16)] * np.linalg.norm(ref)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_paired_blocks(rng, head_dim):
    """The decode preset's shape (64 kv heads of 64 rows): on Hopper with at least 128 SMs the
    wgmma kernel's e4m3 configuration with two splits per block, merged in the unit's cluster
    (the plan of the same call on a 2-byte cache, whose residency the e4m3 kernel shares)."""
    if not hopper() or getattr(jax.devices()[0], "core_count", 0) < 128:
        pytest.skip("four splits of 64 units pair up on Hopper with at least 128 SMs")
    q = jnp.asarray(rng.standard_normal((8, 16, 32, head_dim)), jnp.bfloat16)
    k8, v8, kd, vd, k_deq, v_deq = quantized_cache(rng, 8, 1500, 8, head_dim)
    assert _ffi.decode_layout(q, k_deq.astype(jnp.bfloat16)) == (4, "paired_cluster")
    out = jax.jit(lambda *xs: jax_flashattn.attention(
        xs[0], xs[1], xs[2], descale_k=xs[3], descale_v=xs[4]))(q, k8, v8, kd, vd)
    assert_attention_close(out, q, k_deq, v_deq)


def test_under_vmap(rng):
    """vmap over a leading axis: one kernel call per element, each its own cache."""
    q = jnp.asarray(rng.standard_normal((3, B, 1, N, 64)), jnp.bfloat16)
    parts = [quantized_cache(rng, B, 512, K, 64) for _ in range(3)]
    k8, v8, kd, vd, k_deq, v_deq = (jnp.stack([p[i] for p in parts]) for i in range(6))
    out = jax.vmap(lambda *xs: jax_flashattn.attention(
        xs[0], xs[1], xs[2], descale_k=xs[3], descale_v=xs[4]))(q, k8, v8, kd, vd)
    for i in range(3):
        assert_attention_close(out[i], q[i], k_deq[i], v_deq[i])


def test_cuda_refuses_e4m3_off_the_decode_kernels(rng):
    """The CUDA handler takes e4m3 keys and values on the decode kernels only: a float32 query
    (which the CPU kernels take) or a prefill's rows are an error, not a misread."""
    from jax_flashattn import _ffi, _ops
    k8, v8, kd, vd, _, _ = quantized_cache(rng, B, 512, K, 64)
    for dtype, t in ((jnp.float32, 1), (jnp.bfloat16, 300)):
        q = jnp.asarray(rng.standard_normal((B, t, N, 64)), dtype)
        with pytest.raises(jax.errors.JaxRuntimeError, match="decode kernels only"):
            jax.block_until_ready(_ops.cache_forward(
                q, k8, v8, None, None, None, scale=0.125, window=(None, None),
                switches=_ffi.kernel_switches(), k_descale=kd, v_descale=vd,
                align_window_to_lengths=False))
