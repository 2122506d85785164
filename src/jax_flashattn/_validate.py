"""Trace-time validation and normalisation of `attention`'s arguments.

Every bad input raises a `ValueError` or `TypeError` that names the argument and what it got,
before anything is lowered. Nothing here reads the values of a JAX array, so it all runs under
`jit`; only host (numpy or Python) sequence lengths have their values checked.
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
    window: tuple[int, int] | None  # each side at most MAX_WINDOW_SIDE
    out_shape: tuple[int, ...]  # the caller's query shape: [B, T, N, H] or [T, N, H]
    # int32 [B, T] and [B, S], both or neither: query t sees key s only where they are equal.
    query_segment_ids: jax.Array | None = None
    key_value_segment_ids: jax.Array | None = None
    # The logits' soft-cap, cap tanh(s / cap) before bias and masks; 0.0 for none.
    soft_cap: float = 0.0
    # diagonal_alignment="bottom_right": query t sits at position t + S - T for the causal
    # mask and the window (the diagonal_shift below), with seq lengths at t + kv_len - q_len of
    # its batch entry (diagonal_shifts).
    bottom_right: bool = False
    # float32 [N]: one logit per query head that every row's softmax takes as a key with value
    # 0 (attention sinks).
    sinks: jax.Array | None = None
    # float32 [B, N]: ALiBi, whose term -slope |t + shift - s| joins the bias (shift as the
    # window's: diagonal_shifts).
    alibi_slopes: jax.Array | None = None

    @property
    def zero_size(self) -> bool:
        """Whether B, T, S, N or H is 0: then every output is empty or, for S = 0, that of
        rows that see no key, known without running a kernel."""
        b, t, n, h = self.query.shape
        return min(b, t, self.key.shape[1], n, h) == 0

    @property
    def diagonal_shift(self) -> int:
        """S - T with bottom-right alignment, 0 with top-left: query t's position (without
        seq lengths; with them, align_window_to_lengths)."""
        return self.key.shape[1] - self.query.shape[1] if self.bottom_right else 0

    @property
    def align_window_to_lengths(self) -> bool:
        """Whether the window (and ALiBi's diagonal) moves per batch entry: bottom-right
        alignment of a causal mask, a window or ALiBi with seq lengths puts query t of entry b
        at t + kv_len_b - q_len_b (cuDNN's BOTTOM_RIGHT), which the kernels take as an option of
        the call (ffi/params.h). The lengths are traced, so even T == S does not say that the
        shift is 0."""
        return (self.bottom_right
                and (self.is_causal or self.window is not None or self.alibi_slopes is not None)
                and (self.query_seq_lengths is not None
                     or self.key_value_seq_lengths is not None))

    def diagonal_shifts(self):
        """Query t's position is t plus this: int32 [B] kv_len - q_len under
        align_window_to_lengths (the lengths clamped to [0, S] and [0, T] as the kernels take
        them, S or T where absent), else the int diagonal_shift."""
        if not self.align_window_to_lengths:
            return self.diagonal_shift
        b, t = self.query.shape[:2]
        s = self.key.shape[1]
        q_len = t if self.query_seq_lengths is None else jnp.clip(self.query_seq_lengths, 0, t)
        kv_len = (s if self.key_value_seq_lengths is None
                  else jnp.clip(self.key_value_seq_lengths, 0, s))
        return jnp.broadcast_to(jnp.asarray(kv_len - q_len, jnp.int32), (b,))

    @property
    def kernel_window(self) -> tuple[int | None, int | None]:
        """(left, right) with None for an unbounded side, as the kernels take it (query t sees
        key s iff t - left <= s <= t + right): causal attention is right <= 0, and bottom-right
        alignment moves both bounded sides by diagonal_shift (the left one may go negative),
        except under align_window_to_lengths, where the kernels move them per batch entry."""
        return self.kernel_window_at(0 if self.align_window_to_lengths else self.diagonal_shift)

    def kernel_window_at(self, shift: int) -> tuple[int | None, int | None]:
        """kernel_window with the queries at t + shift: for ring attention, whose shards'
        S - T is not the sequences'."""
        return kernel_window(self.window, self.is_causal, shift)

    @property
    def alibi_shift(self) -> int:
        """The diagonal ALiBi measures from, as the kernels take it: diagonal_shift, or 0 where
        the kernels move it per batch entry (align_window_to_lengths)."""
        return 0 if self.align_window_to_lengths else self.diagonal_shift

    @property
    def aligned(self) -> bool:
        """Whether the alignment may move any bound: bottom-right, causal or a window, and
        T != S or seq lengths."""
        return ((self.diagonal_shift != 0 and (self.is_causal or self.window is not None))
                or self.align_window_to_lengths)


def kernel_window(window, is_causal: bool, shift: int = 0) -> tuple[int | None, int | None]:
    """(left, right) as the kernels take it, None for an unbounded side, from a checked window
    (or None) and is_causal, with the queries at t + shift: query t sees key s iff
    t + shift - left <= s <= t + shift + right (causal: right <= 0 before the shift)."""
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return (None if left is None else left - shift, None if right is None else right + shift)


def _as_array(x, name: str) -> jax.Array:
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _check_qkv(query, key, value, fp8_kv: bool = False, fp8_q: bool = False):
    """fp8_kv: key and value of float8_e4m3fn beside a bfloat16 or float16 query; fp8_q: the
    query too (the caller has checked their dtypes)."""
    checked = () if fp8_q else (("query", query),) if fp8_kv else (
        ("query", query), ("key", key), ("value", value))
    for name, x in checked:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array (bfloat16, float16 or "
                            f"float32), got {_describe(x)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not fp8_kv and not (key.dtype == value.dtype == query.dtype):
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


# Integer dtypes every value of which fits int32: their lengths cast to int32 exactly.
_INT32_SAFE_DTYPES = tuple(np.dtype(d) for d in (np.int8, np.int16, np.int32, np.uint8, np.uint16))
_INT32 = np.iinfo(np.int32)


def host_integers(x, name: str) -> np.ndarray:
    """Host (numpy or Python) integers (lengths, segment ids) as int32, their values checked to
    fit: np.array([5, 7]) is int64, and its values are known here, so no wider dtype is refused
    for its width alone."""
    x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        return x  # refused by the dtype check that follows, with the other non-integer inputs
    if x.size and not _INT32.min <= int(x.min()) <= int(x.max()) <= _INT32.max:
        raise ValueError(f"{name} values must fit int32, got values from {int(x.min())} to "
                         f"{int(x.max())}")
    return x.astype(np.int32)


def _int32_array(x, name: str, shape: tuple[int, ...], meaning: str, noun: str) -> jax.Array:
    """An integer operand (lengths, segment ids) of `shape` as int32; TypeError or ValueError
    naming it otherwise. `meaning` says what its shape holds, `noun` what its values are."""
    if not isinstance(x, jax.Array):
        x = host_integers(x, name)
    x = _as_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape {shape}, got {_describe(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({meaning}), got {_describe(x)}")
    if x.dtype not in _INT32_SAFE_DTYPES:
        # A JAX array's values are unknown at trace time, and casting wraps them around.
        raise TypeError(f"{name} must be int32 (or int8, int16, uint8, uint16, which fit it), got "
                        f"{_describe(x)}, whose values could wrap around in int32 and cannot be "
                        f"checked at trace time: pass int32 {noun}")
    return x.astype(jnp.int32)


def _seq_lengths(x, name: str, batch: int) -> jax.Array | None:
    if x is None:
        return None
    return _int32_array(x, name, (batch,), "one length per batch entry", "lengths")


def _segment_ids(x, name: str, shape: tuple[int, ...], unbatched: bool) -> jax.Array:
    """Segment ids as int32 `shape` ([B, T] or [B, S]); [T] / [S] when the call is unbatched."""
    position = "query" if name.startswith("query") else "key"
    meaning = f"one id per {position} position{'' if unbatched else ' of each batch entry'}"
    given = shape[1:] if unbatched else shape
    return _int32_array(x, name, given, meaning, "ids").reshape(shape)


def segment_ids(query_segment_ids, key_value_segment_ids, *, batch: int, q_len: int,
                kv_len: int, unbatched: bool):
    """Both ids checked and as int32 [B, T] and [B, S], or (None, None); ValueError naming the
    missing one when only one is given."""
    if query_segment_ids is None and key_value_segment_ids is None:
        return None, None
    for name, x, other in (("query_segment_ids", query_segment_ids, "key_value_segment_ids"),
                           ("key_value_segment_ids", key_value_segment_ids, "query_segment_ids")):
        if x is None:
            raise ValueError(f"{name} is missing: segment ids need both query_segment_ids and "
                             f"key_value_segment_ids, and only {other} was given")
    return (_segment_ids(query_segment_ids, "query_segment_ids", (batch, q_len), unbatched),
            _segment_ids(key_value_segment_ids, "key_value_segment_ids", (batch, kv_len),
                         unbatched))


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


# A window side this large already reaches every key of any sequence an int64 position can index,
# so a larger side is clamped to it: the FFI attribute is an int64, and the kernels add a side to
# a position (row + right), which must not overflow.
MAX_WINDOW_SIDE = 2**62


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
    return min(left, MAX_WINDOW_SIDE), min(right, MAX_WINDOW_SIDE)


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        # With H = 0 every q.k is an empty sum, 0, and any finite scale gives the same logits;
        # 1/sqrt(0) = inf would make them 0 * inf = NaN (as jax.nn's default does there).
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python number (it is compiled into the kernel), "
                        "got a traced value")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond float64, so beyond float32 as well
        value = math.inf
    except (TypeError, ValueError) as e:
        raise TypeError(f"scale must be a real number, got {scale!r}") from e
    with np.errstate(over="ignore"):
        kernel_value = np.float32(value)
    if not np.isfinite(kernel_value):
        raise ValueError(f"scale must be finite in float32, the kernels' type for it (|scale| <= "
                         f"{float(np.finfo(np.float32).max):.8g}), got {scale!r}")
    # A nonzero scale below float32's smallest subnormal rounds to 0, which the kernels take
    # (on their scale <= 0 path): it is accepted because it moves no logit by more than a few
    # float32 ulps (|q.k| < 3.4e38 in the float32 accumulator), so softmax is uniform either
    # way, and jax.nn, which multiplies the logits by the scale in float32, rounds it alike.
    return value


def _soft_cap(value) -> float:
    """The soft-cap as the kernels take it: a static real number, finite and > 0 in float32,
    or None (0.0: none)."""
    if value is None:
        return 0.0
    if isinstance(value, jax.core.Tracer):
        raise TypeError("logits_soft_cap must be a static Python number (it is compiled into "
                        "the kernel), got a traced value")
    # A Python or numpy real, or a concrete 0-d numeric array; never a bool.
    array_like = isinstance(value, (np.ndarray, jax.Array))
    if (isinstance(value, (bool, np.bool_))
            or not (isinstance(value, numbers.Real) or array_like)
            or (array_like and (np.ndim(value) != 0 or np.dtype(value.dtype).kind not in "iuf"))):
        raise TypeError(f"logits_soft_cap must be a real number or None, got {value!r}")
    try:
        cap = float(value)
    except OverflowError:  # an integer past float64's range
        cap = math.inf
    log2e = math.log2(math.e)
    with np.errstate(over="ignore", under="ignore"):
        kernel_value = np.float32(cap)
        base2 = kernel_value * np.float32(log2e)  # the kernels' base-2 cap (variant::SoftCap)
    if not (np.isfinite(base2) and kernel_value > 0):
        raise ValueError(f"logits_soft_cap must be > 0 and finite in float32 times log2(e) "
                         f"(at most {float(np.finfo(np.float32).max) / log2e:.6g}), "
                         f"got {value!r}")
    return float(kernel_value)


DIAGONAL_ALIGNMENTS = ("top_left", "bottom_right")


def check_diagonal_alignment(diagonal_alignment) -> bool:
    """Whether `diagonal_alignment` is "bottom_right"; TypeError or ValueError unless it is one
    of DIAGONAL_ALIGNMENTS."""
    if not isinstance(diagonal_alignment, str):
        raise TypeError(f"diagonal_alignment must be one of {DIAGONAL_ALIGNMENTS}, got "
                        f"{diagonal_alignment!r}")
    if diagonal_alignment not in DIAGONAL_ALIGNMENTS:
        raise ValueError(f"diagonal_alignment must be one of {DIAGONAL_ALIGNMENTS}, got "
                         f"{diagonal_alignment!r}")
    return diagonal_alignment == "bottom_right"


def _sinks(sinks, num_heads: int) -> jax.Array | None:
    """Attention sinks as float32 [N]: a real array of one logit per query head."""
    if sinks is None:
        return None
    sinks = _as_array(sinks, "sinks")
    if not (jnp.issubdtype(sinks.dtype, jnp.floating) or jnp.issubdtype(sinks.dtype, jnp.integer)):
        raise TypeError(f"sinks must be a real array of one logit per query head, got "
                        f"{_describe(sinks)}")
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape [N] = ({num_heads},), one logit per query "
                         f"head, got {_describe(sinks)}")
    return sinks.astype(jnp.float32)


def _alibi_slopes(slopes, batch: int, num_heads: int, unbatched: bool) -> jax.Array | None:
    """ALiBi slopes as float32 [B, N]: a real array of one slope per query head, [N] or (with a
    batched query) [B, N]."""
    if slopes is None:
        return None
    slopes = _as_array(slopes, "alibi_slopes")
    if not (jnp.issubdtype(slopes.dtype, jnp.floating)
            or jnp.issubdtype(slopes.dtype, jnp.integer)):
        raise TypeError(f"alibi_slopes must be a real array of one slope per query head, got "
                        f"{_describe(slopes)}")
    shapes = [(num_heads,)] + ([] if unbatched else [(batch, num_heads)])
    if slopes.shape not in shapes:
        allowed = " or ".join(f"{list(x)}" for x in shapes)
        raise ValueError(f"alibi_slopes must have shape [N] or [B, N] = {allowed}, one slope "
                         f"per query head, got {_describe(slopes)}")
    return jnp.broadcast_to(slopes.astype(jnp.float32), (batch, num_heads))


def normalize(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None,
              local_window_size=None, allow_empty=False, query_segment_ids=None,
              key_value_segment_ids=None, logits_soft_cap=None,
              diagonal_alignment="top_left", sinks=None, alibi_slopes=None,
              fp8_kv=False, fp8_q=False) -> Normalized:
    """`allow_empty`: accept T, S, N or H = 0 (B = 0 is always accepted), for a caller that
    answers such inputs without the kernels (`attention`'s Normalized.zero_size path).
    `fp8_kv`: key and value are float8_e4m3fn beside a bfloat16 or float16 query, checked by
    the caller (fp8.dequantized_inputs); `fp8_q`: the query as well (FP8 attention)."""
    query, key, value = (_as_array(x, n) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    _check_qkv(query, key, value, fp8_kv or fp8_q, fp8_q)
    out_shape = tuple(query.shape)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    b, t, n, h = query.shape
    kb, s, kv_heads, kh = key.shape
    if kb != b:
        raise ValueError(f"key batch size {kb} must match query's {b} (query "
                         f"{_describe(query)}, key {_describe(key)})")
    if kh != h:
        raise ValueError(f"key head dim {kh} must match query's {h} (query {_describe(query)}, "
                         f"key {_describe(key)})")
    if kv_heads < 1:  # N % K is undefined (jax.nn fails on it too)
        raise ValueError(f"key and value need K >= 1 heads, got key {_describe(key)}")
    if not allow_empty and min(t, s, n, h) < 1:
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
    q_ids, kv_ids = segment_ids(query_segment_ids, key_value_segment_ids, batch=b, q_len=t,
                                kv_len=s, unbatched=unbatched)

    return Normalized(
        query=query, key=key, value=value, bias=bias, mask=mask,
        query_seq_lengths=_seq_lengths(query_seq_lengths, "query_seq_lengths", b),
        key_value_seq_lengths=_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b),
        scale=_scale(scale, h), is_causal=bool(is_causal), window=_window(local_window_size),
        out_shape=out_shape, query_segment_ids=q_ids, key_value_segment_ids=kv_ids,
        soft_cap=_soft_cap(logits_soft_cap),
        bottom_right=check_diagonal_alignment(diagonal_alignment), sinks=_sinks(sinks, n),
        alibi_slopes=_alibi_slopes(alibi_slopes, b, n, unbatched))
