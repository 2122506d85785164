"""Multi-device attention: partitioning rules for `attention` under `jit`.

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

`ring_attention`, `ring_schedule`, `zigzag` and `unzigzag`, the same ring for callers who write
`shard_map` themselves, live in `jax_flashattn._ring_api` and are importable from here.
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

from jax_flashattn import _ffi, _ops, _ring
from jax_flashattn._ring_api import ring_attention, ring_schedule, unzigzag, zigzag

__all__ = ["ring_attention", "ring_schedule", "zigzag", "unzigzag", "forward", "backward"]


# ----------------------------------------------------------------------------------------------
# Partitioned kernel ops (what `attention` calls)

def _present(*xs):
    return tuple(x for x in xs if x is not None)


def _flags(*optional):
    return tuple(x is not None for x in optional)


def forward(q, k, v, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None, alibi=None, *,
            scale: float, window, switches: _ffi.KernelSwitches, soft_cap: float = 0.0,
            align_window_to_lengths: bool = False, alibi_shift: int = 0):
    """`_ops.forward` that partitions under jit: (out, lse [..., N, T] float32). With
    `align_window_to_lengths` the sequences are never split (_make_plan)."""
    optional = (bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi)
    op = _partitioned("fwd", _flags(*optional), float(scale), float(soft_cap),
                      _Window(tuple(window), bool(align_window_to_lengths)), False, switches,
                      alibi_shift=int(alibi_shift))
    return tuple(op(q, k, v, *_present(*optional)))


def backward(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None,
             alibi=None, *, scale: float, window, switches: _ffi.KernelSwitches,
             deterministic: bool = False, dbias: bool = False, soft_cap: float = 0.0,
             align_window_to_lengths: bool = False, alibi_shift: int = 0,
             dslopes: bool = False):
    """`_ops.backward` that partitions under jit: (dq, dk, dv, dbias, dslopes), where dbias is
    float32 already summed to bias's shape (None without bias or without `dbias`, whose
    cotangent is then not computed) and dslopes the ALiBi slopes' float32 gradient likewise.
    `deterministic`: see _ops.backward; `align_window_to_lengths`: as in `forward`."""
    optional = (bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi)
    with_dbias = bias is not None and bool(dbias)
    with_dslopes = alibi is not None and bool(dslopes)
    op = _partitioned("bwd", _flags(*optional), float(scale), float(soft_cap),
                      _Window(tuple(window), bool(align_window_to_lengths)),
                      bool(deterministic), switches, with_dbias, int(alibi_shift), with_dslopes)
    grads = op(q, k, v, out, lse, d_out, *_present(*optional))
    return (*grads[:3], grads[3] if with_dbias else None,
            grads[-1] if with_dslopes else None)


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
    alibi: object


def _unpack(kind, flags, xs) -> _Operands:
    xs = list(xs)
    q, k, v = xs[:3]
    out = lse = d_out = None
    rest = xs[3:]
    if kind == "bwd":
        out, lse, d_out = rest[:3]
        rest = rest[3:]
    optional = iter(rest)
    bias, mask, q_lens, kv_lens, q_ids, kv_ids, alibi = (next(optional) if flag else None
                                                         for flag in flags)
    return _Operands(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids, kv_ids,
                     alibi)


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
                 with_dbias=False, alibi_shift=0, with_dslopes=False):
    """The partitioned forward or backward op; `with_dbias`, `with_dslopes`: the backward also
    returns the bias's, the ALiBi slopes' gradient (a result only then)."""
    def body(*xs):
        a = _unpack(kind, flags, xs)
        if kind == "fwd":
            out, lse = _ops.forward(a.q, a.k, a.v, a.bias, a.mask, a.q_lens, a.kv_lens,
                                    _replicated(a.q_ids), _replicated(a.kv_ids), a.alibi,
                                    scale=scale, soft_cap=soft_cap, window=window.sides,
                                    align_window_to_lengths=window.aligned, switches=switches,
                                    alibi_shift=alibi_shift)
            lead = tuple(range(a.q.ndim - 3))
            return (_typed_like(out, a.q),
                    _typed_like(lse, a.q, lead + (a.q.ndim - 2, a.q.ndim - 3)))
        dq, dk, dv, dbias, dslopes = _ops.backward(
            a.q, a.k, a.v, a.out, a.lse, a.d_out, a.bias, a.mask, a.q_lens, a.kv_lens,
            _replicated(a.q_ids), _replicated(a.kv_ids), a.alibi, scale=scale,
            soft_cap=soft_cap, window=window.sides, align_window_to_lengths=window.aligned,
            switches=switches, deterministic=deterministic, dbias=with_dbias,
            alibi_shift=alibi_shift, dslopes=with_dslopes)
        grads = (_typed_like(dq, a.q), _typed_like(dk, a.k), _typed_like(dv, a.v))
        if with_dbias:
            grads += (_typed_like(_ring.reduce_to(dbias, a.bias.shape), a.bias),)
        if with_dslopes:
            grads += (_typed_like(dslopes, a.alibi),)
        return grads

    op = custom_partitioning(body)
    op.def_partition(partition=functools.partial(_partition, kind, flags, scale, soft_cap,
                                                 window, deterministic, switches, with_dbias,
                                                 alibi_shift, with_dslopes),
                     sharding_rule=functools.partial(_sharding_rule, kind, flags, with_dbias,
                                                     with_dslopes))
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


def _sharding_rule(kind, flags, with_dbias, with_dslopes, mesh, operand_types, result_types):
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
    slopes = f"... b {heads}"
    if a.alibi is not None:
        optional.append(slopes)
    if kind == "fwd":
        operands, results = [q, kv, kv] + optional, [q, lse]
    else:
        operands, results = [q, kv, kv, q, lse, q] + optional, [q, kv, kv]
        if with_dbias:
            results.append(optional[0])
        if with_dslopes:
            results.append(slopes)
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
    # (_Window; also ALiBi's diagonal under that flag), keeps them whole: gathered where they
    # are split. ALiBi's distances otherwise take a static shift per ring block (_ring).
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
            schedule = _ring.balanced_schedule(mode, devices, t_len, s_len, window.sides,
                                               alibi=a.alibi is not None)
    return _Plan(batch, heads, kv_heads_split, num_heads, kv_heads, num_heads // head_split,
                 seq_axes, schedule)


def _shardings(kind, flags, with_dbias, with_dslopes, mesh, plan: _Plan, arg_shapes):
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
    slopes = named(*batch, plan.heads)
    if a.alibi is not None:
        optional.append(slopes)
    if kind == "fwd":
        return [q, kv, kv] + optional, (q, lse)
    results = ([q, kv, kv] + ([optional[0]] if with_dbias else []) +
               ([slopes] if with_dslopes else []))
    return [q, kv, kv, q, lse, q] + optional, tuple(results)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _partition(kind, flags, scale, soft_cap, window, deterministic, switches, with_dbias,
               alibi_shift, with_dslopes, mesh, arg_shapes, result_shape):
    del result_shape
    if mesh.empty:
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("_devices",))
    plan = _make_plan(kind, flags, window, mesh, arg_shapes)
    arg_shardings, result_shardings = _shardings(kind, flags, with_dbias, with_dslopes, mesh,
                                                 plan, arg_shapes)
    bias_shape = None
    if flags[0]:
        bias = _unpack(kind, flags, arg_shapes).bias
        bias_shape = tuple(bias.shape)
    local = functools.partial(_local, kind, flags, scale, soft_cap, window, deterministic,
                              switches, with_dbias, alibi_shift, with_dslopes, plan, bias_shape)

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
           alibi_shift, with_dslopes, plan: _Plan, bias_shape, *xs):
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
                                a.kv_ids, a.alibi, scale=scale, soft_cap=soft_cap, window=window,
                                align_window_to_lengths=aligned, switches=switches,
                                alibi_shift=alibi_shift)
        return _ring.seq_forward(a.q, k, v, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
                                 a.kv_ids, a.alibi, scale=scale, soft_cap=soft_cap,
                                 window=window, schedule=schedule, axes=plan.seq_axes,
                                 switches=switches, alibi_shift=alibi_shift)
    dslopes = None
    if schedule is None:
        dq, dk, dv, dbias, dslopes = _ops.backward(
            a.q, k, v, a.out, a.lse, a.d_out, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
            a.kv_ids, a.alibi, scale=scale, soft_cap=soft_cap, window=window,
            align_window_to_lengths=aligned, switches=switches, deterministic=deterministic,
            dbias=with_dbias, alibi_shift=alibi_shift, dslopes=with_dslopes)
        if dbias is not None:
            dbias = _ring.reduce_to(dbias, a.bias.shape)
    else:
        dq, dk, dv, dbias, dslopes = _ring.seq_backward(
            a.q, k, v, a.out, a.lse, a.d_out, a.bias, a.mask, a.q_lens, a.kv_lens, a.q_ids,
            a.kv_ids, a.alibi, scale=scale, soft_cap=soft_cap, window=window,
            schedule=schedule, axes=plan.seq_axes, switches=switches,
            deterministic=deterministic, dbias=with_dbias, alibi_shift=alibi_shift,
            dslopes=with_dslopes)
        if dslopes is not None:
            # Each device's part covers its rows; the slopes are replicated over the sequence.
            dslopes = lax.psum(dslopes, plan.seq_axes)
    if not plan.kv_heads_split:
        dk, dv = _unselect_kv_heads(plan, dk, dv)
    slope_grads = (dslopes,) if with_dslopes else ()
    if dbias is None:
        return (dq, dk, dv) + slope_grads
    # A bias broadcast over a dim whose computation is split sums its gradient over those axes
    # (global shape: a split dim can be 1 locally).
    lead = [axes for axes, size in zip(plan.batch, bias_shape[:-3]) if size == 1]
    split = [x for axes in lead for x in axes]
    if bias_shape[-3] == 1:
        split += list(plan.heads)
    if split:
        dbias = lax.psum(dbias, tuple(split))
    return (dq, dk, dv, dbias) + slope_grads
