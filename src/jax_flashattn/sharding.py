"""Multi-device attention: partitioning rules for `attention` under `jit`, and ring attention.

Under `jax.jit` with sharded inputs, `attention` partitions through XLA's SPMD partitioner: the
kernels' forward and backward are `custom_partitioning` ops with a Shardy sharding rule, so the
partitioner keeps the caller's shardings and every device runs the kernels on its own shards.

- Batch (and any vmapped dims) and heads: no communication. Query head n reads kv head
  n // g; when the mesh size divides the kv heads K, the rule states q's head dim as the
  compound factor `(k g)` of k/v's, so a head sharding propagates between q and k/v and moves
  them together. Otherwise (and for MQA) the two head dims are separate factors: K/V keep their
  own sharding, and a device whose query heads split a kv-head group reads that kv head from
  replicated K/V; only the backward then sums dK/dV over those devices (an all-reduce).
- Sequence (context parallelism): queries sharded on T and keys on S run ring attention over the
  mesh axes of T (`jax_flashattn._ring`): K/V rotate by `ppermute` while each device computes on
  the shard it holds, and partial results merge exactly through their log-sum-exp. Causal
  attention is load-balanced: contiguous shards are re-laid out zig-zag inside the op (half of
  each re-laid shard moves, by two collective-permutes) whenever that lowers the busiest
  device's work. Queries sharded with K/V replicated compute their rows locally; K/V sharded
  with queries replicated (decoding against a sharded cache) compute per shard and merge across
  devices.
- A bias or mask that varies along T or S with a sharded sequence is not split: the partitioner
  gathers the sequence instead (correct, not distributed).

`ring_attention` is the same ring for callers who write `shard_map` themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashattn import _ffi, _ops, _ring, _sinks, _validate

__all__ = ["ring_attention", "ring_schedule", "zigzag", "unzigzag", "forward", "backward"]


# ----------------------------------------------------------------------------------------------
# Public: ring attention inside shard_map

@dataclasses.dataclass(frozen=True)
class _RingConfig:
    scale: float
    soft_cap: float
    window: tuple
    schedule: _ring.Schedule
    axes: tuple
    switches: _ffi.KernelSwitches


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _ring_call(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, config):
    out, lse = _ring.seq_forward(q, k, v, None, None, q_lens, kv_lens, q_ids, kv_ids,
                                 scale=config.scale, soft_cap=config.soft_cap,
                                 window=config.window, schedule=config.schedule,
                                 axes=config.axes, switches=config.switches)
    # The sinks once per row, on the ring's merged result (each step's kernel call runs
    # without them).
    return _sinks.apply(out, lse, sinks)


def _ring_fwd(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, config):
    out, lse = _ring_call(q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, config)
    return (out, lse), (q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, out, lse)


def _ring_bwd(config, residuals, cotangents):
    q, k, v, q_lens, kv_lens, q_ids, kv_ids, sinks, out, lse = residuals
    d_out, _ = cotangents
    dq, dk, dv, _ = _ring.seq_backward(q, k, v, out, lse, d_out, None, None, q_lens, kv_lens,
                                       q_ids, kv_ids, scale=config.scale,
                                       soft_cap=config.soft_cap, window=config.window,
                                       schedule=config.schedule, axes=config.axes,
                                       switches=config.switches)
    # This device's part: ring_attention marked the sinks varying over the ring's axes, so
    # shard_map sums the parts.
    d_sinks = None if sinks is None else _sinks.gradient(sinks, out, lse, d_out)
    return dq, dk, dv, None, None, None, None, d_sinks


_ring_call.defvjp(_ring_fwd, _ring_bwd)


def _axis_tuple(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def ring_schedule(num_devices: int, q_seq_len: int, kv_seq_len: int | None = None, *,
                  is_causal: bool = False, local_window_size=None, layout: str = "contiguous",
                  load_balance: bool = True,
                  diagonal_alignment: str = "top_left") -> _ring.Schedule:
    """The static plan `ring_attention` runs for GLOBAL lengths over `num_devices`.

    `.work()` lists, per device, the (query, key) pairs its kernel calls cover; `.relayout`
    says whether contiguous shards are re-laid out zig-zag for balance; `.steps` lists each ring
    step's kernel calls and their per-device windows.
    """
    if kv_seq_len is None:
        kv_seq_len = q_seq_len
    shift = (kv_seq_len - q_seq_len
             if _validate.check_diagonal_alignment(diagonal_alignment) else 0)
    window = _validate.kernel_window(_validate._window(local_window_size), is_causal, shift)
    return _schedule(num_devices, q_seq_len, kv_seq_len, window, layout, load_balance)


def _schedule(num_devices, q_seq_len, kv_seq_len, window, layout, load_balance):
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
                                   "zigzag")
    return _ring.balanced_schedule(_ring.RING, num_devices, q_seq_len, kv_seq_len, window,
                                   load_balance)


def ring_attention(query, key, value, *, axis_name, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   layout="contiguous", load_balance=True, return_residual=False,
                   query_segment_ids=None, key_value_segment_ids=None, logits_soft_cap=None,
                   diagonal_alignment="top_left", sinks=None):
    """Ring attention on sequence shards, for use inside `jax.shard_map`.

    Args:
      query: the local shard [B, T/D, N, H] (or [T/D, N, H]) of a sequence split over
        `axis_name` (D devices); key, value: [B, S/D, K, H] shards over the same axis.
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      scale, is_causal, local_window_size: as in `jax_flashattn.attention`, in GLOBAL positions;
        logits_soft_cap and diagonal_alignment as there too (the bottom-right diagonal at the
        global S - T; with the seq lengths and a causal mask or window a ValueError, as each
        entry's would sit at its own kv_len - q_len).
      sinks: [N] as in `jax_flashattn.attention`, for the local query heads, replicated over
        `axis_name`; their gradient is summed over it (by shard_map).
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
                               diagonal_alignment=diagonal_alignment, sinks=sinks)
    if args.align_window_to_lengths:
        # Each batch entry's window would move by its global kv_len - q_len, and a ring
        # block's kernel call sees the block's lengths only.
        raise ValueError(
            "ring_attention: diagonal_alignment='bottom_right' with is_causal or "
            "local_window_size and query_seq_lengths or key_value_seq_lengths (each batch "
            "entry's diagonal at its own kv_len - q_len) is not supported on sequence shards; "
            "call jax_flashattn.attention on the sharded arrays instead (it gathers the "
            "sequences for such a call), or drop the lengths (the diagonal then sits at the "
            "global S - T)")
    t_local, s_local = args.query.shape[1], args.key.shape[1]
    # The shards split T and S evenly: the global S - T is the local one times the devices.
    window = args.kernel_window_at(devices * args.diagonal_shift)
    schedule = _schedule(devices, t_local * devices, s_local * devices, window, layout,
                         load_balance)
    config = _RingConfig(args.scale, args.soft_cap, window, schedule, axes,
                         _ffi.kernel_switches())
    # The sinks (replicated over the ring's axes) marked varying as the rows they meet, so that
    # their cotangent, each device's part, is summed by shard_map itself.
    sinks, = _ops.vary_like((args.sinks,), (args.query, args.key, args.value))
    out, lse = _ring_call(args.query, args.key, args.value, args.query_seq_lengths,
                          args.key_value_seq_lengths, args.query_segment_ids,
                          args.key_value_segment_ids, sinks, config)
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


# ----------------------------------------------------------------------------------------------
# Partitioned kernel ops (what `attention` calls)

def _present(*xs):
    return tuple(x for x in xs if x is not None)


def _flags(*optional):
    return tuple(x is not None for x in optional)


def forward(q, k, v, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None, *, scale: float,
            window, switches: _ffi.KernelSwitches, soft_cap: float = 0.0,
            align_window_to_lengths: bool = False):
    """`_ops.forward` that partitions under jit: (out, lse [..., N, T] float32). With
    `align_window_to_lengths` the sequences are never split (_make_plan)."""
    optional = (bias, mask, q_lens, kv_lens, q_ids, kv_ids)
    op = _partitioned("fwd", _flags(*optional), float(scale), float(soft_cap),
                      _Window(tuple(window), bool(align_window_to_lengths)), False, switches)
    return tuple(op(q, k, v, *_present(*optional)))


def backward(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None, *,
             scale: float, window, switches: _ffi.KernelSwitches, deterministic: bool = False,
             dbias: bool = False, soft_cap: float = 0.0, align_window_to_lengths: bool = False):
    """`_ops.backward` that partitions under jit: (dq, dk, dv, dbias), where dbias is float32
    already summed to bias's shape (None without bias or without `dbias`, whose cotangent is
    then not computed). `deterministic`: see _ops.backward; `align_window_to_lengths`: as in
    `forward`."""
    optional = (bias, mask, q_lens, kv_lens, q_ids, kv_ids)
    with_dbias = bias is not None and bool(dbias)
    op = _partitioned("bwd", _flags(*optional), float(scale), float(soft_cap),
                      _Window(tuple(window), bool(align_window_to_lengths)),
                      bool(deterministic), switches, with_dbias)
    grads = op(q, k, v, out, lse, d_out, *_present(*optional))
    return (*grads[:3], grads[3] if with_dbias else None)


@dataclasses.dataclass(frozen=True)
class _Operands:
    q: object
    k: object
    v: object
    out: object
    lse: object
    d_out: object
    bias: object
    mask: object
    q_lens: object
    kv_lens: object
    q_ids: object
    kv_ids: object


def _unpack(kind, flags, xs) -> _Operands:
    xs = list(xs)
    q, k, v = xs[:3]
    out = lse = d_out = None
    rest = xs[3:]
    if kind == "bwd":
        out, lse, d_out = rest[:3]
        rest = rest[3:]
    optional = iter(rest)
    bias, mask, q_lens, kv_lens, q_ids, kv_ids = (next(optional) if flag else None
                                                  for flag in flags)
    return _Operands(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids, kv_ids)


def _explicit_sharding(x):
    """x's sharding-in-types when its mesh has Explicit axes, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    if jax.sharding.AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return sharding


def _replicated(x):
    """x (or None) typed replicated under Explicit mesh axes: the segment ids' spans group the
    position dim, which has no sharding rule where it is split. Only the partitioner's trace of
    the global call sees such types; each shard's call sees its own unsharded ids."""
    sharding = None if x is None else _explicit_sharding(x)
    if sharding is None:
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))


def _typed_like(x, like, dims=None):
    """Under Explicit mesh axes, types x with the sharding of `like` (dims: which of like's
    dims x's dims are): the kernels' results are otherwise typed replicated."""
    sharding = _explicit_sharding(like)
    if sharding is None:
        return x
    spec = tuple(sharding.spec) + (None,) * (like.ndim - len(sharding.spec))
    if dims is not None:
        spec = tuple(spec[d] for d in dims)
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(*spec)))


class _Window(NamedTuple):
    """A call's kernel window: `sides` (left, right), None for an open side, and `aligned`,
    whether it moves per batch entry by kv_len - q_len (align_window_to_lengths in _ops). A
    sequence split cannot take an aligned one: each block would need the global lengths'
    difference, and the kernels see the block's."""
    sides: tuple
    aligned: bool


@functools.lru_cache(maxsize=None)
def _partitioned(kind, flags, scale, soft_cap, window: _Window, deterministic, switches,
                 with_dbias=False):
    """The partitioned forward or backward op; `with_dbias`: the backward also returns the
    bias's gradient (a result only then)."""
    def body(*xs):
        a = _unpack(kind, flags, xs)
        if kind == "fwd":
            out, lse = _ops.forward(a.q, a.k, a.v, a.bias, a.mask, a.q_lens, a.kv_lens,
                                    _replicated(a.q_ids), _replicated(a.kv_ids), scale=scale,
                                    soft_cap=soft_cap, window=window.sides,
                                    align_window_to_lengths=window.aligned, switches=switches)
            lead = tuple(range(a.q.ndim - 3))
            return (_typed_like(out, a.q),
                    _typed_like(lse, a.q, lead + (a.q.ndim - 2, a.q.ndim - 3)))
        dq, dk, dv, dbias = _ops.backward(a.q, a.k, a.v, a.out, a.lse, a.d_out, a.bias,
                                          a.mask, a.q_lens, a.kv_lens, _replicated(a.q_ids),
                                          _replicated(a.kv_ids),
                                          scale=scale, soft_cap=soft_cap, window=window.sides,
                                          align_window_to_lengths=window.aligned,
                                          switches=switches, deterministic=deterministic,
                                          dbias=with_dbias)
        grads = (_typed_like(dq, a.q), _typed_like(dk, a.k), _typed_like(dv, a.v))
        if not with_dbias:
            return grads
        return grads + (_typed_like(_ring.reduce_to(dbias, a.bias.shape), a.bias),)

    op = custom_partitioning(body)
    op.def_partition(partition=functools.partial(_partition, kind, flags, scale, soft_cap,
                                                 window, deterministic, switches, with_dbias),
                     sharding_rule=functools.partial(_sharding_rule, kind, flags, with_dbias))
    op = _broadcasting_vmap(op)
    jitted = jax.jit(op)

    def call(*xs):
        # Eagerly, through jit: sharded inputs then partition as under jit instead of being
        # gathered. Traced, inline: each call lowers to its own custom call.
        return op(*xs) if any(isinstance(x, jax.core.Tracer) for x in xs) else jitted(*xs)

    return call


def _broadcasting_vmap(op):
    """vmap of `op` calls it once with the vmapped dims in front of every operand (the kernels
    treat every dim before [T, N, H] as batch); custom_partitioning has no batching rule."""
    op = jax.custom_batching.custom_vmap(op)

    @op.def_vmap
    def _rule(axis_size, in_batched, *xs):
        xs = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
              for x, batched in zip(xs, in_batched)]
        outs = op(*xs)
        return outs, type(outs)(True for _ in outs)

    return op


def _sharding_rule(kind, flags, with_dbias, mesh, operand_types, result_types):
    """Shardy rule, e.g. "... b t (k g) h, ... b s k h, ... b s k h -> ... b t (k g) h,
    ... b (k g) t" for GQA, with extra factors for the broadcast dims of bias and mask."""
    del result_types
    shapes = [tuple(t.shape) for t in operand_types]
    num_heads, kv_heads = shapes[0][-2], shapes[1][-2]
    devices = math.prod(mesh.shape.values()) if not mesh.empty else 1
    sizes = {}
    if kv_heads == num_heads:
        heads = "k"
    elif kv_heads % devices:
        # Query heads split finer than the kv heads would give K/V a sub-axis sharding that
        # custom_partitioning cannot hand over; separate factors keep K/V as they are (the
        # partition then reads the right kv head on each device). Also the MQA case: Shardy
        # rejects a size-1 factor inside a compound one.
        heads = "n"
    else:
        heads, sizes["g"] = "(k g)", num_heads // kv_heads
    q = f"... b t {heads} h"
    kv = "... b s k h"
    lse = f"... b {heads} t"
    a = _unpack(kind, flags, shapes)  # the shapes of the operands, by name

    def broadcastable(shape, tag):
        names = ("b", heads, "t", "s")
        dims = [name if size != 1 else f"{tag}{i}" for i, (name, size) in
                enumerate(zip(names, shape[-4:]))]
        return "... " + " ".join(dims)

    optional = []
    if a.bias is not None:
        optional.append(broadcastable(a.bias, "bias"))
    if a.mask is not None:
        optional.append(broadcastable(a.mask, "mask"))
    optional += ["... b"] * ((a.q_lens is not None) + (a.kv_lens is not None))
    if a.q_ids is not None:
        optional += ["... b t", "... b s"]
    if kind == "fwd":
        operands, results = [q, kv, kv] + optional, [q, lse]
    else:
        operands, results = [q, kv, kv, q, lse, q] + optional, [q, kv, kv]
        if with_dbias:
            results.append(optional[0])
    return (", ".join(operands) + " -> " + ", ".join(results),
            dict(need_replication_factors=("h",), **sizes))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call partitions: mesh axes per dim, and what the local computation does."""
    batch: tuple  # per dim before [T, N, H]: mesh axes
    heads: tuple  # mesh axes of the query heads
    kv_heads_split: bool  # K/V heads split with the query heads; else replicated and selected
    num_heads: int
    kv_heads: int
    local_heads: int  # query heads per device
    seq_axes: tuple = ()  # mesh axes of the sequence (empty: not split)
    schedule: _ring.Schedule | None = None


def _spec_axes(sharding, ndim):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _make_plan(kind, flags, window: _Window, mesh, arg_shapes) -> _Plan:
    a = _unpack(kind, flags, arg_shapes)
    q_shape, k_shape = a.q.shape, a.k.shape
    ndim = len(q_shape)
    num_heads, kv_heads = q_shape[-2], k_shape[-2]
    if not all(isinstance(x.sharding, NamedSharding) for x in (a.q, a.k)):
        # No mesh to name axes by (shardings given without one): run unsplit, on gathered inputs.
        return _Plan(((),) * (ndim - 3), (), True, num_heads, kv_heads, num_heads)
    sizes = dict(mesh.shape)
    q_axes = _spec_axes(a.q.sharding, ndim)
    k_axes = _spec_axes(a.k.sharding, ndim)
    used = set()

    def take(axes, length):
        axes = tuple(x for x in axes if sizes[x] > 1)
        if not axes or used & set(axes) or length % math.prod(sizes[x] for x in axes):
            return ()
        used.update(axes)
        return axes

    batch = tuple(take(q_axes[d], q_shape[d]) for d in range(ndim - 3))
    heads = take(q_axes[-2], num_heads)
    head_split = math.prod(sizes[x] for x in heads)
    kv_heads_split = kv_heads % head_split == 0

    t_len, s_len = q_shape[-3], k_shape[-3]
    # A bias or mask that varies along the sequences, or a window aligned to the lengths
    # (_Window), keeps them whole: gathered where they are split.
    varies = [x.shape[-2:] != (1, 1) for x in (a.bias, a.mask) if x is not None]
    seq_axes, schedule = (), None
    if not any(varies) and not window.aligned:
        t_axes = take(q_axes[-3], t_len)
        if t_axes:
            devices = math.prod(sizes[x] for x in t_axes)
            mode = _ring.RING if k_axes[-3] and s_len % devices == 0 else _ring.ROWS
            seq_axes = t_axes
        else:
            s_axes = take(k_axes[-3], s_len)
            devices = math.prod(sizes[x] for x in s_axes) if s_axes else 1
            mode, seq_axes = _ring.KV_SPLIT, s_axes
        if seq_axes:
            schedule = _ring.balanced_schedule(mode, devices, t_len, s_len, window.sides)
    return _Plan(batch, heads, kv_heads_split, num_heads, kv_heads, num_heads // head_split,
                 seq_axes, schedule)


def _shardings(kind, flags, with_dbias, mesh, plan: _Plan, arg_shapes):
    a = _unpack(kind, flags, arg_shapes)
    mode = plan.schedule.mode if plan.schedule is not None else None
    q_seq = plan.seq_axes if mode in (_ring.RING, _ring.ROWS) else ()
    k_seq = plan.seq_axes if mode in (_ring.RING, _ring.KV_SPLIT) else ()
    batch = list(plan.batch)

    def named(*dims):
        return NamedSharding(mesh, P(*(_entry(d) for d in dims)))

    q = named(*batch, q_seq, plan.heads, ())
    kv = named(*batch, k_seq, plan.heads if plan.kv_heads_split else (), ())
    lse = named(*batch, plan.heads, q_seq)
    lens = named(*batch)

    def broadcastable(shape):
        lead = [axes if size != 1 else () for axes, size in zip(batch, shape[:-3])]
        return named(*lead, plan.heads if shape[-3] != 1 else (), (), ())

    optional = []
    if a.bias is not None:
        optional.append(broadcastable(a.bias.shape))
    if a.mask is not None:
        optional.append(broadcastable(a.mask.shape))
    optional += [lens] * ((a.q_lens is not None) + (a.kv_lens is not None))
    if a.q_ids is not None:
        optional += [named(*batch, q_seq), named(*batch, k_seq)]
    if kind == "fwd":
        return [q, kv, kv] + optional, (q, lse)
    results = [q, kv, kv] + ([optional[0]] if with_dbias else [])
    return [q, kv, kv, q, lse, q] + optional, tuple(results)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _partition(kind, flags, scale, soft_cap, window, deterministic, switches, with_dbias, mesh,
               arg_shapes, result_shape):
    del result_shape
    if mesh.empty:
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("_devices",))
    plan = _make_plan(kind, flags, window, mesh, arg_shapes)
    arg_shardings, result_shardings = _shardings(kind, flags, with_dbias, mesh, plan,
                                                 arg_shapes)
    bias_shape = None
    if flags[0]:
        bias = _unpack(kind, flags, arg_shapes).bias
        bias_shape = tuple(bias.shape)
    local = functools.partial(_local, kind, flags, scale, soft_cap, window, deterministic,
                              switches, with_dbias, plan, bias_shape)

    def lower(*xs):
        # XLA calls this after its partitioner has run, inside the caller's context: under
        # `jax.set_mesh` with Explicit axes, jax >= 0.11 would annotate the local values with
        # sharding custom calls that nothing lowers any more. Per-device code has no mesh.
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return local(*xs)

    return mesh, lower, result_shardings, tuple(arg_shardings)


def _kv_head_index(plan: _Plan):
    """The kv heads this device's query heads read: (start, 1) when they share one kv head,
    else an index per local query head."""
    group = plan.num_heads // plan.kv_heads
    local = plan.local_heads
    first = lax.axis_index(plan.heads) * local
    if group % local == 0:
        return first // group, None
    return None, (first + jnp.arange(local)) // group


def _select_kv_heads(plan: _Plan, *xs):
    start, index = _kv_head_index(plan)
    if index is None:
        return [lax.dynamic_slice_in_dim(x, start, 1, axis=x.ndim - 2) for x in xs]
    return [jnp.take(x, index, axis=-2) for x in xs]


def _unselect_kv_heads(plan: _Plan, *grads):
    """Scatters the gradients of the selected kv heads back to all K heads, summed over the
    devices that share them."""
    start, index = _kv_head_index(plan)
    out = []
    for g in grads:
        shape = g.shape[:-2] + (plan.kv_heads, g.shape[-1])
        full = jnp.zeros(shape, jnp.float32)
        if index is None:
            full = lax.dynamic_update_slice_in_dim(full, g.astype(jnp.float32), start,
                                                   axis=g.ndim - 2)
        else:
            full = full.at[..., index, :].add(g.astype(jnp.float32))
        out.append(lax.psum(full, plan.heads).astype(g.dtype))
    return out


def _local(kind, flags, scale, soft_cap, window: _Window, deterministic, switches, with_dbias,
           plan: _Plan, bias_shape, *xs):
    """The per-device computation of one partitioned call (a ring schedule only for a window
    that is not aligned to the lengths: _make_plan)."""
    a = _unpack(kind, flags, xs)
    aligned, window = window.aligned, window.sides
    k, v = a.k, a.v
    if not plan.kv_heads_split:
        k, v = _select_kv_heads(plan, k, v)
    schedule = plan.schedule
    # The ring's blocks see their own lengths only: _make_plan gathers the sequences instead.
    assert schedule is None or not aligned, "a window aligned to the lengths took a ring"
    if kind == "fwd":
        if schedule is None:
            return _ops.forward(a.q, k, v, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
                                a.kv_ids, scale=scale, soft_cap=soft_cap, window=window,
                                align_window_to_lengths=aligned, switches=switches)
        return _ring.seq_forward(a.q, k, v, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
                                 a.kv_ids, scale=scale, soft_cap=soft_cap, window=window,
                                 schedule=schedule, axes=plan.seq_axes, switches=switches)
    if schedule is None:
        dq, dk, dv, dbias = _ops.backward(a.q, k, v, a.out, a.lse, a.d_out, a.bias,
                                          a.mask, a.q_lens, a.kv_lens, a.q_ids, a.kv_ids,
                                          scale=scale, soft_cap=soft_cap, window=window,
                                          align_window_to_lengths=aligned, switches=switches,
                                          deterministic=deterministic, dbias=with_dbias)
        if dbias is not None:
            dbias = _ring.reduce_to(dbias, a.bias.shape)
    else:
        dq, dk, dv, dbias = _ring.seq_backward(
            a.q, k, v, a.out, a.lse, a.d_out, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
            a.kv_ids, scale=scale, soft_cap=soft_cap, window=window, schedule=schedule,
            axes=plan.seq_axes, switches=switches, deterministic=deterministic,
            dbias=with_dbias)
    if not plan.kv_heads_split:
        dk, dv = _unselect_kv_heads(plan, dk, dv)
    if dbias is None:
        return dq, dk, dv
    # A bias broadcast over a dim whose computation is split sums its gradient over those axes
    # (global shape: a split dim can be 1 locally).
    lead = [axes for axes, size in zip(plan.batch, bias_shape[:-3]) if size == 1]
    split = [x for axes in lead for x in axes]
    if bias_shape[-3] == 1:
        split += list(plan.heads)
    if split:
        dbias = lax.psum(dbias, tuple(split))
    return dq, dk, dv, dbias
