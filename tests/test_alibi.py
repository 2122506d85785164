"""ALiBi: -slope |t + shift - s| added to each logit, the slopes differentiable. The reference
against a direct numpy formula, then `attention` on the CPU kernels (values, lse, gradients of
q, k, v, the bias and the slopes) against the float32 reference with every option and both
diagonal alignments, under jit and vmap, the jax.nn implementations (a dense bias there), the
Flax adapter, a sharded batch or heads, a sharded sequence on the ring (under jit and in
`ring_attention`, each ring step's kernel call with its own ALiBi shift), and the errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn
from jax_flashattn import flax as jfa_flax
from jax_flashattn import _ring, _validate, reference, sharding
from jax_flashattn.attention import _alibi_logits
from helpers import assert_attention_close, assert_grads_close, assert_lse_close, random_qkv
# test_soft_cap's shapes, which its options' segment ids and lengths are built for.
from test_soft_cap import B, H, K, N, S, T, OPTIONS as SOFT_CAP_OPTIONS

Q_LENS, KV_LENS = np.array([30, 37], np.int32), np.array([70, 41], np.int32)
OPTIONS = dict(
    SOFT_CAP_OPTIONS,
    soft_cap=dict(logits_soft_cap=2.0, is_causal=True),
    bottom_right=dict(diagonal_alignment="bottom_right"),
    bottom_right_causal=dict(is_causal=True, diagonal_alignment="bottom_right"),
    # Each entry's diagonal at kv_len - q_len (11 and 4), without and with a causal mask.
    bottom_right_lengths=dict(diagonal_alignment="bottom_right", query_seq_lengths=Q_LENS,
                              key_value_seq_lengths=KV_LENS),
    bottom_right_lengths_window=dict(diagonal_alignment="bottom_right", local_window_size=(9, 0),
                                     query_seq_lengths=Q_LENS, key_value_seq_lengths=KV_LENS))


def draw_slopes(rng, shape=(N,)):
    """Slopes of BLOOM's range (2^-8 to 2^-1), some distances of S giving logits of -1 to -35."""
    return jnp.asarray(2.0 ** -rng.uniform(1, 8, shape), jnp.float32)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_reference_is_the_formula(rng, alignment):
    q, k, v = random_qkv(rng, B, T, S, N, N, H, jnp.float32)
    slopes = draw_slopes(rng, (B, N))
    shift = S - T if alignment == "bottom_right" else 0
    distance = np.abs(np.arange(T)[:, None] + shift - np.arange(S)[None, :])
    logits = (np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64))
              / np.sqrt(H) - np.asarray(slopes, np.float64)[:, :, None, None] * distance)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), np.asarray(v, np.float64))
    out = reference.attention(q, k, v, alibi_slopes=slopes, diagonal_alignment=alignment)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("slopes_shape", [(N,), (B, N)], ids=["N", "BN"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward_matches_reference(rng, dtype, slopes_shape, option):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, dtype)
    kwargs = dict(OPTIONS[option], alibi_slopes=draw_slopes(rng, slopes_shape))
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True, **kwargs)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, **kwargs))


def alibi_grads(fn, q, k, v, bias, slopes, d_out, **kwargs):
    """(out, dq, dk, dv, dbias, dslopes) of fn for cotangent d_out."""
    def f(q, k, v, bias, slopes):
        return fn(q, k, v, bias, alibi_slopes=slopes, **kwargs)
    out, vjp = jax.vjp(f, q, k, v, bias, slopes)
    return (out, *vjp(d_out))


# Jitted once per (option, slopes shape): the float32 and bf16 cases share it.
@functools.partial(jax.jit, static_argnames=("option",))
def reference_alibi_grads(q, k, v, bias, slopes, d_out, option):
    return alibi_grads(reference.attention, q, k, v, bias, slopes, d_out, **OPTIONS[option])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("slopes_shape", [(N,), (B, N)], ids=["N", "BN"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gradients_match_reference(rng, dtype, slopes_shape, option):
    """dslopes sums -|t + shift - s| dS over each head's pairs (and over the batch for [N])."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, dtype)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    slopes = draw_slopes(rng, slopes_shape)
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    kwargs = OPTIONS[option]
    got = jax.jit(lambda *a: alibi_grads(jax_flashattn.attention, *a, **kwargs))(
        q, k, v, bias, slopes, d_out)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias, slopes, d_out)]
    want = reference_alibi_grads(*f32, option=option)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape, name
        assert_grads_close(g, w, normwise=normwise, name=name)
    if dtype == jnp.float32:
        assert_grads_close(got[5], want[5], name="dslopes")
    else:
        assert_dslopes_close(got[5], want[5], q, k, v, bias, slopes, d_out, got[0],
                             relative=1e-2, **kwargs)


def slopes_terms(q, k, v, bias, slopes, d_out, out, **kwargs):
    """(model, scale), float64 of the slopes' shape: the slopes' gradient -sum |t + shift - s|
    dS with the kernels' own rounding, dS = P (dP - D) from the exact P and dP but
    D = rowsum(dO o out) from the kernels' output `out` (which the float32 reference does not
    round; the error of D that rounding brings dominates the kernels' dslopes error), and
    |t + shift - s| |dS| summed, the size of the terms whose signed sum that is (dS sums to
    about 0 along a row, so the sum cancels), which the tolerances are relative to."""
    args = _validate.normalize(q, k, v, bias, alibi_slopes=slopes, **kwargs)
    p = np.asarray(reference._softmax(args, jnp.float32)[0], np.float64)  # [B, N, T, S]
    group = q.shape[2] // k.shape[2]
    v64 = np.repeat(np.asarray(v, np.float64), group, axis=2)
    d_out64, out64 = np.asarray(d_out, np.float64), np.asarray(out, np.float64)
    dp = np.einsum("btnh,bsnh->bnts", d_out64, v64)
    d = np.einsum("btnh,btnh->bnt", d_out64, out64)[..., None]
    ds = p * (dp - d)
    unit = _validate.normalize(q, k, v, bias, alibi_slopes=jnp.ones(q.shape[:1] + q.shape[2:3]),
                               **kwargs)
    distance = -np.asarray(_alibi_logits(unit), np.float64)
    model, scale = -np.sum(distance * ds, axis=(2, 3)), np.sum(distance * np.abs(ds), axis=(2, 3))
    if np.ndim(slopes) == 1:  # slopes shared by the batch: gradients summed over it
        return model.sum(axis=0), scale.sum(axis=0)
    return model, scale


def assert_dslopes_close(got, want, q, k, v, bias, slopes, d_out, out, *, relative, **kwargs):
    """Low-precision dslopes against the float32 reference `want` within `relative` of the
    terms' size (the rounding of the output moves D, and so each term), and against the model
    with that rounding within float32 arithmetic (1e-3 of the terms' size, checked to be below
    half the gradient: a missing or halved gradient fails it)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == np.shape(slopes) and np.isfinite(got).all(), "dslopes"
    model, scale = slopes_terms(q, k, v, bias, slopes, d_out, out, **kwargs)
    err, bound = np.linalg.norm(got - want), relative * np.linalg.norm(scale) + 1e-5
    assert err <= bound, f"dslopes: normwise error {err:.3g} exceeds {bound:.3g}"
    err, bound = np.linalg.norm(got - model), 1e-3 * np.linalg.norm(scale) + 1e-5
    assert err <= bound, f"dslopes against the model: error {err:.3g} exceeds {bound:.3g}"
    assert bound < 0.5 * np.linalg.norm(model), "dslopes: the model's bound is too loose here"


def test_slopes_change_the_result_and_zero_is_none(rng):
    """Slopes of 0 give the call without ALiBi bit for bit; large ones keep each row on its
    diagonal key."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    without = jax_flashattn.attention(q, k, v, return_residual=True)
    zero = jax_flashattn.attention(q, k, v, alibi_slopes=jnp.zeros(N), return_residual=True)
    for a, b in zip(zero, without):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    steep = jax_flashattn.attention(q, k, v, alibi_slopes=jnp.full(N, 1e4))
    group = N // K
    np.testing.assert_allclose(np.asarray(steep), np.repeat(np.asarray(v[:, :T]), group, axis=2),
                               rtol=1e-5, atol=1e-5)


def test_under_jit_vmap_and_grad(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    slopes = draw_slopes(rng)
    f = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=True,
                                                                 alibi_slopes=slopes)))
    out = f(q[:, None], k[:, None], v[:, None])[:, 0]
    want = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)

    def loss(fn, s):
        return jnp.sum(fn(q, k, v, is_causal=True, alibi_slopes=s) ** 2)
    got = jax.jit(jax.grad(lambda s: loss(jax_flashattn.attention, s)))(slopes)
    assert_grads_close(got, jax.grad(lambda s: loss(reference.attention, s))(slopes),
                       name="dslopes")


@pytest.mark.parametrize("option", ["causal", "bottom_right_lengths"])
def test_jax_nn_implementation_takes_a_dense_bias(rng, option):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    kwargs = dict(OPTIONS[option], alibi_slopes=draw_slopes(rng))
    out = jax_flashattn.attention(q, k, v, implementation="xla", **kwargs)
    assert_attention_close(out, q, k, v, **kwargs)


def test_zero_size_inputs(rng):
    """S = 0: rows that see no key; H = 0: the logits are ALiBi's term alone."""
    q, k, v = random_qkv(rng, B, T, 0, N, K, H, jnp.float32)
    out, lse = jax_flashattn.attention(q, k, v, alibi_slopes=draw_slopes(rng),
                                       return_residual=True)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    q, k, v = random_qkv(rng, B, T, S, N, K, 0, jnp.float32)
    slopes = draw_slopes(rng)
    _, lse = jax_flashattn.attention(q, k, v, alibi_slopes=slopes, return_residual=True)
    logits = -np.asarray(slopes, np.float64)[:, None, None] * np.abs(
        np.arange(T)[:, None] - np.arange(S)[None, :])  # [N, T, S]
    want = np.log(np.exp(logits).sum(-1)).T  # [T, N]
    np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(want, (B, T, N)), rtol=1e-5,
                               atol=1e-5)


def test_flax_adapter_passes_them_on(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    slopes = draw_slopes(rng)
    want = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    out = jfa_flax.dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    fixed = jfa_flax.make_attention_fn(is_causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(np.asarray(fixed(q, k, v)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)
    per_entry = draw_slopes(rng, (B, N))
    out = jfa_flax.dot_product_attention(q[None], k[None], v[None], alibi_slopes=per_entry[None])
    want = reference.attention(q, k, v, alibi_slopes=per_entry)
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want), rtol=1e-5, atol=1e-5)


def sharded_out_and_grads(fn, **kwargs):
    """f(q, k, v, slopes, d_out) -> (out, (dq, dk, dv, dslopes)) of fn, in one program."""
    def f(q, k, v, slopes, d_out):
        out, vjp = jax.vjp(lambda q, k, v, s: fn(q, k, v, alibi_slopes=s, **kwargs), q, k, v,
                           slopes)
        return out, vjp(d_out)
    return f


def assert_matches_reference(got, q, k, v, slopes, d_out, **kwargs):
    """(out, grads) of sharded_out_and_grads against the float32 reference's, by the
    error-ratio rules of helpers."""
    out, grads = got
    # Jitted: each case's shapes are its own (eagerly, one compilation per operation).
    assert_attention_close(out, q, k, v, alibi_slopes=slopes, jit_reference=True, **kwargs)
    _, want = jax.jit(sharded_out_and_grads(reference.attention, **kwargs))(q, k, v, slopes,
                                                                           d_out)
    for name, g, w in zip(("dq", "dk", "dv", "dslopes"), grads, want):
        assert_grads_close(g, w, name=name)


def assert_sequence_stays_split(compiled):
    """K/V rotate around the ring (collective-permute), and nothing gathers the sequence."""
    text = compiled.as_text()
    assert "collective-permute" in text
    gathers = re.findall(r"\b(all-gather|all-to-all)(?:-start)?\(", text)
    assert not gathers, f"the sequence was gathered: {sorted(set(gathers))}"


def test_sharded_batch_and_heads(rng):
    """The partitioned call with the batch or the heads split over 4 devices, slopes [B, N]
    sharded alike: the unsharded values and gradients, those the reference's."""
    devices = 4
    q, k, v = random_qkv(rng, 4, 32, 64, 4, 4, 16, jnp.float32)
    slopes = draw_slopes(rng, (4, 4))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(is_causal=True, diagonal_alignment="bottom_right")
    attention = jax.jit(sharded_out_and_grads(jax_flashattn.attention, **kwargs))
    want = attention(q, k, v, slopes, d_out)
    assert_matches_reference(want, q, k, v, slopes, d_out, **kwargs)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    for spec, slopes_spec in ((P("d"), P("d")), (P(None, None, "d"), P(None, "d"))):
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, d_out)]
        placed_slopes = jax.device_put(slopes, NamedSharding(mesh, slopes_spec))
        got = attention(*placed[:3], placed_slopes, placed[3])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


# name: (mesh shape, its axes (the last one splits the sequence), B, T, S, N, K, slopes' shape,
# options). Odd chunks where the layout allows: T / D (contiguous) or T / 2D (zig-zag).
RING_CASES = {
    # GQA, top-left, with padding: two distinct shifts per step (the keys before and after).
    "4-full-lengths": ((4,), ("seq",), 2, 36, 36, 4, 2, (4,), dict(
        query_seq_lengths=np.array([36, 29], np.int32),
        key_value_seq_lengths=np.array([31, 36], np.int32))),
    # Re-laid out zig-zag inside: blocks across a device's two chunks, heads split too.
    "2x4-heads-causal": ((2, 4), ("heads", "seq"), 2, 72, 72, 4, 2, (2, 4), dict(
        is_causal=True)),
    "8-window": ((8,), ("seq",), 2, 40, 40, 4, 4, (2, 4), dict(local_window_size=(6, 2))),
    # Cross attention, the global diagonal at S - T = 24, causal (zig-zag), MQA.
    "4-cross-bottom-right": ((4,), ("seq",), 1, 24, 48, 4, 1, (4,), dict(
        is_causal=True, diagonal_alignment="bottom_right")),
}


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("case", list(RING_CASES), ids=str)
def test_sequence_sharded_runs_the_ring(rng, case):
    """T and S split over 4 or 8 devices under jit: ring attention, each step's kernel call
    with its own ALiBi shift, no gather of the sequence; values and gradients (the slopes'
    summed over the ring) the reference's."""
    shape, axes, b, t, s, n, kv_heads, slopes_shape, kwargs = RING_CASES[case]
    q, k, v = random_qkv(rng, b, t, s, n, kv_heads, 16, jnp.float32)
    slopes = draw_slopes(rng, slopes_shape)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    mesh = jax.sharding.Mesh(devices, axes)
    spec = P(None, "seq", "heads" if "heads" in axes else None)
    slopes_spec = P(*((None,) * (len(slopes_shape) - 1)), "heads" if "heads" in axes else None)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, d_out)]
    placed_slopes = jax.device_put(slopes, NamedSharding(mesh, slopes_spec))
    program = jax.jit(sharded_out_and_grads(jax_flashattn.attention, **kwargs))
    compiled = program.lower(*placed[:3], placed_slopes, placed[3]).compile()
    assert_sequence_stays_split(compiled)
    assert_matches_reference(compiled(*placed[:3], placed_slopes, placed[3]), q, k, v, slopes,
                             d_out, **kwargs)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_steep_slopes_show_each_steps_shift(rng):
    """Slopes of 32 (a distance one off moves a logit by 32): every causal row takes its own
    value, the key at distance 0, on the zig-zag ring over 8 devices, whose blocks sit at
    global offsets their local positions do not give; a step's shift off by anything would
    take another key's."""
    devices, t = 8, 80
    q, k, v = random_qkv(rng, 2, t, t, 4, 2, 16, jnp.float32)
    slopes = jnp.full((4,), 32.0, jnp.float32)
    assert _ring.balanced_schedule(_ring.RING, devices, t, t, (None, 0), alibi=True).relayout
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("seq",))
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
    out = jax.jit(lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=True,
                                                          alibi_slopes=slopes))(*placed)
    assert_attention_close(out, q, k, v, is_causal=True, alibi_slopes=slopes,
                           jit_reference=True)  # shapes of its own: one compilation
    own_value = np.repeat(np.asarray(v), 2, axis=2)
    np.testing.assert_allclose(np.asarray(out), own_value, atol=2e-3 * np.abs(own_value).max())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_attention_in_shard_map(rng, layout):
    """ring_attention on local shards over 4 devices, the slopes replicated (P()) and their
    gradient summed over the ring by shard_map: the reference's values and gradients.
    contiguous: causal, re-laid out zig-zag inside, slopes [N]; zigzag: a window on cross
    attention with the bottom-right diagonal, slopes [B, N]."""
    devices = 4
    if layout == "contiguous":
        t, s, slopes_shape, kwargs = 72, 72, (4,), dict(is_causal=True)
    else:
        t, s, slopes_shape = 40, 72, (2, 4)
        kwargs = dict(local_window_size=(20, 5), diagonal_alignment="bottom_right")
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 16, jnp.float32)
    slopes = draw_slopes(rng, slopes_shape)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("sp",))
    prepare, restore = ((lambda x: sharding.zigzag(x, devices), lambda x: sharding.unzigzag(
        x, devices)) if layout == "zigzag" else (lambda x: x, lambda x: x))
    spec = P(None, "sp")
    program = jax.jit(jax.shard_map(
        sharded_out_and_grads(functools.partial(sharding.ring_attention, axis_name="sp",
                                                layout=layout), **kwargs),
        mesh=mesh, in_specs=(spec, spec, spec, P(), spec), out_specs=(spec, (spec,) * 3 + (P(),))))
    out, (dq, dk, dv, dslopes) = program(prepare(q), prepare(k), prepare(v), slopes,
                                         prepare(d_out))
    got = restore(out), (restore(dq), restore(dk), restore(dv), dslopes)
    assert_matches_reference(got, q, k, v, slopes, d_out, **kwargs)


def test_ring_schedule_offsets_are_global():
    """With `alibi`, each call's offset plus a pair's local distance is the pair's global
    distance, for every pair it computes (a whole-block call across zig-zag's two chunks would
    break it); without, step 0 of a causal zig-zag ring is one call."""
    devices, t = 4, 64
    for layout, window in (("zigzag", (None, 0)), ("contiguous", (None, None)),
                           ("zigzag", (9, 3))):
        schedule = _ring.make_schedule(_ring.RING, devices, t, t, window, layout, alibi=True)
        cq = ck = schedule.q.chunk
        for step, calls in enumerate(schedule.steps):
            for call in calls:
                for p, (w, offset) in enumerate(zip(call.windows, call.offsets)):
                    if w == _ring.HIDDEN:
                        continue
                    rows = np.concatenate([np.arange(c * cq, (c + 1) * cq) for c in
                                           schedule.q.chunks[p][slice(*call.rows)]])
                    cols = np.concatenate([np.arange(c * ck, (c + 1) * ck) for c in
                                           schedule.kv.chunks[schedule.source(step, p)]
                                           [slice(*call.cols)]])
                    i, j = np.arange(len(rows))[:, None], np.arange(len(cols))[None, :]
                    seen = np.ones((len(rows), len(cols)), bool)
                    if w[0] is not None:
                        seen &= j >= i - w[0]
                    if w[1] is not None:
                        seen &= j <= i + w[1]
                    distance = cols[None, :] - rows[:, None]
                    np.testing.assert_array_equal(np.where(seen, distance, 0),
                                                  np.where(seen, offset + j - i, 0))
    plain = _ring.make_schedule(_ring.RING, devices, t, t, (None, 0), "zigzag")
    with_alibi = _ring.make_schedule(_ring.RING, devices, t, t, (None, 0), "zigzag", alibi=True)
    assert len(plain.steps[0]) == 1 and len(with_alibi.steps[0]) == 3
    assert plain.work() == with_alibi.work()


def test_ring_attention_refuses_a_diagonal_per_batch_entry(rng):
    """Bottom-right ALiBi with seq lengths puts each entry's diagonal at its own
    kv_len - q_len, which a ring block's call cannot see: a ValueError naming the options
    (`attention` on sharded arrays gathers the sequences for it)."""
    q, k, v = random_qkv(rng, 2, 16, 16, 4, 2, 16, jnp.float32)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("sp",))
    f = jax.shard_map(lambda q, k, v: sharding.ring_attention(
        q, k, v, axis_name="sp", alibi_slopes=jnp.ones(4), diagonal_alignment="bottom_right",
        key_value_seq_lengths=jnp.array([16, 9])), mesh=mesh, in_specs=(P(None, "sp"),) * 3,
        out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match="alibi_slopes and query_seq_lengths or key_value"):
        f(q, k, v)


@pytest.mark.parametrize("value,error,match", [
    (np.zeros(3, np.float32), ValueError, r"alibi_slopes must have shape \[N\] or \[B, N\]"),
    (np.zeros((3, 4), np.float32), ValueError, "alibi_slopes must have shape"),
    (np.zeros((2, 4, 1), np.float32), ValueError, "alibi_slopes must have shape"),
    (np.ones(4, bool), TypeError, "alibi_slopes must be a real array"),
    ("0", TypeError, "alibi_slopes"),
])
def test_bad_values_raise_naming_the_option(rng, value, error, match):
    q, k, v = random_qkv(rng, B, 5, 9, N, K, H, jnp.float32)
    for fn in (jax_flashattn.attention, reference.attention):
        with pytest.raises(error, match=match):
            fn(q, k, v, alibi_slopes=value)


def test_unbatched_query_takes_slopes_of_n(rng):
    q, k, v = random_qkv(rng, 1, T, S, N, K, H, jnp.float32)
    slopes = draw_slopes(rng)
    out = jax_flashattn.attention(q[0], k[0], v[0], is_causal=True, alibi_slopes=slopes)
    want = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        jax_flashattn.attention(q[0], k[0], v[0], alibi_slopes=slopes[None])
