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
    "empty_query": (lambda r: (qkv(r, q_shape=(B, 0, N, H)), {}), ValueError, "query"),
    "empty_key": (lambda r: (qkv(r, k_shape=(B, 0, K, H)), {}), ValueError, "key"),
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
    "float8_query": (lambda r: (qkv(r, dtypes=(jnp.float8_e4m3fn,) * 3), {}), TypeError,
                     "query"),
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


def test_valid_edge_arguments_accepted(rng):
    """Things that look odd but are valid: numpy-integer windows, a concrete array scale,
    numpy bool is_causal, int64 lengths, list windows."""
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
             has_kv_seqlens=np.int32(0))
ATTRS = dict(scale=np.float32(0.25), window_left=np.int64(_ops.UNBOUNDED_WINDOW),
             window_right=np.int64(_ops.UNBOUNDED_WINDOW),
             deterministic=np.int32(0), **_ffi.KernelSwitches().attrs())


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
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_flashattn: "):
        jax.block_until_ready(_raw_forward(q, k, v, *optional, **spec))
    # The process is fine afterwards.
    out = jax.block_until_ready(jax_flashattn.attention(q, k, v))
    assert np.isfinite(np.asarray(out)).all()


def test_backward_handler_error_is_python_exception(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    out = jax_flashattn.attention(q, k, v)
    lse = jnp.zeros((B, N, T), jnp.float32)
    # Claims a bias but passes none, and asks for a dbias result anyway.
    grads = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype))
    workspaces = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                  jax.ShapeDtypeStruct((B, N, T), jnp.float32))
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
                            grads + (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16), workspaces[1]))
    with pytest.raises(jax.errors.JaxRuntimeError, match="dq_accum"):
        jax.block_until_ready(call(q, k, v, out, lse, out, **FLAGS, **ATTRS))


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
