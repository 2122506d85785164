"""The correctness gate: a float32 reference on a slice of each case and the error-budget
verdicts on forward outputs and gradients. (Method: the package docstring.)"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn import dequantize_fp8, reference
from jax_flashattn._bench.configs import Config, DTYPES
from jax_flashattn._bench.impls import FP8_EXTRAS, PAGED_EXTRAS, Inputs
from jax_flashattn._bench.packed import CUDNN_PACKED_EXTRA


# Gradient tolerances (normwise relative error against the float32 reference).
GRAD_RTOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
# Elements of one float32 [b, n, t, S] logits tensor a reference slice may materialise (on
# the host CPU): the forward+backward check (every query row) and the forward check (at most
# FORWARD_CHECK_ROWS query rows). At least one head of one batch entry is always checked.
DEFAULT_CHECK_BUDGET = 1 << 24
FORWARD_CHECK_BUDGET = 1 << 23
FORWARD_CHECK_ROWS = 256
# Past this many logits in the forward+backward check's one kv head (8 GiB of float32: one
# 131072-token sequence of 4 query heads per kv head has 2^36), the host could not hold its
# reference and would take minutes over it: it runs on the benchmark's device instead, at
# float32's full matmul precision, GRADIENT_CHUNK_LOGITS logits of query rows at a time,
# each chunk's out and dq kept and its dk and dv summed.
CHUNKED_GRADIENT_LOGITS = 1 << 31
GRADIENT_CHUNK_LOGITS = 1 << 28




@dataclasses.dataclass
class Verdict:
    ok: bool
    detail: str
    metrics: dict


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def forward_verdict(out, exact, rounded, dtype: str, magnitude=None) -> Verdict:
    """`out` (the kernel's) against `exact` (float32 reference) with the tests' rule; `rounded`
    is the reference with P and the output rounded to `dtype` (unused for float32), `magnitude`
    each element's sum_j p_j |v_j| (reference.error_budget)."""
    out, exact = _f64(out), _f64(exact)
    scale = float(np.max(np.abs(exact), initial=0.0))
    if dtype == "fp32":
        bounds = 2e-5 * (scale + 1)
    else:
        bounds = reference.error_budget(exact, _f64(rounded), DTYPES[dtype],
                                        None if magnitude is None else _f64(magnitude))
    metrics = dict(max_err=None, bound=float(np.max(bounds, initial=0.0)), rel_err=None)
    if not np.isfinite(out).all():
        bad = int(np.size(out) - np.isfinite(out).sum())
        return Verdict(False, f"{bad} non-finite output elements", metrics)
    errors = np.abs(out - exact)
    err = float(np.max(errors, initial=0.0))
    rel = float(np.linalg.norm(out - exact) / max(np.linalg.norm(exact), 1e-30))
    worst, bound = reference.worst_against_budget(errors, bounds)
    metrics.update(max_err=err, bound=bound, rel_err=rel)
    ok = worst <= bound
    return Verdict(ok, f"err {worst:.3g} {'<=' if ok else '>'} its bound {bound:.3g} "
                       f"(max err {err:.3g}, rel {rel:.2g})", metrics)


def grad_verdict(grads: dict, ref_grads: dict, dtype: str) -> Verdict:
    """Each gradient against its float32 reference: normwise relative error <= GRAD_RTOL and
    max abs error <= 4 GRAD_RTOL max |ref|."""
    rtol = GRAD_RTOL[dtype]
    metrics, problems, parts = {}, [], []
    for name, ref in ref_grads.items():
        got, ref = _f64(grads[name]), _f64(ref)
        if not np.isfinite(got).all():
            problems.append(f"{name}: non-finite")
            metrics[name] = dict(rel_err=None, max_err=None)
            continue
        norm = max(np.linalg.norm(ref), 1e-30)
        rel = float(np.linalg.norm(got - ref) / norm)
        err = float(np.max(np.abs(got - ref), initial=0.0))
        err_rel = err / max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)
        metrics[name] = dict(rel_err=rel, max_err=err, max_err_rel=err_rel)
        parts.append(f"{name} {rel:.2g}")
        if rel > rtol or err_rel > 4 * rtol:
            problems.append(f"{name}: rel {rel:.3g} (tol {rtol:g}), max {err_rel:.3g} of max|ref| "
                            f"(tol {4 * rtol:g})")
    if problems:
        return Verdict(False, "; ".join(problems), metrics)
    return Verdict(True, "grad rel err " + ", ".join(parts), metrics)


@dataclasses.dataclass
class ReferenceSlice:
    """The float32 reference on a slice of input set 0; see the package docstring."""
    batch_index: np.ndarray
    rows: np.ndarray | None  # query rows checked (None: all)
    kv_heads: int
    exact: jax.Array
    rounded: jax.Array
    grads: dict | None
    magnitude: jax.Array | None = None  # sum_j p_j |v_j| per element (reference.error_budget)

    def take(self, cfg: "Config", x, per_query_head: bool = True):
        """The slice of a full [B, T or S, N or K, H] array that the reference covers."""
        rows = self.rows if per_query_head else None
        return _take(x, self.batch_index, rows,
                     heads=self.kv_heads * (cfg.group if per_query_head else 1))

    def take_extras(self, cfg: "Config", extras: dict) -> dict:
        """The extras (`Inputs.extras`) of the slice: bias and mask [B or 1, N or 1, T, S] at
        the checked batch entries, heads and query rows (every key), the sinks and ALiBi
        slopes at the heads,
        lengths and segment ids at the batch entries (every position: _row_visibility picks the
        rows' ids). cuDNN's lengths and offsets of the packed rows restate the segment ids, the
        pages of a paged decode row k and v, and the e4m3 copies of an e4m3 row k and v as
        its call reads them (`reference_slice` takes those as its k and v): all are left
        out."""
        heads = self.kv_heads * cfg.group
        sliced = {}
        for name, x in extras.items():
            if name == CUDNN_PACKED_EXTRA or name in PAGED_EXTRAS or name in FP8_EXTRAS:
                continue
            if name in ("bias", "mask"):
                sliced[name] = _take_logits_shaped(x, self.batch_index, self.rows, heads=heads)
            elif name in ("sinks", "alibi_slopes"):
                sliced[name] = x[:heads]
            else:
                sliced[name] = x[self.batch_index]
        return sliced


@functools.partial(jax.jit, static_argnames="heads")
def _take(x, batch_index, rows, *, heads):
    x = x[batch_index, :, :heads]
    return x if rows is None else x[:, rows]


@functools.partial(jax.jit, static_argnames="heads")
def _take_logits_shaped(x, batch_index, rows, *, heads):
    """`_take` for a [B or 1, N or 1, T or 1, S] bias or mask (a broadcast dim stays 1)."""
    if x.shape[0] > 1:
        x = x[batch_index]
    if x.shape[1] > 1:
        x = x[:, :heads]
    return x if rows is None or x.shape[2] == 1 else x[:, :, rows]


def _slice_plan(cfg: Config, budget: int, max_rows: int | None):
    """Batch entries {0, B-1}, query rows (the first and last max_rows/2, or all), and as many
    kv heads (with their query-head groups) as keep one [b, n, t, S] logits tensor in budget."""
    batch_index = np.array(sorted({0, cfg.batch - 1}), np.int32)
    rows = None
    if max_rows is not None and cfg.seqlen_q > max_rows:
        half = max_rows // 2
        rows = np.concatenate([np.arange(half), np.arange(cfg.seqlen_q - half, cfg.seqlen_q)])
    n_rows = cfg.seqlen_q if rows is None else len(rows)
    per_kv_head = len(batch_index) * cfg.group * n_rows * cfg.seqlen_k
    kv_heads = max(1, min(cfg.num_kv_heads, budget // per_kv_head))
    return batch_index, rows.astype(np.int32) if rows is not None else None, kv_heads


def _row_visibility(rows, seqlen_k, *, causal, window, q_lens, kv_lens, mask, q_ids=None,
                    kv_ids=None, shift=0):
    """bool [b or 1, 1 or n, r, S] (None where nothing is hidden): which keys query rows
    `rows` (their true positions, plus `shift` for the causal mask and the window: S - T with
    bottom-right alignment) see, by `reference.visibility`'s rules; q_lens, kv_lens, mask and
    the segment ids are already sliced to the checked batch entries (and the mask to the
    rows)."""
    if not (causal or window is not None or q_lens is not None or kv_lens is not None
            or mask is not None or q_ids is not None):
        return None
    t = rows[:, None] + shift
    s = jnp.arange(seqlen_k)[None, :]
    keep = jnp.ones((len(rows), seqlen_k), bool)
    if causal:
        keep &= s <= t
    if window is not None:
        left, right = window
        keep &= (s >= t - left) & (s <= t + right)
    keep = keep[None, None]
    if q_lens is not None:
        keep = keep & (rows[None, :] < q_lens[:, None])[:, None, :, None]
    if kv_lens is not None:
        keep = keep & (jnp.arange(seqlen_k)[None, :] < kv_lens[:, None])[:, None, None, :]
    if mask is not None:
        keep = keep & mask
    if q_ids is not None:
        keep = keep & (q_ids[:, rows, None] == kv_ids[:, None, :])[:, None]
    return keep


def _rows_attention(k, rows, extras, *, causal, window, soft_cap, shift):
    """`reference.attention` for query rows `rows` (causal, window, lengths, mask and segment
    ids mask by the rows' true positions, as the full problem would, and ALiBi is the dense
    bias of those positions; `extras` are sliced by `ReferenceSlice.take_extras`)."""
    bias = extras.get("bias")
    if extras.get("alibi_slopes") is not None:
        distance = jnp.abs(rows[:, None] + shift - jnp.arange(k.shape[1])[None, :])
        alibi = -extras["alibi_slopes"][None, :, None, None] * distance.astype(jnp.float32)
        bias = alibi if bias is None else bias.astype(jnp.float32) + alibi
    mask = _row_visibility(rows, k.shape[1], causal=causal, window=window,
                           q_lens=extras.get("query_seq_lengths"),
                           kv_lens=extras.get("key_value_seq_lengths"), mask=extras.get("mask"),
                           q_ids=extras.get("query_segment_ids"),
                           kv_ids=extras.get("key_value_segment_ids"), shift=shift)
    return functools.partial(reference.attention, bias=bias, mask=mask,
                             logits_soft_cap=soft_cap, sinks=extras.get("sinks"))


def _rounded_and_magnitude(f, q, k, v, dtype):
    """The reference `f`'s output with P rounded to `dtype` (cast to it), and with |v| (the
    error budget's sum_j p_j |v_j|)."""
    return f(q, k, v, p_dtype=DTYPES[dtype]).astype(DTYPES[dtype]), f(q, k, jnp.abs(v))


@functools.partial(jax.jit,
                   static_argnames=("causal", "window", "dtype", "soft_cap", "shift"))
def _reference_forward(q, k, v, rows, extras, *, causal, window, dtype, soft_cap, shift):
    """Exact and P-rounded reference outputs for query rows `rows` (`_rows_attention`)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    f = _rows_attention(k, rows, extras, causal=causal, window=window, soft_cap=soft_cap,
                        shift=shift)
    return (f(q, k, v), *_rounded_and_magnitude(f, q, k, v, dtype))


@functools.partial(jax.jit,
                   static_argnames=("causal", "window", "dtype", "soft_cap", "shift"))
def _reference_rows_forward_backward(q, k, v, g, rows, extras, *, causal, window, dtype,
                                     soft_cap, shift):
    """`_reference_forward` and the gradients of query rows `rows` for their cotangent g: their
    dq, and their share of dk and dv."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    f = _rows_attention(k, rows, extras, causal=causal, window=window, soft_cap=soft_cap,
                        shift=shift)
    exact, vjp = jax.vjp(f, q, k, v)
    return (exact, *_rounded_and_magnitude(f, q, k, v, dtype), *vjp(g.astype(jnp.float32)))


def _reference_by_row_chunks(cfg: Config, inputs: Inputs, q, k, v, batch_index,
                             chunk_logits: int) -> ReferenceSlice:
    """The forward+backward reference of every query row and one kv head, on the device that
    holds the inputs, `chunk_logits` logits of rows at a time (CHUNKED_GRADIENT_LOGITS)."""
    per_row = len(batch_index) * cfg.group * cfg.seqlen_k
    chunk = max(1, chunk_logits // per_row)
    options = dict(causal=cfg.causal, window=cfg.window, dtype=cfg.dtype, soft_cap=cfg.soft_cap,
                   shift=cfg.diagonal_shift if cfg.bottom_right else 0)
    parts, dk, dv = [], 0.0, 0.0
    with jax.default_matmul_precision("highest"):
        for r0 in range(0, cfg.seqlen_q, chunk):
            rows = np.arange(r0, min(r0 + chunk, cfg.seqlen_q), dtype=np.int32)
            rows_slice = ReferenceSlice(batch_index, rows, 1, None, None, None)
            *outputs, dk_rows, dv_rows = _reference_rows_forward_backward(
                rows_slice.take(cfg, q), rows_slice.take(cfg, k, False),
                rows_slice.take(cfg, v, False), rows_slice.take(cfg, inputs.g), rows,
                rows_slice.take_extras(cfg, inputs.extras), **options)
            parts.append(outputs)
            dk, dv = dk + dk_rows, dv + dv_rows
    exact, rounded, magnitude, dq = (jnp.concatenate(x, axis=1) for x in zip(*parts))
    return ReferenceSlice(batch_index, None, 1, exact, rounded, dict(dq=dq, dk=dk, dv=dv),
                          magnitude)


@functools.partial(jax.jit,
                   static_argnames=("causal", "window", "dtype", "soft_cap", "alignment"))
def _reference_forward_backward(q, k, v, g, extras, *, causal, window, dtype, soft_cap,
                                alignment):
    """Every query row: the options go to `reference.attention` as its own arguments."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    f = functools.partial(reference.attention, is_causal=causal, local_window_size=window,
                          logits_soft_cap=soft_cap, diagonal_alignment=alignment, **extras)
    exact, vjp = jax.vjp(f, q, k, v)
    grads = dict(zip(("dq", "dk", "dv"), vjp(g.astype(jnp.float32))))
    return (exact, *_rounded_and_magnitude(f, q, k, v, dtype), grads)


def _reference_device():
    """The references run on the host's CPU backend: no GPU compile (or autotuning) per shape,
    and nothing on the GPU that is being measured."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


def reference_slice(cfg: Config, inputs: Inputs, with_grads: bool,
                    budget: int = DEFAULT_CHECK_BUDGET) -> ReferenceSlice:
    """Forward: up to FORWARD_CHECK_ROWS query rows against all keys. Forward+backward: every
    row (dk and dv sum over all of them) of fewer heads. Both on the host CPU, except a
    forward+backward too large for it (CHUNKED_GRADIENT_LOGITS). An e4m3 row's
    reference reads the K and V its call reads, the e4m3 values times their descales: the
    rounding to e4m3 is the cache's, not the kernel's, and the gate judges the kernel."""
    q, k, v = inputs.sets[0]
    if cfg.kv_fp8:
        k = dequantize_fp8(inputs.extras["key_e4m3"], inputs.extras["descale_k"])
        v = dequantize_fp8(inputs.extras["value_e4m3"], inputs.extras["descale_v"])
    if with_grads:
        batch_index, rows, kv_heads = _slice_plan(cfg, budget, None)
        if len(batch_index) * cfg.group * cfg.seqlen_q * cfg.seqlen_k > CHUNKED_GRADIENT_LOGITS:
            plan = _reference_by_row_chunks(cfg, inputs, q, k, v, batch_index,
                                            GRADIENT_CHUNK_LOGITS)
            jax.block_until_ready((plan.exact, plan.grads))
            return plan
    else:
        batch_index, rows, kv_heads = _slice_plan(cfg, FORWARD_CHECK_BUDGET,
                                                  FORWARD_CHECK_ROWS)
    plan = ReferenceSlice(batch_index, rows, kv_heads, None, None, None)
    sliced = (plan.take(cfg, q), plan.take(cfg, k, False), plan.take(cfg, v, False))
    extras = plan.take_extras(cfg, inputs.extras)
    device = _reference_device()
    if with_grads:
        args = jax.device_put(sliced + (plan.take(cfg, inputs.g), extras), device)
        plan.exact, plan.rounded, plan.magnitude, plan.grads = _reference_forward_backward(
            *args, causal=cfg.causal, window=cfg.window, dtype=cfg.dtype, soft_cap=cfg.soft_cap,
            alignment="bottom_right" if cfg.bottom_right else "top_left")
    else:
        all_rows = np.arange(cfg.seqlen_q, dtype=np.int32) if rows is None else rows
        args = jax.device_put(sliced + (all_rows, extras), device)
        plan.exact, plan.rounded, plan.magnitude = _reference_forward(
            *args, causal=cfg.causal, window=cfg.window, dtype=cfg.dtype, soft_cap=cfg.soft_cap,
            shift=cfg.diagonal_shift if cfg.bottom_right else 0)
    jax.block_until_ready((plan.exact, plan.rounded, plan.grads))
    return plan


def check_outputs(cfg: Config, outputs, ref: ReferenceSlice) -> Verdict:
    """`outputs` = (out,) or (out, dq, dk, dv) of the full-size call on input set 0."""
    verdict = forward_verdict(ref.take(cfg, outputs[0]), ref.exact, ref.rounded, cfg.dtype,
                              ref.magnitude)
    if not verdict.ok or ref.grads is None:
        return verdict
    grads = dict(dq=ref.take(cfg, outputs[1]), dk=ref.take(cfg, outputs[2], False),
                 dv=ref.take(cfg, outputs[3], False))
    g_verdict = grad_verdict(grads, ref.grads, cfg.dtype)
    return Verdict(g_verdict.ok, f"{verdict.detail}; {g_verdict.detail}",
                   dict(verdict.metrics, grads=g_verdict.metrics))
