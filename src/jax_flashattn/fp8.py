"""FP8 (e4m3) values with a float32 descale per group (the real value is the stored e4m3
value times its descale): the quantisation helpers, the descales `attention` and the paged
cache take per (batch entry, kv head), and `attention`'s FP8 inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flashattn import _ffi, _forward_only, _validate

E4M3 = jnp.float8_e4m3fn
# The largest finite e4m3fn value: amax scaling maps each group's largest magnitude onto it.
E4M3_MAX = float(jnp.finfo(E4M3).max)


def _axes(axis, ndim: int, name: str) -> tuple[int, ...]:
    """`axis` (an int or a sequence of them) as sorted non-negative axes of a rank-`ndim` array
    named `name`; a ValueError otherwise."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if not axes or any(not isinstance(a, int) or not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axis must be axes of {name} (rank {ndim}), got {axis!r}")
    return tuple(sorted({a % ndim for a in axes}))


def quantize_fp8(x, axis=(1, 3), descale=None):
    """(values, descale): `x` as float8_e4m3fn values and their float32 descale, one per group
    of the elements that share every index outside `axis` (for keys or values [B, S, K, H] and
    the default axis (1, 3), one per (batch entry, kv head): a [B, K] descale), so that
    values * descale approximates x (relative error at most 2^-4 per element in e4m3's normal
    range).

    descale None: amax scaling, descale = max |x| over the group / 448 (e4m3's largest value),
    1 for a group of zeros. A given descale (broadcastable to the groups' shape, e.g. the [B, K]
    of a cache the new tokens join) is used as it is, the values clipped to +-448 where x
    exceeds it. NaN stays NaN.
    """
    x = _validate._as_array(x, "x")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got {_validate._describe(x)}")
    axes = _axes(axis, x.ndim, "x")
    kept = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    x32 = x.astype(jnp.float32)
    if descale is None:
        amax = jnp.max(jnp.abs(x32), axis=axes) if x.size else jnp.zeros(kept, jnp.float32)
        descale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    else:
        descale = _validate._as_array(descale, "descale")
        if not jnp.issubdtype(descale.dtype, jnp.floating):
            raise TypeError(f"descale must be float32, got {_validate._describe(descale)}")
        try:
            descale = jnp.broadcast_to(descale.astype(jnp.float32), kept)
        except ValueError:
            raise ValueError(f"descale must broadcast to the groups' shape {kept}, got "
                             f"{_validate._describe(descale)}") from None
    scaled = x32 / jnp.expand_dims(descale, axes)
    values = jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return values, descale


def dequantize_fp8(values, descale, axis=(1, 3), dtype=jnp.float32):
    """values * descale in `dtype`: the inverse of quantize_fp8 (the descale spread back over
    `axis`)."""
    values = _validate._as_array(values, "values")
    axes = _axes(axis, values.ndim, "values")
    descale = jnp.asarray(descale, jnp.float32)
    return (values.astype(jnp.float32) * jnp.expand_dims(descale, axes)).astype(dtype)


def is_e4m3(x) -> bool:
    """Whether array x holds float8_e4m3fn values."""
    return jnp.dtype(x.dtype) == jnp.dtype(E4M3)


def group_descale(x, name: str, batch: int, kv_heads: int, unbatched: bool = False) -> jax.Array:
    """A descale as float32 [B, K] (one per batch entry and kv head) from a real scalar or a
    [B, K] array ([K] for an `unbatched` call, whose B is 1); a TypeError or ValueError naming
    it otherwise."""
    x = _validate._as_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be float32, got {_validate._describe(x)}")
    if unbatched and x.ndim == 1:
        x = x[None]
    if x.ndim == 0:
        x = jnp.broadcast_to(x, (batch, kv_heads))
    if tuple(x.shape) != (batch, kv_heads):
        raise ValueError(f"{name} must be a scalar or [B, K] = {(batch, kv_heads)}, got "
                         f"{_validate._describe(x)}")
    return x.astype(jnp.float32)


def kernels_take(query_shape, query_dtype, keys_shape, *, scale: float, has_q_lens: bool,
                 has_kv_lens: bool, switches) -> bool:
    """Whether the kernels read e4m3 keys and values of this call as they are stored (each
    value dequantised as it is loaded, the descales applied in the kernel): the CPU kernels
    for a float32, bfloat16 or float16 query; on a GPU, the split-KV decode kernels for a
    bfloat16 or float16 query on a decoding shape of head dim a multiple of 16
    (ffi/decode_plan.h's decode_fp8_kv_fits). The other conditions (no soft-cap, bias, mask,
    ALiBi, sinks or segment ids) are the caller's. keys_shape: [B, S, K, H], S the keys the
    call reaches."""
    backend = jax.default_backend()
    if backend == "cpu":
        return jnp.dtype(query_dtype) in _validate.SUPPORTED_DTYPES
    if (backend != "gpu" or not _ffi.cuda_built()
            or jnp.dtype(query_dtype) not in OUTPUT_DTYPES or query_shape[-1] % 16):
        return False
    shape = _ffi.call_shape(query_shape, keys_shape, query_dtype, scale=scale,
                            has_q_seqlens=has_q_lens, has_kv_seqlens=has_kv_lens,
                            switches=switches)
    return _ffi.plan(shape).decode_workspace_floats > 0


def attention_kernels_take(query_shape, keys_shape, out_dtype, *, scale: float,
                           has_q_lens: bool, has_kv_lens: bool, switches) -> bool:
    """Whether FP8 attention (query, key and value of float8_e4m3fn, the output of out_dtype)
    runs on the Hopper forward's e4m3 kernels as stored: a GPU whose plan for the call names
    them (head dim a multiple of 16 up to 256, TMA-addressable tensors; the other conditions,
    no soft-cap, bias, mask, ALiBi, sinks or segment ids, are the caller's). A call placed on
    the CPU by `jax.default_device` is not (the CPU kernels take FP8 attention dequantised)."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        device = jax.devices(device)[0]
    if device is None:
        device = jax.devices()[0]
    if device.platform != "gpu" or not _ffi.cuda_built():
        return False
    shape = _ffi.call_shape(query_shape, keys_shape, out_dtype, scale=scale,
                            has_q_seqlens=has_q_lens, has_kv_seqlens=has_kv_lens,
                            switches=switches, e4m3_attention=True)
    return _ffi.plan(shape, device).forward == "sm90"


# Each 32 keys of kernel_values' V^T, in the order the e4m3 k32 steps' register A operand
# takes P: column 16 a + 4 t + 2 b + c holds key 16 a + 8 b + 2 t + c (a, b, c < 2, t < 4),
# which is where the S accumulators of thread t of a quad hold that key (ffi/cuda/wgmma/
# forward_consumer.cuh pack_p).
KEY_ORDER = tuple(16 * a + 8 * b + 2 * t + c
                  for a in range(2) for t in range(4) for b in range(2) for c in range(2))


def kernel_values(value, kv_lens=None):
    """float8_e4m3fn values [..., B, S, K, H] as FP8 attention's kernels read them: V^T
    [..., B, K, H, S'] with S' = S rounded up to a multiple of 32, each 32 keys in KEY_ORDER,
    and zeros at the keys past each entry's length (kv_lens int32 [..., B], or none) and past
    S, so that P = 0 there multiplies a finite value. One pass over V (O(S H) bytes per kv
    head, beside the call's O(T S H) products)."""
    *lead, s, k, h = value.shape
    padded = -(-s // 32) * 32
    bits = jax.lax.bitcast_convert_type(value, jnp.uint8)
    if kv_lens is not None:
        keys = jnp.arange(s, dtype=jnp.int32)
        bits = jnp.where((keys < kv_lens[..., None])[..., None, None], bits, jnp.uint8(0))
    bits = jnp.pad(bits, [(0, 0)] * len(lead) + [(0, padded - s), (0, 0), (0, 0)])
    groups = bits.reshape(*lead, padded // 32, 2, 2, 4, 2, k, h)  # keys 16a + 8b + 2t + c
    n = len(lead)
    order = (*range(n), n + 5, n + 6, n, n + 1, n + 3, n + 2, n + 4)  # [K, H, group, a, t, b, c]
    return jax.lax.bitcast_convert_type(
        groups.transpose(order).reshape(*lead, k, h, padded), E4M3)


def kernel_descales(descale_k, descale_v, batch: int, kv_heads: int, unbatched: bool = False):
    """(k_descale, v_descale) as the kernels take a call on an e4m3 cache: float32 [B, K] each,
    1 where None. Any value is taken as given: the CPU kernels multiply the keys and values by
    it as they load them; the GPU decode kernels fold the key's magnitude into the softmax's
    factor and its sign (or a zero, or a NaN) into their query fragments, exactly
    (cuda::fold_key_descale).
    `unbatched`: the call's inputs had no batch dim (B = 1 here), its descales are scalars or
    [K]."""
    ones = jnp.ones((batch, kv_heads), jnp.float32)
    return tuple(ones if d is None else group_descale(d, name, batch, kv_heads, unbatched)
                 for d, name in ((descale_k, "descale_k"), (descale_v, "descale_v")))


# The output dtypes of an attention call on e4m3 queries (the first is the default).
OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
NO_GRADIENT = ("attention on float8_e4m3fn inputs is forward-only (inference): it has no "
                "gradient; train on bfloat16 or float16 inputs")


def takes_fp8(query, key, value, descale_q, descale_k, descale_v, output_dtype) -> bool:
    """Whether an `attention` call is an FP8 one (e4m3 keys and values); a ValueError for an
    FP8 option given to a call without them."""
    arrays = [_validate._as_array(x, name) for x, name in
              ((query, "query"), (key, "key"), (value, "value"))]
    if any(is_e4m3(x) for x in arrays):
        return True
    for option, name in ((descale_q, "descale_q"), (descale_k, "descale_k"),
                         (descale_v, "descale_v"), (output_dtype, "output_dtype")):
        if option is not None:
            raise ValueError(f"{name} applies to float8_e4m3fn inputs only, got query, key and "
                             f"value of {', '.join(str(jnp.dtype(x.dtype)) for x in arrays)}")
    return False


def dequantized_inputs(query, key, value, *, descale_q, descale_k, descale_v, output_dtype,
                       float32: bool):
    """(query, key, value, out_dtype) of an FP8 `attention` call: key and value e4m3, query
    e4m3 too (FP8 attention, out in output_dtype, bfloat16 by default) or bfloat16, float16
    or float32 (a quantised KV cache, out in query's dtype); each e4m3 operand times its
    descale (float32 scalars or [B, K], [K] unbatched; 1 where None, a query head taking its
    kv head's), in float32 with `float32`, else in out_dtype."""
    query, key, value = (_validate._as_array(x, n) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    if not (is_e4m3(key) and is_e4m3(value)):
        raise TypeError(f"an FP8 call takes key and value of float8_e4m3fn, got "
                        f"{jnp.dtype(key.dtype)} and {jnp.dtype(value.dtype)}")
    if is_e4m3(query):
        out_dtype = OUTPUT_DTYPES[0] if output_dtype is None else jnp.dtype(output_dtype)
        if out_dtype not in OUTPUT_DTYPES:
            raise TypeError(f"output_dtype must be bfloat16 or float16, got {output_dtype!r}")
    else:
        if jnp.dtype(query.dtype) not in _validate.SUPPORTED_DTYPES:
            raise TypeError(f"query must be float8_e4m3fn, or bfloat16, float16 or float32 "
                            f"beside an e4m3 key and value, got {jnp.dtype(query.dtype)}")
        for option, name in ((descale_q, "descale_q"), (output_dtype, "output_dtype")):
            if option is not None:
                raise ValueError(f"{name} applies to a float8_e4m3fn query only, got a "
                                 f"{jnp.dtype(query.dtype)} query")
        out_dtype = jnp.dtype(query.dtype)
    if not query.ndim == key.ndim == value.ndim or query.ndim not in (3, 4):
        raise ValueError(f"query, key and value must be [B, T, N, H], [B, S, K, H] (or "
                         f"unbatched), got {_validate._describe(query)}, "
                         f"{_validate._describe(key)} and {_validate._describe(value)}")
    unbatched = query.ndim == 3
    q, k, v = (x[None] if unbatched else x for x in (query, key, value))
    batch, kv_heads, heads = q.shape[0], k.shape[2], q.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads N={heads} must be a multiple of key/value heads "
                         f"K={kv_heads}")
    compute = jnp.float32 if float32 else out_dtype

    def scaled(x, descale, name):
        if descale is None:
            return x.astype(compute)
        d = group_descale(descale, name, batch, kv_heads, unbatched)  # [B, K]
        groups = x.reshape(*x.shape[:2], kv_heads, x.shape[2] // kv_heads, x.shape[-1])
        out = groups.astype(jnp.float32) * d[:, None, :, None, None]
        return out.reshape(x.shape).astype(compute)

    q = scaled(q, descale_q, "descale_q") if is_e4m3(query) else q.astype(compute)
    k, v = scaled(k, descale_k, "descale_k"), scaled(v, descale_v, "descale_v")
    q, k, v = (x[0] if unbatched else x for x in (q, k, v))
    return q, k, v, out_dtype


def result(out, out_dtype):
    """`attention`'s result on the dequantised inputs (out, or (out, lse)) with out in
    out_dtype and a gradient that raises: an FP8 call is forward-only."""
    if isinstance(out, tuple):
        return result(out[0], out_dtype), out[1]
    return _forward_only.identity(NO_GRADIENT, out.astype(out_dtype))
