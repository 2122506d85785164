"""Benchmark machinery shared by `benchmarks/bench_attention.py` and `python -m jax_flashattn`.

What is measured
----------------
* FLOPs: forward = 4·B·N·T·S·H (the two matmuls), halved when causal; backward = 2.5x
  forward, so forward+backward counts 3.5x forward (FlashAttention's convention, and the one
  behind the numbers in docs/performance.md). The variants preset (`variants_grid`) counts only
  the logits a call computes: each visible (t, s) pair costs 4·H per query head in the forward,
  3.5x that forward+backward, with the pairs counted exactly (`Config.visible_pairs`: each
  query row sees one interval of keys, cut by its causal and window bounds, the row's and the
  batch entry's lengths and, for the document mask, its document). Rows without such a
  restriction keep the counts above (causal: T·S/2, the convention, where the exact count is
  T(T+1)/2 for T = S, 0.01% more at T = 4096), so the preset's baselines match the standard
  grid. The bias row counts as full; GQA counts query heads, as everywhere. Decode configs
  also report the bytes of K and V
  read, and the benchmark script sets that rate against the device's copy bandwidth
  (`copy_bandwidth`: cudaMemcpy device to device, bytes read plus written), measured before and
  after the cases (why that yardstick: docs/decisions/decode-benchmark-yardstick.md).
* "fwdbwd" is one `jax.vjp` of attention with a fixed random cotangent g: the forward, then
  dq, dk, dv. That is `jax.value_and_grad` of the scalar loss sum(out * g) minus the loss's own
  reduction, which would add the same memory pass to every implementation.

How it is timed (`prepare`, `time_interleaved`)
-----------------------------------------------
* One timed run executes one jitted program: a `lax.fori_loop` with a static trip count whose
  body calls attention once on each of `n_sets` (2 by default) independently drawn input
  sets, so consecutive calls read different buffers (each set's K and V alone outsize the L2
  cache on the standard grid) and Python dispatch and the program's launch are paid once per
  run, not once per call. Nothing is subtracted.
* Each call depends on the previous call on the same set, so XLA can neither hoist it out of
  the loop nor overlap it: q[0, 0, 0, 0] is rewritten as `where(isnan(r), r, q0)` with r the
  sum of the first elements of every output of that set's previous call (out, and dq, dk, dv
  for "fwdbwd") and q0 that element as it was before the loop. The value never changes
  (unless an output is NaN), and every output of every call feeds the next, so no call or
  gradient is dead code (each round's outputs replace the last ones in the loop carry: with
  only out feeding the next call, XLA dropped all but the last of the unrolled rounds'
  backward calls, for every implementation alike, and forward+backward rows read far too
  fast). (XLA's own backward may still hoist dP = dO V^T, whose inputs no round changes, out
  of the loop: the "xla" forward+backward rows are an upper bound.) The update does not read
  q inside the loop, so XLA writes it in place: one one-element kernel per call. (Built from
  q's own element, the update made XLA copy all of q before every call, a cost every
  implementation paid that pulled the short rows' ratios towards one.)
* Inputs and outputs are donated and fed back, so the program copies nothing. The variants'
  extra arguments (bias, mask, lengths: `Inputs.extras`) are arguments of the program, one
  copy shared by the sets and not donated. They do not change inside the loop, so XLA may
  hoist work on them alone out of it (the "xla" rows' combined mask, the bias cast): such
  rows are upper bounds, like the "xla" forward+backward rows.
* The loop runs RUNNER_UNROLL rounds per iteration: each iteration of a GPU while loop waits
  on the host for its condition, and the launches of the next iteration then run with the GPU
  idle. That wait depends on each implementation's host-side launch cost, so with one round
  per iteration it would weigh on the implementations unequally.
* The trip count is picked from a FLOP/byte estimate so that a run lasts about `target_s`
  (25 ms; decode configs `decode_target_s`, 100 ms); the first run (after a separate, untimed
  compile) is a warm-up whose outputs feed the correctness check; then the median over
  `repeats` runs of run time / calls.
* Decode runs are longer because a run's fixed cost (dispatch, the first launch, the wait for
  the last; the same whatever the loop's unrolling) weighs on short calls. The decode rows are
  judged in TB/s against the card's copy bandwidth, where that overhead would count in full;
  the standard grid keeps 25 ms runs (its rows are compared as ratios, and each of its cases
  would take ~3x as long). cuDNN's calls at T = 8-16, which compute more than they read, run a
  few percent slower in the longer runs, which raises those rows' ratios by as much. (The
  measurements: docs/decisions/decode-benchmark-yardstick.md.)
* Every implementation goes through the same loop in the same process, so the ratios are
  like for like; on a shared, noisy GPU they are what to compare. The implementations of one
  case are compiled, warmed up and checked first, then run once more untimed (the first run
  after the checks, which leave the GPU idle, comes out slow), then timed in alternation
  (ABBA: A B, B A, A B, ...) for 7-15 rounds of about 0.6 s in all, so that a drift of the
  GPU's clocks or load during the case reaches every implementation alike instead of landing
  in the ratio (back-to-back blocks of runs let the short rows' ratios move between runs of
  the same code).
* Why each of these, with measurements: docs/decisions/benchmark-timing-method.md.

Correctness gate (`reference_slice`, `forward_verdict`, `grad_verdict`)
-----------------------------------------------------------------------
Before any timing, the output (and gradients) of the warm-up run on input set 0 are compared
with `reference.attention` in float32 on a slice of the full-size problem: batch entries 0 and
B-1, the first kv heads (with their query-head groups), and, for the forward check, the first
and last FORWARD_CHECK_ROWS/2 query rows (all keys; causal masking by the rows' true
positions). Batch entries, heads and query rows are independent in the forward, so the slice of
the full-size result must equal the reference on the sliced inputs. The forward+backward
check needs every query row (dk and dv sum over them) and so covers fewer heads. The references
run on the host's CPU backend: no GPU compile (and autotuning) per shape, nothing on the GPU
that is being measured.
* forward, bf16/fp16, each element: |out - ref| <= max(2 · max |ref_rounded - ref|, ulp(ref),
  u · sum_j p_j |v_j| + ulp(ref) / 2) + 1e-5 (max |ref| + 1), where ref_rounded rounds P and
  the output to the input dtype, ulp(ref) is the input dtype's spacing at that element and u
  its unit roundoff: `reference.error_budget`'s rule.
  float32: max |out - ref| <= 2e-5 (max |ref| + 1) (the tests also scale this by the largest
  logit; the benchmark inputs keep logits small).
* gradients: per tensor, normwise relative error <= GRAD_RTOL[dtype] and max abs error
  <= 4 · GRAD_RTOL[dtype] · max |ref| (so that one wrong row cannot hide in the norm).
* NaN or inf never passes. A failing config is reported as FAIL and not timed.
* The variants' options are part of the reference: the bias and mask are sliced like the
  logits ([B or 1, N or 1, T, S]: the checked batch entries, heads and query rows), the lengths
  like the batch, and the forward check's causal, window, length and mask bounds are applied
  at the rows' true positions (`_row_visibility`); the forward+backward reference takes them
  as `reference.attention`'s own arguments. Query rows past a query length are checked too:
  jax.nn's "xla" and our kernels both return 0 there (and pass no gradient through them), and
  so did cuDNN (H100, JAX 0.11.2).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import math
import shlex
import statistics
import sys
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashattn import reference

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
IMPLS = ("ours", "cudnn", "xla")
MODES = ("fwd", "fwdbwd")
MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward+backward"}
BACKWARD_FLOP_FACTOR = 2.5  # backward FLOPs / forward FLOPs
# Rounds of the timed loop per loop iteration (`build_runner`; why: the module docstring).
RUNNER_UNROLL = 8


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd") -> float:
    """The FLOP count: forward 4 B N T S H (half when causal), backward 2.5x forward."""
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal else 1.0)
    return forward * (1.0 if mode == "fwd" else 1.0 + BACKWARD_FLOP_FACTOR)


# The standard grid: 16k tokens per batch, hidden 2048.
STANDARD_TOKENS = 16384
STANDARD_HIDDEN = 2048
STANDARD_HEAD_DIMS = (64, 128, 256)
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# The decode preset: B=8, N=32, K=8, H=128, S=65536.
DECODE_SEQLENS = (1, 8, 16)
DECODE_SHAPE = dict(batch=8, num_heads=32, num_kv_heads=8, head_dim=128, kv_len=65536)
# The variants preset: B=4, T=S=4096, N=16 (hidden 2048), H=128, one row per option.
VARIANTS_SEQLENS = (4096,)
VARIANTS_SHAPE = dict(batch=4, hidden=2048, head_dim=128, kv_group=4, window=1024)

# Gradient tolerances (normwise relative error against the float32 reference).
GRAD_RTOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
# Elements of one float32 [b, n, t, S] logits tensor a reference slice may materialise (on
# the host CPU): the forward+backward check (every query row) and the forward check (at most
# FORWARD_CHECK_ROWS query rows). At least one head of one batch entry is always checked.
DEFAULT_CHECK_BUDGET = 1 << 24
FORWARD_CHECK_BUDGET = 1 << 23
FORWARD_CHECK_ROWS = 256


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class Config:
    """One attention problem: q [B, T, N, H], k/v [B, S, K, H]."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    kind: str = "standard"  # "standard", "decode" or "variants": picks its table
    # The variants preset's options (`variants_grid`), each None where unused:
    variant: str = ""  # the row's name in the table ("window 1024", "GQA 16/4", ...)
    window: tuple[int, int] | None = None  # local_window_size (left, right)
    q_lens: tuple[int, ...] | None = None  # query_seq_lengths, one per batch entry
    kv_lens: tuple[int, ...] | None = None  # key_value_seq_lengths, one per batch entry
    bias_shape: tuple[int, int, int, int] | None = None  # an additive bias of this shape
    # A boolean mask [B, 1, T, S] of packed documents: batch entry b holds mask_docs[b]
    # documents of (nearly) equal length, and a position sees its own document only.
    mask_docs: tuple[int, ...] | None = None

    @property
    def q_shape(self):
        return (self.batch, self.seqlen_q, self.num_heads, self.head_dim)

    @property
    def kv_shape(self):
        return (self.batch, self.seqlen_k, self.num_kv_heads, self.head_dim)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def restricted(self) -> bool:
        """Whether an option beyond `causal` hides logits (window, lengths, mask)."""
        return any(x is not None for x in (self.window, self.q_lens, self.kv_lens,
                                           self.mask_docs))

    def visible_pairs(self) -> float:
        """The (t, s) pairs whose logits a call computes, summed over the batch, per query
        head: B·T·S (causal: half that, the convention) without a restriction; else the exact
        count, row by row (each row sees one interval of keys; see the module docstring)."""
        if not self.restricted:
            return self.batch * self.seqlen_q * self.seqlen_k * (0.5 if self.causal else 1.0)
        t = np.arange(self.seqlen_q, dtype=np.int64)
        total = 0
        for b in range(self.batch):
            rows = t[:self.q_lens[b]] if self.q_lens is not None else t
            lo = np.zeros_like(rows)
            hi = np.full_like(rows, self.seqlen_k if self.kv_lens is None else self.kv_lens[b])
            if self.causal:
                hi = np.minimum(hi, rows + 1)
            if self.window is not None:
                left, right = self.window
                lo = np.maximum(lo, rows - left)
                hi = np.minimum(hi, rows + right + 1)
            if self.mask_docs is not None:
                starts, ends = _document_bounds(self.mask_docs[b], self.mask_length, rows)
                lo, hi = np.maximum(lo, starts), np.minimum(hi, ends)
            total += int(np.maximum(hi - lo, 0).sum())
        return float(total)

    @property
    def mask_length(self) -> int:
        """The positions the document mask's boundaries split (queries and keys alike)."""
        return max(self.seqlen_q, self.seqlen_k)

    def flops(self, mode: str = "fwd") -> float:
        if not self.restricted:
            return attention_flops(self.batch, self.num_heads, self.seqlen_q, self.seqlen_k,
                                   self.head_dim, self.causal, mode)
        forward = 4.0 * self.num_heads * self.head_dim * self.visible_pairs()
        return forward * (1.0 if mode == "fwd" else 1.0 + BACKWARD_FLOP_FACTOR)

    def kv_bytes(self) -> int:
        """Bytes of K and V one forward call must read."""
        return 2 * math.prod(self.kv_shape) * jnp.dtype(self.jnp_dtype).itemsize

    def extra_bytes(self) -> int:
        """Bytes of the bias and mask a call reads."""
        total = 0
        if self.bias_shape is not None:
            total += math.prod(self.bias_shape) * jnp.dtype(self.jnp_dtype).itemsize
        if self.mask_docs is not None:
            total += self.batch * self.seqlen_q * self.seqlen_k
        return total

    def io_bytes(self, mode: str = "fwd") -> int:
        """A lower bound on the bytes a call moves: q, k, v, out (and their gradients), and
        the bias and mask."""
        item = jnp.dtype(self.jnp_dtype).itemsize
        forward = 2 * math.prod(self.q_shape) * item + self.kv_bytes()
        return forward * (1 if mode == "fwd" else 3) + self.extra_bytes()

    def label(self) -> str:
        gqa = "" if self.num_kv_heads == self.num_heads else f" K={self.num_kv_heads}"
        variant = (f" {self.variant}" if self.variant and self.variant not in ("full", "causal")
                   else "")
        return (f"{self.dtype} B={self.batch} T={self.seqlen_q} S={self.seqlen_k} "
                f"N={self.num_heads}{gqa} H={self.head_dim}{' causal' if self.causal else ''}"
                f"{variant}")


def _document_bounds(docs: int, length: int, positions):
    """[start, end) of the document holding each position, for `docs` documents splitting
    `length` positions as evenly as integers allow."""
    bounds = (np.arange(docs + 1, dtype=np.int64) * length) // docs
    index = np.searchsorted(bounds, positions, side="right") - 1
    return bounds[index], bounds[index + 1]


def document_ids(docs: int, length: int) -> np.ndarray:
    """The document index of each of `length` positions (`_document_bounds`' split)."""
    bounds = (np.arange(docs + 1, dtype=np.int64) * length) // docs
    return (np.searchsorted(bounds, np.arange(length), side="right") - 1).astype(np.int32)


def standard_grid(dtypes=("bf16", "fp16"), head_dims=STANDARD_HEAD_DIMS,
                  seqlens=STANDARD_SEQLENS, causal=(False, True), tokens=STANDARD_TOKENS,
                  hidden=STANDARD_HIDDEN) -> list[Config]:
    """B = tokens / T, N = hidden / H, S = T (the standard grid)."""
    configs = []
    for dtype in dtypes:
        for h in head_dims:
            if hidden % h:
                raise ValueError(f"hidden {hidden} is not a multiple of head dim {h}")
            for t in seqlens:
                if tokens % t:
                    raise ValueError(f"tokens {tokens} is not a multiple of seqlen {t}")
                for is_causal in causal:
                    configs.append(Config(tokens // t, t, t, hidden // h, hidden // h, h, dtype,
                                          bool(is_causal)))
    return configs


def decode_grid(dtypes=("bf16", "fp16"), seqlens=DECODE_SEQLENS, kv_len=None) -> list[Config]:
    """The decode preset: a few query tokens against a long, grouped K/V."""
    d = DECODE_SHAPE
    return [Config(d["batch"], t, kv_len or d["kv_len"], d["num_heads"], d["num_kv_heads"],
                   d["head_dim"], dtype, False, kind="decode")
            for dtype in dtypes for t in seqlens]


def variants_grid(dtypes=("bf16",), seqlens=VARIANTS_SEQLENS,
                  head_dims=(VARIANTS_SHAPE["head_dim"],), batch=VARIANTS_SHAPE["batch"],
                  hidden=VARIANTS_SHAPE["hidden"], kv_group=VARIANTS_SHAPE["kv_group"],
                  window=None) -> list[Config]:
    """The variants preset: one row per option users pass, at B = `batch`, T = S, N =
    hidden / H: full, causal, a causal sliding window (`window`, default min(1024, T/4),
    right side 0), per-batch lengths (queries and keys alike: T·(B-i)/B for entry i, so
    4096, 3072, 2048, 1024), GQA (N over N/kv_group kv heads, causal), a bias [1, N, T, S]
    (full) and a boolean document mask [B, 1, T, S] (entry i packs 2**i documents, full)."""
    configs = []
    for dtype in dtypes:
        for h in head_dims:
            if hidden % h:
                raise ValueError(f"hidden {hidden} is not a multiple of head dim {h}")
            n = hidden // h
            kv = max(1, n // kv_group)
            if n % kv:
                raise ValueError(f"{n} heads do not split into groups of {kv_group}")
            for t in seqlens:
                base = Config(batch, t, t, n, n, h, dtype, False, kind="variants",
                              variant="full")
                side = window or max(1, min(VARIANTS_SHAPE["window"], t // 4))
                lens = tuple(max(1, t * (batch - i) // batch) for i in range(batch))
                configs += [
                    base,
                    dataclasses.replace(base, causal=True, variant="causal"),
                    dataclasses.replace(base, causal=True, window=(side, 0),
                                        variant=f"window {side}"),
                    dataclasses.replace(base, q_lens=lens, kv_lens=lens, variant="lengths"),
                    dataclasses.replace(base, causal=True, num_kv_heads=kv,
                                        variant=f"GQA {n}/{kv}"),
                    dataclasses.replace(base, bias_shape=(1, n, t, t), variant="bias [1,N,T,S]"),
                    dataclasses.replace(base, mask_docs=tuple(min(2 ** i, t) for i in
                                                              range(batch)),
                                        variant="mask [B,1,T,S]"),
                ]
    return configs


# ----------------------------------------------------------------------------- implementations


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def ours_implementation() -> str:
    """Our kernels for the default backend, by name, so a missing build raises rather than
    silently falling back to XLA."""
    return "cuda" if on_gpu() else "cpu"


def available_impls(requested: Sequence[str]) -> list[str]:
    """The requested implementations that can run here (cuDNN needs a GPU)."""
    unknown = [i for i in requested if i not in IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; choose from {IMPLS}")
    return [i for i in requested if i != "cudnn" or on_gpu()]


def attention_fn(impl: str, causal: bool, window: tuple[int, int] | None = None) -> Callable:
    """(q, k, v, **extras) -> out for one implementation; `extras` are `Inputs.extras` (bias,
    mask, lengths), the same keywords for every implementation."""
    options = dict(is_causal=causal)
    if window is not None:
        options["local_window_size"] = window
    if impl == "ours":
        import jax_flashattn
        return functools.partial(jax_flashattn.attention, implementation=ours_implementation(),
                                 **options)
    return functools.partial(jax.nn.dot_product_attention, implementation=impl, **options)


def config_attention_fn(impl: str, cfg: Config) -> Callable:
    """`attention_fn` with the config's static options."""
    if cfg.window is None:
        return attention_fn(impl, cfg.causal)
    return attention_fn(impl, cfg.causal, cfg.window)


def _call(fn, mode, q, k, v, g, extras=None):
    """The outputs one call produces: (out,) or (out, dq, dk, dv); the gradients are those of
    q, k and v only (none of a bias)."""
    extras = extras or {}
    if mode == "fwd":
        return (fn(q, k, v, **extras),)
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **extras), q, k, v)
    return (out, *vjp(g))


# ----------------------------------------------------------------------------- inputs


@functools.partial(jax.jit, static_argnums=(1, 2))
def _flat_normal(key, size, dtype):
    return jax.random.normal(key, (size,), jnp.float32).astype(dtype)


def _normal(key, shape, dtype):
    """Standard normal `shape` array. Drawn flat, so that every config with the same element
    count (the whole standard grid has B*T*N*H = tokens*hidden) shares one compiled draw."""
    return _flat_normal(key, math.prod(shape), dtype).reshape(shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _document_mask(ids, seqlen_q, seqlen_k):
    """bool [B, 1, T, S]: query t sees key s where both lie in one document."""
    return (ids[:, None, :seqlen_q, None] == ids[:, None, None, :seqlen_k])


class Inputs:
    """`n_sets` independent (q, k, v) sets plus a cotangent g, drawn on the device.

    Runs donate the sets and hand them back; `ensure_alive` redraws them (same seed, same
    values) when a failed run left them deleted."""

    def __init__(self, cfg: Config, n_sets: int, seed: int = 0):
        self.cfg, self.n_sets, self.seed = cfg, n_sets, seed
        self._suspect = False
        self.sets, self.g = self._draw()
        self.extras = self._draw_extras()

    def _draw_extras(self) -> dict:
        """The config's extra arguments, by `attention`'s keyword: bias (standard normal, the
        input dtype), mask, query_seq_lengths and key_value_seq_lengths (int32). One copy for
        every set; never donated."""
        cfg, extras = self.cfg, {}
        if cfg.bias_shape is not None:
            key = jax.random.fold_in(jax.random.key(self.seed), 1 << 20)
            extras["bias"] = _normal(key, cfg.bias_shape, jnp.dtype(cfg.jnp_dtype))
        if cfg.mask_docs is not None:
            ids = np.stack([document_ids(d, cfg.mask_length) for d in cfg.mask_docs])
            extras["mask"] = _document_mask(jnp.asarray(ids), cfg.seqlen_q, cfg.seqlen_k)
        if cfg.q_lens is not None:
            extras["query_seq_lengths"] = jnp.asarray(cfg.q_lens, jnp.int32)
        if cfg.kv_lens is not None:
            extras["key_value_seq_lengths"] = jnp.asarray(cfg.kv_lens, jnp.int32)
        return extras

    def _draw(self):
        cfg = self.cfg
        keys = jax.random.split(jax.random.key(self.seed), 3 * self.n_sets + 1)

        dtype = jnp.dtype(cfg.jnp_dtype)
        sets = [tuple(_normal(keys[3 * i + j], shape, dtype) for j, shape in
                      enumerate((cfg.q_shape, cfg.kv_shape, cfg.kv_shape)))
                for i in range(self.n_sets)]
        return sets, _normal(keys[-1], cfg.q_shape, dtype)

    def ensure_alive(self):
        leaves = jax.tree.leaves((self.sets, self.g))
        if self._suspect or any(x.is_deleted() for x in leaves):
            self.sets = self.g = None
            gc.collect()
            self.sets, self.g = self._draw()
            self._suspect = False

    def invalidate(self):
        """After a failed run: the sets it handed back may carry its error (PJRT propagates an
        asynchronous failure into the outputs), so the next use redraws them."""
        self._suspect = True


# ----------------------------------------------------------------------------- correctness


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
    """The float32 reference on a slice of input set 0; see the module docstring."""
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
        the checked batch entries, heads and query rows (every key), lengths at the batch
        entries."""
        heads = self.kv_heads * cfg.group
        sliced = {}
        for name, x in extras.items():
            if name in ("bias", "mask"):
                sliced[name] = _take_logits_shaped(x, self.batch_index, self.rows, heads=heads)
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


def _row_visibility(rows, seqlen_k, *, causal, window, q_lens, kv_lens, mask):
    """bool [b or 1, 1 or n, r, S] (None where nothing is hidden): which keys query rows
    `rows` (their true positions) see, by `reference.visibility`'s rules; q_lens, kv_lens and
    mask are already sliced to the checked batch entries (and the mask to the rows)."""
    if not (causal or window is not None or q_lens is not None or kv_lens is not None
            or mask is not None):
        return None
    t = rows[:, None]
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
    return keep


@functools.partial(jax.jit, static_argnames=("causal", "window", "dtype"))
def _reference_forward(q, k, v, rows, extras, *, causal, window, dtype):
    """Exact and P-rounded reference outputs for query rows `rows` (causal, window, lengths
    and mask mask by the rows' true positions, as the full problem would; `extras` are sliced
    by `ReferenceSlice.take_extras`)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    mask = _row_visibility(rows, k.shape[1], causal=causal, window=window,
                           q_lens=extras.get("query_seq_lengths"),
                           kv_lens=extras.get("key_value_seq_lengths"), mask=extras.get("mask"))
    f = functools.partial(reference.attention, bias=extras.get("bias"), mask=mask)
    exact = f(q, k, v)
    rounded = f(q, k, v, p_dtype=DTYPES[dtype])
    magnitude = f(q, k, jnp.abs(v))
    return exact, rounded.astype(DTYPES[dtype]), magnitude


@functools.partial(jax.jit, static_argnames=("causal", "window", "dtype"))
def _reference_forward_backward(q, k, v, g, extras, *, causal, window, dtype):
    """Every query row: the options go to `reference.attention` as its own arguments."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    f = functools.partial(reference.attention, is_causal=causal, local_window_size=window,
                          **extras)
    exact, vjp = jax.vjp(f, q, k, v)
    rounded = f(q, k, v, p_dtype=DTYPES[dtype])
    magnitude = f(q, k, jnp.abs(v))
    grads = dict(zip(("dq", "dk", "dv"), vjp(g.astype(jnp.float32))))
    return exact, rounded.astype(DTYPES[dtype]), magnitude, grads


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
    row (dk and dv sum over all of them) of fewer heads. Both on the host CPU."""
    q, k, v = inputs.sets[0]
    if with_grads:
        batch_index, rows, kv_heads = _slice_plan(cfg, budget, None)
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
            *args, causal=cfg.causal, window=cfg.window, dtype=cfg.dtype)
    else:
        all_rows = np.arange(cfg.seqlen_q, dtype=np.int32) if rows is None else rows
        args = jax.device_put(sliced + (all_rows, extras), device)
        plan.exact, plan.rounded, plan.magnitude = _reference_forward(
            *args, causal=cfg.causal, window=cfg.window, dtype=cfg.dtype)
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


# ----------------------------------------------------------------------------- timing


@dataclasses.dataclass
class TimingSettings:
    target_s: float = 0.025      # wall time of one timed run
    # Decode rows: longer runs. A run carries a fixed cost beside its calls (dispatch, the
    # first launch, the wait for the last), a share of each short decode call; the decode rows
    # are judged against the card's bandwidth, where that share counts in full (the module
    # docstring, "decode runs"; docs/decisions/decode-benchmark-yardstick.md).
    decode_target_s: float = 0.1
    repeats: int = 15            # timed runs per implementation and case (at most)
    min_repeats: int = 7
    time_budget_s: float = 0.6   # rounds (one run of every implementation) fill about this
    n_sets: int = 2              # input sets the calls rotate through
    max_iters: int = 256
    decode_max_iters: int = 1024
    seed: int = 0
    check_budget: int = DEFAULT_CHECK_BUDGET
    # Rough device speed, only used to pick the trip count before anything has run.
    est_flops: float = 4e14
    est_bandwidth: float = 3e12

    @classmethod
    def for_backend(cls, **overrides):
        if not on_gpu():
            overrides = dict(dict(target_s=0.02, decode_target_s=0.02, repeats=3,
                                  min_repeats=2, time_budget_s=0.2,
                                  n_sets=2, est_flops=2e10, est_bandwidth=1e10), **overrides)
        return cls(**overrides)

    def iterations(self, cfg: Config, mode: str) -> int:
        per_call = max(cfg.flops(mode) / self.est_flops, cfg.io_bytes(mode) / self.est_bandwidth)
        decode = cfg.kind == "decode"
        target = self.decode_target_s if decode else self.target_s
        cap = self.decode_max_iters if decode else self.max_iters
        return max(1, min(cap, math.ceil(target / (per_call * self.n_sets))))


def build_runner(fn: Callable, mode: str, iters: int):
    """jit(sets, results, g, extras=None) -> (sets, results): `iters` rounds of one call per
    set (each passed `extras`, not donated); see the module docstring for why each call depends
    on the previous one, and how."""
    def run(sets, results, g, extras=None):
        origin = (0,) * sets[0][0].ndim
        one = (1,) * sets[0][0].ndim
        # Materialized before the loop: XLA 0.11 otherwise re-slices each first element from
        # the original q inside the unrolled loop's updates, which keeps that q alive and so
        # makes it copy q once per run instead of updating it in place
        # (docs/decisions/benchmark-timing-method.md).
        firsts = lax.optimization_barrier([lax.slice(q, origin, one) for q, _, _ in sets])

        def body(_, carry):
            sets, results = carry
            new_sets, new_results = [], []
            for (q, k, v), previous, first in zip(sets, results, firsts):
                r = sum(lax.slice(x, origin, one).astype(jnp.float32) for x in previous)
                r = r.astype(q.dtype)
                q = lax.dynamic_update_slice(q, jnp.where(r != r, r, first), origin)
                new_sets.append((q, k, v))
                new_results.append(_call(fn, mode, q, k, v, g, extras))
            return new_sets, new_results
        return lax.fori_loop(0, iters, body, (sets, results), unroll=min(iters, RUNNER_UNROLL))
    return jax.jit(run, donate_argnums=(0, 1))


def _empty_results(fn, mode, inputs: Inputs):
    shapes = jax.eval_shape(functools.partial(_call, fn, mode), *inputs.sets[0], inputs.g,
                            inputs.extras)
    return [tuple(jnp.zeros(s.shape, s.dtype) for s in shapes) for _ in inputs.sets]


def is_oom(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                   "OOM", "Resource exhausted"))


def _short(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


class _Timed:
    """One implementation of one (config, mode), compiled, warmed up and checked: `run()`
    times one run (of `calls` calls) and returns its seconds; `per_call` collects the timed
    rounds' seconds per call and `record` the outcome."""

    def __init__(self, record: dict, compiled, results, calls: int):
        self.record, self.compiled, self.results = record, compiled, results
        self.calls, self.per_call = calls, []

    def run(self, inputs: Inputs) -> float:
        t0 = time.perf_counter()
        inputs.sets, self.results = self.compiled(inputs.sets, self.results, inputs.g,
                                                  inputs.extras)
        jax.block_until_ready(self.results)
        return time.perf_counter() - t0


def _fail(record: dict, e: BaseException, inputs: Inputs) -> dict:
    record.update(status="OOM" if is_oom(e) else "error", message=_short(e))
    inputs.invalidate()
    gc.collect()  # a failed run's traceback may hold device buffers
    return record


def prepare(cfg: Config, impl: str, mode: str, inputs: Inputs, ref: ReferenceSlice | None,
            settings: TimingSettings) -> tuple[dict, _Timed | None]:
    """Compiles, warms up and checks one (config, implementation, mode). Never raises:
    failures come back as status "FAIL" (wrong result), "OOM" or "error", with a message, and
    no timer."""
    record = dict(impl=impl, mode=mode, status="error", message="")
    try:
        fn = config_attention_fn(impl, cfg)
        iters = settings.iterations(cfg, mode)
        calls = iters * inputs.n_sets
        runner = build_runner(fn, mode, iters)
        inputs.ensure_alive()
        t0 = time.perf_counter()
        results = _empty_results(fn, mode, inputs)
        lowered = runner.lower(inputs.sets, results, inputs.g, inputs.extras)
        record["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        record["compile_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        inputs.sets, results = compiled(inputs.sets, results, inputs.g, inputs.extras)
        jax.block_until_ready(results)
        warm_s = time.perf_counter() - t0
        record.update(warmup_s=warm_s, iterations=iters, calls=calls)

        if ref is None:
            raise RuntimeError("no reference to check against")
        t0 = time.perf_counter()
        verdict = check_outputs(cfg, results[0], ref)
        record["check_s"] = time.perf_counter() - t0
        record["check"] = dict(verdict.metrics, detail=verdict.detail)
        if not verdict.ok:
            record.update(status="FAIL", message=verdict.detail)
            return record, None
        return record, _Timed(record, compiled, results, calls)
    except Exception as e:  # noqa: BLE001 - one config must never end the run
        return _fail(record, e, inputs), None


def time_interleaved(cfg: Config, mode: str, timers: Sequence[_Timed], inputs: Inputs,
                     settings: TimingSettings) -> None:
    """Times the prepared implementations of one (config, mode) in alternation, ABBA order
    (A B, then B A, ...), the same number of runs each; each record gets the median of its
    runs' seconds per call. In alternation they share whatever the GPU's clocks and
    neighbours do during the case, which back-to-back blocks of runs do not: a drift within
    the case would otherwise land in the ratio. One untimed round goes first: after the
    correctness checks (on the host, GPU idle) the first run comes out slower than the next
    ones (docs/decisions/benchmark-timing-method.md). The rounds fill `time_budget_s`, as
    that round's times allow, within [min_repeats, repeats] (repeats, at least 1, is a hard
    cap). Every implementation's program and results stay alive until the case ends. Never
    raises: an implementation that fails here is marked and dropped from the remaining
    rounds."""
    live = list(timers)

    def one_round(order, keep: bool) -> float:
        nonlocal live
        total = 0.0
        for timer in order:
            try:
                inputs.ensure_alive()
                seconds = timer.run(inputs)
            except Exception as e:  # noqa: BLE001
                timer.results = timer.compiled = None  # so that _fail's collection frees them
                _fail(timer.record, e, inputs)
                live = [t for t in live if t is not timer]
                continue
            total += seconds
            if keep:
                timer.per_call.append(seconds / timer.calls)
        return total

    fill = int(settings.time_budget_s / max(one_round(live, keep=False), 1e-9))
    repeats = max(1, min(settings.repeats, max(settings.min_repeats, fill)))
    for round_index in range(repeats):
        one_round(live if round_index % 2 == 0 else live[::-1], keep=True)
    for timer in timers:
        if timer in live:
            seconds = statistics.median(timer.per_call)
            timer.record.update(status="ok", seconds=seconds, times_s=timer.per_call,
                                repeats=len(timer.per_call),
                                tflops=cfg.flops(mode) / seconds / 1e12,
                                kv_tbps=cfg.kv_bytes() / seconds / 1e12)
        timer.compiled = timer.results = None


def copy_bandwidth(nbytes: int = 2 << 30, runs: int = 10) -> float | None:
    """The first device's copy bandwidth in bytes per second (bytes read plus bytes written;
    the median of `runs` cudaMemcpy device-to-device copies of `nbytes`), the yardstick of the
    decode rows: the decode kernels aim to read K/V at no less than 85% of the card's measured
    copy bandwidth, and H200s differ by a few percent in it, so the benchmark measures it in its
    own process (docs/decisions/decode-benchmark-yardstick.md). None where there is no CUDA
    device or no CUDA build, and with a warning where the copy fails (its 2 x `nbytes` do not
    fit beside XLA's memory pool, say)."""
    import jax_flashattn
    if not on_gpu() or not jax_flashattn.cuda_built():
        return None
    from jax_flashattn import _ffi
    try:
        median, _ = _ffi._ext.cuda_copy_bandwidth(jax.devices()[0].local_hardware_id, nbytes,
                                                  runs)
    except RuntimeError as e:
        warnings.warn(f"device copy bandwidth not measured: {e}", stacklevel=2)
        return None
    return median


# ----------------------------------------------------------------------------- driver


class Progress:
    """A progress bar on stderr: rich, else tqdm, when stderr is a terminal; else one plain
    line per step (readable in logs)."""

    def __init__(self, total: int, description: str = "", enabled: bool = True):
        self.total, self.done, self.description = total, 0, description
        self._kind, self._bar = "plain", None
        self._start = time.perf_counter()
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                           TextColumn, TimeElapsedColumn)
                self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                         MofNCompleteColumn(), TimeElapsedColumn(),
                                         console=Console(stderr=True), transient=False)
                self._task = self._bar.add_task(description, total=total)
                self._kind = "rich"
            except ImportError:
                try:
                    from tqdm import tqdm
                    self._bar = tqdm(total=total, desc=description, file=sys.stderr)
                    self._kind = "tqdm"
                except ImportError:
                    pass
        self._enabled = enabled

    def __enter__(self):
        if self._kind == "rich":
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._kind == "rich":
            self._bar.stop()
        elif self._kind == "tqdm":
            self._bar.close()

    def step(self, label: str):
        """Announces the step about to run."""
        if self._kind == "rich":
            self._bar.update(self._task, description=label)
        elif self._kind == "tqdm":
            self._bar.set_description(label)
        elif self._enabled:
            elapsed = time.perf_counter() - self._start
            print(f"[{self.done + 1}/{self.total} {elapsed:6.1f}s] {label}", file=sys.stderr,
                  flush=True)

    def advance(self, n: int = 1):
        self.done += n
        if self._kind == "rich":
            self._bar.advance(self._task, n)
        elif self._kind == "tqdm":
            self._bar.update(n)

    def log(self, message: str):
        if self._kind == "rich":
            self._bar.console.print(message, markup=False, highlight=False)
        elif self._kind == "tqdm":
            self._bar.write(message, file=sys.stderr)
        elif self._enabled:
            print(message, file=sys.stderr, flush=True)


def config_record(cfg: Config) -> dict:
    record = dict(kind=cfg.kind, dtype=cfg.dtype, batch=cfg.batch, seqlen_q=cfg.seqlen_q,
                  seqlen_k=cfg.seqlen_k, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, causal=cfg.causal)
    if cfg.kind == "variants":
        # The options, and the share of the B·T·S logits a call computes (FLOPs count those).
        record.update(variant=cfg.variant, window=cfg.window, q_lens=cfg.q_lens,
                      kv_lens=cfg.kv_lens, bias_shape=cfg.bias_shape, mask_docs=cfg.mask_docs,
                      visible=cfg.visible_pairs() / (cfg.batch * cfg.seqlen_q * cfg.seqlen_k))
    return record


def run_benchmark(configs: Sequence[Config], impls: Sequence[str], modes: Sequence[str],
                  settings: TimingSettings | None = None, progress: bool = True) -> list[dict]:
    """Every (config, mode, impl), checked then timed, the implementations of a (config, mode)
    in alternation (`time_interleaved`); one flat list of records."""
    settings = settings or TimingSettings.for_backend()
    jobs = [(cfg, mode) for cfg in configs for mode in modes
            if not (cfg.kind == "decode" and mode != "fwd")]
    records = []
    # Steps: each implementation's check of a (config, mode), then its timing, one step.
    with Progress(len(jobs) * (len(impls) + 1), "attention", enabled=progress) as bar:
        for cfg in configs:
            cfg_modes = [m for c, m in jobs if c == cfg]
            if not cfg_modes:
                continue
            inputs = None
            t_draw = time.perf_counter()
            try:
                inputs = Inputs(cfg, settings.n_sets, settings.seed)
                jax.block_until_ready(inputs.sets)
                t_draw = time.perf_counter() - t_draw
            except Exception as e:  # noqa: BLE001
                failure = dict(status="OOM" if is_oom(e) else "error",
                               message="drawing inputs: " + _short(e))
            for mode in cfg_modes:
                ref, ref_error = None, None
                t_ref = time.perf_counter()
                if inputs is not None:
                    try:
                        inputs.ensure_alive()
                        ref = reference_slice(cfg, inputs, mode == "fwdbwd",
                                              settings.check_budget)
                        t_ref = time.perf_counter() - t_ref
                    except Exception as e:  # noqa: BLE001
                        ref_error = "reference check failed: " + _short(e)
                        inputs.invalidate()
                case_records, timers = [], []
                for impl in impls:
                    bar.step(f"{cfg.label()} {mode} {impl}")
                    if inputs is None:
                        record = dict(impl=impl, mode=mode, **failure)
                    elif ref is None:
                        record = dict(impl=impl, mode=mode, status="error", message=ref_error)
                    else:
                        record, timer = prepare(cfg, impl, mode, inputs, ref, settings)
                        if timer is not None:
                            timers.append(timer)
                    case_records.append(record)
                    bar.advance()
                bar.step(f"{cfg.label()} {mode}: timing {', '.join(impls)}")
                if timers:
                    time_interleaved(cfg, mode, timers, inputs, settings)
                bar.advance()
                for record in case_records:
                    record = dict(config_record(cfg), **record, flops=cfg.flops(mode),
                                  kv_bytes=cfg.kv_bytes(), draw_s=t_draw, reference_s=t_ref)
                    records.append(record)
                    bar.log(format_record(cfg, record))
                del ref, timers
            del inputs
            gc.collect()
    return records


def format_record(cfg: Config, record: dict) -> str:
    head = f"  {cfg.label()} {record['mode']} {record['impl']}:"
    if record["status"] != "ok":
        return f"{head} {record['status']} {record.get('message', '')}"[:400]
    extra = (f"{record['kv_tbps']:.2f} TB/s, {record['seconds'] * 1e6:.1f} us"
             if cfg.kind == "decode" else f"{record['tflops']:.4g} TFLOP/s")
    return f"{head} {extra} (median of {record['repeats']} runs of {record['calls']} calls)"


# ----------------------------------------------------------------------------- reporting


def environment() -> dict:
    """Device, versions, build: the header of every report."""
    import jax_flashattn
    device = jax.devices()[0]
    return dict(
        device=getattr(device, "device_kind", str(device)), platform=device.platform,
        device_count=jax.device_count(), jax_version=jax.__version__,
        jax_flashattn_version=getattr(jax_flashattn, "__version__", "?"),
        cuda_built=jax_flashattn.cuda_built(),
        cuda_architectures=list(jax_flashattn.cuda_architectures()),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        command=_command_line())


def forward_kernel_summary(configs) -> str:
    """The dispatcher's forward kernel family per (dtype, head dim) of the configs, e.g.
    "bf16 H=128 sm90, bf16 H=256 sm80"."""
    import jax_flashattn
    seen = {}
    for cfg in configs:
        key = (cfg.dtype, cfg.head_dim)
        if key not in seen:
            q = jax.ShapeDtypeStruct(cfg.q_shape, cfg.jnp_dtype)
            k = jax.ShapeDtypeStruct(cfg.kv_shape, cfg.jnp_dtype)
            seen[key] = jax_flashattn.forward_kernel(q, k)
    return ", ".join(f"{d} H={h} {kernel}" for (d, h), kernel in seen.items())


def _command_line() -> str:
    python = sys.executable.rsplit("/", 1)[-1] or "python"
    argv = list(sys.argv)
    if argv and argv[0].replace("\\", "/").endswith("jax_flashattn/__main__.py"):
        argv[0:1] = ["-m", "jax_flashattn"]
    return shlex.join([python] + argv)


def environment_lines(env: dict) -> list[str]:
    archs = ", ".join(env["cuda_architectures"]) or "-"
    return [f"device: {env['device']} ({env['platform']}, {env['device_count']} device(s))",
            f"jax {env['jax_version']}, jax_flashattn {env['jax_flashattn_version']}, "
            f"CUDA kernels built: {env['cuda_built']} (architectures: {archs})",
            f"date: {env['date']}",
            f"command: {env['command']}"]


def _number(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _cell(record: dict | None, key: str, scale: float = 1.0) -> str:
    if record is None:
        return "-"
    if record["status"] != "ok":
        return record["status"]
    return _number(record[key] * scale)


def _ratio(ours: dict | None, base: dict | None, key: str, invert: bool = False) -> str:
    if not ours or not base or ours["status"] != "ok" or base["status"] != "ok":
        return "-"
    r = base[key] / ours[key] if invert else ours[key] / base[key]
    return f"{r:.2f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _group(records):
    """{(kind, dtype, mode): {config key: {impl: record}}}, in first-seen order."""
    groups: dict = {}
    for r in records:
        key = (r["kind"], r["dtype"], r["mode"])
        ckey = (r["seqlen_q"], r["seqlen_k"], r["head_dim"], r["causal"], r["batch"],
                r["num_heads"], r["num_kv_heads"], r.get("variant", ""))
        groups.setdefault(key, {}).setdefault(ckey, {})[r["impl"]] = r
    return groups


def markdown_tables(records: Sequence[dict], impls: Sequence[str],
                    copy_tbps: float | None = None) -> list[tuple[str, str]]:
    """[(title, markdown table)] per (kind, dtype, mode). With the device's copy bandwidth
    (`copy_bandwidth`, TB/s), decode tables add our K/V read rate as a fraction of it."""
    base = "cudnn" if "cudnn" in impls else ("xla" if "xla" in impls else None)
    tables = []
    for (kind, dtype, mode), rows_by_config in _group(records).items():
        first = next(iter(next(iter(rows_by_config.values())).values()))
        if kind == "decode":
            title = (f"{dtype} decode {MODE_TITLES[mode]}: B={first['batch']}, "
                     f"N={first['num_heads']}, K={first['num_kv_heads']}, "
                     f"H={first['head_dim']}; K/V read TB/s and time per call")
            header = (["T", "S"] + [f"{i} TB/s" for i in impls] + [f"{i} us" for i in impls])
            rows = []
            for (t, s, h, causal, *_), by_impl in rows_by_config.items():
                rows.append([str(t), str(s)]
                            + [_cell(by_impl.get(i), "kv_tbps") for i in impls]
                            + [_cell(by_impl.get(i), "seconds", 1e6) for i in impls])
                if "ours" in impls and base and base != "ours":
                    rows[-1].append(_ratio(by_impl.get("ours"), by_impl.get(base), "kv_tbps"))
            if "ours" in impls and base and base != "ours":
                header.append(f"ours/{base}")
            if "ours" in impls and copy_tbps:
                header.append("ours/copy")
                for row, by_impl in zip(rows, rows_by_config.values()):
                    ours = by_impl.get("ours")
                    row.append(f"{ours['kv_tbps'] / copy_tbps:.2f}"
                               if ours and ours["status"] == "ok" else "-")
        elif kind == "variants":
            title = (f"{dtype} {MODE_TITLES[mode]} TFLOP/s, options: B={first['batch']}, "
                     f"N={first['num_heads']}, H={first['head_dim']}, T = S; FLOPs count the "
                     f"visible logits only (visible: their share of B*T*S)")
            header = (["T", "variant", "causal", "visible"] + [f"{i} TFLOP/s" for i in impls]
                      + [f"{i} ms" for i in impls])
            with_ratio = "ours" in impls and base and base != "ours"
            if with_ratio:
                header.append(f"ours/{base}")
            rows = []
            for by_impl in rows_by_config.values():
                r = next(iter(by_impl.values()))
                row = [str(r["seqlen_q"]), r["variant"], "yes" if r["causal"] else "no",
                       f"{r['visible']:.2f}"]
                row += [_cell(by_impl.get(i), "tflops") for i in impls]
                row += [_cell(by_impl.get(i), "seconds", 1e3) for i in impls]
                if with_ratio:
                    row.append(_ratio(by_impl.get("ours"), by_impl.get(base), "tflops"))
                rows.append(row)
        else:
            tokens = first["batch"] * first["seqlen_q"]
            title = (f"{dtype} {MODE_TITLES[mode]} TFLOP/s: {tokens} tokens per batch "
                     f"(B = {tokens}/T), hidden {first['num_heads'] * first['head_dim']} "
                     f"(N = hidden/H)")
            header = ["T", "H", "causal"] + [f"{i} TFLOP/s" for i in impls]
            with_ratio = "ours" in impls and base and base != "ours"
            if with_ratio:
                header.append(f"ours/{base}")
            rows = []
            for (t, s, h, causal, *_), by_impl in rows_by_config.items():
                row = [str(t), str(h), "yes" if causal else "no"]
                row += [_cell(by_impl.get(i), "tflops") for i in impls]
                if with_ratio:
                    row.append(_ratio(by_impl.get("ours"), by_impl.get(base), "tflops"))
                rows.append(row)
        tables.append((title, _markdown(header, rows)))
    return tables


def failures(records: Sequence[dict], impl: str = "ours") -> list[dict]:
    return [r for r in records if r["impl"] == impl and r["status"] in ("FAIL", "error")]
