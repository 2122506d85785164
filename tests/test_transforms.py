"""jit, grad and vmap of `attention`: values equal the untransformed/looped computation, and the
lowered HLO holds exactly one custom call per FFI op (a vmapped call is one launch, no loop)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import assert_attention_close, random_qkv

attention = jax_flashattn.attention
B, T, S, N, K, H, V = 2, 13, 17, 4, 2, 8, 3


def close(got, want):
    """Tight float32 agreement (same kernels, same data: only summation order may differ);
    infinities (the lse of empty rows) must sit at the same places."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), "NaN"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=False)


def close_tree(got, want):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        close(g, w)


def count_calls(fn, *args):
    """(#fwd, #bwd) custom calls in the StableHLO and in the compiled HLO; asserts no loop."""
    lowered = jax.jit(fn).lower(*args)
    text = lowered.as_text()
    assert re.search(r"\bwhile\b", text) is None, "a while loop in the lowered StableHLO"
    stablehlo = (len(re.findall(r"@jax_flashattn_fwd\b", text)),
                 len(re.findall(r"@jax_flashattn_bwd\b", text)))
    compiled = lowered.compile().as_text()
    assert re.search(r"\bwhile\b", compiled) is None, "a while loop in the compiled HLO"
    hlo = (compiled.count('custom_call_target="jax_flashattn_fwd"'),
           compiled.count('custom_call_target="jax_flashattn_bwd"'))
    return stablehlo, hlo


def assert_calls(fn, *args, fwd=1, bwd=0):
    stablehlo, hlo = count_calls(fn, *args)
    assert stablehlo == (fwd, bwd), f"StableHLO custom calls (fwd, bwd) = {stablehlo}"
    assert hlo == (fwd, bwd), f"compiled HLO custom calls (fwd, bwd) = {hlo}"


def inputs(rng, lead=(), b=B, t=T, s=S, n=N, k=K, h=H):
    q = jnp.asarray(rng.standard_normal(lead + (b, t, n, h), dtype=np.float32))
    kk = jnp.asarray(rng.standard_normal(lead + (b, s, k, h), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal(lead + (b, s, k, h), dtype=np.float32))
    return q, kk, v


def loss(q, k, v, *args, **kwargs):
    return jnp.sum(jnp.sin(attention(q, k, v, *args, **kwargs)))


def test_count_calls_sees_the_custom_call(rng):
    """Guards the HLO checks below: the pattern really matches what the lowering emits."""
    q, k, v = inputs(rng)
    text = jax.jit(attention).lower(q, k, v).as_text()
    assert "jax_flashattn_fwd" in text
    assert count_calls(attention, q, k, v) == ((1, 0), (1, 0))
    # Two independent calls give two custom calls.
    assert_calls(lambda q, k, v: attention(q, k, v) + attention(2 * q, k, v), q, k, v, fwd=2)


def test_jit(rng):
    q, k, v = inputs(rng)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S), dtype=np.float32))
    mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.8)
    q_lens, kv_lens = jnp.asarray([T, 5]), jnp.asarray([3, S])

    def f(q, k, v, bias, mask, q_lens, kv_lens):
        return attention(q, k, v, bias, mask, is_causal=True, local_window_size=(6, 2),
                         query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)

    args = (q, k, v, bias, mask, q_lens, kv_lens)
    out = jax.jit(f)(*args)
    close(out, f(*args))
    assert_attention_close(out, q, k, v, bias, mask, is_causal=True, local_window_size=(6, 2),
                           query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
    assert_calls(f, *args)


def test_jit_return_residual(rng):
    q, k, v = inputs(rng)
    f = lambda q, k, v: attention(q, k, v, is_causal=True, return_residual=True)  # noqa: E731
    close_tree(jax.jit(f)(q, k, v), f(q, k, v))
    assert_calls(f, q, k, v)


def test_grad_and_jit(rng):
    q, k, v = inputs(rng)
    bias = jnp.asarray(rng.standard_normal((N, T, S), dtype=np.float32))
    g = jax.grad(lambda q, k, v, b: loss(q, k, v, b, is_causal=True), argnums=(0, 1, 2, 3))
    close_tree(jax.jit(g)(q, k, v, bias), g(q, k, v, bias))
    assert_calls(g, q, k, v, bias, fwd=1, bwd=1)
    vg = jax.value_and_grad(lambda q, k, v: loss(q, k, v), argnums=(0, 1, 2))
    assert_calls(vg, q, k, v, fwd=1, bwd=1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_backward_reaches_the_call(rng, deterministic):
    """The flag is an attribute of the backward custom call only; the CPU kernels give the same
    gradients either way."""
    q, k, v = inputs(rng)
    g = jax.grad(lambda q, k, v: loss(q, k, v, is_causal=True,
                                      deterministic_backward=deterministic), argnums=(0, 1, 2))
    compiled = jax.jit(g).lower(q, k, v).compile().as_text()
    calls = re.findall(r'custom_call_target="(jax_flashattn_\w+)".*?backend_config=(\{[^}]*\})',
                       compiled)
    flags = {target: re.search(r"deterministic = (\d)", config).group(1)
             for target, config in calls}
    assert flags == {"jax_flashattn_fwd": "0", "jax_flashattn_bwd": str(int(deterministic))}
    reference = jax.grad(lambda q, k, v: loss(q, k, v, is_causal=True), argnums=(0, 1, 2))
    close_tree(jax.jit(g)(q, k, v), reference(q, k, v))


def loop(fn, batched, in_axes, size):
    """Stacks fn over the vmapped axis: what vmap must equal."""
    outs = []
    for i in range(size):
        args = [x if ax is None else jnp.take(x, i, axis=ax) for x, ax in zip(batched, in_axes)]
        outs.append(fn(*args))
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs)


def check_vmap(fn, args, in_axes, size=V, fwd=1, bwd=0):
    got = jax.vmap(fn, in_axes=in_axes)(*args)
    close_tree(got, loop(fn, args, in_axes, size))
    assert_calls(jax.vmap(fn, in_axes=in_axes), *args, fwd=fwd, bwd=bwd)
    return got


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_vmap_qkv_leading(rng, is_causal):
    q, k, v = inputs(rng, lead=(V,))
    fn = lambda q, k, v: attention(q, k, v, is_causal=is_causal,  # noqa: E731
                                   local_window_size=(5, 3))
    check_vmap(fn, (q, k, v), (0, 0, 0))


def test_vmap_qkv_different_axes(rng):
    q, k, v = inputs(rng, lead=(V,))
    q = jnp.moveaxis(q, 0, 2)   # [B, T, V, N, H]
    k = jnp.moveaxis(k, 0, 4)   # [B, S, K, H, V]
    fn = lambda q, k, v: attention(q, k, v, is_causal=True)  # noqa: E731
    check_vmap(fn, (q, k, v), (2, 4, 0))


@pytest.mark.parametrize("axis", [0, 1, 3], ids=lambda a: f"axis{a}")
def test_vmap_query_only(rng, axis):
    q, k, v = inputs(rng, lead=(V,))
    q = jnp.moveaxis(q, 0, axis)
    k, v = k[0], v[0]
    fn = lambda q, k, v: attention(q, k, v, is_causal=True)  # noqa: E731
    check_vmap(fn, (q, k, v), (axis, None, None))


def test_vmap_unbatched_inputs(rng):
    """vmap over [T, N, H] inputs: the vmapped axis plays the role of the batch."""
    q, k, v = (x[:, 0] for x in inputs(rng, lead=(V,)))
    bias = jnp.asarray(rng.standard_normal((T, S), dtype=np.float32))
    fn = lambda q, k, v: attention(q, k, v, bias, is_causal=True)  # noqa: E731
    got = check_vmap(fn, (q, k, v), (0, 0, 0))
    close(got, attention(q, k, v, bias, is_causal=True))


@pytest.mark.parametrize("shape", [(V, B, N, T, S), (V, 1, 1, T, S), (V, B, 1, 1, S), (V, S),
                                   (V, N, 1, 1)], ids=str)
def test_vmap_bias_only(rng, shape):
    q, k, v = inputs(rng)
    bias = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    fn = lambda b: attention(q, k, v, b)  # noqa: E731
    check_vmap(fn, (bias,), (0,))


def test_vmap_mask_only(rng):
    q, k, v = inputs(rng)
    mask = jnp.asarray(rng.random((B, 1, T, S, V)) < 0.7)
    fn = lambda m: attention(q, k, v, None, m)  # noqa: E731
    check_vmap(fn, (mask,), (4,))


def test_vmap_seq_lengths(rng):
    q, k, v = inputs(rng)
    q_lens = jnp.asarray(rng.integers(0, T + 2, (V, B)), jnp.int32)
    kv_lens = jnp.asarray(rng.integers(0, S + 2, (B, V)), jnp.int32)
    fn = lambda ql, kl: attention(q, k, v, query_seq_lengths=ql,  # noqa: E731
                                  key_value_seq_lengths=kl, is_causal=True)
    check_vmap(fn, (q_lens, kv_lens), (0, 1))
    fn_q = lambda ql: attention(q, k, v, query_seq_lengths=ql)  # noqa: E731
    check_vmap(fn_q, (q_lens,), (0,))


def test_vmap_everything(rng):
    """All inputs batched at once, with GQA, bias, mask, lengths, causal and a window."""
    q, k, v = inputs(rng, lead=(V,))
    bias = jnp.asarray(rng.standard_normal((V, 1, N, T, S), dtype=np.float32))
    mask = jnp.asarray(rng.random((V, B, 1, T, S)) < 0.8)
    q_lens = jnp.asarray(rng.integers(1, T + 1, (V, B)), jnp.int32)
    kv_lens = jnp.asarray(rng.integers(1, S + 1, (V, B)), jnp.int32)

    def fn(q, k, v, b, m, ql, kl):
        return attention(q, k, v, b, m, is_causal=True, local_window_size=(7, 1),
                         query_seq_lengths=ql, key_value_seq_lengths=kl, return_residual=True)

    out, lse = check_vmap(fn, (q, k, v, bias, mask, q_lens, kv_lens), (0,) * 7)
    assert lse.shape == (V, B, T, N)


def test_nested_vmap(rng):
    v2 = 2
    q, _, _ = inputs(rng, lead=(V, v2))  # outer over q only, inner over q, k, v
    _, k, v = inputs(rng, lead=(v2,))
    bias = jnp.asarray(rng.standard_normal((v2, N, T, S), dtype=np.float32))
    inner_fn = lambda q, k, v, b: attention(q, k, v, b, is_causal=True)  # noqa: E731
    inner = jax.vmap(inner_fn, in_axes=(0, 0, 0, 0))
    outer = jax.vmap(inner, in_axes=(0, None, None, None))
    got = outer(q, k, v, bias)
    want = jnp.stack([jnp.stack([inner_fn(q[i, j], k[j], v[j], bias[j]) for j in range(v2)])
                      for i in range(V)])
    close(got, want)
    assert_calls(outer, q, k, v, bias)
    # vmap over the bias outside, over q/k/v inside.
    q, k, v = inputs(rng, lead=(v2,))
    bias = jnp.asarray(rng.standard_normal((V, 1, 1, T, S), dtype=np.float32))
    nested = jax.vmap(jax.vmap(inner_fn, in_axes=(0, 0, 0, None)), in_axes=(None, None, None, 0))
    got = nested(q, k, v, bias)
    want = jnp.stack([jnp.stack([inner_fn(q[j], k[j], v[j], bias[i]) for j in range(v2)])
                      for i in range(V)])
    close(got, want)
    assert_calls(nested, q, k, v, bias)


def test_vmap_of_grad(rng):
    q, k, v = inputs(rng, lead=(V,))
    bias = jnp.asarray(rng.standard_normal((1, N, T, S), dtype=np.float32))
    g = jax.grad(lambda q, k, v, b: loss(q, k, v, b, is_causal=True, local_window_size=(4, 4)),
                 argnums=(0, 1, 2, 3))
    # Per-example gradients: q/k/v batched, the bias shared (its gradient is per example).
    got = check_vmap(g, (q, k, v, bias), (0, 0, 0, None), bwd=1)
    assert got[3].shape == (V,) + bias.shape


def test_grad_of_vmap(rng):
    q, k, v = inputs(rng, lead=(V,))
    k, v = k[0], v[0]
    bias = jnp.asarray(rng.standard_normal((B, 1, T, S), dtype=np.float32))
    q_lens = jnp.asarray([T, 4])

    def single(q, k, v, b):
        return loss(q, k, v, b, is_causal=True, query_seq_lengths=q_lens)

    def batched(q, k, v, b):
        return jnp.sum(jax.vmap(single, in_axes=(0, None, None, None))(q, k, v, b))

    g = jax.grad(batched, argnums=(0, 1, 2, 3))
    got = g(q, k, v, bias)
    per_example = [jax.grad(single, argnums=(0, 1, 2, 3))(q[i], k, v, bias) for i in range(V)]
    close(got[0], jnp.stack([p[0] for p in per_example]))
    for j in (1, 2, 3):  # shared inputs: gradients summed over the vmapped axis
        close(got[j], sum(p[j] for p in per_example))
    assert got[3].shape == bias.shape
    assert_calls(g, q, k, v, bias, fwd=1, bwd=1)


def test_vmap_grad_low_precision_dtype_preserved(rng):
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(rng, lead=(V,)))
    g = jax.vmap(jax.grad(lambda q, k, v: loss(q, k, v).astype(jnp.float32), argnums=(0, 1, 2)))
    dq, dk, dv = g(q, k, v)
    assert dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
    assert dq.shape == q.shape and dk.shape == k.shape
    assert np.isfinite(np.asarray(dq, np.float32)).all()
    assert_calls(g, q, k, v, fwd=1, bwd=1)


def test_vmap_single_token(rng):
    """vmap over unbatched [1, N, H] elements (T = S = 1)."""
    q, k, v = random_qkv(rng, V, 1, 1, N, K, H, jnp.float32)
    check_vmap(lambda q, k, v: attention(q, k, v), (q, k, v), (0, 0, 0))
