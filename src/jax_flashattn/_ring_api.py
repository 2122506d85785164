"""Ring attention for callers who write `jax.shard_map` themselves.

`ring_attention` runs inside `shard_map` on sequence shards: the same ring that `attention` takes
under `jit` when T and S are sharded (`jax_flashattn._ring`). K/V rotate by `ppermute` over the
mesh axes the sequence is split over while each device computes on the shard it holds, and the
partial results merge exactly through their log-sum-exp; the backward runs the same ring,
rotating dK/dV with their K/V shard. `ring_schedule` is the static plan a call runs (each
device's work, the re-layout, the steps). Causal work is balanced either by a zig-zag re-layout
inside the call (`layout="contiguous"`, `load_balance=True`) or by inputs already laid out
zig-zag (`layout="zigzag"`: `zigzag` reorders a global sequence for that, `unzigzag` undoes it).

Public through `jax_flashattn.sharding`, which imports these names from here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashattn import _ffi, _ops, _ring, _sinks, _validate

__all__ = ["ring_attention", "ring_schedule", "zigzag", "unzigzag"]


@dataclasses.dataclass(frozen=True)
class _RingConfig:
    scale: float
    soft_cap: float
    window: tuple
    schedule: _ring.Schedule
    axes: tuple
    switches: _ffi.KernelSwitches
    alibi_shift: int  # ALiBi's diagonal in global positions (the global S - T or 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _ring_call(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, slopes, config):
    out, lse = _ring.seq_forward(q, k, v, None, None, q_lens, kv_lens, q_ids, kv_ids, slopes,
                                 scale=config.scale, soft_cap=config.soft_cap,
                                 window=config.window, schedule=config.schedule,
                                 axes=config.axes, switches=config.switches,
                                 alibi_shift=config.alibi_shift)
    # The sinks once per row, on the ring's merged result (each step's kernel call runs
    # without them).
    return _sinks.apply(out, lse, sinks)


def _ring_fwd(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, slopes, config):
    out, lse = _ring_call(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, slopes, config)
    return (out, lse), (q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, slopes, out, lse)


def _ring_bwd(config, residuals, cotangents):
    q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, slopes, out, lse = residuals
    d_out, _ = cotangents
    dq, dk, dv, _, d_slopes = _ring.seq_backward(
        q, k, v, out, lse, d_out, None, None, q_lens, kv_lens, q_ids, kv_ids, slopes,
        scale=config.scale, soft_cap=config.soft_cap, window=config.window,
        schedule=config.schedule, axes=config.axes, switches=config.switches,
        alibi_shift=config.alibi_shift, dslopes=True)
    # This device's parts: ring_attention marked the sinks and the slopes varying over the
    # ring's axes, so shard_map sums the parts.
    d_sinks = None if sinks is None else _sinks.gradient(sinks, out, lse, d_out)
    return dq, dk, dv, None, None, None, None, d_sinks, d_slopes


_ring_call.defvjp(_ring_fwd, _ring_bwd)


def _axis_tuple(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def ring_schedule(num_devices: int, q_seq_len: int, kv_seq_len: int | None = None, *,
                  is_causal: bool = False, local_window_size=None, layout: str = "contiguous",
                  load_balance: bool = True, diagonal_alignment: str = "top_left",
                  alibi: bool = False) -> _ring.Schedule:
    """The static plan `ring_attention` runs for GLOBAL lengths over `num_devices`; `alibi`:
    for a call with `alibi_slopes`.

    `.work()` lists, per device, the (query, key) pairs its kernel calls cover; `.relayout`
    says whether contiguous shards are re-laid out zig-zag for balance; `.steps` lists each ring
    step's kernel calls with their per-device windows and offsets (the global position of the
    block's first key less that of its first query; ALiBi's distances move by it).
    """
    if kv_seq_len is None:
        kv_seq_len = q_seq_len
    shift = (kv_seq_len - q_seq_len
             if _validate.check_diagonal_alignment(diagonal_alignment) else 0)
    window = _validate.kernel_window(_validate._window(local_window_size), is_causal, shift)
    return _schedule(num_devices, q_seq_len, kv_seq_len, window, layout, load_balance,
                     bool(alibi))


def _schedule(num_devices, q_seq_len, kv_seq_len, window, layout, load_balance, alibi):
    """ring_schedule for a kernel window (left, right) in GLOBAL positions, None for an
    unbounded side, either side possibly negative (a bottom-right alignment's)."""
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    chunks = num_devices if layout == "contiguous" else 2 * num_devices
    for name, length in (("query", q_seq_len), ("key/value", kv_seq_len)):
        if length % chunks:
            raise ValueError(f"the {name} sequence ({length}) must split into {chunks} equal "
                             f"chunks for layout={layout!r} over {num_devices} devices")
    if layout == "zigzag":
        return _ring.make_schedule(_ring.RING, num_devices, q_seq_len, kv_seq_len, window,
                                   "zigzag", alibi=alibi)
    return _ring.balanced_schedule(_ring.RING, num_devices, q_seq_len, kv_seq_len, window,
                                   load_balance, alibi)


def ring_attention(query, key, value, *, axis_name, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   layout="contiguous", load_balance=True, return_residual=False,
                   query_segment_ids=None, key_value_segment_ids=None, logits_soft_cap=None,
                   diagonal_alignment="top_left", sinks=None, alibi_slopes=None):
    """Ring attention on sequence shards, for use inside `jax.shard_map`.

    Args:
      query: the local shard [B, T/D, N, H] (or [T/D, N, H]) of a sequence split over
        `axis_name` (D devices); key, value: [B, S/D, K, H] shards over the same axis.
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      scale, is_causal, local_window_size: as in `jax_flashattn.attention`, in GLOBAL positions;
        logits_soft_cap and diagonal_alignment as there too (the bottom-right diagonal at the
        global S - T; with the seq lengths and a causal mask, a window or ALiBi a ValueError,
        as each entry's would sit at its own kv_len - q_len).
      sinks: [N] as in `jax_flashattn.attention`, for the local query heads, replicated over
        `axis_name`; their gradient is summed over it (by shard_map).
      alibi_slopes: [N] or [B, N] as in `jax_flashattn.attention`, for the local query heads
        (and batch entries), replicated over `axis_name`: ALiBi's distances are GLOBAL
        positions' (each ring step's kernel call measures them shifted to its block). Their
        gradient is summed over `axis_name` (by shard_map).
      query_seq_lengths, key_value_seq_lengths: int [B] GLOBAL valid lengths (replicated over
        `axis_name`).
      query_segment_ids, key_value_segment_ids: int [B, T/D] and [B, S/D], the LOCAL shards of
        the packed sequences' ids (laid out as query and key); both or neither. The key ids
        travel with their K/V shard, and a step whose blocks share no id computes nothing.
      layout: how the global sequence is laid out over the devices. "contiguous": device p holds
        positions [p*T/D, (p+1)*T/D) (what `NamedSharding` gives). "zigzag": the sequence is cut
        into 2D chunks and device p holds chunks p and 2D-1-p (shard `zigzag(x, D)` to get it;
        undo with `unzigzag`); causal work is then balanced with no re-layout.
      load_balance: for "contiguous", re-lay causal shards out zig-zag inside the call (two
        collective-permutes in, one pair out) when that balances the work; False keeps them.
      return_residual: also return the lse [B, T/D, N] (float32) of the local rows.

    Returns the local output shard [B, T/D, N, H] (and lse). Differentiable: the backward runs
    the same ring, rotating dK/dV with their K/V shard. Memory per device is O(T/D).
    """
    axes = _axis_tuple(axis_name)
    devices = lax.axis_size(axes)
    args = _validate.normalize(query, key, value, None, None, scale=scale, is_causal=is_causal,
                               query_seq_lengths=query_seq_lengths,
                               key_value_seq_lengths=key_value_seq_lengths,
                               local_window_size=local_window_size,
                               query_segment_ids=query_segment_ids,
                               key_value_segment_ids=key_value_segment_ids,
                               logits_soft_cap=logits_soft_cap,
                               diagonal_alignment=diagonal_alignment, sinks=sinks,
                               alibi_slopes=alibi_slopes)
    if args.align_window_to_lengths:
        # Each batch entry's window (and ALiBi's diagonal) would move by its global
        # kv_len - q_len, and a ring block's kernel call sees the block's lengths only.
        raise ValueError(
            "ring_attention: diagonal_alignment='bottom_right' with is_causal, "
            "local_window_size or alibi_slopes and query_seq_lengths or key_value_seq_lengths "
            "(each batch entry's diagonal at its own kv_len - q_len) is not supported on "
            "sequence shards; "
            "call jax_flashattn.attention on the sharded arrays instead (it gathers the "
            "sequences for such a call), or drop the lengths (the diagonal then sits at the "
            "global S - T)")
    t_local, s_local = args.query.shape[1], args.key.shape[1]
    # The shards split T and S evenly: the global S - T is the local one times the devices.
    window = args.kernel_window_at(devices * args.diagonal_shift)
    schedule = _schedule(devices, t_local * devices, s_local * devices, window, layout,
                         load_balance, args.alibi_slopes is not None)
    config = _RingConfig(args.scale, args.soft_cap, window, schedule, axes,
                         _ffi.kernel_switches(), devices * args.alibi_shift)
    # The sinks and slopes (replicated over the ring's axes) marked varying as the rows they
    # meet, so that their cotangents, each device's part, are summed by shard_map itself.
    sinks, slopes = _ops.vary_like((args.sinks, args.alibi_slopes),
                                   (args.query, args.key, args.value))
    out, lse = _ring_call(args.query, args.key, args.value, args.query_seq_lengths,
                          args.key_value_seq_lengths, args.query_segment_ids,
                          args.key_value_segment_ids, sinks, slopes, config)
    out = out.reshape(args.out_shape)
    if not return_residual:
        return out
    lse = lax.stop_gradient(jnp.swapaxes(lse, -1, -2)).reshape(args.out_shape[:-1])
    return out, lse


def zigzag(x, num_shards: int, axis: int = 1):
    """Reorders a GLOBAL sequence axis so that contiguous sharding over `num_shards` devices
    gives device p the chunks p and 2*num_shards-1-p (of 2*num_shards): the layout
    `ring_attention(..., layout="zigzag")` expects."""
    return _permute_chunks(x, num_shards, axis, inverse=False)


def unzigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `zigzag`."""
    return _permute_chunks(x, num_shards, axis, inverse=True)


def _permute_chunks(x, num_shards, axis, inverse):
    x = jnp.asarray(x)
    axis = axis % x.ndim
    chunks = 2 * num_shards
    if x.shape[axis] % chunks:
        raise ValueError(f"axis {axis} of size {x.shape[axis]} does not split into {chunks} "
                         "equal chunks")
    order = [c for p in range(num_shards) for c in (p, chunks - 1 - p)]
    if inverse:
        order = sorted(range(chunks), key=order.__getitem__)
    pieces = jnp.split(x, chunks, axis=axis)
    return jnp.concatenate([pieces[c] for c in order], axis=axis)
