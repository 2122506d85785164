"""The benchmark's cases: `Config`, its FLOP and byte counts, and the standard, decode and
variants grids. (Method: the package docstring.)"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
IMPLS = ("ours", "cudnn", "xla")  # the implementations every case takes
# And those on request or of some cases only: ours with deterministic_backward=True, and cuDNN's
# packed-sequence path (the packed preset's rows).
ALL_IMPLS = IMPLS + ("ours-deterministic", "cudnn-packed")
MODES = ("fwd", "fwdbwd")
MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward+backward"}
BACKWARD_FLOP_FACTOR = 2.5  # backward FLOPs / forward FLOPs
# Rounds of the timed loop per loop iteration (`build_runner`; why: the package docstring).
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
# soft_cap: Gemma 2's cap on its attention logits.
VARIANTS_SHAPE = dict(batch=4, hidden=2048, head_dim=128, kv_group=4, window=1024, soft_cap=50.0)




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
    kind: str = "standard"  # "standard", "decode", "variants" or "packed": picks its table
    # The variants preset's options (`variants_grid`), each None where unused:
    variant: str = ""  # the row's name in the table ("window 1024", "GQA 16/4", ...)
    window: tuple[int, int] | None = None  # local_window_size (left, right)
    q_lens: tuple[int, ...] | None = None  # query_seq_lengths, one per batch entry
    kv_lens: tuple[int, ...] | None = None  # key_value_seq_lengths, one per batch entry
    bias_shape: tuple[int, int, int, int] | None = None  # an additive bias of this shape
    # A boolean mask [B, 1, T, S] of packed documents: batch entry b holds mask_docs[b]
    # documents of (nearly) equal length, and a position sees its own document only.
    mask_docs: tuple[int, ...] | None = None
    # The same packing given as segment ids ([B, T] and [B, S] int32) instead of a mask; an
    # entry may also be the lengths of its documents (a tuple summing to T: the packed preset).
    segment_docs: tuple[int | tuple[int, ...], ...] | None = None
    soft_cap: float | None = None  # logits_soft_cap (ours only: jax.nn has no soft-capping)
    sinks: bool = False  # one sink logit per query head, drawn (ours only: jax.nn has none)
    # ALiBi with BLOOM's slopes (jax.nn gets the dense [1, N, T, S] bias it stands for, built
    # inside the timed call).
    alibi: bool = False
    # diagonal_alignment="bottom_right": query t at position t + S - T for causal and the window
    # (jax.nn gets that as a mask).
    bottom_right: bool = False
    # Decode rows: K/V read from a paged cache of pages of this many tokens, scattered over
    # the pool at random, through jax_flashattn.paged_attention (ours only).
    page_size: int | None = None
    # Decode rows: K and V stored as float8_e4m3fn with float32 [B, K] descales (made from the
    # drawn ones outside the timed call), given to jax_flashattn.attention (ours only).
    kv_fp8: bool = False

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
        """Whether an option beyond `causal` hides logits (window, lengths, mask, segment
        ids), or moves causal's diagonal (bottom-right alignment)."""
        return self.bottom_right or any(x is not None for x in (
            self.window, self.q_lens, self.kv_lens, self.mask_docs, self.segment_docs))

    def visible_pairs(self) -> float:
        """The (t, s) pairs whose logits a call computes, summed over the batch, per query
        head: B·T·S (causal: half that, the convention) without a restriction; else the exact
        count, row by row (each row sees one interval of keys; see the package docstring)."""
        if not self.restricted:
            return self.batch * self.seqlen_q * self.seqlen_k * (0.5 if self.causal else 1.0)
        t = np.arange(self.seqlen_q, dtype=np.int64)
        total = 0
        for b in range(self.batch):
            rows = t[:self.q_lens[b]] if self.q_lens is not None else t
            lo = np.zeros_like(rows)
            hi = np.full_like(rows, self.seqlen_k if self.kv_lens is None else self.kv_lens[b])
            pos = rows + (self.diagonal_shift if self.bottom_right else 0)
            if self.causal:
                hi = np.minimum(hi, pos + 1)
            if self.window is not None:
                left, right = self.window
                lo = np.maximum(lo, pos - left)
                hi = np.minimum(hi, pos + right + 1)
            docs = self.mask_docs if self.mask_docs is not None else self.segment_docs
            if docs is not None:
                starts, ends = _document_bounds(docs[b], self.mask_length, rows)
                lo, hi = np.maximum(lo, starts), np.minimum(hi, ends)
            total += int(np.maximum(hi - lo, 0).sum())
        return float(total)

    @property
    def diagonal_shift(self) -> int:
        """S - T: where bottom-right alignment puts query 0."""
        return self.seqlen_k - self.seqlen_q

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
        """Bytes of K and V one forward call must read: one per element when they are stored
        as e4m3 (their descales, 8 bytes per batch entry and kv head, are left out)."""
        item = 1 if self.kv_fp8 else jnp.dtype(self.jnp_dtype).itemsize
        return 2 * math.prod(self.kv_shape) * item

    def term_bytes(self) -> int:
        """Bytes of the bias and boolean mask as passed: the bias in q's dtype, the mask [B, 1,
        T, S] one byte per element (0 without either)."""
        total = 0
        if self.bias_shape is not None:
            total += math.prod(self.bias_shape) * jnp.dtype(self.jnp_dtype).itemsize
        if self.mask_docs is not None:
            total += self.batch * self.seqlen_q * self.seqlen_k
        return total

    def extra_bytes(self) -> int:
        """Bytes of the bias, mask and segment ids a call reads."""
        total = self.term_bytes()
        if self.segment_docs is not None:
            total += 4 * self.batch * (self.seqlen_q + self.seqlen_k)
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


def document_bounds(docs: int | tuple[int, ...], length: int) -> np.ndarray:
    """The document boundaries [0, ..., length] of one batch entry: `docs` documents splitting
    `length` positions as evenly as integers allow (an int), or documents of the given lengths
    (a tuple, summing to `length`)."""
    if isinstance(docs, (int, np.integer)):
        return (np.arange(docs + 1, dtype=np.int64) * length) // docs
    bounds = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])
    if bounds[-1] != length or np.any(np.diff(bounds) < 1):
        raise ValueError(f"document lengths {docs} are not positive lengths summing to {length}")
    return bounds


def _document_bounds(docs, length: int, positions):
    """[start, end) of the document holding each position (`document_bounds`' split)."""
    bounds = document_bounds(docs, length)
    index = np.searchsorted(bounds, positions, side="right") - 1
    return bounds[index], bounds[index + 1]


def document_ids(docs, length: int) -> np.ndarray:
    """The document index of each of `length` positions (`document_bounds`' split)."""
    bounds = document_bounds(docs, length)
    return (np.searchsorted(bounds, np.arange(length), side="right") - 1).astype(np.int32)


def heads(hidden: int, head_dim: int) -> int:
    """N = hidden / H, which must divide."""
    if hidden % head_dim:
        raise ValueError(f"hidden {hidden} is not a multiple of head dim {head_dim}")
    return hidden // head_dim


def standard_grid(dtypes=("bf16", "fp16"), head_dims=STANDARD_HEAD_DIMS,
                  seqlens=STANDARD_SEQLENS, causal=(False, True), tokens=STANDARD_TOKENS,
                  hidden=STANDARD_HIDDEN) -> list[Config]:
    """B = tokens / T, N = hidden / H, S = T (the standard grid)."""
    configs = []
    for dtype in dtypes:
        for h in head_dims:
            n = heads(hidden, h)
            for t in seqlens:
                if tokens % t:
                    raise ValueError(f"tokens {tokens} is not a multiple of seqlen {t}")
                for is_causal in causal:
                    configs.append(Config(tokens // t, t, t, n, n, h, dtype, bool(is_causal)))
    return configs


def decode_grid(dtypes=("bf16", "fp16"), seqlens=DECODE_SEQLENS, kv_len=None,
                page_sizes=(), fp8=False) -> list[Config]:
    """The decode preset: a few query tokens against a long, grouped K/V. With `fp8`, each
    T's plain row is followed by the same call on K and V stored as e4m3 (variant "e4m3").
    With `page_sizes`, each T also gets a row causal at the bottom right (the new tokens' own
    positions) with each sequence's length given, as a paged call gives it (variant
    "contiguous", the paged rows' yardstick), and that call through a paged cache of each page
    size (variant "paged P")."""
    d = DECODE_SHAPE
    configs = []
    for dtype in dtypes:
        for t in seqlens:
            base = Config(d["batch"], t, kv_len or d["kv_len"], d["num_heads"],
                          d["num_kv_heads"], d["head_dim"], dtype, False, kind="decode")
            configs.append(base)
            if fp8:
                configs.append(dataclasses.replace(base, kv_fp8=True, variant="e4m3"))
            if page_sizes:
                contiguous = dataclasses.replace(base, causal=True, bottom_right=True,
                                                 kv_lens=(base.seqlen_k,) * base.batch,
                                                 variant="contiguous")
                configs.append(contiguous)
                configs += [dataclasses.replace(contiguous, page_size=size,
                                                variant=f"paged {size}")
                            for size in page_sizes]
    return configs


def variants_grid(dtypes=("bf16",), seqlens=VARIANTS_SEQLENS,
                  head_dims=(VARIANTS_SHAPE["head_dim"],), batch=VARIANTS_SHAPE["batch"],
                  hidden=VARIANTS_SHAPE["hidden"], kv_group=VARIANTS_SHAPE["kv_group"],
                  window=None, soft_cap=VARIANTS_SHAPE["soft_cap"], tokens=None) -> list[Config]:
    """The variants preset: one row per option users pass, at B = `batch` (or tokens / T
    when `tokens` is given), T = S, N = hidden / H: full, causal, a causal sliding window (`window`, default min(1024, T/4),
    right side 0), per-batch lengths (queries and keys alike: T·(B-i)/B for entry i, so
    4096, 3072, 2048, 1024), GQA (N over N/kv_group kv heads, causal), a bias of q's dtype
    in three shapes, full (rows "bias [1,N,T,S]", "bias [B,1,T,S]", "bias [B,N,T,S]"), a
    boolean document mask [B, 1, T, S] (entry i packs 2**i documents, full), the same
    documents as segment ids, full and causal (other implementations than ours get them as
    that mask, built from the ids inside the timed call, as a jax.nn user would), and logits
    soft-capped at `soft_cap`, full and causal (ours only; no such rows with None),
    attention sinks, full and causal (ours only), ALiBi, full and causal (jax.nn gets the
    dense bias), and a prefill of T / 16 queries against the T keys, causal with the diagonal
    at the bottom right (jax.nn gets it as a mask)."""
    configs = []
    for dtype in dtypes:
        for h in head_dims:
            n = heads(hidden, h)
            kv = max(1, n // kv_group)
            if n % kv:
                raise ValueError(f"{n} heads do not split into groups of {kv_group}")
            for t in seqlens:
                b = max(1, tokens // t) if tokens else batch
                base = Config(b, t, t, n, n, h, dtype, False, kind="variants", variant="full")
                side = window or max(1, min(VARIANTS_SHAPE["window"], t // 4))
                lens = tuple(max(1, t * (b - i) // b) for i in range(b))
                docs = tuple(min(2 ** i, t) for i in range(b))
                configs += [
                    base,
                    dataclasses.replace(base, causal=True, variant="causal"),
                    dataclasses.replace(base, causal=True, window=(side, 0),
                                        variant=f"window {side}"),
                    dataclasses.replace(base, q_lens=lens, kv_lens=lens, variant="lengths"),
                    dataclasses.replace(base, causal=True, num_kv_heads=kv,
                                        variant=f"GQA {n}/{kv}"),
                    dataclasses.replace(base, bias_shape=(1, n, t, t), variant="bias [1,N,T,S]"),
                    dataclasses.replace(base, bias_shape=(b, 1, t, t),
                                        variant="bias [B,1,T,S]"),
                    dataclasses.replace(base, bias_shape=(b, n, t, t),
                                        variant="bias [B,N,T,S]"),
                    dataclasses.replace(base, mask_docs=docs, variant="mask [B,1,T,S]"),
                    dataclasses.replace(base, segment_docs=docs, variant="segment ids"),
                    dataclasses.replace(base, causal=True, segment_docs=docs,
                                        variant="segment ids, causal"),
                ]
                if soft_cap is not None:
                    configs += [
                        dataclasses.replace(base, soft_cap=soft_cap,
                                            variant=f"soft-cap {soft_cap:g}"),
                        dataclasses.replace(base, causal=True, soft_cap=soft_cap,
                                            variant=f"soft-cap {soft_cap:g}, causal"),
                    ]
                prefill = max(1, t // 16)
                configs += [
                    dataclasses.replace(base, sinks=True, variant="sinks"),
                    dataclasses.replace(base, causal=True, sinks=True, variant="sinks, causal"),
                    dataclasses.replace(base, alibi=True, variant="ALiBi"),
                    dataclasses.replace(base, causal=True, alibi=True, variant="ALiBi, causal"),
                    dataclasses.replace(base, seqlen_q=prefill, causal=True, bottom_right=True,
                                        variant=f"prefill {prefill}, bottom-right"),
                ]
    return configs
