"""Attention sinks: each query head's logit that every row's softmax takes as a key of value 0.
The reference against a direct numpy formula, then `attention` (values, lse, gradients of q, k,
v and the sinks) against the float32 reference with every option, under jit and vmap, the Flax
adapter, batch and sequence sharding and ring attention, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn
from jax_flashattn import flax as jfa_flax
from jax_flashattn import reference, sharding
from helpers import (assert_attention_close, assert_dsinks_close, assert_grads_close,
                     assert_lse_close, random_qkv)
# test_soft_cap's shapes, which its options' segment ids and lengths are built for.
from test_soft_cap import B, H, K, N, S, T, OPTIONS as SOFT_CAP_OPTIONS

# test_soft_cap's options, and the soft-cap with bottom-right alignment.
OPTIONS = dict(SOFT_CAP_OPTIONS,
               soft_cap_bottom_right=dict(logits_soft_cap=3.0, is_causal=True,
                                          diagonal_alignment="bottom_right"))


def draw_sinks(rng, n=N):
    """Logits the size of the rows' own (standard normal q, k give ~N(0, 1) logits)."""
    return jnp.asarray(rng.standard_normal(n) * 2, jnp.float32)


def test_reference_is_the_formula(rng):
    q, k, v = random_qkv(rng, B, T, S, N, N, H, jnp.float32)
    sinks = draw_sinks(rng)
    logits = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64),
                       np.asarray(k, np.float64)) / np.sqrt(H)
    e = np.exp(logits)
    denominator = e.sum(-1, keepdims=True) + np.exp(np.asarray(sinks, np.float64))[:, None, None]
    want = np.einsum("bnts,bsnh->btnh", e / denominator, np.asarray(v, np.float64))
    out, lse = reference.attention(q, k, v, sinks=sinks, return_residual=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.log(denominator[..., 0]).transpose(0, 2, 1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward_matches_reference(rng, dtype, option):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, dtype)
    kwargs = dict(OPTIONS[option], sinks=draw_sinks(rng))
    out, lse = jax_flashattn.attention(q, k, v, return_residual=True, **kwargs)
    assert_lse_close(lse, assert_attention_close(out, q, k, v, **kwargs))


def sinks_grads(fn, q, k, v, bias, sinks, d_out, **kwargs):
    """(out, dq, dk, dv, dbias, dsinks) of fn for cotangent d_out."""
    def f(q, k, v, bias, sinks):
        return fn(q, k, v, bias, sinks=sinks, **kwargs)
    out, vjp = jax.vjp(f, q, k, v, bias, sinks)
    return (out, *vjp(d_out))


# The reference's values and gradients jitted once per option, for the option's float32 and
# bfloat16 cases alike (both take the inputs upcast): a jit per case compiled it twice.
@functools.partial(jax.jit, static_argnames="option")
def reference_sinks_grads(q, k, v, bias, sinks, d_out, option):
    return sinks_grads(reference.attention, q, k, v, bias, sinks, d_out, **OPTIONS[option])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gradients_match_reference(rng, dtype, option):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, dtype)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float32)
    sinks = draw_sinks(rng)
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    kwargs = OPTIONS[option]
    got = jax.jit(lambda *a: sinks_grads(jax_flashattn.attention, *a, **kwargs))(
        q, k, v, bias, sinks, d_out)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias, sinks, d_out)]
    want = reference_sinks_grads(*f32, option=option)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert_grads_close(g, w, normwise=normwise, name=name)
    if dtype == jnp.float32:
        assert_grads_close(got[5], want[5], name="dsinks")
        return
    assert_dsinks_close(got[5], q, k, v, bias, sinks, d_out, relative=2e-2, **kwargs)


def test_rows_that_see_nothing_and_a_sink_of_minus_inf(rng):
    """A row that sees no key returns 0 with lse = its head's sink; a sink of -inf is no sink
    (bit for bit), its gradient 0."""
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    sinks = draw_sinks(rng)
    lens = np.array([70, 0], np.int32)
    out, lse = jax_flashattn.attention(q, k, v, key_value_seq_lengths=lens, sinks=sinks,
                                       return_residual=True)
    assert (np.asarray(out[1]) == 0).all()
    np.testing.assert_array_equal(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks), (T, N)))
    none = jnp.full((N,), -jnp.inf)
    for kwargs in ({}, dict(key_value_seq_lengths=lens)):
        with_none = jax_flashattn.attention(q, k, v, sinks=none, return_residual=True, **kwargs)
        without = jax_flashattn.attention(q, k, v, return_residual=True, **kwargs)
        for a, b in zip(with_none, without):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    d_sinks = jax.grad(lambda s: jnp.sum(jax_flashattn.attention(q, k, v, sinks=s) ** 2))(none)
    assert (np.asarray(d_sinks) == 0).all()


def test_a_large_sink_takes_the_weight(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    out = jax_flashattn.attention(q, k, v, sinks=jnp.full((N,), 60.0))
    assert float(jnp.max(jnp.abs(out))) < 1e-20


def test_under_jit_and_vmap(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    sinks = draw_sinks(rng)
    f = jax.jit(jax.vmap(lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=True,
                                                                 sinks=sinks)))
    out = f(q[:, None], k[:, None], v[:, None])[:, 0]
    want = reference.attention(q, k, v, is_causal=True, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_zero_size_inputs(rng):
    q, k, v = random_qkv(rng, B, T, 0, N, K, H, jnp.float32)
    sinks = draw_sinks(rng)
    out, lse = jax_flashattn.attention(q, k, v, sinks=sinks, return_residual=True)
    assert (np.asarray(out) == 0).all()
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks), (B, T, N)))


def test_flax_adapter_passes_them_on(rng):
    q, k, v = random_qkv(rng, B, T, S, N, K, H, jnp.float32)
    sinks = draw_sinks(rng)
    want = reference.attention(q, k, v, is_causal=True, sinks=sinks)
    out = jfa_flax.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sharded_batch_sequence_and_ring_attention(rng):
    """The partitioned call (batch or sequence split over 4 devices) and ring attention, with
    the sinks' gradient summed over the devices' rows, as unsharded."""
    devices = 4
    q, k, v = random_qkv(rng, 4, 32, 64, N, K, 16, jnp.float32)
    sinks = draw_sinks(rng)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(is_causal=True, diagonal_alignment="bottom_right")

    def out_and_grads(fn):
        def f(q, k, v, sinks, d_out):
            out, vjp = jax.vjp(lambda *a: fn(*a, **kwargs), q, k, v, sinks)
            return out, vjp(d_out)
        return f

    want = jax.jit(out_and_grads(lambda q, k, v, s, **kw: reference.attention(
        q, k, v, sinks=s, **kw)))(q, k, v, sinks, d_out)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    attention = jax.jit(out_and_grads(lambda q, k, v, s, **kw: jax_flashattn.attention(
        q, k, v, sinks=s, **kw)))
    for spec in (P("d"), P(None, "d")):
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, d_out)]
        got = attention(*placed[:3], sinks, placed[3])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    spec = P(None, "d")
    ring = jax.jit(jax.shard_map(out_and_grads(
        lambda q, k, v, s, **kw: sharding.ring_attention(q, k, v, axis_name="d", sinks=s,
                                                         **kw)),
        mesh=mesh, in_specs=(spec, spec, spec, P(), spec),
        out_specs=(spec, (spec, spec, spec, P()))))
    got = ring(q, k, v, sinks, d_out)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value,error,match", [
    (np.zeros(3, np.float32), ValueError, r"sinks must have shape \[N\] = \(4,\)"),
    (np.zeros((1, 4), np.float32), ValueError, "sinks must have shape"),
    (np.ones(4, bool), TypeError, "sinks must be a real array"),
    ("0", TypeError, "sinks"),
])
def test_bad_values_raise_naming_the_option(rng, value, error, match):
    q, k, v = random_qkv(rng, B, 5, 9, N, K, H, jnp.float32)
    for fn in (jax_flashattn.attention, reference.attention):
        with pytest.raises(error, match=match):
            fn(q, k, v, sinks=value)


def test_jax_nn_implementations_refuse_them(rng):
    q, k, v = random_qkv(rng, B, 5, 9, N, K, H, jnp.float32)
    with pytest.raises(ValueError, match="sinks.*jax.nn"):
        jax_flashattn.attention(q, k, v, sinks=jnp.zeros(N), implementation="xla")


def sin_loss(fn):
    return lambda q, k, v, s: jnp.sum(jnp.sin(fn(q, k, v, s)))


# The reference's gradients of the test below, jitted once for its four cases (same shapes and
# options): eagerly, its first case compiled each of their operations (~2 s on 2 CPU cores).
reference_sin_grads = jax.jit(jax.grad(sin_loss(
    lambda q, k, v, s: reference.attention(q, k, v, is_causal=True, sinks=s)),
    argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("call", ["attention", "ring_attention"])
def test_gradient_outside_shard_map_is_summed_once(rng, check_vma, call):
    """Sinks replicated into shard_map (P()), the gradient taken outside it: each device's part
    summed once, with shard_map's type checks on and off."""
    devices = 4
    q, k, v = random_qkv(rng, 4, 32, 32, N, K, 16, jnp.float32)
    sinks = draw_sinks(rng)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    spec = P("d") if call == "attention" else P(None, "d")

    def local(q, k, v, sinks):
        if call == "attention":
            return jax_flashattn.attention(q, k, v, is_causal=True, sinks=sinks)
        return sharding.ring_attention(q, k, v, axis_name="d", is_causal=True, sinks=sinks)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec,
                            check_vma=check_vma)
    got = jax.jit(jax.grad(sin_loss(sharded), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = reference_sin_grads(q, k, v, sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
