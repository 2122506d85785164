"""The paged forward kernel call (`_ops.paged_forward`) as an op that partitions under jit.

Every operand keeps the caller's batch and head shardings and each device attends its own
sequences and heads, with no collective: q [B, T, N, H] and the lengths by batch entry, the page
pools [P, page_size, K, H] by kv head (their pages are any sequence's, so never split), the page
table [B, max_pages] by batch entry. Query heads split finer than the kv heads (or a split that
does not divide B, N or K) are gathered instead: correct, not distributed.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashattn import _ffi, _ops, sharding


def forward(q, key_cache, value_cache, page_table, kv_lens, q_lens=None, *, scale: float,
            window: tuple, switches: _ffi.KernelSwitches, soft_cap: float = 0.0):
    """(out [B, T, N, H] in q's dtype, lse [B, N, T] float32) of `_ops.paged_forward`."""
    op = _partitioned(q_lens is not None, float(scale), tuple(window), switches,
                      float(soft_cap))
    operands = (q, key_cache, value_cache, page_table, kv_lens)
    return tuple(op(*operands, *(() if q_lens is None else (q_lens,))))


@functools.lru_cache(maxsize=None)
def _partitioned(with_q_lens: bool, scale: float, window: tuple, switches, soft_cap: float):
    def body(q, key_cache, value_cache, page_table, kv_lens, *q_lens):
        out, lse = _ops.paged_forward(q, key_cache, value_cache, page_table,
                                      q_lens[0] if with_q_lens else None, kv_lens, scale=scale,
                                      window=window, switches=switches, soft_cap=soft_cap)
        # Under Explicit mesh axes, typed with q's sharding (lse [B, N, T] with its B and N).
        return sharding._typed_like(out, q), sharding._typed_like(lse, q, (0, 2, 1))

    op = custom_partitioning(body)
    op.def_partition(partition=functools.partial(_partition, body),
                     sharding_rule=_sharding_rule)
    op = jax.custom_batching.custom_vmap(op)

    @op.def_vmap
    def _one_call_per_element(axis_size, in_batched, *xs):
        # The kernels take one pool and one table per call: a vmapped call runs one per element,
        # the unbatched operands (a shared pool) passed as they are, not copied per element.
        del axis_size

        def one(mapped):
            it = iter(mapped)
            return op(*(next(it) if batched else x for x, batched in zip(xs, in_batched)))
        mapped = tuple(x for x, batched in zip(xs, in_batched) if batched)
        return lax.map(one, mapped), (True, True)

    jitted = jax.jit(op)

    def call(*xs):
        # Eagerly, through jit: sharded inputs then partition as under jit instead of being
        # gathered.
        return op(*xs) if any(isinstance(x, jax.core.Tracer) for x in xs) else jitted(*xs)

    return call


def _sharding_rule(mesh, operand_types, result_types):
    """Shardy rule "b t (k g) h, p s k h, p s k h, b m, b[, b] -> b t (k g) h, b (k g) t", with
    q's heads a factor of their own where the devices do not divide the kv heads."""
    del result_types
    num_heads, kv_heads = operand_types[0].shape[2], operand_types[1].shape[2]
    devices = math.prod(mesh.shape.values()) if not mesh.empty else 1
    sizes, replicated = {}, ["h", "t", "p", "s", "m"]
    if kv_heads == num_heads:
        heads = "k"
    elif kv_heads % devices:
        heads = "n"
        replicated += ["n", "k"]
    else:
        heads, sizes["g"] = "(k g)", num_heads // kv_heads
    q = f"b t {heads} h"
    operands = [q, "p s k h", "p s k h", "b m"] + ["b"] * (len(operand_types) - 4)
    rule = ", ".join(operands) + f" -> {q}, b {heads} t"
    # Shardy wants them in the order the factors first appear.
    order = [f for f in re.split(r"[^a-z]+", rule) if f]
    replicated.sort(key=order.index)
    return rule, dict(need_replication_factors=tuple(replicated), **sizes)


def _partition(body, mesh, arg_shapes, result_shape):
    del result_shape
    if mesh.empty:
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("_devices",))
    q, key_cache = arg_shapes[0], arg_shapes[1]
    batch_axes, head_axes = (), ()
    if isinstance(q.sharding, NamedSharding):
        sizes = dict(mesh.shape)
        spec = sharding._spec_axes(q.sharding, 4)

        def take(axes, *lengths):
            axes = tuple(x for x in axes if sizes[x] > 1)
            split = math.prod(sizes[x] for x in axes)
            return axes if axes and all(n % split == 0 for n in lengths) else ()

        batch_axes = take(spec[0], q.shape[0])
        head_axes = tuple(x for x in take(spec[2], q.shape[2], key_cache.shape[2])
                          if x not in batch_axes)
    b, h = sharding._entry(batch_axes), sharding._entry(head_axes)

    def named(*spec):
        return NamedSharding(mesh, P(*spec))

    pool = named(None, None, h, None)
    args = [named(b, None, h, None), pool, pool, named(b, None)]
    args += [named(b)] * (len(arg_shapes) - 4)

    def lower(*xs):
        with jax.sharding.use_abstract_mesh(sharding._NO_MESH):
            return body(*xs)

    return mesh, lower, (named(b, None, h, None), named(b, h, None)), tuple(args)
