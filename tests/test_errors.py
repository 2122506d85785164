"""Bad inputs raise ValueError/TypeError at trace time, naming the argument; handler errors come
back as Python exceptions instead of crashing the process."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, _ops
from helpers import random_qkv

B, T, S, N, K, H = 2, 8, 10, 4, 2, 16


def arr(rng, shape, dtype=jnp.float32):
    x = rng.standard_normal(shape, dtype=np.float32)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        return jnp.asarray(x > 0, dtype)
    return jnp.asarray(x, dtype)


def qkv(rng, q_shape=(B, T, N, H), k_shape=(B, S, K, H), v_shape=None, dtypes=(jnp.float32,) * 3):
    v_shape = k_shape if v_shape is None else v_shape
    return tuple(arr(rng, shape, d) for shape, d in zip((q_shape, k_shape, v_shape), dtypes))


# name -> (build(rng) -> (args, kwargs), exception type, regex the message must match)
CASES = {
    "query_rank_2": (lambda r: (qkv(r, (T, H), (S, H)), {}), ValueError, "query"),
    "query_rank_5": (lambda r: (qkv(r, (1, B, T, N, H), (1, B, S, K, H)), {}), ValueError,
                     "query"),
    "key_rank": (lambda r: (qkv(r, k_shape=(S, K, H)), {}), ValueError, "key"),
    "value_rank": (lambda r: (qkv(r, v_shape=(S, K, H)), {}), ValueError, "value"),
    "batch_mismatch": (lambda r: (qkv(r, k_shape=(B + 1, S, K, H)), {}), ValueError, "batch"),
    "key_head_dim": (lambda r: (qkv(r, k_shape=(B, S, K, H // 2)), {}), ValueError, "head dim"),
    "value_head_dim": (lambda r: (qkv(r, v_shape=(B, S, K, H // 2)), {}), ValueError, "value"),
    "value_length": (lambda r: (qkv(r, v_shape=(B, S + 1, K, H)), {}), ValueError, "value"),
    "value_heads": (lambda r: (qkv(r, v_shape=(B, S, 1, H)), {}), ValueError, "value"),
    "heads_not_multiple": (lambda r: (qkv(r, k_shape=(B, S, 3, H)), {}), ValueError,
                           r"N=4.*K=3|heads"),
    "more_kv_heads": (lambda r: (qkv(r, k_shape=(B, S, 2 * N, H)), {}), ValueError, "heads"),
    "no_kv_heads": (lambda r: (qkv(r, k_shape=(B, S, 0, H)), {}), ValueError, "K >= 1"),
    "no_heads_at_all": (lambda r: (qkv(r, (B, T, 0, H), (B, S, 0, H)), {}), ValueError,
                        "K >= 1"),
    # Zero-size inputs are valid (tests/test_edge_cases.py), and checked like any other.
    "empty_query_bias_shape": (lambda r: (qkv(r, q_shape=(B, 0, N, H))
                                          + (arr(r, (B, N, 1, S + 1)),), {}), ValueError, "bias"),
    "empty_key_mask_dtype": (lambda r: (qkv(r, k_shape=(B, 0, K, H))
                                        + (None, arr(r, (B, N, T, 0))), {}), TypeError, "mask"),
    "empty_query_lens_shape": (lambda r: (qkv(r, q_shape=(B, 0, N, H)),
                                          dict(query_seq_lengths=jnp.ones((B + 1,), jnp.int32))),
                               ValueError, "query_seq_lengths"),
    "empty_head_dim_heads": (lambda r: (qkv(r, (B, T, N, 0), (B, S, 3, 0)), {}), ValueError,
                             "heads"),
    "empty_value_shape": (lambda r: (qkv(r, q_shape=(B, 0, N, H), v_shape=(B, S + 1, K, H)), {}),
                          ValueError, "value"),
    "query_none": (lambda r: ((None,) + qkv(r)[1:], {}), TypeError, "query"),
    "key_none": (lambda r: (qkv(r)[:1] + (None,) + qkv(r)[2:], {}), TypeError, "key"),
    "value_none": (lambda r: (qkv(r)[:2] + (None,), {}), TypeError, "value"),
    "int_query": (lambda r: (qkv(r, dtypes=(jnp.int32, jnp.float32, jnp.float32)), {}),
                  TypeError, "query"),
    "int_key": (lambda r: (qkv(r, dtypes=(jnp.float32, jnp.int8, jnp.float32)), {}), TypeError,
                "key"),
    "bool_value": (lambda r: (qkv(r, dtypes=(jnp.float32, jnp.float32, jnp.bool_)), {}),
                   TypeError, "value"),
    "mixed_dtypes": (lambda r: (qkv(r, dtypes=(jnp.float32, jnp.bfloat16, jnp.bfloat16)), {}),
                     TypeError, "dtype"),
    "mixed_key_value": (lambda r: (qkv(r, dtypes=(jnp.float16, jnp.float16, jnp.bfloat16)), {}),
                        TypeError, "dtype"),
    "float8_query_alone": (lambda r: (qkv(r, dtypes=(jnp.float8_e4m3fn, jnp.float32,
                                                    jnp.float32)), {}),
                           TypeError, "key and value of float8_e4m3fn"),
    "float8_key_alone": (lambda r: (qkv(r, dtypes=(jnp.bfloat16, jnp.float8_e4m3fn,
                                                  jnp.bfloat16)), {}),
                         TypeError, "key and value of float8_e4m3fn"),
    "float8_descale_shape": (lambda r: (qkv(r, dtypes=(jnp.float8_e4m3fn,) * 3),
                                        dict(descale_k=jnp.ones((K,)))), ValueError, "descale_k"),
    "bias_int": (lambda r: (qkv(r) + (arr(r, (B, N, T, S), jnp.int32),), {}), TypeError, "bias"),
    "bias_bool": (lambda r: (qkv(r) + (arr(r, (B, N, T, S), jnp.bool_),), {}), TypeError, "bias"),
    "bias_bad_shape": (lambda r: (qkv(r) + (arr(r, (B, N, T, S + 1)),), {}), ValueError, "bias"),
    "bias_bad_batch": (lambda r: (qkv(r) + (arr(r, (B + 1, 1, T, S)),), {}), ValueError, "bias"),
    "bias_swapped": (lambda r: (qkv(r) + (arr(r, (S, T)),), {}), ValueError, "bias"),
    "bias_5d": (lambda r: (qkv(r) + (arr(r, (1, B, N, T, S)),), {}), ValueError, "bias"),
    "mask_float": (lambda r: (qkv(r) + (None, arr(r, (B, N, T, S))), {}), TypeError, "mask"),
    "mask_int": (lambda r: (qkv(r) + (None, arr(r, (B, N, T, S), jnp.int32)), {}), TypeError,
                 "mask"),
    "mask_bad_shape": (lambda r: (qkv(r) + (None, arr(r, (B, N, 3, S), jnp.bool_)), {}),
                       ValueError, "mask"),
    "mask_5d": (lambda r: (qkv(r) + (None, arr(r, (1, 1, 1, T, S), jnp.bool_)), {}), ValueError,
                "mask"),
    "q_lens_float": (lambda r: (qkv(r), dict(query_seq_lengths=jnp.ones((B,), jnp.float32))),
                     TypeError, "query_seq_lengths"),
    "q_lens_shape": (lambda r: (qkv(r), dict(query_seq_lengths=jnp.ones((B + 1,), jnp.int32))),
                     ValueError, "query_seq_lengths"),
    "q_lens_2d": (lambda r: (qkv(r), dict(query_seq_lengths=jnp.ones((B, 1), jnp.int32))),
                  ValueError, "query_seq_lengths"),
    "kv_lens_float": (lambda r: (qkv(r),
                                 dict(key_value_seq_lengths=jnp.ones((B,), jnp.bfloat16))),
                      TypeError, "key_value_seq_lengths"),
    "kv_lens_bool": (lambda r: (qkv(r), dict(key_value_seq_lengths=jnp.ones((B,), bool))),
                     TypeError, "key_value_seq_lengths"),
    "kv_lens_scalar": (lambda r: (qkv(r), dict(key_value_seq_lengths=jnp.int32(3))), ValueError,
                       "key_value_seq_lengths"),
    # 2**31 as uint32 would wrap to a negative length in int32 (hiding every key).
    "kv_lens_uint32": (lambda r: (qkv(r), dict(key_value_seq_lengths=jnp.asarray([2**31, 3],
                                                                                jnp.uint32))),
                       TypeError, "key_value_seq_lengths.*int32"),
    "q_lens_uint32": (lambda r: (qkv(r), dict(query_seq_lengths=jnp.asarray([T, 1], jnp.uint32))),
                      TypeError, "query_seq_lengths.*int32"),
    "window_negative": (lambda r: (qkv(r), dict(local_window_size=-1)), ValueError,
                        "local_window_size"),
    "window_negative_side": (lambda r: (qkv(r), dict(local_window_size=(2, -3))), ValueError,
                             "local_window_size"),
    "window_float": (lambda r: (qkv(r), dict(local_window_size=2.0)), TypeError,
                     "local_window_size"),
    "window_float_side": (lambda r: (qkv(r), dict(local_window_size=(1.5, 2))), TypeError,
                          "local_window_size"),
    "window_3_tuple": (lambda r: (qkv(r), dict(local_window_size=(1, 2, 3))), TypeError,
                       "local_window_size"),
    "window_1_tuple": (lambda r: (qkv(r), dict(local_window_size=(1,))), TypeError,
                       "local_window_size"),
    "window_bool": (lambda r: (qkv(r), dict(local_window_size=True)), TypeError,
                    "local_window_size"),
    "window_bool_side": (lambda r: (qkv(r), dict(local_window_size=(True, 2))), TypeError,
                         "local_window_size"),
    "window_string": (lambda r: (qkv(r), dict(local_window_size="3")), TypeError,
                      "local_window_size"),
    "window_array": (lambda r: (qkv(r), dict(local_window_size=jnp.asarray([2, 2]))), TypeError,
                     "local_window_size"),
    "scale_string": (lambda r: (qkv(r), dict(scale="big")), TypeError, "scale"),
    "scale_nan": (lambda r: (qkv(r), dict(scale=math.nan)), ValueError, "scale"),
    "scale_inf": (lambda r: (qkv(r), dict(scale=math.inf)), ValueError, "scale"),
    "scale_inf_in_float32": (lambda r: (qkv(r), dict(scale=1e39)), ValueError, "scale"),
    "scale_negative_inf_in_float32": (lambda r: (qkv(r), dict(scale=-3.5e38)), ValueError,
                                      "scale"),
    "scale_int_beyond_float64": (lambda r: (qkv(r), dict(scale=10**400)), ValueError, "scale"),
    "is_causal_string": (lambda r: (qkv(r), dict(is_causal="yes")), TypeError, "is_causal"),
    "unknown_implementation": (lambda r: (qkv(r), dict(implementation="flash")), ValueError,
                               "implementation"),
    "implementation_case": (lambda r: (qkv(r), dict(implementation="CPU")), ValueError,
                            "implementation"),
}

# Arguments that are arrays are passed through jit as traced values; the rest stay static.
ARRAY_KWARGS = ("query_seq_lengths", "key_value_seq_lengths")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_bad_input_raises(rng, case, jit):
    build, exc, pattern = CASES[case]
    args, kwargs = build(rng)
    if not jit:
        with pytest.raises(exc, match=pattern):
            jax_flashattn.attention(*args, **kwargs)
        return
    traced = {k: v for k, v in kwargs.items() if k in ARRAY_KWARGS}
    static = {k: v for k, v in kwargs.items() if k not in ARRAY_KWARGS}
    fn = jax.jit(lambda a, kw: jax_flashattn.attention(*a, **kw, **static))
    with pytest.raises(exc, match=pattern):
        fn.trace(args, traced)  # trace time: nothing is lowered or run


def test_errors_describe_what_they_got(rng):
    """Messages give the shapes/dtypes received, not only the argument's name."""
    q, k, v = qkv(rng, k_shape=(B, S, 3, H))
    with pytest.raises(ValueError, match="3"):
        jax_flashattn.attention(q, k, v)
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match=rf"\(1, 1, {T}, {S + 1}\)|{S + 1}"):
        jax_flashattn.attention(q, k, v, arr(rng, (T, S + 1)))
    with pytest.raises(TypeError, match="int32"):
        jax_flashattn.attention(q, k, v, None, arr(rng, (T, S), jnp.int32))


def test_float64_rejected(rng):
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in qkv(rng))
        assert q.dtype == jnp.float64
        with pytest.raises(TypeError, match="query"):
            jax_flashattn.attention(q, k, v)
        with pytest.raises(TypeError, match="query"):
            jax.jit(jax_flashattn.attention).trace(q, k, v)


def test_float64_bias_accepted_under_x64(rng):
    """A float64 bias is a valid float bias: it is cast, not rejected."""
    with jax.enable_x64(True):
        q, k, v = qkv(rng)
        bias = jnp.asarray(rng.standard_normal((T, S)), jnp.float64)
        out = jax_flashattn.attention(q, k, v, bias)
        want = jax_flashattn.attention(q, k, v, bias.astype(jnp.float32))
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_traced_scale_rejected(rng):
    q, k, v = qkv(rng)
    fn = jax.jit(lambda q, k, v, s: jax_flashattn.attention(q, k, v, scale=s))
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v, 0.5)


def test_traced_is_causal_rejected(rng):
    q, k, v = qkv(rng)
    fn = jax.jit(lambda q, k, v, c: jax_flashattn.attention(q, k, v, is_causal=c))
    with pytest.raises(TypeError, match="is_causal"):
        fn(q, k, v, True)


def test_not_an_array():
    with pytest.raises(TypeError, match="query"):
        jax_flashattn.attention("query", jnp.ones((B, S, K, H)), jnp.ones((B, S, K, H)))


def test_cuda_on_cpu_raises(rng):
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU backend")
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="cuda"):
        jax_flashattn.attention(q, k, v, implementation="cuda")
    with pytest.raises(ValueError, match="cuda"):
        jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, implementation="cuda"))(q, k, v)


def test_cudnn_without_gpu_raises(rng):
    """Names the argument and what runs here, instead of jax.nn's RuntimeError."""
    if jax.default_backend() == "gpu":
        pytest.skip("checks a backend without cuDNN")
    q, k, v = qkv(rng)
    pattern = r"implementation='cudnn'.*available here: \(None, 'cpu', 'xla'\)"
    with pytest.raises(ValueError, match=pattern):
        jax_flashattn.attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match=pattern):
        jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, implementation="cudnn"))(q, k, v)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("lengths", [np.array([2**31, 3]), np.array([3, -2**31 - 1]),
                                     [2**32 + 3, 1], np.array([2**63, 5], np.uint64)], ids=str)
def test_host_lengths_must_fit_int32(rng, lengths, jit):
    """numpy/Python lengths are checked by value (they are on the host at trace time): one that
    does not fit int32 would wrap around (2**32 + 3 acting as 3), so it raises."""
    q, k, v = qkv(rng)
    fn = lambda q, k, v: jax_flashattn.attention(q, k, v, key_value_seq_lengths=lengths)
    with pytest.raises(ValueError, match="key_value_seq_lengths values must fit int32"):
        (jax.jit(fn) if jit else fn)(q, k, v)


@pytest.mark.parametrize("dtype", [jnp.int64, jnp.uint32, jnp.uint64],
                         ids=lambda d: jnp.dtype(d).name)
def test_wide_device_lengths_rejected(rng, dtype):
    """A JAX array of a dtype wider than int32 cannot have its values checked at trace time."""
    q, k, v = qkv(rng)
    with jax.enable_x64(True):
        lengths = jnp.asarray([S, 1], dtype)
        assert lengths.dtype == dtype
        with pytest.raises(TypeError, match="query_seq_lengths.*pass int32"):
            jax_flashattn.attention(q, k, v, query_seq_lengths=lengths)
        fn = jax.jit(lambda q, k, v, n: jax_flashattn.attention(q, k, v, key_value_seq_lengths=n))
        with pytest.raises(TypeError, match="key_value_seq_lengths.*pass int32"):
            fn.trace(q, k, v, lengths)


def _sum_attention(**kwargs):
    return lambda q, k, v: jax_flashattn.attention(q, k, v, **kwargs).sum()


# name -> function of (f: q, k, v -> scalar) differentiating it past the first order or forward
DERIVATIVES = {
    "hessian": lambda f: lambda q, k, v: jax.hessian(f)(q, k, v),
    "grad_of_grad": lambda f: lambda q, k, v: jax.grad(lambda q: jax.grad(f)(q, k, v).sum())(q),
    "jit_grad_of_grad": lambda f: jax.jit(
        lambda q, k, v: jax.grad(lambda k: jax.grad(f, argnums=1)(q, k, v).sum())(k)),
    # The backward alone differentiated, along its cotangent.
    "grad_of_vjp": lambda f: lambda q, k, v: jax.grad(
        lambda c: jax.vjp(lambda q: f(q, k, v), q)[1](c)[0].sum())(jnp.float32(1)),
    "jacfwd": lambda f: lambda q, k, v: jax.jacfwd(f)(q, k, v),
    "jit_jacfwd": lambda f: jax.jit(lambda q, k, v: jax.jacfwd(f, argnums=2)(q, k, v)),
    "jvp": lambda f: lambda q, k, v: jax.jvp(lambda q: f(q, k, v), (q,), (q,)),
    "jit_jvp": lambda f: jax.jit(
        lambda q, k, v: jax.jvp(lambda k: f(q, k, v), (k,), (jnp.ones_like(k),))),
}


@pytest.mark.parametrize("name", list(DERIVATIVES), ids=str)
def test_unsupported_derivatives_say_so(rng, name):
    """Second-order and forward-mode derivatives raise one message naming what does support
    them, instead of JAX's errors about our custom_vjp and partitioned ops; that suggestion
    holds."""
    q, k, v = qkv(rng, (1, 3, 2, 4), (1, 5, 1, 4))
    derivative = DERIVATIVES[name]
    pattern = r"second-order.*not supported by jax_flashattn.*implementation=\"xla\""
    with pytest.raises(TypeError, match=pattern):
        derivative(_sum_attention(is_causal=True))(q, k, v)
    got = derivative(_sum_attention(is_causal=True, implementation="xla"))(q, k, v)
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(got))


def test_valid_edge_arguments_accepted(rng):
    """Things that look odd but are valid: numpy-integer windows, a concrete array scale,
    numpy bool is_causal, list windows (lengths: tests/test_edge_cases.py)."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    base = jax_flashattn.attention(q, k, v, is_causal=True, local_window_size=(3, 1), scale=0.5)
    for kw in (dict(local_window_size=(np.int64(3), np.int32(1)), scale=np.float32(0.5)),
               dict(local_window_size=[3, 1], scale=jnp.float32(0.5)),
               dict(local_window_size=(3, 1), scale=0.5, is_causal=np.bool_(True))):
        kw.setdefault("is_causal", True)
        np.testing.assert_allclose(jax_flashattn.attention(q, k, v, **kw), base, rtol=1e-6,
                                   atol=1e-6)


# --- errors inside the FFI handlers -------------------------------------------------------------

FLAGS = dict(has_bias=np.int32(0), has_mask=np.int32(0), has_q_seqlens=np.int32(0),
             has_kv_seqlens=np.int32(0), has_segment_ids=np.int32(0), has_spans=np.int32(0),
             has_alibi=np.int32(0), has_kv_descale=np.int32(0), has_page_table=np.int32(0))
ATTRS = dict(scale=np.float32(0.25), logits_soft_cap=np.float32(0),
             window_left=np.int64(_ops.UNBOUNDED_WINDOW),
             window_right=np.int64(_ops.UNBOUNDED_WINDOW), align_window_to_lengths=np.int32(0),
             alibi_shift=np.int64(0), deterministic=np.int32(0), want_dslopes=np.int32(0),
             **_ffi.KernelSwitches().attrs())


def _raw_forward(q, k, v, *optional, out_shape=None, lse_shape=None, lse_dtype=jnp.float32,
                 workspace_dtype=jnp.int32, decode_workspace_dtype=jnp.float32, **flags):
    b, t, n, _ = q.shape
    results = (jax.ShapeDtypeStruct(out_shape or q.shape, q.dtype),
               jax.ShapeDtypeStruct(lse_shape or (b, n, t), lse_dtype),
               jax.ShapeDtypeStruct((1,), workspace_dtype),
               jax.ShapeDtypeStruct((0,), decode_workspace_dtype))
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, results)
    return call(q, k, v, *optional, **{**FLAGS, **flags}, **ATTRS)


HANDLER_CASES = {
    "lse_shape": dict(lse_shape=(B, N, T + 1)),
    "lse_dtype": dict(lse_dtype=jnp.bfloat16),
    "out_shape": dict(out_shape=(B, T, N, H + 1)),
    "workspace_dtype": dict(workspace_dtype=jnp.float32),
    "decode_workspace_dtype": dict(decode_workspace_dtype=jnp.int32),
    "missing_optional_operand": dict(has_bias=np.int32(1)),
    "extra_optional_operand": "extra",
    "bias_wrong_rank": "bias",
    "lengths_wrong_dtype": "lengths",
    "segment_ids_wrong_dtype": "segments_dtype",
    "segment_ids_wrong_shape": "segments_shape",
    "segment_ids_one_only": "segments_one",
    "spans_wrong_shape": "spans_shape",
    "alibi_slopes_wrong_shape": "alibi_shape",
    "alibi_slopes_wrong_dtype": "alibi_dtype",
}


@pytest.mark.parametrize("case", list(HANDLER_CASES), ids=str)
def test_handler_error_is_python_exception(rng, case):
    """Inconsistent operands reach the C++ decoder, which returns an error: JAX raises it."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    spec, optional = HANDLER_CASES[case], ()
    if spec == "extra":
        spec, optional = {}, (jnp.ones((B,), jnp.int32),)
    elif spec == "bias":
        spec, optional = dict(has_bias=np.int32(1)), (jnp.ones((T, S), jnp.float32),)
    elif spec == "lengths":
        spec, optional = dict(has_q_seqlens=np.int32(1)), (jnp.ones((B,), jnp.float32),)
    elif spec == "segments_dtype":
        spec = dict(has_segment_ids=np.int32(1))
        optional = (jnp.zeros((B, T), jnp.float32), jnp.zeros((B, S), jnp.int32))
    elif spec == "segments_shape":  # the key ids sized like the queries
        spec = dict(has_segment_ids=np.int32(1))
        optional = (jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32))
    elif spec == "segments_one":
        spec, optional = dict(has_segment_ids=np.int32(1)), (jnp.zeros((B, T), jnp.int32),)
    elif spec == "spans_shape":  # three granules of keys where S has one
        spec = dict(has_spans=np.int32(1))
        optional = (jnp.zeros((B, 1, 2), jnp.int32), jnp.zeros((B, 3, 2), jnp.int32))
    elif spec == "alibi_shape":  # one slope per kv head
        spec, optional = dict(has_alibi=np.int32(1)), (jnp.zeros((B, K), jnp.float32),)
    elif spec == "alibi_dtype":
        spec, optional = dict(has_alibi=np.int32(1)), (jnp.zeros((B, N), jnp.bfloat16),)
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_flashattn: "):
        jax.block_until_ready(_raw_forward(q, k, v, *optional, **spec))
    # The process is fine afterwards.
    out = jax.block_until_ready(jax_flashattn.attention(q, k, v))
    assert np.isfinite(np.asarray(out)).all()


PAGED_CASES = {
    # (page size, table shape, table dtype, with lengths)
    "page_size_not_a_power_of_two": (24, (B, 4), jnp.int32, True),
    "page_size_below_16": (8, (B, 4), jnp.int32, True),
    "page_table_rows": (16, (B + 1, 4), jnp.int32, True),
    "page_table_dtype": (16, (B, 4), jnp.uint32, True),
    "without_lengths": (16, (B, 4), jnp.int32, False),
}


@pytest.mark.parametrize("case", list(PAGED_CASES), ids=str)
def test_paged_handler_error_is_python_exception(rng, case):
    """A paged call's pools, table and lengths reach the C++ decoder, which refuses bad ones."""
    page_size, table_shape, table_dtype, with_lengths = PAGED_CASES[case]
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((6, page_size, K, H)), jnp.float32)
    table = jnp.zeros(table_shape, table_dtype)
    lengths = (jnp.full((B,), 5, jnp.int32),) if with_lengths else ()
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_flashattn: "):
        jax.block_until_ready(_raw_forward(q, pool, pool, *lengths, table,
                                           has_page_table=np.int32(1),
                                           has_kv_seqlens=np.int32(with_lengths)))


FP8_CASES = {
    # (k dtype, q dtype, descale shape): what the decoder says
    "bf16 keys": (jnp.bfloat16, jnp.bfloat16, (B, K), "float8_e4m3fn key and value"),
    "bf16 value": (jnp.float8_e4m3fn, jnp.bfloat16, (B, K), "value must have shape"),
    "descale per head": (jnp.float8_e4m3fn, jnp.bfloat16, (B, N), r"k_descale must be float32 "
                         r"\[\.\.\., B, K\]"),
    "descale without batch": (jnp.float8_e4m3fn, jnp.bfloat16, (K,), "k_descale must be"),
}


@pytest.mark.parametrize("case", list(FP8_CASES), ids=str)
def test_fp8_handler_error_is_python_exception(rng, case):
    """e4m3 keys and values with their descales reach the C++ decoder, which refuses bad
    ones."""
    k_dtype, q_dtype, descale_shape, message = FP8_CASES[case]
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), q_dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), k_dtype)
    v = k.astype(jnp.bfloat16) if case == "bf16 value" else k
    descale = jnp.ones(descale_shape, jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(_raw_forward(q, k, v, descale, descale,
                                           has_kv_descale=np.int32(1)))


def test_backward_handler_error_is_python_exception(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    out = jax_flashattn.attention(q, k, v)
    lse = jnp.zeros((B, N, T), jnp.float32)
    # Claims a bias but passes none, and asks for a dbias result anyway.
    grads = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype))
    workspaces = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                  jax.ShapeDtypeStruct((B, N, T), jnp.float32),
                  jax.ShapeDtypeStruct((0,), jnp.int32))
    dbias = jax.ShapeDtypeStruct((B, N, T, S), jnp.float32)
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, grads + workspaces + (dbias,))
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_flashattn: "):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS, **ATTRS))
    # d_out with the wrong shape.
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, grads + workspaces)
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_flashattn: "):
        jax.block_until_ready(call(q, k, v, out, lse, out[:, :-1], **FLAGS, **ATTRS))
    # A dQ accumulator of the wrong dtype.
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET,
                            grads + (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                                     *workspaces[1:]))
    with pytest.raises(jax.errors.JaxRuntimeError, match="dq_accum"):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS, **ATTRS))
    # dQ semaphores that are not int32, and too few of them for a deterministic call (one per
    # batch entry, query head and 64 queries).
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET,
                            grads + workspaces[:2] + (jax.ShapeDtypeStruct((4,), jnp.float32),))
    with pytest.raises(jax.errors.JaxRuntimeError, match="dq_semaphores"):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS, **ATTRS))
    needed = B * N * -(-T // 64)
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, grads + workspaces[:2] + (
        jax.ShapeDtypeStruct((needed - 1,), jnp.int32),))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"at least {needed} int32"):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS,
                                   **dict(ATTRS, deterministic=np.int32(1))))
    # A dslopes result asked for without the slopes, and one of the wrong shape with them.
    slopes = jax.ShapeDtypeStruct((B, N), jnp.float32)
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, grads + workspaces + (slopes,))
    with pytest.raises(jax.errors.JaxRuntimeError, match="dslopes"):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS,
                                   **dict(ATTRS, want_dslopes=np.int32(1))))
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET,
                            grads + workspaces + (jax.ShapeDtypeStruct((B, K), jnp.float32),))
    with pytest.raises(jax.errors.JaxRuntimeError, match="dslopes must be float32"):
        jax.block_until_ready(call(q, k, v, out, lse, out, jnp.zeros((B, N), jnp.float32),
                                   **dict(FLAGS, has_alibi=np.int32(1)),
                                   **dict(ATTRS, want_dslopes=np.int32(1))))


@pytest.mark.parametrize("value", [1, None, "yes", np.bool_(True)])
def test_deterministic_backward_must_be_bool(rng, value):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    with pytest.raises(TypeError, match="deterministic_backward"):
        jax_flashattn.attention(q, k, v, deterministic_backward=value)


def test_forward_kernel_query_rejects_other_dtypes():
    q = jax.ShapeDtypeStruct((2, 10, 4, 64), jnp.int8)
    with pytest.raises(TypeError, match="query"):
        jax_flashattn.forward_kernel(q, q)


def test_backward_kernel_query_rejects_other_dtypes():
    q = jax.ShapeDtypeStruct((2, 10, 4, 64), jnp.int8)
    with pytest.raises(TypeError, match="query"):
        jax_flashattn.backward_kernel(q, q)
