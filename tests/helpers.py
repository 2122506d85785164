"""Shared test utilities: random inputs and the error-ratio comparison of the float32
reference."""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, _validate, reference

# Above this many [B, N, T, S] logits (256 MiB of float32), the reference runs one batch entry at
# a time: its logits and probabilities are live together, and GPU tests share one device among
# many pytest-xdist workers.
_SPLIT_LOGITS = 2**26


def load_benchmark_script(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_qkv(rng, b, t, s, n, k, h, dtype, magnitude=1.0):
    """Normal q [*lead, T, N, H], k/v [*lead, S, K, H] in `dtype`; lead is (b,) for an int b,
    () for b=None (unbatched arrays), b itself for a tuple (extra leading dims, as vmap or
    Flax add)."""
    lead = () if b is None else tuple(b) if isinstance(b, tuple) else (b,)
    q = rng.standard_normal(lead + (t, n, h), dtype=np.float32) * magnitude
    kk = rng.standard_normal(lead + (s, k, h), dtype=np.float32) * magnitude
    v = rng.standard_normal(lead + (s, k, h), dtype=np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def poison(*like):
    """Fills and frees device blocks of the sizes (and dtypes) of the coming results with NaN:
    XLA's allocator hands a freed block to the next allocation of that size, so a result element
    a kernel forgot to write shows up as NaN."""
    blocks = [jnp.full(x.shape, jnp.nan, x.dtype).block_until_ready() for x in like]
    del blocks


def fill_past_lengths(key, value, kv_lens, fill):
    """key and value [B, S, K, H] with every row past its batch entry's length set to `fill`
    (NaN, Inf: what a padded cache may hold there)."""
    past = np.arange(key.shape[1])[None, :, None, None] >= np.asarray(kv_lens)[:, None, None, None]
    return tuple(jnp.where(past, jnp.asarray(fill, x.dtype), x) for x in (key, value))


def _static_options(args, kwargs):
    """(positional, arrays, static) for the jitted reference gradients: the array options
    traced, the rest (flags, scales, window sizes, dtypes) static; None where an option is
    neither an array nor hashable (a list), which the caller then runs eagerly."""
    def is_array(x):
        return isinstance(x, (np.ndarray, jax.Array))
    if not all(a is None or is_array(a) for a in args):
        return None
    arrays = {name: x for name, x in kwargs.items() if is_array(x)}
    static = tuple(sorted((name, x) for name, x in kwargs.items() if name not in arrays))
    try:
        hash(static)
    except TypeError:
        return None
    return tuple(args), arrays, static


# The reference's gradients jitted once per (options, shapes) and reused by every check with
# the same ones (each fresh jit of them compiled anew: most of the gradient tests' time). The
# forward reference stays eager unless a check asks for jitted_reference: its operations' small
# programs are shared across options where checks share shapes.
@functools.partial(jax.jit, static_argnames=("static",))
def _jitted_reference_grads(q, k, v, bias, d_out, positional, arrays, static):
    return grads(reference.attention, q, k, v, bias, d_out, *positional, **arrays, **dict(static))


@functools.partial(jax.jit, static_argnames=("fn", "static"))
def _jitted(fn, q, k, v, positional, arrays, static):
    return fn(q, k, v, *positional, **arrays, **dict(static))


def _jit_with_options(fn, query, key, value, args, kwargs):
    """fn(query, key, value, *args, **kwargs) as one jitted program per (fn, options, shapes),
    the array options traced."""
    split = _static_options(args, kwargs)
    if split is None:  # one jitted computation, the options as its constants
        return jax.jit(lambda q, k, v: fn(q, k, v, *args, **kwargs))(query, key, value)
    return _jitted(fn, query, key, value, *split[:2], static=split[2])


def jitted_reference(query, key, value, *args, **kwargs):
    """`reference.attention` as one jitted program per (options, shapes), the array options
    traced: for a check whose shapes no other check of its file shares (sharded and ring
    tests), one compilation instead of one per operation, eagerly (~35 for a forward). Where
    many checks share a shape, the eager reference, whose small programs they share, is
    cheaper (assert_attention_close). The whole batch at once: not for problems large enough
    that reference_attention splits them by batch entry."""
    return _jit_with_options(reference.attention, query, key, value, args, kwargs)


def reference_attention(query, key, value, *args, return_residual=False, p_dtype=None,
                        implementation=None, **kwargs):
    """`reference.attention`, one batch entry at a time when the problem is large: the same
    result bit for bit, with less memory live at once. A B = 3, T = 2100 check of the Hopper
    tests ran 16 workers out of an 80 GB GPU; on the CPU its peak growth is 1.25 GiB this way
    against 1.94 GiB in one piece. `implementation` is ignored, as by the reference."""
    del implementation
    *lead, t, n, _ = np.shape(query)
    b = lead[0] if lead else 1
    if b == 1 or b * n * t * np.shape(key)[-3] <= _SPLIT_LOGITS:
        return reference.attention(query, key, value, *args, return_residual=return_residual,
                                   p_dtype=p_dtype, **kwargs)
    a = _validate.normalize(query, key, value, *args, **kwargs)

    def entry(x, i):  # bias and mask may broadcast over the batch (the rest has entry i)
        return None if x is None else x if x.shape[0] == 1 else x[i:i + 1]

    parts = [reference.attention(
        a.query[i:i + 1], a.key[i:i + 1], a.value[i:i + 1], entry(a.bias, i), entry(a.mask, i),
        scale=a.scale, is_causal=a.is_causal, local_window_size=a.window,
        query_seq_lengths=entry(a.query_seq_lengths, i),
        key_value_seq_lengths=entry(a.key_value_seq_lengths, i),
        query_segment_ids=entry(a.query_segment_ids, i),
        key_value_segment_ids=entry(a.key_value_segment_ids, i),
        logits_soft_cap=a.soft_cap or None, sinks=a.sinks,
        diagonal_alignment="bottom_right" if a.bottom_right else "top_left",
        return_residual=True, p_dtype=p_dtype)
        for i in range(b)]
    out = jnp.concatenate([o for o, _ in parts]).reshape(a.out_shape)
    if not return_residual:
        return out
    return out, jnp.concatenate([lse for _, lse in parts]).reshape(a.out_shape[:-1])


def finite_max_abs(x) -> float:
    """The largest finite |x| (0 for none)."""
    x = np.abs(np.asarray(x, np.float64))
    return float(np.max(x, where=np.isfinite(x), initial=0.0))


def _reference_terms(attention, query, key, value, *args, **kwargs):
    """What assert_attention_close compares with, from the float32 reference `attention` of the
    inputs upcast: (out, lse), and for low-precision inputs error_budget's terms, the output
    with P and itself rounded to their dtype and the output with |V| (None for float32)."""
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (query, key, value))
    out, lse = attention(q32, k32, v32, *args, return_residual=True, **kwargs)
    dtype = jnp.asarray(query).dtype
    if dtype == jnp.float32:
        return out, lse, None, None
    rounded = attention(q32, k32, v32, *args, p_dtype=dtype, **kwargs).astype(dtype)
    magnitude = attention(q32, k32, jnp.abs(v32), *args, **kwargs)
    return out, lse, rounded, magnitude


# _reference_terms of the reference, for _jit_with_options (this one object its static key):
# low-precision inputs' three references as one program, one compilation (~0.3 s on 2 CPU cores)
# where three jitted references took three (~0.6 s).
_jitted_reference_terms = functools.partial(_reference_terms, reference.attention)


def assert_attention_close(out, query, key, value, *args, nan_rows=False, jit_reference=False,
                           **kwargs):
    """Checks `out` against the float32 reference with the error-ratio rule: a float32 result
    must match to ~1e-5 relative; a low-precision one may err by at most ~2x what the
    reference itself errs when it rounds P and the output to the input dtype, at least one ulp
    of each element and what rounding every P can move it (`reference.error_budget`). Returns
    the reference's lse ([B, T, N], float32) for callers that check it too.

    NaN never passes, except with `nan_rows` (inputs holding NaN or Inf): then the output rows
    (one query of one head) holding NaN must be exactly the reference's, the rows where a NaN
    or +inf logit is visible, and every other row is checked as above.

    `jit_reference`: the reference as one jitted program (as `jitted_reference`; for
    low-precision inputs, with the budget's two other references), for a check whose shapes no
    other check shares; else eagerly, its small programs shared by checks of the same shapes."""
    if jit_reference:
        terms = _jit_with_options(_jitted_reference_terms, query, key, value, args, kwargs)
    else:
        terms = _reference_terms(reference_attention, query, key, value, *args, **kwargs)
    ref, ref_lse, rounded, magnitude = terms
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    ref_nan = np.isnan(ref).any(axis=-1, keepdims=True)
    out_nan = np.isnan(out).any(axis=-1, keepdims=True)
    if nan_rows:
        np.testing.assert_array_equal(out_nan, ref_nan, "NaN rows differ from the reference's")
    else:
        assert not out_nan.any(), "NaN in output"
    out, ref = np.where(ref_nan, 0.0, out), np.where(ref_nan, 0.0, ref)
    dtype = jnp.asarray(query).dtype
    if dtype == jnp.float32:
        # float32 rounding of a logit x moves exp(x) by ~eps * |x|: the budget grows with the
        # largest logit, bias included (x10 inputs give logits in the hundreds, test_large_bias
        # biases of 1e4).
        q64, k64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (query, key))
        if q64.ndim == 3:
            q64, k64 = q64[None], k64[None]
        group = q64.shape[2] // k64.shape[2]
        scale = kwargs.get("scale") or 1 / np.sqrt(q64.shape[-1])
        logits = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k64, group, axis=2)) * scale
        bias = args[0] if args else kwargs.get("bias")
        bias_size = 0.0 if bias is None else finite_max_abs(np.asarray(bias, np.float64))
        logit_size = max(1.0, finite_max_abs(logits) + bias_size)
        bound = 2e-5 * (np.max(np.abs(ref), initial=0.0) + 1) * logit_size
    else:
        rounded = np.where(ref_nan, 0.0, np.asarray(rounded, np.float64))
        magnitude = np.where(ref_nan, 0.0, np.asarray(magnitude, np.float64))
        bound = reference.error_budget(ref, rounded, dtype, magnitude)
    errors = np.abs(out - ref)
    err, err_bound = reference.worst_against_budget(errors, bound)
    assert err <= err_bound, (f"error {err:.3g} exceeds its bound {err_bound:.3g} "
                              f"(max error {np.max(errors):.3g})")
    return np.asarray(ref_lse)


def gradient_nan_rows(q, k, *args, **kwargs):
    """The rows our gradients must hold NaN in: dq [B, T, N] where a row sees a NaN or +inf
    logit (a NaN row), dk and dv [B, S, K] where a NaN row sees the key."""
    a = _validate.normalize(q, k, k, *args, **kwargs)
    b, t, n, _ = a.query.shape
    s, kv = a.key.shape[1], a.key.shape[2]
    q64, k64 = (np.asarray(x, np.float64) for x in (a.query, a.key))
    with np.errstate(invalid="ignore", over="ignore"):
        logits = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k64, n // kv, axis=2)) * a.scale
        if a.bias is not None:
            logits = logits + np.asarray(a.bias, np.float64)
    seen = np.broadcast_to(np.asarray(reference.visibility(
        t, s, batch=b, is_causal=a.is_causal, window=a.window, q_lens=a.query_seq_lengths,
        kv_lens=a.key_value_seq_lengths, mask=a.mask, q_segment_ids=a.query_segment_ids,
        kv_segment_ids=a.key_value_segment_ids)), logits.shape)
    bad_row = (seen & ~(np.isfinite(logits) | np.isneginf(logits))).any(-1)  # [B, N, T]
    bad_key = (seen & bad_row[..., None]).reshape(b, kv, n // kv, t, s).any((2, 3))  # [B, K, S]
    return bad_row.transpose(0, 2, 1), bad_key.transpose(0, 2, 1)


def run_cuda_forward(q, k, v, *args, **kwargs):
    """(out, lse) of attention on our CUDA kernels, jitted, after poisoning freed memory so
    that an unwritten output element shows up as NaN (asserted finite)."""
    out_like = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    poison(*out_like)
    out, lse = jax.jit(lambda q, k, v: jax_flashattn.attention(
        q, k, v, *args, implementation="cuda", return_residual=True, **kwargs))(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all(), "unwritten or NaN output"
    return out, lse


def check_cuda_forward(q, k, v, *args, **kwargs):
    """run_cuda_forward, then out and lse against the float32 reference."""
    out, lse = run_cuda_forward(q, k, v, *args, **kwargs)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, *args, **kwargs))


def assert_lse_close(lse, lse_ref):
    """lse [B, T, N] against the reference's: -inf exactly where it is, close elsewhere."""
    lse = np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=2e-3, atol=2e-3)


def hopper():
    """Whether the first device runs the Hopper (sm_90a) kernels of this install."""
    device = jax.devices()[0]
    # Architectures as the build was given them: "90a", or with a suffix such as "90a-real".
    archs = {arch.split("-")[0] for arch in jax_flashattn.cuda_architectures()}
    return device.compute_capability == "9.0" and "90a" in archs


def use_family(name: str, monkeypatch) -> str:
    """Sends a GPU test's calls to kernel family `name` and returns the family's name as
    forward_kernel and backward_kernel report it: "sm90" (the Hopper kernels; the test is
    skipped off Hopper), or "sm80..." (the mma.sync family, through JAX_FLASHATTN_DISABLE_SM90;
    "sm80_cp_async" also keeps its forward's K/V loads on cp.async on Hopper, any other suffix
    is the caller's own)."""
    if name == "sm90":
        if not hopper():
            pytest.skip("the Hopper kernels need an sm_90a build on an H100/H200")
    else:
        monkeypatch.setenv("JAX_FLASHATTN_DISABLE_SM90", "1")
    if name == "sm80_cp_async":
        monkeypatch.setenv("JAX_FLASHATTN_SM80_CP_ASYNC", "1")
    return name.split("_")[0]


# Gradients against the float32 reference (the CPU tests' rules).

def grads(fn, q, k, v, bias, d_out, *args, **kwargs):
    """(out, dq, dk, dv, dbias) of fn(q, k, v, bias, *args, **kwargs) for cotangent d_out."""
    if bias is None:
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None, *args, **kwargs), q, k, v)
        return (out, *vjp(d_out), None)
    out, vjp = jax.vjp(lambda q, k, v, b: fn(q, k, v, b, *args, **kwargs), q, k, v, bias)
    return (out, *vjp(d_out))


def reference_grads(q, k, v, bias, d_out, *args, **kwargs):
    """Float32 reference gradients (inputs upcast), cast back to the inputs' dtypes."""
    f32 = [None if x is None else jnp.asarray(x, jnp.float32) for x in (q, k, v, bias, d_out)]
    split = _static_options(args, kwargs)
    if split is None:  # one jitted computation, the options as its constants
        return jax.jit(lambda *a: grads(reference.attention, *a, *args, **kwargs))(*f32)
    return _jitted_reference_grads(*f32, *split[:2], static=split[2])


def assert_grads_close(got, want, *, normwise=None, name=""):
    """float32: max error <= 1e-4 * (max |want| + 1). Low precision: normwise relative error."""
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert np.isfinite(got).all(), f"{name}: non-finite gradient"
    if normwise is None:
        err = np.max(np.abs(got - want), initial=0.0)
        bound = 1e-4 * (np.max(np.abs(want), initial=0.0) + 1)
        assert err <= bound, f"{name}: max error {err:.3g} exceeds {bound:.3g}"
    else:
        err = np.linalg.norm(got - want)
        bound = normwise * np.linalg.norm(want) + 1e-6
        assert err <= bound, f"{name}: normwise error {err:.3g} exceeds {bound:.3g}"


def assert_dsinks_close(got, q, k, v, bias, sinks, d_out, *, relative, **kwargs):
    """Low-precision d sinks against the float32 reference. d sinks[n] = -sum over rows of
    P_sink D, with D = dO . O of either sign: the terms cancel, so the rounding of O to
    bf16/fp16 is measured against the sum of their magnitudes, not against the cancelled sum
    (a missing or wrong gradient is off by about that sum)."""
    f32 = [None if x is None else jnp.asarray(x, jnp.float32)
           for x in (q, k, v, bias, sinks, d_out)]
    want = jax.jit(lambda *a: jax.vjp(
        lambda s: reference.attention(*a[:4], sinks=s, **kwargs), a[4])[1](a[5])[0])(*f32)
    out, lse = reference.attention(*f32[:4], sinks=f32[4], return_residual=True, **kwargs)
    delta = jnp.einsum("...tnh,...tnh->...tn", f32[5], out)
    magnitude = jnp.sum(jnp.exp(f32[4] - lse) * jnp.abs(delta), axis=tuple(range(lse.ndim - 1)))
    error = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = relative * np.linalg.norm(np.asarray(magnitude, np.float64))
    assert error <= bound, f"dsinks: normwise error {error:.3g} exceeds {bound:.3g}"


def jaxpr_sizes(jaxpr):
    """(elements of its largest output, primitive name) of every equation of a jaxpr and of the
    jaxprs inside them."""
    for eqn in jaxpr.eqns:
        yield (max((int(np.prod(var.aval.shape)) for var in eqn.outvars), default=0),
               str(eqn.primitive))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from jaxpr_sizes(sub)



def reads_e4m3_in_the_kernel(fn, *args) -> bool:
    """Whether the compiled fn hands e4m3 operands to our forward custom call (the kernels
    read an e4m3 cache as stored), rather than converting them first."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    calls = [line for line in text.splitlines()
             if f'custom_call_target="{_ffi.FORWARD_TARGET}"' in line]
    return bool(calls) and all("f8e4m3fn[" in line for line in calls)
