"""The packed preset: rows packed with documents of random lengths, and cuDNN's own
packed-sequence path as an implementation. (Method: the package docstring.)

Each batch row holds documents whose lengths are drawn, with a fixed seed, from a log-normal
distribution of the given mean (sigma PACKED_SIGMA), at least 1 each, until the row is full; the
last document is cut at T. Every row has its own draw. Our kernels and jax.nn get the documents
as segment ids (jax.nn: the boolean mask [B, 1, T, T] they stand for, built inside the call, as
in the variants preset); "cudnn-packed" gets them as cuDNN's per-document lengths and offsets
(`cudnn_packed_arrays`), computed outside the timed call."""

from __future__ import annotations

import inspect
import math
from typing import Callable

import numpy as np

from jax_flashattn._bench.configs import Config, document_bounds, heads

# bf16, H = 128, N = 16 (hidden 2048), causal, T in {8192, 32768} at 32768 tokens per batch.
PACKED_SEQLENS = (8192, 32768)
PACKED_TOKENS = 32768
PACKED_SHAPE = dict(hidden=2048, head_dim=128)
PACKED_MEANS = (1024, 4096)  # mean document lengths, one row of the table each
PACKED_SIGMA = 1.0  # of the lengths' logarithm
PACKED_SEED = 0
# The key of `Inputs.extras` that holds cuDNN's (lengths, offsets); only "cudnn-packed" reads it.
CUDNN_PACKED_EXTRA = "cudnn_packed"


class Unavailable(Exception):
    """An implementation that cannot run this case here (reported, never timed)."""


def draw_documents(batch: int, length: int, mean: int, sigma: float = PACKED_SIGMA,
                   seed: int = PACKED_SEED) -> tuple[tuple[int, ...], ...]:
    """Each row's document lengths (summing to `length`): log-normal draws of mean `mean`,
    rounded, at least 1, until the row is full, the last one cut. The draws depend on
    (seed, mean, length) only."""
    rng = np.random.default_rng([seed, mean, length])
    mu = math.log(mean) - sigma ** 2 / 2  # E[exp(N(mu, sigma^2))] = mean
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < length:
            draw = max(1, int(round(rng.lognormal(mu, sigma))))
            lengths.append(min(draw, length - total))
            total += lengths[-1]
        rows.append(tuple(lengths))
    return tuple(rows)


def packed_variant(mean: int) -> str:
    """A packed row's name in the table."""
    return f"packed, mean {mean}"


def _variant_mean(variant: str) -> int | None:
    """The mean document length of a `packed_variant` name (None for another name)."""
    head, _, mean = variant.rpartition(" ")
    return int(mean) if head == "packed, mean" and mean.isdigit() else None


DENSE_VARIANT = "dense causal"


def packed_grid(dtypes=("bf16",), seqlens=PACKED_SEQLENS, head_dims=(PACKED_SHAPE["head_dim"],),
                tokens=PACKED_TOKENS, hidden=PACKED_SHAPE["hidden"], means=PACKED_MEANS,
                sigma=PACKED_SIGMA, seed=PACKED_SEED, dense=True) -> list[Config]:
    """The packed preset: per mean document length, causal rows of T in `seqlens` (B =
    tokens / T, N = hidden / H) packed by `draw_documents`, FLOPs counting the visible pairs
    (each document's causal pairs). With `dense`, each mean that is at most the longest T and
    divides `tokens` first gets a dense causal row at T = that mean (B = tokens / T, no
    documents: our own yardstick for the packed rows)."""
    configs = []
    for dtype in dtypes:
        for h in head_dims:
            n = heads(hidden, h)
            for mean in means:
                if dense and mean <= max(seqlens) and tokens % mean == 0:
                    configs.append(Config(tokens // mean, mean, mean, n, n, h, dtype, True,
                                          kind="packed", variant=DENSE_VARIANT))
                for t in seqlens:
                    if tokens % t:
                        raise ValueError(f"tokens {tokens} is not a multiple of seqlen {t}")
                    docs = draw_documents(tokens // t, t, mean, sigma, seed)
                    configs.append(Config(tokens // t, t, t, n, n, h, dtype, True,
                                          kind="packed", variant=packed_variant(mean),
                                          segment_docs=docs))
    return configs


def packed_summary(cfg: Config) -> dict:
    """The documents of a packed row: their count per row and mean length (none: dense)."""
    if cfg.segment_docs is None:
        return dict(documents=0, docs_per_row=0.0, mean_length=None)
    counts = [len(document_bounds(d, cfg.mask_length)) - 1 for d in cfg.segment_docs]
    return dict(documents=sum(counts), docs_per_row=sum(counts) / cfg.batch,
                mean_length=cfg.batch * cfg.mask_length / sum(counts))


# ----------------------------------------------------------------------------- cuDNN's path


def cudnn_packed_arrays(rows, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cuDNN's packed layout of the rows' documents (each row an int or its lengths, as
    `Config.segment_docs`): lengths int32 [B, M] and offsets int32 [B, M+1], M the most
    documents of a row, at least 2 (jax takes its packed path for M > 1 only). Row b of
    lengths: its documents' lengths, then 0 in the slots it does not use; of offsets: its
    documents' starts, then `length` (the row's end) in the slots it does not use, then -1.

    Why this shape: jax._src.cudnn.fused_attention_stablehlo flattens both arrays and moves
    their non-negative entries to the front before cuDNN sees them (`_fix_seqlen_offsets`);
    cuDNN's document i is then lengths.flat[i] positions from the i-th non-negative entry of
    offsets (plus b * T, b that entry's row).
    Lengths padded with 0 all stay in place, so each row of offsets must keep exactly M
    non-negative entries for row b's documents to stay at b * M + j in both; the one -1 per
    row is the entry that drops out. (The module's docstring pads both arrays with -1 after
    the starts, which keeps them aligned too.) Offsets that list a row's end after its starts
    pair lengths with other documents' offsets from the second row on, whichever the
    lengths' padding: wrong rows, and no error (H200, jax 0.11.2).
    """
    bounds = [document_bounds(d, length) for d in rows]
    docs = max(2, max(len(b) - 1 for b in bounds))
    lengths = np.zeros((len(rows), docs), np.int32)
    offsets = np.full((len(rows), docs + 1), length, np.int32)
    for b, row in enumerate(bounds):
        lengths[b, :len(row) - 1] = np.diff(row)
        offsets[b, :len(row) - 1] = row[:-1]
    offsets[:, -1] = -1
    return lengths, offsets


_PACKED_PARAMETERS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type",
                      "qkv_layout")


def cudnn_packed_api():
    """(dot_product_attention, MaskType) of jax._src.cudnn.fused_attention_stablehlo, or
    Unavailable where that private module or the arguments used here are missing."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as module
        function, mask_type = module.dot_product_attention, module.MaskType
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"no cuDNN packed path in this JAX: {e}") from e
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as e:
        raise Unavailable(f"cuDNN's dot_product_attention has no signature: {e}") from e
    missing = [p for p in _PACKED_PARAMETERS if p not in parameters]
    missing += [m for m in ("PADDING", "PADDING_CAUSAL") if not hasattr(mask_type, m)]
    if missing:
        raise Unavailable("cuDNN's dot_product_attention in this JAX lacks "
                          + ", ".join(missing))
    return function, mask_type


def packed_rows(cfg: Config) -> tuple:
    """A packed-preset row's documents per batch entry; one document per entry on the dense
    rows (cuDNN's packed path then sees whole rows)."""
    return cfg.segment_docs if cfg.segment_docs is not None else (1,) * cfg.batch


def cudnn_packed_attention(cfg: Config) -> Callable:
    """(q, k, v, **extras) -> out through cuDNN's packed path for a packed-preset row: its
    documents (`packed_rows`) as lengths and offsets (extras[CUDNN_PACKED_EXTRA], the same
    for queries and keys), mask PADDING_CAUSAL (PADDING when not causal), layout BTNH, scale
    1/sqrt(H). Differentiable (the module's own custom vjp)."""
    if cfg.kind != "packed":
        raise Unavailable("cuDNN's packed path runs on the packed preset's rows only")
    function, mask_types = cudnn_packed_api()
    mask_type = mask_types.PADDING_CAUSAL if cfg.causal else mask_types.PADDING
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def attention(q, k, v, **extras):
        lengths, offsets = extras[CUDNN_PACKED_EXTRA]
        try:
            return function(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                            kv_offsets=offsets, scale=scale, mask_type=mask_type,
                            qkv_layout="BTNH")
        except NotImplementedError as e:  # the module's own checks (device, cuDNN version)
            raise Unavailable(f"cuDNN's packed path: {e}") from e
    return attention


def without_extra(fn: Callable, name: str = CUDNN_PACKED_EXTRA) -> Callable:
    """`fn` with one extra argument dropped (the implementations other than cudnn-packed)."""
    def call(q, k, v, **extras):
        return fn(q, k, v, **{key: x for key, x in extras.items() if key != name})
    return call


def packed_record(cfg: Config) -> dict:
    """The record fields of a packed row (`driver.config_record`)."""
    full = cfg.batch * cfg.seqlen_q * cfg.seqlen_k
    return dict(variant=cfg.variant, doc_mean=_variant_mean(cfg.variant),
                segment_docs=cfg.segment_docs, visible=cfg.visible_pairs() / full,
                **packed_summary(cfg))

