"""Trace-time validation and normalisation of `attention`'s arguments.

Every bad input raises a `ValueError` or `TypeError` that names the argument and what it got,
before anything is lowered; nothing here looks at array values, so it all runs under `jit`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Bias in one of these is read by the kernels as it is; any other float dtype is cast to float32.
_KERNEL_BIAS_DTYPES = SUPPORTED_DTYPES


@dataclasses.dataclass(frozen=True)
class Normalized:
    """Arguments in the kernels' form: 4-D [B, T, N, H] tensors, 4-D bias/mask, int32 lengths."""
    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    query_seq_lengths: jax.Array | None
    key_value_seq_lengths: jax.Array | None
    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    out_shape: tuple[int, ...]  # the caller's query shape: [B, T, N, H] or [T, N, H]

    @property
    def kernel_window(self) -> tuple[int | None, int | None]:
        """(left, right) with None for an unbounded side; causal attention is right <= 0."""
        left, right = self.window if self.window is not None else (None, None)
        if self.is_causal:
            right = 0 if right is None else min(right, 0)
        return left, right


def _as_array(x, name: str) -> jax.Array:
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _check_qkv(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array (bfloat16, float16 or "
                            f"float32), got {_describe(x)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not (key.dtype == value.dtype == query.dtype):
        raise TypeError("query, key and value must share one dtype, got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")
    if query.ndim not in (3, 4):
        raise ValueError(f"query must be [B, T, N, H] or [T, N, H], got {_describe(query)}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have the rank of query ({query.ndim}), got "
                             f"{_describe(x)}")
    if key.shape != value.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}, got "
                         f"{tuple(value.shape)}")


def _broadcastable(x, name: str, target: tuple[int, ...]) -> jax.Array:
    """Left-pads x to rank 4 and checks every dim is 1 or the target's (B, N, T, S)."""
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims, broadcastable to [B, N, T, S] = "
                         f"{target}, got {_describe(x)}")
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    for got, want in zip(x.shape, target):
        if got not in (1, want):
            raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {target}, got "
                             f"{_describe(x)}")
    return x


def _seq_lengths(x, name: str, batch: int) -> jax.Array | None:
    if x is None:
        return None
    x = _as_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape ({batch},), got {_describe(x)}")
    if x.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one length per batch entry), got "
                         f"{_describe(x)}")
    return x.astype(jnp.int32)


IMPLEMENTATIONS = (None, "cpu", "cuda", "xla", "cudnn")


def check_options(*, is_causal=False, implementation=None, deterministic_backward=False):
    """The static options of `attention`, checked where they are given (also when
    jax_flashattn.flax.make_attention_fn fixes them, before any call)."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if not isinstance(deterministic_backward, bool):
        raise TypeError(f"deterministic_backward must be a bool, got {deterministic_backward!r}")


def _window(local_window_size) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    if (not isinstance(local_window_size, (tuple, list)) or len(local_window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                       for w in local_window_size)):
        raise TypeError("local_window_size must be an int or a pair of ints (left, right), got "
                        f"{local_window_size!r}")
    left, right = (int(w) for w in local_window_size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size sides must be >= 0, got {(left, right)}")
    return left, right


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python number (it is compiled into the kernel), "
                        "got a traced value")
    try:
        value = float(scale)
    except (TypeError, ValueError) as e:
        raise TypeError(f"scale must be a real number, got {scale!r}") from e
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def normalize(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None,
              local_window_size=None) -> Normalized:
    query, key, value = (_as_array(x, n) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    _check_qkv(query, key, value)
    out_shape = tuple(query.shape)
    if query.ndim == 3:
        query, key, value = query[None], key[None], value[None]
    b, t, n, h = query.shape
    kb, s, kv_heads, kh = key.shape
    if kb != b:
        raise ValueError(f"key batch size {kb} must match query's {b} (query "
                         f"{_describe(query)}, key {_describe(key)})")
    if kh != h:
        raise ValueError(f"key head dim {kh} must match query's {h} (query {_describe(query)}, "
                         f"key {_describe(key)})")
    if min(t, s, n, kv_heads, h) < 1:
        raise ValueError(f"query and key need T, S, N, K, H >= 1, got query {_describe(query)}, "
                         f"key {_describe(key)}")
    if n % kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kv_heads}")
    check_options(is_causal=is_causal)

    target = (b, n, t, s)
    if bias is not None:
        bias = _as_array(bias, "bias")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a floating-point array, got {_describe(bias)}")
        bias = _broadcastable(bias, "bias", target)
        if bias.dtype not in _KERNEL_BIAS_DTYPES:
            bias = bias.astype(jnp.float32)
    if mask is not None:
        mask = _as_array(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array (True = keep), got {_describe(mask)}")
        mask = _broadcastable(mask, "mask", target)

    return Normalized(
        query=query, key=key, value=value, bias=bias, mask=mask,
        query_seq_lengths=_seq_lengths(query_seq_lengths, "query_seq_lengths", b),
        key_value_seq_lengths=_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b),
        scale=_scale(scale, h), is_causal=bool(is_causal), window=_window(local_window_size),
        out_shape=out_shape)
