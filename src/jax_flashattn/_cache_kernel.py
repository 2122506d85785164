"""The forward kernel call that reads a KV cache as it is stored (`_ops.cache_forward`: pages
read in place, or float8_e4m3fn keys and values widened in the kernel) as an op that
partitions under jit.

Every operand keeps the caller's batch and head shardings and each device attends its own
sequences and heads, with no collective: q [B, T, N, H], the lengths by batch entry and the
descales [B, K] by batch entry and kv head; contiguous keys and values [B, S, K, H] by batch
entry and kv head, page pools [P, page_size, K, H] by kv head (their pages are any sequence's,
so never split) and the page table [B, max_pages] by batch entry. Query heads split finer than
the kv heads (or a split that does not divide B, N or K) are gathered instead: correct, not
distributed.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashattn import _ffi, _ops, fp8, sharding


def forward(q, key, value, page_table=None, kv_lens=None, q_lens=None, k_descale=None,
            v_descale=None, *, scale: float, window: tuple, switches: _ffi.KernelSwitches,
            soft_cap: float = 0.0, align_window_to_lengths: bool = True, e4m3_out_dtype=None):
    """(out [B, T, N, H] in q's dtype, lse [B, N, T] float32) of `_ops.cache_forward`; with
    `e4m3_out_dtype` (bfloat16 or float16), FP8 attention instead: q, key and value of
    float8_e4m3fn (value [B, S, K, H], laid out for the kernel per device by
    fp8.kernel_values), k_descale the query's times the key's, out of that dtype
    (`_ops.e4m3_forward`)."""
    present = tuple(x is not None for x in (page_table, kv_lens, q_lens, k_descale))
    op = _partitioned(present, float(scale), tuple(window), switches, float(soft_cap),
                      bool(align_window_to_lengths),
                      None if e4m3_out_dtype is None else jnp.dtype(e4m3_out_dtype))
    operands = (q, key, value, page_table, kv_lens, q_lens, k_descale, v_descale)
    return tuple(op(*(x for x in operands if x is not None)))


@functools.lru_cache(maxsize=None)
def _partitioned(present: tuple, scale: float, window: tuple, switches, soft_cap: float,
                 align_window_to_lengths: bool, e4m3_out_dtype):
    paged, with_kv_lens, with_q_lens, descaled = present

    def body(q, key, value, *optional):
        it = iter(optional)
        table, kv_lens, q_lens = (next(it) if there else None
                                  for there in (paged, with_kv_lens, with_q_lens))
        k_descale, v_descale = (next(it), next(it)) if descaled else (None, None)
        if e4m3_out_dtype is not None:
            out, lse = _ops.e4m3_forward(
                q, key, fp8.kernel_values(value, kv_lens), q_lens, kv_lens, k_descale,
                v_descale, out_dtype=e4m3_out_dtype, scale=scale, window=window,
                switches=switches, align_window_to_lengths=align_window_to_lengths)
        else:
            out, lse = _ops.cache_forward(q, key, value, table, q_lens, kv_lens, scale=scale,
                                          window=window, switches=switches, soft_cap=soft_cap,
                                          k_descale=k_descale, v_descale=v_descale,
                                          align_window_to_lengths=align_window_to_lengths)
        # Under Explicit mesh axes, typed with q's sharding (lse [B, N, T] with its B and N).
        return sharding._typed_like(out, q), sharding._typed_like(lse, q, (0, 2, 1))

    op = custom_partitioning(body)
    op.def_partition(partition=functools.partial(_partition, body, present),
                     sharding_rule=functools.partial(_sharding_rule, present))
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


def _optional_kinds(present: tuple) -> list[str]:
    """What the optional operands a call passes are, in order: the page table, kv lengths, q
    lengths, the two descales."""
    paged, with_kv_lens, with_q_lens, descaled = present
    return (["table"] * paged + ["lengths"] * (with_kv_lens + with_q_lens)
            + ["descale"] * (2 * descaled))


def _sharding_rule(present, mesh, operand_types, result_types):
    """Shardy rule "b t (k g) h, K, K[, b m][, b][, b][, b k, b k] -> b t (k g) h, b (k g) t"
    with K the keys and values, "p s k h" (pools) or "b s k h", and q's heads a factor of
    their own where the devices do not divide the kv heads."""
    del result_types
    num_heads, kv_heads = operand_types[0].shape[2], operand_types[1].shape[2]
    devices = math.prod(mesh.shape.values()) if not mesh.empty else 1
    sizes, replicated = {}, ["h", "t", "s"] + (["p", "m"] if present[0] else [])
    if kv_heads == num_heads:
        heads = "k"
    elif kv_heads % devices:
        heads = "n"
        replicated += ["n", "k"]
    else:
        heads, sizes["g"] = "(k g)", num_heads // kv_heads
    q = f"b t {heads} h"
    kv = "p s k h" if present[0] else "b s k h"
    factors = {"table": "b m", "lengths": "b", "descale": "b k"}
    operands = [q, kv, kv] + [factors[kind] for kind in _optional_kinds(present)]
    rule = ", ".join(operands) + f" -> {q}, b {heads} t"
    # Shardy wants them in the order the factors first appear.
    order = [f for f in re.split(r"[^a-z]+", rule) if f]
    replicated.sort(key=order.index)
    return rule, dict(need_replication_factors=tuple(replicated), **sizes)


def _partition(body, present, mesh, arg_shapes, result_shape):
    del result_shape
    if mesh.empty:
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("_devices",))
    q, key = arg_shapes[0], arg_shapes[1]
    batch_axes, head_axes = (), ()
    if isinstance(q.sharding, NamedSharding):
        sizes = dict(mesh.shape)
        spec = sharding._spec_axes(q.sharding, 4)

        def take(axes, *lengths):
            axes = tuple(x for x in axes if sizes[x] > 1)
            split = math.prod(sizes[x] for x in axes)
            return axes if axes and all(n % split == 0 for n in lengths) else ()

        batch_axes = take(spec[0], q.shape[0])
        head_axes = tuple(x for x in take(spec[2], q.shape[2], key.shape[2])
                          if x not in batch_axes)
    b, h = sharding._entry(batch_axes), sharding._entry(head_axes)

    def named(*spec):
        return NamedSharding(mesh, P(*spec))

    kv = named(None, None, h, None) if present[0] else named(b, None, h, None)
    specs = {"table": named(b, None), "lengths": named(b), "descale": named(b, h)}
    args = [named(b, None, h, None), kv, kv] + [specs[kind] for kind in _optional_kinds(present)]

    def lower(*xs):
        with jax.sharding.use_abstract_mesh(sharding._NO_MESH):
            return body(*xs)

    return mesh, lower, (named(b, None, h, None), named(b, h, None)), tuple(args)
