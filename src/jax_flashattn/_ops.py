"""`jax.ffi.ffi_call` wrappers: the only place that knows the FFI targets' operands.

Optional inputs (bias, mask, query and key/value lengths, query and key/value segment ids, the
spans the kernels narrow their tiles to (from the ids and the mask: segments.spans,
segments.mask_spans), ALiBi slopes) are passed only when present, in that order, and flagged
by attributes (one flag for the two ids, one for the two spans). The handlers treat every
dimension before [T, N, H] as batch, so operands may carry extra leading dims (all of them the
same ones, in front, as `vmap_method="broadcast_all"` gives a vmapped call): it stays one
custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashattn import _ffi, segments


def _spans(q, k, mask, q_ids, kv_ids):
    """The spans the kernels narrow their tiles to (int32 [..., B, ceil(T / 16), 2] and
    [..., B, ceil(S / 16), 2]: segments.spans): the segment ids', the mask's, or where both
    are given the keys and rows both allow; None without either."""
    if q_ids is None and mask is None:
        return None
    lead = q.shape[:-3]
    t, s = q.shape[-3], k.shape[-3]
    found = []
    if q_ids is not None:
        found.append(segments.spans(q_ids, kv_ids))
    if mask is not None:
        found.append(tuple(jnp.broadcast_to(x, (*lead, *x.shape[-2:]))
                           for x in segments.mask_spans(mask, t, s)))
    if len(found) == 1:
        return found[0]
    return tuple(segments.intersect(a, b) for a, b in zip(*found))


def _optional_operands(q, k, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi, alibi_shift):
    present = [x for x in (bias, mask, q_lens, kv_lens, q_ids, kv_ids) if x is not None]
    spans = _spans(q, k, mask, q_ids, kv_ids)
    if spans is not None:
        present.extend(spans)
    if alibi is not None:
        present.append(alibi)
    flags = dict(has_bias=bias is not None, has_mask=mask is not None,
                 has_q_seqlens=q_lens is not None, has_kv_seqlens=kv_lens is not None,
                 has_segment_ids=q_ids is not None, has_spans=spans is not None,
                 has_alibi=alibi is not None, has_kv_descale=False, has_page_table=False)
    flags = {k: np.int32(v) for k, v in flags.items()}
    return present, dict(flags, alibi_shift=np.int64(alibi_shift))


# ffi/params.h's kUnboundedWindow: any other value, negative ones too, is a real bound.
UNBOUNDED_WINDOW = np.iinfo(np.int64).min


def _attrs(scale: float, window: tuple[int | None, int | None],
           switches: _ffi.KernelSwitches, deterministic: bool = False, soft_cap: float = 0.0,
           align_window_to_lengths: bool = False, want_dslopes: bool = False):
    """window: (left, right), None for an unbounded side; soft_cap: 0 for none;
    align_window_to_lengths: the window (and ALiBi's diagonal) moves by kv_len - q_len per batch
    entry (ffi/params.h); want_dslopes: the backward returns the ALiBi slopes' gradient."""
    left, right = (UNBOUNDED_WINDOW if w is None else w for w in window)
    return dict(scale=np.float32(scale), logits_soft_cap=np.float32(soft_cap),
                window_left=np.int64(left), window_right=np.int64(right),
                align_window_to_lengths=np.int32(align_window_to_lengths),
                deterministic=np.int32(deterministic), want_dslopes=np.int32(want_dslopes),
                **switches.attrs())


def _varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over inside shard_map (jax 0.10+ `manual_axis_type`,
    older `vma`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def vary_like(outs, operands):
    """ffi_call types its results as invariant over shard_map's manual axes whatever its
    operands are; mark them varying over the axes the operands vary over, as they do."""
    axes = frozenset().union(*(_varying_axes(x) for x in operands if x is not None))
    if not axes:
        return outs

    def vary(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)  # jax < 0.8

    return tuple(None if x is None else vary(x) for x in outs)


def forward(q, k, v, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None, alibi=None, *,
            scale: float, window: tuple, switches: _ffi.KernelSwitches, soft_cap: float = 0.0,
            align_window_to_lengths: bool = False, alibi_shift: int = 0):
    """(out [..., B, T, N, H] in q's dtype, lse [..., B, N, T] float32). `switches`: the
    kernel switches the public function read (_ffi.KernelSwitches). `align_window_to_lengths`:
    query t of batch entry b sits at t + kv_len_b - q_len_b for the window and ALiBi (its
    lengths, T and S where absent), which then move per entry. `alibi`: float32 [..., B, N]
    slopes, whose term is -slope |t + alibi_shift - s| (plus that per-entry move).
    """
    out, lse, _, _ = forward_with_workspaces(
        q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi, scale=scale, window=window,
        switches=switches, soft_cap=soft_cap, align_window_to_lengths=align_window_to_lengths,
        alibi_shift=alibi_shift)
    return vary_like((out, lse), (q, k, v, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi))


def forward_with_workspaces(q, k, v, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None,
                            alibi=None, *, scale: float, window: tuple,
                            switches: _ffi.KernelSwitches, soft_cap: float = 0.0,
                            align_window_to_lengths: bool = False, alibi_shift: int = 0):
    """`forward`'s call with all four of its results: out, lse and the CUDA kernels'
    workspaces, which are results so that XLA owns their memory: int32, the Hopper kernel's
    tile counter (zeroed on the stream per call) followed, with segment ids, by the order it
    hands the tiles out in (ffi/cuda/wgmma/tile_order.cuh), and float32, the split partials of
    the decode kernel (_ffi.plan; empty when the call cannot take it). `forward` drops the
    workspaces; the tests read the tile order."""
    *lead, t, n, _ = q.shape
    optional, flags = _optional_operands(q, k, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi,
                                         alibi_shift)
    shape = _ffi.call_shape(q.shape, k.shape, q.dtype, scale=scale, has_bias=bias is not None,
                            has_mask=mask is not None, has_q_seqlens=q_lens is not None,
                            has_kv_seqlens=kv_lens is not None,
                            has_segment_ids=q_ids is not None, has_alibi=alibi is not None,
                            soft_cap=soft_cap, switches=switches)
    plan = _ffi.plan(shape)
    call = jax.ffi.ffi_call(
        _ffi.FORWARD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((*lead, n, t), jnp.float32),
         jax.ShapeDtypeStruct((plan.forward_workspace_ints,), jnp.int32),
         jax.ShapeDtypeStruct((plan.decode_workspace_floats,), jnp.float32)),
        vmap_method="broadcast_all")
    return call(q, k, v, *optional, **flags,
                **_attrs(scale, window, switches, soft_cap=soft_cap,
                         align_window_to_lengths=align_window_to_lengths))


def cache_forward(q, key_cache, value_cache, page_table, q_lens, kv_lens, *, scale: float,
                  window: tuple, switches: _ffi.KernelSwitches, soft_cap: float = 0.0,
                  k_descale=None, v_descale=None, align_window_to_lengths: bool = True):
    """`forward` on a KV cache as it is stored. Pages read in place: q [B, T, N, H], key_cache
    and value_cache [P, page_size, K, H], page_table int32 [B, max_pages], kv_lens int32 [B]
    (required), q_lens int32 [B] or None; the keys are S = max_pages x page_size long
    (ffi/params.h's page_table). page_table None: key_cache and value_cache are [B, S, K, H]
    (kv_lens then optional). k_descale and v_descale (float32 [B, K], both or neither): the
    caches hold float8_e4m3fn values, dequantised as the kernels load them. Window and lengths
    as in `forward` (align_window_to_lengths: True for a paged call, whose windows always move
    with the lengths). Runs on the CPU kernels, or on a GPU where a split-KV decode kernel
    takes the call (its decode workspace is not empty: _ffi.plan; with e4m3 caches a bf16 or
    float16 q and ffi/decode_plan.h's decode_fp8_kv_fits); the CUDA handler refuses any
    other. vmap runs one call per element."""
    batch, t, n, _ = q.shape
    paged = page_table is not None
    kv_heads, head_dim = key_cache.shape[2:]
    keys = ((batch, page_table.shape[1] * key_cache.shape[1], kv_heads, head_dim) if paged
            else key_cache.shape)
    fp8 = k_descale is not None
    optional = [x for x in (q_lens, kv_lens) if x is not None]
    optional += [k_descale, v_descale] if fp8 else []
    optional += [page_table] if paged else []
    shape = _ffi.call_shape(q.shape, keys, q.dtype, scale=scale,
                            has_q_seqlens=q_lens is not None, has_kv_seqlens=kv_lens is not None,
                            soft_cap=soft_cap, switches=switches)
    decode_floats = _ffi.plan(shape).decode_workspace_floats
    flags = dict(has_bias=False, has_mask=False, has_q_seqlens=q_lens is not None,
                 has_kv_seqlens=kv_lens is not None, has_segment_ids=False, has_spans=False,
                 has_alibi=False, has_kv_descale=fp8, has_page_table=paged)
    call = jax.ffi.ffi_call(
        _ffi.FORWARD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((batch, n, t), jnp.float32),
         jax.ShapeDtypeStruct((1,), jnp.int32),
         jax.ShapeDtypeStruct((decode_floats,), jnp.float32)),
        vmap_method="sequential")
    out, lse, _, _ = call(q, key_cache, value_cache, *optional,
                          **{k: np.int32(v) for k, v in flags.items()},
                          alibi_shift=np.int64(0),
                          **_attrs(scale, window, switches, soft_cap=soft_cap,
                                   align_window_to_lengths=align_window_to_lengths))
    return vary_like((out, lse), (q, key_cache, value_cache, page_table, q_lens, kv_lens,
                                  k_descale, v_descale))


def e4m3_forward(q, k, vt, q_lens, kv_lens, qk_descale, v_descale, *, out_dtype, scale: float,
                 window: tuple, switches: _ffi.KernelSwitches,
                 align_window_to_lengths: bool = False):
    """FP8 attention on the Hopper forward's e4m3 kernels: (out [..., B, T, N, H] of out_dtype
    (bfloat16 or float16), lse [..., B, N, T] float32) for q [..., B, T, N, H] and k
    [..., B, S, K, H] of float8_e4m3fn, vt the values as fp8.kernel_values lays them out
    ([..., B, K, H, S'], zero past each entry's key length), qk_descale the product of the query's
    and the key's descales and v_descale the value's (float32 [..., B, K] each). The caller
    asks the plan first (fp8.attention_kernels_take): the CUDA handler refuses a call these
    kernels do not take, the CPU one every call. Window and lengths as in `forward`."""
    *lead, t, n, _ = q.shape
    optional = [x for x in (q_lens, kv_lens) if x is not None] + [qk_descale, v_descale]
    flags = dict(has_bias=False, has_mask=False, has_q_seqlens=q_lens is not None,
                 has_kv_seqlens=kv_lens is not None, has_segment_ids=False, has_spans=False,
                 has_alibi=False, has_kv_descale=True, has_page_table=False)
    call = jax.ffi.ffi_call(
        _ffi.FORWARD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, out_dtype),
         jax.ShapeDtypeStruct((*lead, n, t), jnp.float32),
         jax.ShapeDtypeStruct((1,), jnp.int32),
         jax.ShapeDtypeStruct((0,), jnp.float32)),
        vmap_method="broadcast_all")
    out, lse, _, _ = call(q, k, vt, *optional, **{k: np.int32(v) for k, v in flags.items()},
                          alibi_shift=np.int64(0),
                          **_attrs(scale, window, switches,
                                   align_window_to_lengths=align_window_to_lengths))
    return vary_like((out, lse), (q, k, vt, q_lens, kv_lens, qk_descale, v_descale))


def backward(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None,
             alibi=None, *, scale: float, window: tuple, switches: _ffi.KernelSwitches,
             deterministic: bool = False, dbias: bool = False, soft_cap: float = 0.0,
             align_window_to_lengths: bool = False, alibi_shift: int = 0,
             dslopes: bool = False):
    """(dq, dk, dv, dbias, dslopes) where dbias is the float32 gradient of the logits' bias, or
    None without bias or without `dbias` (its cotangent not needed: the call then has no such
    result and allocates nothing for it), and dslopes the float32 [..., B, N] gradient of the
    ALiBi slopes likewise (with `alibi` and `dslopes`; the kernels give it as partial sums,
    summed here: ffi/params.h's dslopes_slots). The kernels sum dbias over the bias's
    broadcast dims into the bias's shape; with `deterministic` it is the full [..., B, N, T, S]
    instead, for the caller to sum (the CUDA kernels would sum it with float32 atomics, whose
    order varies).

    `deterministic` makes the CUDA kernels' gradients bit-identical across runs (the CPU
    kernels' always are): the Hopper kernel adds each query tile's dQ in a fixed order of key
    blocks, the mma.sync family computes dQ in a pass of its own, instead of float32 atomics in
    any order. `align_window_to_lengths`: as in `forward`.
    """
    grads = backward_with_workspaces(
        q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi, scale=scale,
        window=window, switches=switches, deterministic=deterministic, dbias=dbias,
        soft_cap=soft_cap, align_window_to_lengths=align_window_to_lengths,
        alibi_shift=alibi_shift, dslopes=dslopes)
    with_dbias = bias is not None and dbias
    with_dslopes = alibi is not None and dslopes
    return vary_like((*grads[:3], grads[6] if with_dbias else None,
                      jnp.sum(grads[-1], axis=-1) if with_dslopes else None),
                     (q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids, kv_ids,
                      alibi))


def backward_with_workspaces(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids=None,
                             kv_ids=None, alibi=None, *, scale: float, window: tuple,
                             switches: _ffi.KernelSwitches, deterministic: bool = False,
                             dbias: bool = False, soft_cap: float = 0.0,
                             align_window_to_lengths: bool = False, alibi_shift: int = 0,
                             dslopes: bool = False):
    """`backward`'s call with all of its results: dq, dk, dv, the CUDA kernels' workspaces
    (results so that XLA owns their memory: a float32 dQ accumulator shaped like q, D =
    rowsum(dO * O) float32 [..., B, N, T], and int32, the dQ semaphores of the deterministic
    mode followed, with segment ids, by the order the Hopper kernel runs its blocks in:
    _ffi.plan, ffi/cuda/wgmma/tile_order.cuh), then dbias and the slopes' partial sums where
    asked for. `backward` keeps what it returns; the tests read the block order."""
    *lead, t, n, _ = q.shape
    s = k.shape[-3]
    optional, flags = _optional_operands(q, k, bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi,
                                         alibi_shift)
    plan = _ffi.plan(_ffi.call_shape(q.shape, k.shape, q.dtype, scale=scale,
                                     has_segment_ids=q_ids is not None,
                                     deterministic=deterministic, soft_cap=soft_cap,
                                     switches=switches))
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    results.append(jax.ShapeDtypeStruct(q.shape, jnp.float32))  # dq_accum
    results.append(jax.ShapeDtypeStruct((*lead, n, t), jnp.float32))  # delta
    results.append(jax.ShapeDtypeStruct((plan.backward_workspace_ints,), jnp.int32))
    if bias is not None and dbias:
        shape = (*lead, n, t, s) if deterministic else bias.shape
        results.append(jax.ShapeDtypeStruct(shape, jnp.float32))
    with_dslopes = alibi is not None and dslopes
    if with_dslopes:
        results.append(jax.ShapeDtypeStruct((*alibi.shape, plan.dslopes_slots), jnp.float32))
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, tuple(results), vmap_method="broadcast_all")
    return call(q, k, v, out, lse, d_out, *optional, **flags,
                **_attrs(scale, window, switches, deterministic, soft_cap,
                         align_window_to_lengths, with_dslopes))
