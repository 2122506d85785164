"""Multi-device attention on 8 host CPU devices (conftest sets the device count).

Sharded results must equal the unsharded ones (float32, tight tolerance), batch/head splits must
compile with no collective at all, and a split sequence must run as a ring (collective-permute,
never all-gather/all-to-all) whose causal work is balanced across devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashattn
from jax_flashattn import _ops, _ring, sharding
from helpers import jitted_reference, reference_grads

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)"
                        r"(?:-start)?\(")


def _mesh(shape, names, axis_type=AxisType.Explicit):
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(axis_type,) * len(names))


def _collectives(compiled) -> set:
    return set(COLLECTIVE.findall(compiled.as_text()))


def _assert_communication(compiled, expect: str):
    """expect "none": no collective at all; "ring": collective-permutes, never an all-gather
    or all-to-all; anything else: not checked."""
    found = _collectives(compiled)
    if expect == "none":
        assert not found, f"expected no communication, found {found}"
    elif expect == "ring":
        assert "collective-permute" in found, found
        assert not found & {"all-gather", "all-to-all"}, found


def _normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def _qkv(rng, b, t, s, n, k, h):
    return _normal(rng, (b, t, n, h)), _normal(rng, (b, s, k, h)), _normal(rng, (b, s, k, h))


def _out_and_grads(**kwargs):
    """f(q, k, v, d_out) -> (out, (dq, dk, dv)): one program for the forward and the backward."""
    def f(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: jax_flashattn.attention(q, k, v, **kwargs), q, k, v)
        return out, vjp(d_out)
    return f


def _assert_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"NaN in {what}"
    err = np.max(np.abs(got - want), initial=0.0)
    bound = 1e-5 * (np.max(np.abs(want), initial=0.0) + 1)
    assert err <= bound, f"{what}: max error {err:.3g} exceeds {bound:.3g}"


def _check_sharded(mesh, spec_q, spec_kv, q, k, v, *, expect, **kwargs):
    """Runs forward+backward on sharded inputs; compares with the unsharded run and with the
    reference; checks the collectives of the compiled program. Returns the compiled program."""
    rng = np.random.default_rng(1)
    d_out = _normal(rng, q.shape)
    f = _out_and_grads(**kwargs)
    args = (jax.device_put(q, NamedSharding(mesh, spec_q)),
            jax.device_put(k, NamedSharding(mesh, spec_kv)),
            jax.device_put(v, NamedSharding(mesh, spec_kv)),
            jax.device_put(d_out, NamedSharding(mesh, spec_q)))
    compiled = jax.jit(f).lower(*args).compile()
    out, grads = compiled(*args)
    want_out, want_grads = jax.jit(f)(q, k, v, d_out)
    _assert_close(out, want_out, "out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_close(g, w, name)
    _assert_close(want_out, jitted_reference(q, k, v, **kwargs), "unsharded out vs reference")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec_q), q.ndim), out.sharding
    _assert_communication(compiled, expect)
    return compiled


# Mesh shapes x the roles of their axes. Heads split with K % split == 0 (GQA, group 2) keeps
# q and k/v heads together; the sequence split runs ring attention.
MESHES = [
    ((8,), ("batch",)), ((8,), ("heads",)), ((8,), ("seq",)),
    ((2, 4), ("batch", "heads")), ((2, 4), ("batch", "seq")), ((2, 4), ("heads", "seq")),
    ((4, 2), ("batch", "heads")), ((4, 2), ("batch", "seq")), ((4, 2), ("heads", "seq")),
    ((2, 2, 2), ("batch", "heads", "seq")),
]
DIM = {"batch": 0, "seq": 1, "heads": 2}


def _case_kwargs(roles, t, s):
    if "seq" not in roles:
        return dict(is_causal=True)
    # Vary what the ring must respect: a sliding window whose left side falls exactly one short
    # of a chunk (the shifted window -1 case); causal cross-attention (S = 2T) with padding.
    if "batch" in roles:
        return dict(local_window_size=(t // 8 - 1, 2))
    return dict(is_causal=True, query_seq_lengths=jnp.array([t - 3, t // 2 + 1]),
                key_value_seq_lengths=jnp.array([s, s // 3]))


@pytest.mark.parametrize("shape,roles", MESHES,
                         ids=["x".join(map(str, s)) + "-" + "-".join(r) for s, r in MESHES])
def test_sharded_matches_unsharded(shape, roles):
    sizes = dict(zip(roles, shape))
    b = sizes.get("batch", 2)
    kv_heads = sizes.get("heads", 2)
    t = 8 * sizes.get("seq", 1) * 2
    s = t if "batch" in roles else 2 * t
    q, k, v = _qkv(np.random.default_rng(0), b, t, s, 2 * kv_heads, kv_heads, 16)
    names = tuple(f"a{i}" for i in range(len(shape)))
    spec = [None] * 4
    for name, role in zip(names, roles):
        spec[DIM[role]] = name
    mesh = _mesh(shape, names)
    _check_sharded(mesh, P(*spec), P(*spec), q, k, v,
                   expect="ring" if "seq" in roles else "none", **_case_kwargs(roles, t, s))


def test_heads_split_finer_than_kv_heads():
    """MQA with the query heads split 8 ways: K/V stay replicated, each device reads the kv head
    of its query heads; the forward moves nothing, the backward only sums dK/dV."""
    q, k, v = _qkv(np.random.default_rng(0), 2, 16, 16, 8, 1, 16)
    mesh = _mesh((8,), ("h",))
    compiled = _check_sharded(mesh, P(None, None, "h"), P(), q, k, v, expect=None,
                              is_causal=True)
    assert _collectives(compiled) <= {"all-reduce"}


def test_forward_only_has_no_collectives_for_mqa_heads():
    q, k, v = _qkv(np.random.default_rng(0), 2, 16, 16, 8, 1, 16)
    mesh = _mesh((8,), ("h",))
    spec = NamedSharding(mesh, P(None, None, "h"))
    args = (jax.device_put(q, spec), *(jax.device_put(x, NamedSharding(mesh, P())) for x in (k, v)))
    compiled = jax.jit(jax_flashattn.attention).lower(*args).compile()
    assert not _collectives(compiled)


def test_sharded_keys_with_replicated_queries():
    """Decoding against a sequence-sharded cache: per-shard attention merged across devices."""
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 1, 64, 4, 2, 16)
    mesh = _mesh((8,), ("s",))
    compiled = _check_sharded(mesh, P(), P(None, "s"), q, k, v, expect=None,
                              key_value_seq_lengths=jnp.array([64, 21]))
    assert not _collectives(compiled) & {"all-gather", "all-to-all"}


def test_bias_broadcast_over_sequence_with_ring():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 32, 32, 4, 2, 16)
    bias = _normal(rng, (1, 4, 1, 1))
    mesh = _mesh((4,), ("s",))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "s"))) for x in (q, k, v)]

    def loss(q, k, v, bias):
        return jnp.sum(jnp.sin(jax_flashattn.attention(q, k, v, bias, is_causal=True)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    compiled = grad.lower(*args, bias).compile()
    assert "collective-permute" in _collectives(compiled)
    for g, w in zip(compiled(*args, bias), grad(q, k, v, bias)):
        _assert_close(g, w, "grad")


def test_bias_varying_along_sequence_is_gathered_correctly():
    """Not split by the ring (documented): the partitioner gathers the sequence instead."""
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 16, 16, 4, 2, 16)
    bias = _normal(rng, (2, 1, 16, 16))
    mesh = _mesh((4,), ("s",))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "s"))) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v, b: jax_flashattn.attention(q, k, v, b, is_causal=True))
    _assert_close(f(*args, bias), f(q, k, v, bias), "out")


def test_vmap_over_a_sharded_dim_and_auto_axes():
    rng = np.random.default_rng(0)
    q, k, v = (x.reshape((2, 2) + x.shape[1:]) for x in _qkv(rng, 4, 16, 16, 4, 4, 16))
    mesh = _mesh((2, 4), ("v", "h"), AxisType.Auto)
    spec = NamedSharding(mesh, P("v", None, None, "h"))
    f = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=True)))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    compiled = f.lower(*args).compile()
    assert not _collectives(compiled)
    _assert_close(compiled(*args), f(q, k, v), "out")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_model_with_sharding_constraints(axis_type):
    """q, k, v computed inside jit from data sharded on (batch, sequence), under
    `jax.set_mesh`: value and gradients (through the projections) equal the unsharded ones."""
    rng = np.random.default_rng(0)
    x = _normal(rng, (2, 64, 32))
    w = _normal(rng, (3, 32, 4, 8)) * 0.2
    mesh = _mesh((2, 4), ("dp", "sp"), axis_type)
    data = NamedSharding(mesh, P("dp", "sp"))

    def model(x, w, constrain):
        if constrain:
            x = jax.lax.with_sharding_constraint(x, data)
        q, k, v = (jnp.einsum("btd,dnh->btnh", x, w[i]) for i in range(3))
        return jnp.sum(jax_flashattn.attention(q, k, v, is_causal=True) ** 2)

    grad = jax.value_and_grad(model, argnums=(0, 1))
    want_value, want_grads = jax.jit(grad, static_argnums=2)(x, w, False)
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, data), w)
        compiled = jax.jit(grad, static_argnums=2).lower(*args, True).compile()
        value, grads = compiled(*args)
    assert "collective-permute" in _collectives(compiled)
    assert not _collectives(compiled) & {"all-gather", "all-to-all"}
    _assert_close(value, want_value, "loss")
    for name, g, want in zip(("dx", "dw"), grads, want_grads):
        _assert_close(g, want, name)


# ----------------------------------------------------------------------------------------------
# ring_attention inside shard_map

def _ring_program(mesh, **kwargs):
    spec = P(None, "sp")

    def body(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: sharding.ring_attention(q, k, v, axis_name="sp",
                                                                  **kwargs), q, k, v)
        return out, vjp(d_out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                                 out_specs=(spec, (spec,) * 3)))


RING_CASES = [
    ("contiguous", dict(is_causal=True)),  # re-laid out zig-zag inside
    ("zigzag", dict(is_causal=True)),
    ("contiguous", dict(is_causal=True, local_window_size=(40, 0))),  # per-device windows
    ("zigzag", dict(local_window_size=(30, 5))),
]


@pytest.mark.parametrize("layout,kwargs", RING_CASES,
                         ids=[f"{layout}-{i}" for i, (layout, _) in enumerate(RING_CASES)])
def test_ring_attention_in_shard_map(layout, kwargs):
    rng = np.random.default_rng(0)
    devices, t = 4, 64
    q, k, v = _qkv(rng, 2, t, t, 4, 2, 16)
    d_out = _normal(rng, q.shape)
    kwargs = dict(kwargs, query_seq_lengths=jnp.array([t, 53]),
                  key_value_seq_lengths=jnp.array([t - 1, 45]))
    want_out, want_grads = jax.jit(_out_and_grads(**kwargs))(q, k, v, d_out)
    mesh = _mesh((devices,), ("sp",), AxisType.Auto)
    prepare = ((lambda x: sharding.zigzag(x, devices)) if layout == "zigzag" else (lambda x: x))
    restore = ((lambda x: sharding.unzigzag(x, devices)) if layout == "zigzag" else (lambda x: x))
    out, grads = _ring_program(mesh, layout=layout, **kwargs)(
        *(prepare(x) for x in (q, k, v, d_out)))
    _assert_close(restore(out), want_out, "out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_close(restore(g), w, name)


def test_zigzag_round_trip():
    x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    z = sharding.zigzag(x, 3)
    assert [int(c) for c in z[0, ::4, 0] // 3] == [0, 20, 4, 16, 8, 12]
    np.testing.assert_array_equal(sharding.unzigzag(z, 3), x)


def test_causal_work_is_balanced_at_run_time(monkeypatch):
    """Counts, per device, the (query, key) pairs every kernel call of the ring is asked to
    compute (from the window and lengths it actually receives): balanced with the zig-zag
    re-layout, skewed without, and their total is exactly the causal triangle."""
    devices, t, batch = 4, 64, 2
    records = []  # (device, pairs); list.append is atomic, callbacks run on several threads

    def record(device, pairs):
        records.append((int(device), int(pairs)))

    real = _ops.forward

    def counting(q, k, v, bias, mask, q_len, kv_len, q_ids=None, kv_ids=None, alibi=None, *,
                 scale, window, switches, soft_cap=0.0, alibi_shift=0):
        rows = jnp.arange(q.shape[-3])[None, :]  # [1, T]
        cols = k.shape[-3] if kv_len is None else kv_len[:, None]  # per batch entry
        begin = 0 if window[0] is None else jnp.maximum(rows - window[0], 0)
        end = jnp.minimum(cols, k.shape[-3] if window[1] is None else rows + window[1] + 1)
        pairs = jnp.maximum(end - begin, 0)
        if q_len is not None:
            pairs = jnp.where(rows < q_len[:, None], pairs, 0)
        pairs = jnp.sum(jnp.broadcast_to(pairs, (batch, q.shape[-3])))
        jax.debug.callback(record, lax.axis_index("sp"), pairs)
        return real(q, k, v, bias, mask, q_len, kv_len, q_ids, kv_ids, alibi, scale=scale,
                    window=window, switches=switches, soft_cap=soft_cap, alibi_shift=alibi_shift)

    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, batch, t, t, 2, 2, 16)
    want = jax_flashattn.attention(q, k, v, is_causal=True)
    monkeypatch.setattr(_ops, "forward", counting)
    mesh = _mesh((devices,), ("sp",), AxisType.Auto)
    triangle = batch * t * (t + 1) // 2
    work = {}
    for balance in (True, False):
        records.clear()
        f = jax.jit(jax.shard_map(
            lambda q, k, v: sharding.ring_attention(q, k, v, axis_name="sp", is_causal=True,
                                                    load_balance=balance),
            mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
        out = f(q, k, v)
        jax.effects_barrier()
        _assert_close(out, want, "out")
        work[balance] = [sum(n for device, n in records if device == p)
                         for p in range(devices)]
        assert sum(work[balance]) == triangle
    assert max(work[True]) <= 1.05 * min(work[True]), work[True]
    assert max(work[False]) >= 4 * min(work[False]), work[False]
    schedule = sharding.ring_schedule(devices, t, is_causal=True)
    assert schedule.relayout
    np.testing.assert_array_equal(np.asarray(schedule.work()) * batch, work[True])


# ----------------------------------------------------------------------------------------------
# The static schedule: every visible (query, key) pair computed exactly once

def _coverage(schedule: _ring.Schedule, t: int, s: int) -> np.ndarray:
    covered = np.zeros((t, s), np.int64)
    cq, ck = schedule.q.chunk, schedule.kv.chunk
    for step, calls in enumerate(schedule.steps):
        for call in calls:
            for p, window in enumerate(call.windows):
                if window == _ring.HIDDEN:
                    continue
                q_rows = np.concatenate([np.arange(c * cq, (c + 1) * cq) for c in
                                         schedule.q.chunks[p][call.rows[0]:call.rows[1]]])
                kv_cols = np.concatenate([np.arange(c * ck, (c + 1) * ck) for c in
                                          schedule.kv.chunks[schedule.source(step, p)]
                                          [call.cols[0]:call.cols[1]]])
                left, right = window
                i = np.arange(len(q_rows))[:, None]
                j = np.arange(len(kv_cols))[None, :]
                keep = np.ones((len(q_rows), len(kv_cols)), bool)
                if left is not None:
                    keep &= j >= i - left
                if right is not None:
                    keep &= j <= i + right
                covered[np.ix_(q_rows, kv_cols)] += keep
    return covered


@pytest.mark.parametrize("devices", [2, 3, 4, 8])
@pytest.mark.parametrize("mode", [_ring.RING, _ring.ROWS, _ring.KV_SPLIT])
@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, 0), (7, 0), (8, 8), (0, 5),
                                    (12, None), (2, -1), (-1, 4)])
def test_schedule_covers_each_visible_pair_once(devices, mode, window):
    t = s = 16 * devices
    want = np.ones((t, s), bool)
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    if window[0] is not None:
        want &= j >= i - window[0]
    if window[1] is not None:
        want &= j <= i + window[1]
    for layout in ("contiguous", "zigzag"):
        if mode == _ring.KV_SPLIT and layout == "zigzag":
            continue
        schedule = _ring.make_schedule(mode, devices, t, s, window, layout)
        np.testing.assert_array_equal(_coverage(schedule, t, s), want.astype(np.int64))


def test_schedule_cross_attention_lengths():
    for window in [(None, 0), (5, 3)]:
        schedule = _ring.balanced_schedule(_ring.RING, 4, 32, 64, window)
        i, j = np.arange(32)[:, None], np.arange(64)[None, :]
        want = np.ones((32, 64), bool)
        if window[0] is not None:
            want &= j >= i - window[0]
        want &= j <= i + window[1]
        np.testing.assert_array_equal(_coverage(schedule, 32, 64), want.astype(np.int64))


def test_balanced_schedule_choice():
    causal = sharding.ring_schedule(8, 256, is_causal=True)
    assert causal.relayout and max(causal.work()) == min(causal.work())
    sliding = sharding.ring_schedule(8, 256, is_causal=True, local_window_size=(16, 0))
    assert not sliding.relayout  # a narrow band is balanced as it is
    full = sharding.ring_schedule(8, 256)
    assert not full.relayout and len(set(full.work())) == 1


def test_canonical_windows():
    assert _ring.canonical((None, 0), 4, 4) == (None, 0)
    assert _ring.canonical((None, -4), 4, 4) == _ring.HIDDEN  # keys entirely after the queries
    assert _ring.canonical((None, 4), 4, 4) == (None, None)  # entirely before: no mask
    assert _ring.canonical((3, -1), 4, 4) == (None, -1)  # left 3 cuts nothing in 4 rows
    assert _ring.canonical((2, -1), 4, 4) == (2, -1)
    assert _ring.canonical((-4, None), 4, 4) == _ring.HIDDEN
    assert _ring.canonical((1, -2), 4, 4) == _ring.HIDDEN


# ----------------------------------------------------------------------------------------------
# Packed sequences: segment ids sharded like q's and k's batch and sequence dims

def _packed_ids(rng, b, length):
    """int32 [b, length]: documents in row order, cut at random places (length-1 documents
    among them), the last row's ids in no order."""
    rows = []
    for _ in range(b - 1):
        cuts = np.sort(rng.choice(np.arange(1, length), rng.integers(1, max(2, length // 3)),
                                  replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
    rows.append(rng.integers(0, 3, length))
    return jnp.asarray(np.stack(rows), jnp.int32)


def _segment_program(**kwargs):
    """f(q, k, v, q_ids, kv_ids, d_out) -> (out, (dq, dk, dv))."""
    def f(q, k, v, q_ids, kv_ids, d_out):
        out, vjp = jax.vjp(lambda q, k, v: jax_flashattn.attention(
            q, k, v, query_segment_ids=q_ids, key_value_segment_ids=kv_ids, **kwargs), q, k, v)
        return out, vjp(d_out)
    return f


def _reference_out_and_grads(q, k, v, q_ids, kv_ids, d_out, **kwargs):
    """The reference's (out, (dq, dk, dv)), one jitted program per options and shapes (each
    case's shapes are its own: eagerly, one compilation per operation)."""
    out, dq, dk, dv, _ = reference_grads(q, k, v, None, d_out, query_segment_ids=q_ids,
                                         key_value_segment_ids=kv_ids, **kwargs)
    return out, (dq, dk, dv)


def _assert_grads_near_reference(grads, want_grads):
    """Float32 gradients against the reference's: max error <= 1e-4 * (max |want| + 1)."""
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err, bound = np.max(np.abs(g - w)), 1e-4 * (np.max(np.abs(w)) + 1)
        assert err <= bound, f"{name}: max error {err:.3g} exceeds {bound:.3g}"


def _check_sharded_segments(mesh, spec_q, spec_kv, q, k, v, q_ids, kv_ids, *, expect,
                            **kwargs):
    """Forward and backward with q/k/v and the ids sharded (the ids like the batch and
    sequence dims of q and of k): equal to the unsharded run, which matches the reference;
    the compiled program's collectives as `expect` says."""
    d_out = _normal(np.random.default_rng(1), q.shape)
    f = _segment_program(**kwargs)

    def ids_spec(spec):
        return P(*(tuple(spec) + (None, None))[:2])

    args = (jax.device_put(q, NamedSharding(mesh, spec_q)),
            jax.device_put(k, NamedSharding(mesh, spec_kv)),
            jax.device_put(v, NamedSharding(mesh, spec_kv)),
            jax.device_put(q_ids, NamedSharding(mesh, ids_spec(spec_q))),
            jax.device_put(kv_ids, NamedSharding(mesh, ids_spec(spec_kv))),
            jax.device_put(d_out, NamedSharding(mesh, spec_q)))
    compiled = jax.jit(f).lower(*args).compile()
    out, grads = compiled(*args)
    want_out, want_grads = jax.jit(f)(q, k, v, q_ids, kv_ids, d_out)
    _assert_close(out, want_out, "out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_close(g, w, name)
    ref_out, ref_grads = _reference_out_and_grads(q, k, v, q_ids, kv_ids, d_out, **kwargs)
    _assert_close(want_out, ref_out, "unsharded out vs reference")
    _assert_grads_near_reference(want_grads, ref_grads)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec_q), q.ndim), out.sharding
    plain = jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, **kwargs))(q, k, v)
    assert np.max(np.abs(np.asarray(out) - np.asarray(plain))) > 0.1, "the ids changed nothing"
    _assert_communication(compiled, expect)
    return compiled


@pytest.mark.parametrize("shape,roles", [((8,), ("batch",)), ((2, 4), ("batch", "heads"))],
                         ids=["8-batch", "2x4-batch-heads"])
def test_segment_ids_sharded_on_batch(shape, roles):
    """Ids sharded with the batch of q/k/v (heads split too): the unsharded result and
    gradients, with no communication."""
    rng = np.random.default_rng(2)
    b, t, s = (8, 24, 40) if shape == (8,) else (2, 24, 24)
    kv_heads = 4 if "heads" in roles else 2
    q, k, v = _qkv(rng, b, t, s, 2 * kv_heads, kv_heads, 16)
    names = tuple(f"a{i}" for i in range(len(shape)))
    spec = [None] * 4
    for name, role in zip(names, roles):
        spec[DIM[role]] = name
    _check_sharded_segments(_mesh(shape, names), P(*spec), P(*spec), q, k, v,
                            _packed_ids(rng, b, t), _packed_ids(rng, b, s), expect="none",
                            is_causal=True)


SEQ_CASES = {
    # name: (mesh shape, roles, T, S, attention options)
    "4-seq-full": ((4,), ("seq",), 32, 32, dict()),
    "4-seq-causal": ((4,), ("seq",), 32, 32, dict(is_causal=True)),
    "8-seq-causal-cross": ((8,), ("seq",), 32, 64, dict(
        is_causal=True, query_seq_lengths=jnp.array([29, 17]),
        key_value_seq_lengths=jnp.array([64, 40]))),
    "2x4-batch-seq-window": ((2, 4), ("batch", "seq"), 32, 32, dict(local_window_size=(5, 2))),
    "2x2x2-batch-heads-seq-causal": ((2, 2, 2), ("batch", "heads", "seq"), 16, 16,
                                     dict(is_causal=True)),
}


@pytest.mark.parametrize("case", list(SEQ_CASES), ids=str)
def test_segment_ids_sequence_sharded(case):
    """T and S (and the ids) sharded over 4 or 8 devices run the ring: values and gradients
    equal the unsharded ones, causal and not, with the ids' shards travelling with K/V."""
    shape, roles, t, s, kwargs = SEQ_CASES[case]
    rng = np.random.default_rng(3)
    b = 2
    q, k, v = _qkv(rng, b, t, s, 4, 2, 16)
    if t == s:
        q_ids = kv_ids = _packed_ids(rng, b, t)
    else:
        q_ids, kv_ids = _packed_ids(rng, b, t), _packed_ids(rng, b, s)
    names = tuple(f"a{i}" for i in range(len(shape)))
    spec = [None] * 4
    for name, role in zip(names, roles):
        spec[DIM[role]] = name
    _check_sharded_segments(_mesh(shape, names), P(*spec), P(*spec), q, k, v, q_ids, kv_ids,
                            expect="ring", **kwargs)


@pytest.mark.parametrize("which", ["queries", "keys"])
def test_segment_ids_one_side_sequence_sharded(which):
    """Only the queries sequence-sharded (K/V and their ids replicated), or only the keys (a
    sharded cache, queries replicated): the unsharded result and gradients."""
    rng = np.random.default_rng(4)
    t, s = (32, 24) if which == "queries" else (3, 64)
    q, k, v = _qkv(rng, 2, t, s, 4, 2, 16)
    sharded, replicated = P(None, "s"), P()
    spec_q, spec_kv = (sharded, replicated) if which == "queries" else (replicated, sharded)
    _check_sharded_segments(_mesh((8,), ("s",)), spec_q, spec_kv, q, k, v,
                            _packed_ids(rng, 2, t), _packed_ids(rng, 2, s), expect=None,
                            is_causal=which == "queries")


SEGMENT_RING_CASES = [
    # (layout, S / T, options)
    ("contiguous", 1, dict()),
    ("contiguous", 1, dict(is_causal=True)),  # re-laid out zig-zag inside, ids included
    ("zigzag", 1, dict(is_causal=True)),
    ("zigzag", 1, dict(local_window_size=(20, 3))),
    ("zigzag", 2, dict(is_causal=True)),  # cross attention, the two sides packed differently
]


@pytest.mark.parametrize("layout,ratio,kwargs", SEGMENT_RING_CASES,
                         ids=[f"{layout}-{i}" for i, (layout, _, _) in
                              enumerate(SEGMENT_RING_CASES)])
def test_ring_attention_segment_ids_in_shard_map(layout, ratio, kwargs):
    """ring_attention inside shard_map with the LOCAL shards of the ids (zig-zagged with q/k/v
    for layout="zigzag"): the reference's values and gradients."""
    rng = np.random.default_rng(5)
    devices, t = 4, 48
    s = ratio * t
    q, k, v = _qkv(rng, 2, t, s, 4, 2, 16)
    d_out = _normal(rng, q.shape)
    q_ids = _packed_ids(rng, 2, t)
    if s == t:  # row 0 packed differently on each side
        kv_ids = q_ids.at[0].set(_packed_ids(rng, 2, t)[0])
    else:
        kv_ids = _packed_ids(rng, 2, s)
    kwargs = dict(kwargs, query_seq_lengths=jnp.array([t, 41]),
                  key_value_seq_lengths=jnp.array([s - 1, 37]))
    want_out, want_grads = _reference_out_and_grads(q, k, v, q_ids, kv_ids, d_out, **kwargs)
    mesh = _mesh((devices,), ("sp",), AxisType.Auto)
    prepare = ((lambda x: sharding.zigzag(x, devices)) if layout == "zigzag" else (lambda x: x))
    restore = ((lambda x: sharding.unzigzag(x, devices)) if layout == "zigzag" else (lambda x: x))
    spec = P(None, "sp")

    def body(q, k, v, q_ids, kv_ids, d_out):
        out, vjp = jax.vjp(lambda q, k, v: sharding.ring_attention(
            q, k, v, axis_name="sp", layout=layout, query_segment_ids=q_ids,
            key_value_segment_ids=kv_ids, **kwargs), q, k, v)
        return out, vjp(d_out)

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6,
                                    out_specs=(spec, (spec,) * 3)))
    out, grads = program(*(prepare(x) for x in (q, k, v, q_ids, kv_ids, d_out)))
    _assert_close(restore(out), want_out, "out")
    _assert_grads_near_reference([restore(g) for g in grads], want_grads)
    plain = jax_flashattn.attention(q, k, v, **kwargs)
    assert np.max(np.abs(np.asarray(restore(out)) - np.asarray(plain))) > 0.1
