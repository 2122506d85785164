"""FP8 (e4m3) quantisation with a float32 descale per group, the form the paged cache's
`descale_k` / `descale_v` take: the real value is the stored e4m3 value times its descale."""

from __future__ import annotations

import jax.numpy as jnp

from jax_flashattn import _validate

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

