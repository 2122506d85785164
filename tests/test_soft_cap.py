"""logits_soft_cap: the scaled logits become cap * tanh(s / cap) before the bias and every mask
(Gemma 2's order), on the CPU kernels, forward and gradients, against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import _ffi, _ops, reference
from helpers import (assert_attention_close, assert_grads_close, grads, random_qkv,
                     reference_grads)

B, T, S, N, K, H = 2, 37, 70, 4, 2, 24


def cpu_attention(*args, **kwargs):
    return jax_flashattn.attention(*args, implementation="cpu", **kwargs)


def capped_qkv(rng, dtype, t=T, s=S, magnitude=3.0):
    """Inputs whose logits reach well past the caps below (|s| up to ~20), so the tanh bends
    them."""
    return random_qkv(rng, B, t, s, N, K, H, dtype, magnitude=magnitude)


OPTIONS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_lengths": dict(local_window_size=(9, 4),
                           query_seq_lengths=np.array([37, 11], np.int32),
                           key_value_seq_lengths=np.array([70, 0], np.int32)),
    "segments": dict(query_segment_ids=np.arange(2 * T).reshape(2, T) // 15,
                     key_value_segment_ids=np.arange(2 * S).reshape(2, S) * T // S // 15,
                     is_causal=True),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_forward_matches_reference(rng, dtype, cap, option):
    q, k, v = capped_qkv(rng, dtype)
    kwargs = dict(OPTIONS[option], logits_soft_cap=cap)
    assert_attention_close(cpu_attention(q, k, v, **kwargs), q, k, v, **kwargs)


def test_cap_changes_the_result_and_bounds_the_logits(rng):
    """The cap is applied (the result differs from the uncapped one), and it bounds every
    logit: huge logits give the same output as logits of exactly +-cap would."""
    q, k, v = capped_qkv(rng, jnp.float32)
    capped = cpu_attention(q, k, v, logits_soft_cap=1.0)
    assert float(jnp.max(jnp.abs(capped - cpu_attention(q, k, v)))) > 1e-2
    huge = cpu_attention(q * 1e6, k, v, logits_soft_cap=1.0)
    signs = jnp.sign(jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)))
    weights = jax.nn.softmax(signs, axis=-1)  # logits of exactly +-1
    want = jnp.einsum("bnts,bsnh->btnh", weights, jnp.repeat(v, N // K, axis=2))
    np.testing.assert_allclose(np.asarray(huge), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(huge)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("option", sorted(OPTIONS) + ["mask"])
def test_gradients_match_reference(rng, dtype, option):
    q, k, v = capped_qkv(rng, dtype)
    d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
    kwargs = dict(OPTIONS.get(option, {}), logits_soft_cap=4.0)
    mask = jnp.asarray(rng.random((B, 1, T, S)) > 0.3) if option == "mask" else None
    args = () if mask is None else (mask,)
    got = grads(cpu_attention, q, k, v, None, d_out, *args, **kwargs)
    want = reference_grads(q, k, v, None, d_out, *args, **kwargs)
    normwise = None if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("out", "dq", "dk", "dv"), got[:4], want[:4]):
        assert_grads_close(g, w, normwise=normwise, name=name)


@pytest.mark.parametrize("bias_shape", [(B, N, T, S), (1, N, 1, S), (B, 1, T, 1)])
def test_bias_is_added_after_the_cap(rng, bias_shape):
    """The bias is not capped (a bias of 100 stays 100 above a cap of 2), and its gradient is
    dS itself, not dS times the cap's slope."""
    q, k, v = capped_qkv(rng, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(bias_shape) * 3, jnp.float32)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(is_causal=True, logits_soft_cap=2.0)
    got = grads(cpu_attention, q, k, v, bias, d_out, **kwargs)
    want = reference_grads(q, k, v, bias, d_out, **kwargs)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert_grads_close(g, w, name=name)
    big = jnp.zeros((1, 1, 1, S)).at[..., 3].set(100.0)
    out = cpu_attention(q, k, v, big, logits_soft_cap=2.0)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(
        np.asarray(jnp.repeat(v, N // K, axis=2))[:, 3:4], out.shape), rtol=1e-5, atol=1e-5)


def test_lse_matches_reference(rng):
    q, k, v = capped_qkv(rng, jnp.float32)
    _, lse = cpu_attention(q, k, v, is_causal=True, logits_soft_cap=1.5, return_residual=True)
    _, want = reference.attention(q, k, v, is_causal=True, logits_soft_cap=1.5,
                                  return_residual=True)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_nan_at_a_masked_key_stays_out_of_its_gradients(rng):
    """A key the mask hides from every row, whose q.k is NaN: the cap's slope there is NaN, but
    dS is 0 there, so its dk and dv rows stay 0 and the output finite."""
    q, k, v = capped_qkv(rng, jnp.float32)
    k = k.at[:, 5].set(jnp.nan)
    mask = jnp.ones((1, 1, T, S), bool).at[..., 5].set(False)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    out, _, dk, dv, _ = grads(cpu_attention, q, k, v, None, d_out, mask, logits_soft_cap=2.0)
    assert np.isfinite(np.asarray(out)).all()
    assert (np.asarray(dk)[:, 5] == 0).all() and (np.asarray(dv)[:, 5] == 0).all()
    assert np.isfinite(np.delete(np.asarray(dk), 5, axis=1)).all()


def test_under_jit_and_vmap(rng):
    q, k, v = capped_qkv(rng, jnp.float32)
    f = jax.jit(jax.vmap(lambda q, k, v: cpu_attention(q, k, v, logits_soft_cap=3.0)))
    out = f(q[:, None], k[:, None], v[:, None])[:, 0]
    want = reference.attention(q, k, v, logits_soft_cap=3.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value,error", [(0, ValueError), (-1.0, ValueError),
                                         (float("inf"), ValueError), (float("nan"), ValueError),
                                         (1e39, ValueError), (3e38, ValueError),
                                         (10**400, ValueError), (True, TypeError),
                                         (np.array(True), TypeError), (np.array("2"), TypeError),
                                         (np.ones(2), TypeError), ("2", TypeError),
                                         ([2.0], TypeError)])
def test_bad_values_raise_naming_the_option(rng, value, error):
    q, k, v = capped_qkv(rng, jnp.float32)
    with pytest.raises(error, match="logits_soft_cap"):
        cpu_attention(q, k, v, logits_soft_cap=value)
    with pytest.raises(error, match="logits_soft_cap"):
        reference.attention(q, k, v, logits_soft_cap=value)


def test_numpy_and_jax_scalars_are_taken(rng):
    q, k, v = capped_qkv(rng, jnp.float32)
    want = cpu_attention(q, k, v, logits_soft_cap=2.0)
    for cap in (np.float32(2.0), np.int64(2), np.array(2.0), jnp.float32(2.0)):
        np.testing.assert_array_equal(np.asarray(cpu_attention(q, k, v, logits_soft_cap=cap)),
                                      np.asarray(want))


def test_traced_value_raises(rng):
    q, k, v = capped_qkv(rng, jnp.float32)
    with pytest.raises(TypeError, match="logits_soft_cap must be a static"):
        jax.jit(lambda cap: cpu_attention(q, k, v, logits_soft_cap=cap))(2.0)


@pytest.mark.parametrize("implementation", ["xla"])
def test_jax_nn_implementations_refuse_it(rng, implementation):
    q, k, v = capped_qkv(rng, jnp.float32)
    with pytest.raises(ValueError, match="logits_soft_cap.*jax.nn"):
        jax_flashattn.attention(q, k, v, logits_soft_cap=2.0, implementation=implementation)


def test_handler_refuses_a_negative_cap(rng):
    """A call built by hand with a cap the Python side would refuse gets the handler's error."""
    q, k, v = capped_qkv(rng, jnp.float32)
    flags = dict(has_bias=np.int32(0), has_mask=np.int32(0), has_q_seqlens=np.int32(0),
                 has_kv_seqlens=np.int32(0), has_segment_ids=np.int32(0), has_spans=np.int32(0),
                 has_alibi=np.int32(0), has_kv_descale=np.int32(0), has_page_table=np.int32(0),
                 alibi_shift=np.int64(0))
    attrs = dict(_ops._attrs(0.25, (None, None), _ffi.KernelSwitches()),
                 logits_soft_cap=np.float32(-1.0))
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, (
        jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((0,), jnp.float32)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="logits_soft_cap"):
        jax.block_until_ready(call(q, k, v, **flags, **attrs))


def test_flax_adapters_pass_it_on(rng):
    from jax_flashattn import flax as jfa_flax
    q, k, v = capped_qkv(rng, jnp.float32)
    want = reference.attention(q, k, v, is_causal=True, logits_soft_cap=2.0)
    out = jfa_flax.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=2.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    fn = jfa_flax.make_attention_fn(is_causal=True, logits_soft_cap=2.0)
    np.testing.assert_allclose(np.asarray(fn(q, k, v)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sharded_batch_and_ring_attention(rng):
    """The cap travels through the partitioned call (batch split over devices) and through ring
    attention's steps (sequence split), values and gradients as unsharded."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_flashattn import sharding
    devices = 4
    q, k, v = random_qkv(rng, 4, 64, 64, N, K, 16, jnp.float32, magnitude=3.0)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kwargs = dict(is_causal=True, logits_soft_cap=2.0)

    def out_and_grads(fn):
        def f(q, k, v, d_out):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(d_out)
        return f

    want_out, want_grads = jax.jit(out_and_grads(
        lambda q, k, v: cpu_attention(q, k, v, **kwargs)))(q, k, v, d_out)
    ref_out = reference.attention(q, k, v, **kwargs)
    np.testing.assert_allclose(np.asarray(want_out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("d",))
    batch = NamedSharding(mesh, P("d"))
    out, grads_ = jax.jit(out_and_grads(lambda q, k, v: cpu_attention(q, k, v, **kwargs)))(
        *(jax.device_put(x, batch) for x in (q, k, v, d_out)))
    for got, want in zip((out, *grads_), (want_out, *want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    sequence = NamedSharding(mesh, P(None, "d"))  # the partitioned call's ring path
    out, grads_ = jax.jit(out_and_grads(lambda q, k, v: cpu_attention(q, k, v, **kwargs)))(
        *(jax.device_put(x, sequence) for x in (q, k, v, d_out)))
    for got, want in zip((out, *grads_), (want_out, *want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    spec = P(None, "d")
    ring = jax.jit(jax.shard_map(out_and_grads(
        lambda q, k, v: sharding.ring_attention(q, k, v, axis_name="d", **kwargs)),
        mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec, (spec,) * 3)))
    out, grads_ = ring(q, k, v, d_out)
    for got, want in zip((out, *grads_), (want_out, *want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
