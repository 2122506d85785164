"""Sequence parallelism on local shards: the ring schedule, its per-block kernel calls, and the
exact merge of partial results through their log-sum-exp.

Everything here runs on one device's shards inside a `shard_map` body or a custom_partitioning
lowering, with the sequence spread over the mesh axes `axes` (D devices, linear index p).

Positions. A device holds its query rows and key rows as `slots`: 1 contiguous chunk per device,
or 2 chunks in the zig-zag layout (device p holds chunks p and 2D-1-p of 2D), always in increasing
global order. A kernel call on a block whose query rows start at global position qo and whose keys
start at ko sees, for global window (l, r) (query t sees keys [t-l, t+r]), the local window
(l + d, r - d) with d = ko - qo. `_canonical` reduces that to the form the kernel gets (or to
"hidden" when the block sees nothing), so that everything about masking is static Python; only the
device index p (and the seq lengths) are traced, and selecting among the few distinct windows a
block can have on different devices is a table lookup at p. ALiBi moves alike: its global term
-slope |gq + A - gk| (A the global diagonal shift) is, on local rows t and keys s of the block,
-slope |t + (A - d) - s|, the kernel's term with the static shift A - d, one more key of that
lookup.

Schedule. Steps i = 0..D-1 of the ring: device p holds the K/V shard that started on device
(p - i) mod D and passes it to p + 1 (`ppermute`) while it computes. Every (query slot, key slot)
pair of a step is one kernel call, or the whole local block is one call when one window describes
it exactly (step 0 of a causal ring: plain local causal attention, in both layouts), and with ALiBi
one shift too (the slot pairs that see keys lie as far apart globally as locally: not across
zig-zag's two chunks). A call that is hidden on some devices runs there with key length 0, which
the kernels skip; a call whose window (or ALiBi shift) differs between devices becomes a
`lax.switch` over the distinct ones.

Merge. Each call returns (o, lse) for its rows; the running (acc, lse) become
lse' = logaddexp(lse, lse_i), acc' = acc * exp(lse - lse') + o_i * exp(lse_i - lse'), in float32,
with -inf (a row that saw nothing yet) giving weight 0. The backward replays the schedule with the
final (global) out and lse, which recomputes P exactly per block, and rotates the dK/dV
accumulators with their K/V shard so that they arrive home after D transfers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashattn import _ops, segments

Window = tuple  # (left, right): ints, or None for an unbounded side
HIDDEN = "hidden"  # a block in which no query sees any key

RING, ROWS, KV_SPLIT = "ring", "rows", "kv_split"


# ----------------------------------------------------------------------------------------------
# Window algebra (static)

def shift(window: Window, d: int) -> Window:
    """The window of a block whose keys start d positions after its queries."""
    left, right = window
    return (None if left is None else left + d, None if right is None else right - d)


def canonical(window: Window, rows: int, cols: int):
    """`window` on a rows x cols block: HIDDEN, or (left, right) with None for a side that cuts
    nothing there. Equal canonical forms mean equal visible sets."""
    if rows <= 0 or cols <= 0:
        return HIDDEN
    left, right = window
    if left is not None and right is not None and left + right < 0:
        return HIDDEN  # an empty band
    if right is not None and right < 1 - rows:
        return HIDDEN  # even the last row's band ends before key 0
    if left is not None and left < 1 - cols:
        return HIDDEN  # even row 0's band starts after the last key
    if left is not None and left >= rows - 1:
        left = None
    if right is not None and right >= cols - 1:
        right = None
    return (left, right)


def visible_pairs(window, rows: int, cols: int) -> int:
    """How many (query, key) pairs of a rows x cols block a canonical window lets through."""
    if window == HIDDEN:
        return 0
    left, right = window
    t = np.arange(rows, dtype=np.int64)
    begin = np.zeros_like(t) if left is None else np.maximum(t - left, 0)
    end = np.full_like(t, cols) if right is None else np.minimum(t + right + 1, cols)
    return int(np.maximum(end - begin, 0).sum())


# ----------------------------------------------------------------------------------------------
# Layouts and schedules (static)

@dataclasses.dataclass(frozen=True)
class Layout:
    """Which global chunks a device holds: chunks[p] lists them per local slot, increasing."""
    name: str  # "contiguous", "zigzag" or "whole" (every device holds the whole sequence)
    chunks: tuple
    chunk: int  # chunk length

    @property
    def slots(self) -> int:
        return len(self.chunks[0])


def make_layout(name: str, devices: int, length: int) -> Layout:
    if name == "contiguous":
        return Layout(name, tuple((p,) for p in range(devices)), length // devices)
    if name == "zigzag":
        return Layout(name, tuple((p, 2 * devices - 1 - p) for p in range(devices)),
                      length // (2 * devices))
    if name == "whole":
        return Layout(name, ((0,),) * devices, length)
    raise ValueError(f"unknown sequence layout {name!r}")


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call of a step: query slots [rows), key slots [cols), and per device the
    canonical window of that block (HIDDEN where it is skipped) and its offset, the global
    position of its first key less that of its first query (ALiBi's shift there is the global
    one less the offset)."""
    rows: tuple
    cols: tuple
    windows: tuple
    offsets: tuple


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The static plan of a sequence-parallel attention over D devices.

    mode RING: queries and keys both split, K/V rotate for D steps. ROWS: queries split, every
    device holds all keys (one step). KV_SPLIT: keys split, every device holds all queries (one
    step, then the partial results merge across devices). `relayout` is True when the caller's
    shards are contiguous and the schedule runs on their zig-zag re-layout (balanced causal work).
    """
    mode: str
    devices: int
    q: Layout
    kv: Layout
    relayout: bool
    steps: tuple  # per step: tuple of Call

    def source(self, step: int, p: int) -> int:
        """The device whose K/V shard device p holds at `step`."""
        return (p - step) % self.devices if self.mode == RING else p

    def q_offsets(self) -> np.ndarray:
        """[D, q slots] global position of each local query slot."""
        return np.asarray(self.q.chunks, np.int32) * self.q.chunk

    def kv_offsets(self, step: int) -> np.ndarray:
        """[D, kv slots] global position of each key slot device p holds at `step`."""
        return np.asarray([self.kv.chunks[self.source(step, p)] for p in range(self.devices)],
                          np.int32) * self.kv.chunk

    def work(self) -> list:
        """Per device: the (query, key) pairs its kernel calls cover (seq lengths aside)."""
        cq, ck = self.q.chunk, self.kv.chunk
        totals = [0] * self.devices
        for calls in self.steps:
            for call in calls:
                rows = (call.rows[1] - call.rows[0]) * cq
                cols = (call.cols[1] - call.cols[0]) * ck
                for p, w in enumerate(call.windows):
                    totals[p] += visible_pairs(w, rows, cols)
        return totals


_NOT_ONE_CALL = "not one call"


def _plan_step(mode, devices, q: Layout, kv: Layout, window: Window, step: int,
               alibi: bool) -> tuple:
    cq, ck = q.chunk, kv.chunk
    nq, nk = q.slots, kv.slots
    source = (lambda p: (p - step) % devices) if mode == RING else (lambda p: p)
    pairs, offsets, whole = [], [], []
    for p in range(devices):
        qs, ks = q.chunks[p], kv.chunks[source(p)]
        offset = {(a, b): ks[b] * ck - qs[a] * cq for a in range(nq) for b in range(nk)}
        pair = {ab: canonical(shift(window, d), cq, ck) for ab, d in offset.items()}
        pairs.append(pair)
        offsets.append(offset)
        # One call for the whole local block if the window that fits slot pair (0, 0) is exact
        # on every other slot pair too; with ALiBi, also its distances: every slot pair that
        # sees a key must lie as far from pair (0, 0) globally as locally.
        base = offset[(0, 0)]

        def fits(a, b, w):
            local = base + b * ck - a * cq  # pair (a, b)'s offset inside the whole block
            return (canonical(shift(window, local), cq, ck) == w
                    and (not alibi or w == HIDDEN or offset[(a, b)] == local))

        exact = all(fits(a, b, w) for (a, b), w in pair.items())
        whole.append(canonical(shift(window, base), nq * cq, nk * ck) if exact
                     else _NOT_ONE_CALL)
    distinct = {w for w in whole if w != HIDDEN}
    if _NOT_ONE_CALL not in distinct and len(distinct) <= 1:
        if not distinct:
            return ()
        return (Call((0, nq), (0, nk), tuple(whole), tuple(o[(0, 0)] for o in offsets)),)
    calls = []
    for a in range(nq):
        for b in range(nk):
            windows = tuple(pair[(a, b)] for pair in pairs)
            if any(w != HIDDEN for w in windows):
                calls.append(Call((a, a + 1), (b, b + 1), windows,
                                  tuple(o[(a, b)] for o in offsets)))
    return tuple(calls)


def make_schedule(mode: str, devices: int, q_len: int, kv_len: int, window: Window,
                  q_layout: str = "contiguous", kv_layout: str | None = None,
                  relayout: bool = False, alibi: bool = False) -> Schedule:
    """`alibi`: the calls take ALiBi slopes, so a whole local block is one call only where one
    static shift measures all its distances (_plan_step)."""
    if kv_layout is None:
        kv_layout = q_layout
    if mode == ROWS:
        kv_layout = "whole"
    if mode == KV_SPLIT:
        q_layout = "whole"
    q = make_layout(q_layout, devices, q_len)
    kv = make_layout(kv_layout, devices, kv_len)
    steps = devices if mode == RING else 1
    return Schedule(mode, devices, q, kv, relayout,
                    tuple(_plan_step(mode, devices, q, kv, window, i, alibi)
                          for i in range(steps)))


def balanced_schedule(mode: str, devices: int, q_len: int, kv_len: int, window: Window,
                      load_balance: bool = True, alibi: bool = False) -> Schedule:
    """The schedule for contiguous shards: run on their zig-zag re-layout when that lowers the
    busiest device's work (causal attention), else as they are. `alibi`: as in make_schedule."""
    plain = make_schedule(mode, devices, q_len, kv_len, window, alibi=alibi)
    splittable = q_len % (2 * devices) == 0 and (mode != RING or kv_len % (2 * devices) == 0)
    if not load_balance or devices == 1 or mode == KV_SPLIT or not splittable:
        return plain
    zigzag = make_schedule(mode, devices, q_len, kv_len, window, "zigzag", relayout=True,
                           alibi=alibi)
    return zigzag if max(zigzag.work()) < max(plain.work()) else plain


# ----------------------------------------------------------------------------------------------
# The result of a block no key of which a query row sees

def _empty_forward(q):
    lse_shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    return jnp.zeros(q.shape, q.dtype), jnp.full(lse_shape, -jnp.inf, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Merging partial results

def _rows_last(lse):
    """[..., N, T] -> [..., T, N, 1], to scale [..., T, N, H] rows."""
    return jnp.swapaxes(lse, -1, -2)[..., None]


def _finite_or_zero(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def merge(acc, acc_lse, out, lse):
    """Adds a partial result (out, lse) to a running float32 (acc, acc_lse)."""
    new = jnp.logaddexp(acc_lse, lse)
    safe = _finite_or_zero(new)
    acc = (acc * _rows_last(jnp.exp(acc_lse - safe)) +
           out.astype(jnp.float32) * _rows_last(jnp.exp(lse - safe)))
    return acc, new


def merge_across(acc, acc_lse, axes):
    """The exact combination of every device's partial (acc, acc_lse) over the same rows."""
    top = _finite_or_zero(lax.pmax(acc_lse, axes))
    weight = jnp.exp(acc_lse - top)  # 0 where a device saw nothing
    total = lax.psum(weight, axes)
    lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    share = jnp.where(total > 0, weight / jnp.where(total > 0, total, 1.0), 0.0)
    return lax.psum(acc * _rows_last(share), axes), lse


# ----------------------------------------------------------------------------------------------
# Zig-zag re-layout of contiguous shards (two collective-permutes each way)

def _zigzag_home(chunk: int, devices: int) -> int:
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def to_zigzag(x, dim, axes, devices):
    """Contiguous shards (device p: chunks 2p, 2p+1 of 2D) to zig-zag ones (p: chunks p, 2D-1-p)
    along `dim`."""
    if devices == 1:
        return x
    first, second = jnp.split(x, 2, axis=dim)
    recv_even = lax.ppermute(first, axes, [(p, _zigzag_home(2 * p, devices))
                                           for p in range(devices)])
    recv_odd = lax.ppermute(second, axes, [(p, _zigzag_home(2 * p + 1, devices))
                                           for p in range(devices)])
    # Device m receives chunks m and 2D-1-m; the even one came through the first permute.
    even = lax.axis_index(axes) % 2 == 0
    return jnp.concatenate([jnp.where(even, recv_even, recv_odd),
                            jnp.where(even, recv_odd, recv_even)], axis=dim)


def from_zigzag(x, dim, axes, devices):
    """The inverse of `to_zigzag`."""
    if devices == 1:
        return x
    low, high = jnp.split(x, 2, axis=dim)  # chunks m and 2D-1-m
    even = lax.axis_index(axes) % 2 == 0
    even_chunk = jnp.where(even, low, high)
    odd_chunk = jnp.where(even, high, low)

    def even_of(m):
        return m if m % 2 == 0 else 2 * devices - 1 - m

    back_even = lax.ppermute(even_chunk, axes, [(m, even_of(m) // 2) for m in range(devices)])
    back_odd = lax.ppermute(odd_chunk, axes,
                            [(m, (2 * devices - 1 - even_of(m)) // 2) for m in range(devices)])
    return jnp.concatenate([back_even, back_odd], axis=dim)


# ----------------------------------------------------------------------------------------------
# Running a schedule on local shards

@dataclasses.dataclass(frozen=True)
class _Block:
    """One call of a step with its static slices: local query rows [r0, r1), keys [c0, c1)."""
    call: Call
    r0: int
    r1: int
    c0: int
    c1: int


def _blocks(schedule: Schedule, step: int):
    cq, ck = schedule.q.chunk, schedule.kv.chunk
    return [_Block(c, c.rows[0] * cq, c.rows[1] * cq, c.cols[0] * ck, c.cols[1] * ck)
            for c in schedule.steps[step]]


def _rows(x, r0, r1, dim=-3):
    return lax.slice_in_dim(x, r0, r1, axis=dim % x.ndim)


def _update_rows(acc, part, r0, dim=-3):
    start = [0] * acc.ndim
    start[dim % acc.ndim] = r0
    return lax.dynamic_update_slice(acc, part, start)


def _add_rows(acc, part, r0, dim=-3):
    r1 = r0 + part.shape[dim]
    return _update_rows(acc, _rows(acc, r0, r1, dim) + part.astype(acc.dtype), r0, dim)


def _span_length(lens, offsets, chunk, first, last):
    """Valid positions (global position < lens) in local slots [first, last) of a device whose
    slots start at global `offsets`: slots are in increasing global order, so the valid
    positions of the span are a prefix of it."""
    total = 0
    for a in range(first, last):
        total = total + jnp.clip(lens - offsets[a], 0, chunk)
    return total.astype(jnp.int32)


def _block_lengths(schedule, step, block, p, q_lens, kv_lens):
    """Traced (q_len, kv_len) of a call on device p (None where the caller gave none)."""
    q_len = kv_len = None
    if q_lens is not None:
        q_len = _span_length(q_lens, jnp.asarray(schedule.q_offsets())[p], schedule.q.chunk,
                             *block.call.rows)
    if kv_lens is not None:
        kv_len = _span_length(kv_lens, jnp.asarray(schedule.kv_offsets(step))[p],
                              schedule.kv.chunk, *block.call.cols)
    return q_len, kv_len


def _without_keys_where(visible, kv_len, cols, batch_shape):
    """kv_len, forced to 0 where `visible` (this device's call, or each batch entry of it) is
    False: the kernels then skip the call. None: nothing hidden."""
    if visible is None:
        return kv_len
    if kv_len is None:
        kv_len = jnp.full(batch_shape, cols, jnp.int32)
    return jnp.where(visible, kv_len, 0)


def _segments_meet(q_ids, kv_ids):
    """bool [..., B]: whether a batch entry's query and key ids of the call (q_ids [..., B, rows],
    kv_ids [..., B, cols]) share a value range; None without segment ids. Where they do not,
    the call computes nothing: a ring step between different documents."""
    if q_ids is None:
        return None
    return segments.ranges_meet(jnp.min(q_ids, axis=-1), jnp.max(q_ids, axis=-1),
                                jnp.min(kv_ids, axis=-1), jnp.max(kv_ids, axis=-1))


def _dispatch(call: Call, p, run, hidden, operands, alibi_shift=None):
    """run(window, shift, visible) on device p, shift the call's ALiBi shift there (the global
    `alibi_shift` less the block's offset; 0 without ALiBi, None): one call when the devices
    that compute agree on both (hidden devices run it with no keys), else a switch over the
    distinct (window, shift) pairs (all branches typed as varying like `operands`)."""
    keys = [None if w == HIDDEN else (w, 0 if alibi_shift is None else alibi_shift - d)
            for w, d in zip(call.windows, call.offsets)]
    distinct = sorted({key for key in keys if key is not None}, key=repr)
    if len(distinct) == 1:
        visible = np.asarray([key is not None for key in keys])
        return run(*distinct[0], None if visible.all() else jnp.asarray(visible)[p])
    index = np.asarray([0 if key is None else 1 + distinct.index(key) for key in keys],
                       np.int32)
    branches = [hidden] + [functools.partial(run, *key, None) for key in distinct]
    branches = [lambda branch=branch: _ops.vary_like(branch(), operands) for branch in branches]
    return lax.switch(jnp.asarray(index)[p], branches)


def _pass_on(xs, axes, devices):
    """Sends each of xs (None stays None) to the next device of the ring."""
    perm = [(p, (p + 1) % devices) for p in range(devices)]
    return [None if x is None else lax.ppermute(x, axes, perm) for x in xs]


def _segment_slices(q_ids, kv_ids, block):
    """The block's query and key segment ids (None, None without them)."""
    if q_ids is None:
        return None, None
    return _rows(q_ids, block.r0, block.r1, -1), _rows(kv_ids, block.c0, block.c1, -1)


def seq_forward(q, k, v, bias, mask, q_lens, kv_lens, q_ids=None, kv_ids=None, alibi=None, *,
                scale, window: Window, schedule: Schedule, axes, switches, soft_cap=0.0,
                alibi_shift=0):
    """(out, lse [..., N, T_local]) of local shards under `schedule`. bias and mask must
    broadcast over T and S (their last two dims 1); the lengths are global; the segment ids
    [..., B, T_local] and [..., B, S_local] are the shards' own, and travel with K/V. `alibi`:
    the slopes [..., B, N] of the local heads, whose term -slope |gq + alibi_shift - gk| is on
    global positions (the schedule made with `alibi`)."""
    devices, ring = schedule.devices, schedule.mode == RING
    p = lax.axis_index(axes)
    if schedule.relayout:
        q = to_zigzag(q, -3, axes, devices)
        q_ids = None if q_ids is None else to_zigzag(q_ids, -1, axes, devices)
        if ring:
            k, v = to_zigzag(k, -3, axes, devices), to_zigzag(v, -3, axes, devices)
            kv_ids = None if kv_ids is None else to_zigzag(kv_ids, -1, axes, devices)
    batch_shape = q.shape[:-3]
    acc = jnp.zeros(q.shape, jnp.float32)
    acc_lse = jnp.full(batch_shape + (q.shape[-2], q.shape[-3]), -jnp.inf, jnp.float32)
    for step in range(len(schedule.steps)):
        if ring and step + 1 < devices:
            # In flight during this step.
            k_next, v_next, ids_next = _pass_on((k, v, kv_ids), axes, devices)
        for block in _blocks(schedule, step):
            q_len, kv_len = _block_lengths(schedule, step, block, p, q_lens, kv_lens)
            qb = _rows(q, block.r0, block.r1)
            kb, vb = _rows(k, block.c0, block.c1), _rows(v, block.c0, block.c1)
            qb_ids, kb_ids = _segment_slices(q_ids, kv_ids, block)

            def run(window, shift, visible, qb=qb, kb=kb, vb=vb, q_len=q_len, kv_len=kv_len,
                    qb_ids=qb_ids, kb_ids=kb_ids):
                kv_len = _without_keys_where(visible, kv_len, kb.shape[-3], batch_shape)
                kv_len = _without_keys_where(_segments_meet(qb_ids, kb_ids), kv_len,
                                             kb.shape[-3], batch_shape)
                return _ops.forward(qb, kb, vb, bias, mask, q_len, kv_len, qb_ids, kb_ids, alibi,
                                    scale=scale, soft_cap=soft_cap, window=window,
                                    switches=switches, alibi_shift=shift)

            out, lse = _dispatch(block.call, p, run, functools.partial(_empty_forward, qb),
                                 (qb, kb, vb, q_len, kv_len, qb_ids, kb_ids, alibi),
                                 None if alibi is None else alibi_shift)
            part, part_lse = merge(_rows(acc, block.r0, block.r1),
                                   _rows(acc_lse, block.r0, block.r1, -1), out, lse)
            acc = _update_rows(acc, part, block.r0)
            acc_lse = _update_rows(acc_lse, part_lse, block.r0, -1)
        if ring and step + 1 < devices:
            k, v, kv_ids = k_next, v_next, ids_next
    if schedule.mode == KV_SPLIT:
        acc, acc_lse = merge_across(acc, acc_lse, axes)
    out = acc.astype(q.dtype)
    if schedule.relayout:
        out = from_zigzag(out, -3, axes, devices)
        acc_lse = from_zigzag(acc_lse, -1, axes, devices)
    return out, acc_lse


def reduce_to(x, shape):
    """Sums x over the dims where `shape` is 1 (keeping them)."""
    dims = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return jnp.sum(x, axis=dims, keepdims=True) if dims else x


def seq_backward(q, k, v, out, lse, d_out, bias, mask, q_lens, kv_lens, q_ids=None,
                 kv_ids=None, alibi=None, *, scale, window: Window, schedule: Schedule, axes,
                 switches, deterministic=False, dbias=False, soft_cap=0.0, alibi_shift=0,
                 dslopes=False):
    """(dq, dk, dv, dbias, dslopes) of local shards under `schedule`, from the global out and
    lse of the forward: dbias summed to bias's shape, or None without bias or `dbias`; dslopes
    the float32 [..., B, N] gradient of the ALiBi slopes (`alibi`, `alibi_shift` as in
    seq_forward) over this device's rows, or None without them or `dslopes`: every device of
    the ring has a part, which the caller sums over `axes`."""
    devices, ring = schedule.devices, schedule.mode == RING
    p = lax.axis_index(axes)
    if schedule.relayout:
        q, out, d_out = (to_zigzag(x, -3, axes, devices) for x in (q, out, d_out))
        lse = to_zigzag(lse, -1, axes, devices)
        q_ids = None if q_ids is None else to_zigzag(q_ids, -1, axes, devices)
        if ring:
            k, v = to_zigzag(k, -3, axes, devices), to_zigzag(v, -3, axes, devices)
            kv_ids = None if kv_ids is None else to_zigzag(kv_ids, -1, axes, devices)
    batch_shape = q.shape[:-3]
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    with_dbias = bias is not None and dbias
    dbias = jnp.zeros(bias.shape, jnp.float32) if with_dbias else None
    with_dslopes = alibi is not None and dslopes
    dslopes = jnp.zeros(alibi.shape, jnp.float32) if with_dslopes else None
    for step in range(len(schedule.steps)):
        if ring and step + 1 < devices:
            k_next, v_next, ids_next = _pass_on((k, v, kv_ids), axes, devices)
        for block in _blocks(schedule, step):
            q_len, kv_len = _block_lengths(schedule, step, block, p, q_lens, kv_lens)
            qb, ob, dob = (_rows(x, block.r0, block.r1) for x in (q, out, d_out))
            lb = _rows(lse, block.r0, block.r1, -1)
            kb, vb = _rows(k, block.c0, block.c1), _rows(v, block.c0, block.c1)
            qb_ids, kb_ids = _segment_slices(q_ids, kv_ids, block)

            def run(window, shift, visible, qb=qb, kb=kb, vb=vb, ob=ob, lb=lb, dob=dob,
                    q_len=q_len, kv_len=kv_len, qb_ids=qb_ids, kb_ids=kb_ids):
                kv_len = _without_keys_where(visible, kv_len, kb.shape[-3], batch_shape)
                kv_len = _without_keys_where(_segments_meet(qb_ids, kb_ids), kv_len,
                                             kb.shape[-3], batch_shape)
                dqb, dkb, dvb, dbias_b, dslopes_b = _ops.backward(
                    qb, kb, vb, ob, lb, dob, bias, mask, q_len, kv_len, qb_ids, kb_ids, alibi,
                    scale=scale, soft_cap=soft_cap, window=window, switches=switches,
                    deterministic=deterministic, dbias=with_dbias, alibi_shift=shift,
                    dslopes=with_dslopes)
                return ((dqb, dkb, dvb) +
                        ((reduce_to(dbias_b, bias.shape),) if with_dbias else ()) +
                        ((dslopes_b,) if with_dslopes else ()))

            def hidden(qb=qb, kb=kb):
                return ((jnp.zeros_like(qb), jnp.zeros_like(kb), jnp.zeros_like(kb)) +
                        ((jnp.zeros(bias.shape, jnp.float32),) if with_dbias else ()) +
                        ((jnp.zeros(alibi.shape, jnp.float32),) if with_dslopes else ()))

            grads = _dispatch(block.call, p, run, hidden,
                              (qb, kb, vb, ob, lb, dob, q_len, kv_len, qb_ids, kb_ids, alibi),
                              None if alibi is None else alibi_shift)
            dq = _add_rows(dq, grads[0], block.r0)
            dk = _add_rows(dk, grads[1], block.c0)
            dv = _add_rows(dv, grads[2], block.c0)
            if with_dbias:
                dbias = dbias + grads[3]
            if with_dslopes:
                dslopes = dslopes + grads[-1]
        if ring:
            # dK/dV follow their K/V shard; the pass after the last step brings them home.
            dk, dv = _pass_on((dk, dv), axes, devices)
            if step + 1 < devices:
                k, v, kv_ids = k_next, v_next, ids_next
    if schedule.mode == ROWS:
        dk, dv = lax.psum(dk, axes), lax.psum(dv, axes)
    elif schedule.mode == KV_SPLIT:
        dq = lax.psum(dq, axes)
    if dbias is not None:
        dbias = lax.psum(dbias, axes)
    if schedule.relayout:
        dq = from_zigzag(dq, -3, axes, devices)
        if ring:
            dk, dv = from_zigzag(dk, -3, axes, devices), from_zigzag(dv, -3, axes, devices)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dslopes
