"""quantize_fp8 / dequantize_fp8, an e4m3 paged cache filled with them, and attention on e4m3
inputs against the float32 reference on their dequantised values (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from jax_flashattn.fp8 import E4M3_MAX
from helpers import reads_e4m3_in_the_kernel


def test_amax_scaling_round_trip(rng):
    """Each (batch entry, kv head) group's largest magnitude lands on 448; every element comes
    back within e4m3's rounding: 2^-4 of itself, or half its smallest step (2^-9 descale)."""
    x = rng.standard_normal((2, 37, 3, 16)).astype(np.float32)
    x *= rng.uniform(0.01, 100, (2, 1, 3, 1)).astype(np.float32)
    values, descale = jax_flashattn.quantize_fp8(x)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == x.shape
    assert descale.dtype == jnp.float32 and descale.shape == (2, 3)
    np.testing.assert_allclose(np.abs(np.asarray(values, np.float32)).max(axis=(1, 3)), E4M3_MAX)
    back = np.asarray(jax_flashattn.dequantize_fp8(values, descale))
    step = np.asarray(descale)[:, None, :, None] * 2.0 ** -10
    assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) + step)
    assert np.abs(back - x).max() > 0  # rounding happened: the check above is not vacuous


def test_zeros_nan_given_descale_and_other_axes(rng):
    values, descale = jax_flashattn.quantize_fp8(np.zeros((2, 5, 1, 4), np.float32))
    assert np.all(np.asarray(descale) == 1) and not np.asarray(values, np.float32).any()
    x = np.array([[1.0, np.nan, -3.0, 1000.0]], np.float32)
    values, descale = jax_flashattn.quantize_fp8(x, axis=1, descale=np.array([0.5], np.float32))
    assert descale.shape == (1,)
    np.testing.assert_array_equal(np.asarray(values, np.float32), [[2.0, np.nan, -6.0, 448.0]])
    # One descale per row of a [T, H] matrix (axis -1).
    x = rng.standard_normal((6, 8)).astype(np.float32)
    values, descale = jax_flashattn.quantize_fp8(x, axis=-1)
    assert descale.shape == (6,)
    np.testing.assert_allclose(np.asarray(jax_flashattn.dequantize_fp8(values, descale, axis=-1)),
                               x, rtol=2.0 ** -4, atol=float(np.asarray(descale).max()) * 2.0 ** -9)


def test_errors():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        jax_flashattn.quantize_fp8(np.ones((2, 3), np.int32), axis=1)
    with pytest.raises(ValueError, match="axis must be axes of x"):
        jax_flashattn.quantize_fp8(np.ones((2, 3), np.float32), axis=2)
    with pytest.raises(ValueError, match="descale must broadcast to the groups' shape"):
        jax_flashattn.quantize_fp8(np.ones((2, 3, 4, 5), np.float32), descale=np.ones(3))


def test_fp8_paged_cache_from_quantize(rng):
    """A prefill's keys and values quantised per (sequence, kv head), written into e4m3 pages;
    a decode token quantised with its sequence's descales and written after them: attention
    over the pages is attention over the float keys and values, within e4m3's rounding."""
    batch, s, kv_heads, heads, head_dim, page_size = 2, 40, 2, 4, 32, 16
    keys = rng.standard_normal((batch, s + 1, kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((batch, s + 1, kv_heads, head_dim)).astype(np.float32)
    table = np.array([[5, 0, 3], [1, 4, 2]], np.int32)
    k8, descale_k = jax_flashattn.quantize_fp8(keys[:, :s])
    v8, descale_v = jax_flashattn.quantize_fp8(values[:, :s])
    cache_k = jnp.zeros((6, page_size, kv_heads, head_dim), jnp.float8_e4m3fn)
    cache_v = jnp.zeros_like(cache_k)
    start = np.zeros(batch, np.int32)
    cache_k, cache_v = jax_flashattn.paged_cache_update(cache_k, cache_v, table, start, k8, v8)
    step_k, _ = jax_flashattn.quantize_fp8(keys[:, s:], descale=descale_k)
    step_v, _ = jax_flashattn.quantize_fp8(values[:, s:], descale=descale_v)
    cache_k, cache_v = jax_flashattn.paged_cache_update(cache_k, cache_v, table,
                                                        np.full(batch, s, np.int32), step_k,
                                                        step_v)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    lengths = np.full(batch, s + 1, np.int32)
    out = jax_flashattn.paged_attention(q, cache_k, cache_v, table, lengths,
                                        descale_k=descale_k, descale_v=descale_v)
    exact = jax_flashattn.attention(q, jnp.asarray(keys), jnp.asarray(values), is_causal=True,
                                    diagonal_alignment="bottom_right")
    err = np.linalg.norm(np.asarray(out) - np.asarray(exact)) / np.linalg.norm(np.asarray(exact))
    # e4m3's rounding of K and V moves the output by 3-4% here (8 seeds); a lost descale, O(1).
    assert 1e-4 < err < 0.08, err


def _dequantised(values, descale, heads=None):
    """float32 values [B, L, K or N, H] times their [B, K] descale, a query head n taking kv
    head n // (N / K)'s."""
    x = np.asarray(values, np.float32)
    d = np.asarray(descale, np.float32)
    if heads is not None:
        d = np.repeat(d, heads // d.shape[1], axis=1)
    return x * d[:, None, :, None]


# Each option through the FP8 call: the masks, lengths, a bias, segment ids and the modifiers.
FP8_OPTIONS = [dict(is_causal=True), dict(local_window_size=(9, 4), query_seq_lengths=[21, 5],
                                          key_value_seq_lengths=[30, 17]),
               dict(bias=True, mask=True), dict(logits_soft_cap=5.0, sinks=True),
               dict(alibi_slopes=True, is_causal=True, diagonal_alignment="bottom_right"),
               dict(query_segment_ids=True)]


def _options(rng, kwargs, b, t, s, n):
    kwargs = dict(kwargs)
    if kwargs.pop("bias", False):
        kwargs["bias"] = jnp.asarray(rng.standard_normal((b, n, t, s)), jnp.float32)
    if kwargs.pop("mask", False):
        kwargs["mask"] = rng.random((b, 1, t, s)) < 0.8
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
    if kwargs.pop("alibi_slopes", False):
        kwargs["alibi_slopes"] = jnp.asarray(2.0 ** -rng.uniform(1, 8, n), jnp.float32)
    if kwargs.pop("query_segment_ids", False):
        kwargs["query_segment_ids"] = np.repeat(np.arange(3), [9, 9, t - 18])[None].repeat(b, 0)
        kwargs["key_value_segment_ids"] = np.repeat(np.arange(3), [11, 9, s - 20])[None].repeat(
            b, 0)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kwargs:
            kwargs[name] = np.asarray(kwargs[name], np.int32)
    return kwargs


@pytest.mark.parametrize("kwargs", FP8_OPTIONS, ids=lambda k: ",".join(k))
@pytest.mark.parametrize("output_dtype", [None, jnp.float16])
def test_fp8_attention_matches_the_dequantised_reference(rng, kwargs, output_dtype):
    """q, k, v of e4m3 with [B, K] descales (GQA 6 -> 2): the output, bfloat16 by default, is
    the float32 reference on the dequantised inputs, rounded once to the output dtype."""
    b, t, s, n, k, h = 2, 23, 30, 6, 2, 16
    q, kk, v = (rng.standard_normal(shape).astype(np.float32) * 3 for shape in
                ((b, t, n, h), (b, s, k, h), (b, s, k, h)))
    q8, dq = jax_flashattn.quantize_fp8(q.reshape(b, t, k, n // k * h))
    q8 = q8.reshape(q.shape)
    k8, dk = jax_flashattn.quantize_fp8(kk)
    v8, dv = jax_flashattn.quantize_fp8(v)
    options = _options(rng, kwargs, b, t, s, n)
    out, lse = jax_flashattn.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                                       output_dtype=output_dtype, return_residual=True,
                                       **options)
    want_dtype = jnp.bfloat16 if output_dtype is None else output_dtype
    assert out.dtype == want_dtype and out.shape == q.shape
    want, want_lse = reference.attention(
        jnp.asarray(_dequantised(q8, dq, heads=n)), jnp.asarray(_dequantised(k8, dk)),
        jnp.asarray(_dequantised(v8, dv)), return_residual=True, **options)
    want = np.asarray(want, np.float64)
    error = np.linalg.norm(np.asarray(out, np.float64) - want)
    assert error <= float(jnp.finfo(want_dtype).eps) * np.linalg.norm(want)
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_quantised_kv_cache_beside_a_query(rng, dtype):
    """k and v of e4m3 with scalar and [B, K] descales beside a bfloat16, float16 or float32
    query (unbatched too, with [K] descales): the output in the query's dtype, under jit."""
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 32)), dtype)
    kk, v = (rng.standard_normal((2, 300, 2, 32)).astype(np.float32) for _ in range(2))
    k8, dk = jax_flashattn.quantize_fp8(kk)
    v8, _ = jax_flashattn.quantize_fp8(v, descale=0.01)
    f = jax.jit(lambda q, k, v, dk: jax_flashattn.attention(q, k, v, descale_k=dk,
                                                             descale_v=0.01))
    out = f(q, k8, v8, dk)
    assert out.dtype == dtype
    want = reference.attention(jnp.asarray(q, jnp.float32), jnp.asarray(_dequantised(k8, dk)),
                               jnp.asarray(np.asarray(v8, np.float32) * 0.01))
    error = np.linalg.norm(np.asarray(out, np.float64) - np.asarray(want, np.float64))
    # bfloat16 / float16: the output's rounding; float32: the kernels' own sums.
    bound = max(2 * float(jnp.finfo(dtype).eps), 1e-5)
    assert error <= bound * np.linalg.norm(np.asarray(want))
    unbatched = jax_flashattn.attention(q[0], k8[0], v8[0], descale_k=dk[0], descale_v=0.01)
    np.testing.assert_array_equal(np.asarray(unbatched), np.asarray(out[0]))


def test_fp8_errors_and_no_gradient(rng):
    q8, k8, v8 = (jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float8_e4m3fn)
                  for _ in range(3))
    bf16 = jnp.asarray(q8, jnp.bfloat16)
    with pytest.raises(ValueError, match="descale_k applies to float8_e4m3fn inputs only"):
        jax_flashattn.attention(bf16, bf16, bf16, descale_k=1.0)
    with pytest.raises(ValueError, match="descale_q applies to a float8_e4m3fn query only"):
        jax_flashattn.attention(bf16, k8, v8, descale_q=1.0)
    with pytest.raises(ValueError, match="output_dtype applies to a float8_e4m3fn query"):
        jax_flashattn.attention(bf16, k8, v8, output_dtype=jnp.float16)
    with pytest.raises(TypeError, match="key and value of float8_e4m3fn"):
        jax_flashattn.attention(q8, k8, bf16)
    with pytest.raises(TypeError, match="output_dtype must be bfloat16 or float16"):
        jax_flashattn.attention(q8, k8, v8, output_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"descale_k must be a scalar or \[B, K\]"):
        jax_flashattn.attention(q8, k8, v8, descale_k=jnp.ones((1, 3)))
    with pytest.raises(TypeError, match="descale_v must be float32"):
        jax_flashattn.attention(q8, k8, v8, descale_v=jnp.ones((1, 2), jnp.int32))
    bias = jnp.zeros((1, 2, 4, 4), jnp.float32)
    with pytest.raises(TypeError, match="forward-only"):  # even for the bias's gradient alone
        jax.grad(lambda b: jnp.sum(jax_flashattn.attention(q8, k8, v8, b).astype(
            jnp.float32)))(bias)


@pytest.mark.parametrize("output_dtype", [jnp.bfloat16, jnp.float16])
def test_fp8_inputs_for_the_gpu_kernels(rng, output_dtype):
    """Off the CPU the dequantised inputs are in the output dtype, for the tensor-core kernels:
    each the stored value times its descale, rounded once."""
    from jax_flashattn import fp8
    q, kk = (rng.standard_normal(shape).astype(np.float32) for shape in
             ((2, 5, 4, 16), (2, 7, 2, 16)))
    q8, dq = jax_flashattn.quantize_fp8(q.reshape(2, 5, 2, 32))
    q8 = q8.reshape(q.shape)
    k8, dk = jax_flashattn.quantize_fp8(kk)
    q2, k2, v2, out_dtype = fp8.dequantized_inputs(q8, k8, k8, descale_q=dq, descale_k=dk,
                                                   descale_v=None, output_dtype=output_dtype,
                                                   float32=False)
    assert out_dtype == output_dtype and {x.dtype for x in (q2, k2, v2)} == {out_dtype}
    for got, want in ((q2, _dequantised(q8, dq, heads=4)), (k2, _dequantised(k8, dk)),
                      (v2, np.asarray(k8, np.float32))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want, out_dtype)))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
@pytest.mark.parametrize("split", ["heads", "batch"])
def test_cache_op_on_contiguous_keys_partitions_without_collectives(rng, split):
    """The op the GPU decode kernels take an e4m3 cache through (_cache_kernel.forward without
    a page table), here on the CPU kernels with float32 keys and values and key lengths: split
    by kv heads or by batch entries over 2 devices it runs with no collective and gives
    `attention`'s result."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_flashattn import _cache_kernel, _ffi
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32) for _ in range(2))
    kv_lens = jnp.asarray([37, 20], jnp.int32)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), (split,))
    spec = P(None, None, "heads", None) if split == "heads" else P("batch")
    rows = NamedSharding(mesh, P() if split == "heads" else P("batch"))
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    kernel = jax.jit(lambda q, k, v, lens: _cache_kernel.forward(
        q, k, v, None, lens, scale=0.25, window=(None, 0), switches=_ffi.kernel_switches(),
        align_window_to_lengths=True))
    compiled = kernel.lower(*args, jax.device_put(kv_lens, rows)).compile()
    text = compiled.as_text()
    for op in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute"):
        assert op + "(" not in text and op + "-start(" not in text, op
    out, lse = compiled(*args, jax.device_put(kv_lens, rows))
    want, want_lse = jax_flashattn.attention(
        q, k, v, scale=0.25, is_causal=True, diagonal_alignment="bottom_right",
        key_value_seq_lengths=kv_lens, return_residual=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(lse, 1, 2)), np.asarray(want_lse),
                               rtol=1e-5, atol=1e-5)


def test_cache_op_shards_descales_with_their_batch_entries_and_kv_heads():
    """The cache op's Shardy rule and partition: contiguous keys and values and the [B, K]
    descales split by batch entry and kv head like q; the pools of a paged call by kv head
    alone, its table by batch entry."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_flashattn import _cache_kernel
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 64), jnp.float8_e4m3fn)
    descale = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    contiguous = (False, True, False, True)  # (page table, kv lengths, q lengths, descales)
    rule, factors = _cache_kernel._sharding_rule(contiguous, mesh, [q, kv, kv, lens, descale,
                                                                    descale], None)
    assert rule == ("b t (k g) h, b s k h, b s k h, b, b k, b k -> b t (k g) h, b (k g) t")
    assert factors["g"] == 4 and "s" in factors["need_replication_factors"]
    paged = (True, True, False, True)
    pool = jax.ShapeDtypeStruct((9, 64, 2, 64), jnp.float8_e4m3fn)
    table = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    rule, _ = _cache_kernel._sharding_rule(paged, mesh, [q, pool, pool, table, lens, descale,
                                                         descale], None)
    assert rule == ("b t (k g) h, p s k h, p s k h, b m, b, b k, b k -> b t (k g) h, "
                    "b (k g) t")
    if len(jax.devices()) < 2:
        return
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
    operands = (q, kv, kv, lens, descale, descale)

    def padded(spec, rank):
        return tuple(spec) + (None,) * (rank - len(spec))
    # q split by batch entry, or by heads: keys, values, lengths and descales follow.
    for q_spec, kv_spec, lens_spec, descale_spec in (
            (P("x"), P("x"), P("x"), P("x")),
            (P(None, None, "x"), P(None, None, "x"), P(), P(None, "x"))):
        # The partition follows q's sharding; the others' are whatever the caller had.
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, q_spec if i == 0 else P()))
                  for i, x in enumerate(operands)]
        _, _, _, args = _cache_kernel._partition(None, contiguous, mesh, shapes, None)
        want = (q_spec, kv_spec, kv_spec, lens_spec, descale_spec, descale_spec)
        assert ([padded(a.spec, len(x.shape)) for a, x in zip(args, operands)]
                == [padded(w, len(x.shape)) for w, x in zip(want, operands)])


def test_kernels_take_the_descales_as_given(rng):
    """The kernels take each [B, K] descale as given, negative, zero and NaN ones included (the
    CPU kernels multiply the rows they load by it, the GPU decode kernels fold its sign into
    their query fragments): 1 where None, scalars and [K] of an unbatched call grouped, and no
    elementwise op on the query before the kernel."""
    from jax_flashattn import fp8
    descale_k = jnp.asarray([[0.5, -0.25], [0.0, np.nan]], jnp.float32)
    k_descale, v_descale = fp8.kernel_descales(descale_k, None, 2, 2)
    np.testing.assert_array_equal(np.asarray(k_descale), np.asarray(descale_k))
    np.testing.assert_array_equal(np.asarray(v_descale), np.ones((2, 2)))
    k_descale, v_descale = fp8.kernel_descales(jnp.float32(-2.0), jnp.asarray([3.0, 0.0]), 1, 2,
                                               unbatched=True)
    np.testing.assert_array_equal(np.asarray(k_descale), [[-2.0, -2.0]])
    np.testing.assert_array_equal(np.asarray(v_descale), [[3.0, 0.0]])

    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.bfloat16)
    k8 = jnp.asarray(rng.standard_normal((2, 5, 2, 16)), jnp.float8_e4m3fn)

    def f(q, k8, descale):
        return jax_flashattn.attention(q, k8, k8, descale_k=descale, descale_v=descale)
    assert reads_e4m3_in_the_kernel(f, q, k8, descale_k)
    ops = jax.jit(f).lower(q, k8, descale_k).as_text()
    assert not any(op in ops for op in ("multiply", "sign", "select")), ops


@pytest.mark.parametrize("t,q_lens", [(1, None), (4, None), (4, [2, 4])],
                         ids=["t1", "t4", "t4_query_lengths"])
def test_nan_key_descale_makes_its_heads_nan(rng, t, q_lens):
    """A NaN key descale makes exactly the rows of its (batch entry, kv head) that see a key
    NaN, as the dequantised keys do (rows past a query length see none: 0); a negative and a
    zero one beside it give the reference."""
    b, s, n, k, h = 2, 40, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16)
    k8, v8 = (jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float8_e4m3fn)
              for _ in range(2))
    descale_k = jnp.asarray([[0.7, np.nan], [-0.4, 0.0]], jnp.float32)
    descale_v = jnp.asarray([[1.5, 0.5], [2.0, -1.0]], jnp.float32)
    lens = None if q_lens is None else jnp.asarray(q_lens, jnp.int32)
    out = np.asarray(jax_flashattn.attention(q, k8, v8, descale_k=descale_k,
                                             descale_v=descale_v, query_seq_lengths=lens),
                     np.float64)
    want = np.asarray(reference.attention(
        jnp.asarray(q, jnp.float32), jnp.asarray(_dequantised(k8, descale_k)),
        jnp.asarray(_dequantised(v8, descale_v)), query_seq_lengths=lens), np.float64)
    nan_rows = np.zeros((b, t, n), bool)
    nan_rows[0, :t if q_lens is None else q_lens[0], n // k:] = True
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), nan_rows)
    np.testing.assert_allclose(out[~nan_rows], want[~nan_rows], rtol=0,
                               atol=1e-2 * (np.abs(want[~nan_rows]).max() + 1))


def test_in_kernel_path_gradient_raises_the_forward_only_error(rng):
    """jax.grad through a call the kernels take on an e4m3 cache as stored raises the FP8
    TypeError before JAX meets the kernel op (which has no derivative rule)."""
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.bfloat16)
    k8, kd = jax_flashattn.quantize_fp8(rng.standard_normal((2, 300, 2, 16)))

    def loss(q, kd):
        out = jax_flashattn.attention(q, k8, k8, descale_k=kd, descale_v=kd)
        return jnp.sum(out.astype(jnp.float32))
    for argnum in (0, 1):
        with pytest.raises(TypeError, match="forward-only"):
            jax.jit(jax.grad(loss, argnums=argnum)).lower(q, kd)


KV_CACHE_OPTIONS = {
    "plain": {},
    "lengths": dict(query_seq_lengths=[5, 2], key_value_seq_lengths=[37, 19]),
    "bottom_right_causal": dict(is_causal=True, diagonal_alignment="bottom_right"),
    "window": dict(is_causal=True, local_window_size=(6, 0)),
}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels' path")
@pytest.mark.parametrize("option", sorted(KV_CACHE_OPTIONS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cpu_kernels_read_the_e4m3_cache(rng, option, dtype):
    """The CPU kernels take e4m3 keys and values as stored, each dequantised as it is loaded:
    the result is the reference on the dequantised values, rounded once to the query's dtype,
    with descales of every sign per (batch entry, kv head) (a negative key descale negates
    the scores, a zero one makes them equal), and NaN rows exactly where a visible key or value
    is NaN."""
    b, t, s, n, k, h = 2, 5, 37, 6, 2, 24
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k8, v8 = (jnp.asarray(rng.standard_normal((b, s, k, h)) * 4, jnp.float8_e4m3fn)
              for _ in range(2))
    k8 = k8.at[1, 3, 0, 5].set(jnp.nan)  # seen by every row of entry 1's kv head 0
    descale_k = jnp.asarray([[0.3, -0.7], [0.2, 0.0]], jnp.float32)
    descale_v = jnp.asarray([[-1.5, 0.25], [2.0, 0.5]], jnp.float32)
    options = _options(rng, KV_CACHE_OPTIONS[option], b, t, s, n)

    def f(q, k8, v8, descale_k, descale_v):
        return jax_flashattn.attention(q, k8, v8, descale_k=descale_k, descale_v=descale_v,
                                       **options)
    assert reads_e4m3_in_the_kernel(f, q, k8, v8, descale_k, descale_v)
    out = np.asarray(jax.jit(f)(q, k8, v8, descale_k, descale_v), np.float64)
    want = np.asarray(reference.attention(
        jnp.asarray(q, jnp.float32), jnp.asarray(_dequantised(k8, descale_k)),
        jnp.asarray(_dequantised(v8, descale_v)), **options), np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(want[1, :, :n // k]).any()  # the NaN key is visible
    out, want = np.nan_to_num(out), np.nan_to_num(want)
    bound = max(float(jnp.finfo(dtype).eps), 1e-5) * (np.abs(want).max() + 1)
    np.testing.assert_allclose(out, want, rtol=0, atol=bound)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
@pytest.mark.parametrize("batch_split", [False, True], ids=["heads", "batch_and_heads"])
def test_e4m3_cache_under_explicit_sharding(rng, batch_split):
    """Explicit mesh axes over the heads (and the batch), the descales sharded with their kv
    heads: the call runs without a resharding and gives the unsharded result, a negative
    descale included."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 2), ("b", "h"), axis_types=(AxisType.Explicit,) * 2)
    q = jnp.asarray(rng.standard_normal((4, 3, 8, 16)), jnp.float32)
    k8, descale = jax_flashattn.quantize_fp8(rng.standard_normal((4, 70, 2, 16)))
    descale = descale * jnp.asarray([1.0, -1.0])
    want = jax_flashattn.attention(q, k8, k8, descale_k=descale, descale_v=descale)
    b = "b" if batch_split else None
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in (
            (q, P(b, None, "h")), (k8, P(b, None, "h")), (descale, P(b, "h")))]
        out = jax.jit(lambda q, k, d: jax_flashattn.attention(q, k, k, descale_k=d,
                                                              descale_v=d))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_zero_size_e4m3_cache():
    """No keys (S = 0) or a head dim of 0 beside descales: zeros, as without them."""
    e4m3 = jnp.float8_e4m3fn
    out = jax_flashattn.attention(jnp.ones((2, 3, 4, 16)), jnp.zeros((2, 0, 2, 16), e4m3),
                                  jnp.zeros((2, 0, 2, 16), e4m3), descale_k=jnp.ones((2, 2)))
    assert out.shape == (2, 3, 4, 16) and not np.asarray(out).any()
    out = jax_flashattn.attention(jnp.ones((2, 3, 4, 0), jnp.bfloat16),
                                  jnp.zeros((2, 5, 2, 0), e4m3), jnp.zeros((2, 5, 2, 0), e4m3),
                                  descale_v=jnp.ones((2, 2)))
    assert out.shape == (2, 3, 4, 0) and out.dtype == jnp.bfloat16


def test_kernel_values_layout(rng):
    """fp8.kernel_values, V as FP8 attention's kernels read it: V^T [B, K, H, S'] (S' = S
    rounded up to 32) with each 32 keys in KEY_ORDER (a permutation), zeros at the keys past
    each entry's length and past S."""
    from jax_flashattn import fp8
    assert sorted(fp8.KEY_ORDER) == list(range(32))
    b, s, k, h = 2, 70, 3, 16
    v8, _ = jax_flashattn.quantize_fp8(rng.standard_normal((b, s, k, h)).astype(np.float32))
    lens = np.array([70, 33], np.int32)
    vt = np.asarray(jax.jit(fp8.kernel_values)(v8, jnp.asarray(lens)), np.float32)
    assert vt.shape == (b, k, h, 96)
    order = np.concatenate([32 * g + np.array(fp8.KEY_ORDER) for g in range(3)])
    v = np.asarray(v8, np.float32)
    for i in range(b):
        for column, key in enumerate(order):
            want = v[i, key] if key < lens[i] else np.zeros((k, h), np.float32)
            np.testing.assert_array_equal(vt[i, :, :, column], want)
    natural = np.asarray(fp8.kernel_values(v8), np.float32)[..., np.argsort(order)]
    np.testing.assert_array_equal(natural[..., :s], v.transpose(0, 2, 3, 1))
    assert not natural[..., s:].any()


def test_fp8_attention_call_partitions_like_the_cache_call(rng, monkeypatch):
    """Where the e4m3 kernel takes FP8 attention (forced here: the CPU compiles the call, only
    a GPU runs it), batch-sharded inputs give each device its own batch entries: no gather,
    one kernel call on 2 of the 8 entries."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jax_flashattn import _ffi, fp8
    monkeypatch.setattr(fp8, "attention_kernels_take", lambda *args, **kwargs: True)
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    q8, dq = jax_flashattn.quantize_fp8(rng.standard_normal((8, 64, 4, 64)).astype(np.float32))
    q8 = q8.reshape(8, 64, 8, 32)
    (k8, dk), (v8, dv) = (jax_flashattn.quantize_fp8(
        rng.standard_normal((8, 64, 4, 32)).astype(np.float32)) for _ in range(2))
    args = [jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
            for x in (q8, k8, v8, dq, dk, dv)]
    target = f'custom_call_target="{_ffi.FORWARD_TARGET}"'
    for descaled in (True, False):
        text = jax.jit(lambda q, k, v, a, b, c: jax_flashattn.attention(
            q, k, v, **(dict(descale_q=a, descale_k=b, descale_v=c) if descaled else {}))).lower(
            *args).compile().as_text()
        calls = [line for line in text.splitlines() if target in line]
        assert "all-gather" not in text
        assert len(calls) == 1 and "bf16[2,64,8,32]" in calls[0]
        assert "f8e4m3fn[2,64,8,32]" in calls[0]
