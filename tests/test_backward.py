"""Gradients of `attention` against `jax.grad` of the float32 reference."""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from jax_flashattn import reference
from helpers import (assert_grads_close, fill_past_lengths, grads, jaxpr_sizes, random_qkv,
                     reference_grads)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


def check_grads_vs_reference(rng, q, k, v, bias=None, *args, **kwargs):
    """Compares out, dq, dk, dv (and dbias) with the reference; returns the kernel's grads."""
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), q.dtype)
    got = grads(jax_flashattn.attention, q, k, v, bias, d_out, *args, **kwargs)
    want = reference_grads(q, k, v, bias, d_out, *args, **kwargs)
    normwise = None if q.dtype == jnp.float32 else 2e-2
    for name, x, g, w in zip(("out", "dq", "dk", "dv", "dbias"), (None, q, k, v, bias), got,
                             want):
        if x is None and name != "out":
            continue
        if name != "out":
            assert g.dtype == x.dtype, f"{name}: dtype {g.dtype}, want {x.dtype}"
        assert_grads_close(g, w, normwise=normwise, name=name)
    return got


SHAPES = [
    (2, 16, 16, 2, 2, 32),
    (1, 1, 1, 1, 1, 8),
    (2, 1, 23, 4, 2, 16),
    (2, 23, 1, 2, 1, 16),
    (1, 37, 61, 3, 3, 7),
    (2, 61, 37, 6, 2, 64),  # GQA: dk/dv summed over the 3 query heads of each kv head
    (1, 33, 17, 4, 1, 40),  # MQA
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}S{}N{}K{}H{}".format(*s))
def test_grads_f32(rng, shape, is_causal):
    b, t, s, n, k, h = shape
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, jnp.float32)
    check_grads_vs_reference(rng, q, kk, v, is_causal=is_causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(2, 29, 29, 4, 2, 32), (1, 45, 21, 2, 1, 64),
                                   (2, 21, 45, 3, 3, 16)],
                         ids=lambda s: "B{}T{}S{}N{}K{}H{}".format(*s))
def test_grads_low_precision(rng, shape, dtype):
    b, t, s, n, k, h = shape
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, dtype)
    bias = jnp.asarray(rng.standard_normal((1, n, t, s), dtype=np.float32), dtype)
    check_grads_vs_reference(rng, q, kk, v, is_causal=True)
    check_grads_vs_reference(rng, q, kk, v, bias, local_window_size=(7, 3))


@pytest.mark.parametrize("window", [0, 4, (6, 0), (0, 3), (3, 9)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_grads_window(rng, window, is_causal):
    q, k, v = random_qkv(rng, 2, 31, 24, 4, 2, 16, jnp.float32)
    check_grads_vs_reference(rng, q, k, v, is_causal=is_causal, local_window_size=window)


B, N, T, S = 2, 4, 19, 23
BIAS_SHAPES = [(B, N, T, S), (1, 1, T, S), (B, 1, 1, S), (1, N, 1, 1), (B, N, T, 1), (N, T, S),
               (T, S), (S,)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=str)
def test_bias_grad_broadcast(rng, shape):
    """dbias has the bias's shape, summed over every broadcast dimension."""
    q, k, v = random_qkv(rng, B, T, S, N, 2, 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    got = check_grads_vs_reference(rng, q, k, v, bias, is_causal=True)
    assert got[4].shape == shape


@pytest.mark.parametrize("shape", [(2, 4, 70, 1), (1, 4, 1, 1), (1, 1, 1, 130), (2, 1, 70, 130),
                                   (1, 4, 70, 130)], ids=str)
def test_bias_grad_broadcast_across_tiles(rng, shape):
    """dbias summed over broadcast dims where several key tiles, query tiles, kv heads (GQA)
    and batch entries add into one element: on the CPU the tasks that share an element run in
    one task, in order; a full-shape dbias has one writer per element."""
    q, k, v = random_qkv(rng, 2, 70, 130, 4, 2, 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    got = check_grads_vs_reference(rng, q, k, v, bias, local_window_size=(90, 20))
    assert got[4].shape == shape


@pytest.mark.parametrize("bias_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_bias_grad_dtype(rng, bias_dtype):
    """A bias in a lower precision than q gets a gradient in its own dtype."""
    q, k, v = random_qkv(rng, B, T, S, N, 2, 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, N, T, S), dtype=np.float32), bias_dtype)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32))
    *_, dbias = grads(jax_flashattn.attention, q, k, v, bias, d_out)
    *_, want = reference_grads(q, k, v, bias, d_out)
    assert dbias.dtype == bias_dtype and dbias.shape == bias.shape
    assert_grads_close(dbias, want, normwise=2e-2, name="dbias")


@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_grads_never_read_keys_past_the_length(rng, is_causal):
    """NaN in K/V past a length leaves the CPU kernels' gradients as they are with finite
    values there (dK and dV past the length 0)."""
    if jax.default_backend() != "cpu":
        pytest.skip("implementation='cpu' needs the CPU backend")
    q, k, v = random_qkv(rng, 2, 11, 23, 2, 1, 8, jnp.float32)
    kv_lens = np.array([9, 17], np.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, np.nan)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32))

    def fn(q, k, v, bias=None):
        return jax_flashattn.attention(q, k, v, bias, key_value_seq_lengths=jnp.asarray(kv_lens),
                                       is_causal=is_causal, implementation="cpu")
    got = grads(fn, q, *poisoned, None, d_out)
    want = grads(fn, q, k, v, None, d_out)
    for g, w in zip(got[:4], want[:4]):  # out, dq, dk, dv
        np.testing.assert_array_equal(g, w)
    for b, length in enumerate(kv_lens):
        assert (np.asarray(got[2])[b, length:] == 0).all()
        assert (np.asarray(got[3])[b, length:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grads_zero_length_rows(rng, dtype):
    """Padded query rows and hidden keys get exactly zero gradients, never NaN."""
    b, t, s = 4, 17, 13
    q, k, v = random_qkv(rng, b, t, s, 4, 2, 16, dtype)
    bias = jnp.asarray(rng.standard_normal((b, 1, t, s), dtype=np.float32))
    q_lens = np.array([t, 0, 6, 9])
    kv_lens = np.array([s, 5, 0, 4])
    kw = dict(query_seq_lengths=jnp.asarray(q_lens), key_value_seq_lengths=jnp.asarray(kv_lens))
    _, dq, dk, dv, dbias = check_grads_vs_reference(rng, q, k, v, bias, **kw)
    dq, dk, dv, dbias = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (dq, dk, dv, dbias))
    for i in range(b):
        visible_rows = q_lens[i] if kv_lens[i] > 0 else 0
        visible_keys = kv_lens[i] if q_lens[i] > 0 else 0
        assert (dq[i, visible_rows:] == 0).all()
        assert (dk[i, visible_keys:] == 0).all() and (dv[i, visible_keys:] == 0).all()
        assert (dbias[i, :, visible_rows:] == 0).all()
        assert (dbias[i, :, :, visible_keys:] == 0).all()
        if visible_rows and visible_keys:
            assert (dq[i, :visible_rows] != 0).any() and (dv[i, :visible_keys] != 0).any()


def test_grads_unseen_keys_are_zero(rng):
    """Causal with T < S: keys j >= T are never seen, so dk/dv are exactly 0 there."""
    t, s = 11, 19
    q, k, v = random_qkv(rng, 2, t, s, 4, 2, 8, jnp.float32)
    _, dq, dk, dv, _ = check_grads_vs_reference(rng, q, k, v, is_causal=True)
    assert (np.asarray(dk)[:, t:] == 0).all() and (np.asarray(dv)[:, t:] == 0).all()
    assert (np.asarray(dk)[:, :t] != 0).any()


def test_grads_mask(rng):
    """A random mask with fully masked rows and columns."""
    b, t, s, n = 2, 27, 33, 4
    q, k, v = random_qkv(rng, b, t, s, n, 2, 16, jnp.float32)
    mask = rng.random((b, 1, t, s)) < 0.6
    mask[:, :, 3] = False   # a query row that sees nothing
    mask[:, :, :, 5] = False  # a key nobody sees
    _, dq, dk, dv, _ = check_grads_vs_reference(rng, q, k, v, None, jnp.asarray(mask),
                                                is_causal=True)
    assert (np.asarray(dq)[:, 3] == 0).all()
    assert (np.asarray(dk)[:, 5] == 0).all() and (np.asarray(dv)[:, 5] == 0).all()


def test_grads_everything_together(rng):
    b, t, s, n = 3, 29, 21, 6
    q, k, v = random_qkv(rng, b, t, s, n, 2, 24, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, n, t, s), dtype=np.float32))
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.8)
    check_grads_vs_reference(rng, q, k, v, bias, mask, is_causal=True, local_window_size=(8, 1),
                             query_seq_lengths=jnp.asarray([t, 10, 1]),
                             key_value_seq_lengths=jnp.asarray([s, 0, 7]), scale=0.4)


def test_grads_large_magnitude(rng):
    q, k, v = random_qkv(rng, 1, 41, 53, 2, 1, 32, jnp.float32, magnitude=10.0)
    check_grads_vs_reference(rng, q, k, v, is_causal=True)


def test_grads_unbatched(rng):
    q, k, v = random_qkv(rng, None, 19, 26, 4, 2, 8, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((19, 26), dtype=np.float32))
    got = check_grads_vs_reference(rng, q, k, v, bias, is_causal=True)
    assert got[1].shape == q.shape and got[4].shape == bias.shape


def test_residual_output_has_no_gradient(rng):
    """The lse of return_residual=True carries no gradient (as in jax.nn)."""
    q, k, v = random_qkv(rng, 1, 9, 11, 2, 2, 8, jnp.float32)

    def loss(q, k, v):
        out, lse = jax_flashattn.attention(q, k, v, return_residual=True)
        return jnp.sum(out * out) + jnp.sum(lse)

    def loss_out_only(q, k, v):
        return jnp.sum(jax_flashattn.attention(q, k, v) ** 2)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss_out_only, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_check_grads_numerically(rng):
    """Finite differences in float32 on a tiny case (loose tolerances: eps 1e-2 in float32)."""
    q, k, v = random_qkv(rng, 1, 3, 4, 2, 1, 4, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 2, 3, 4), dtype=np.float32))

    def f(q, k, v, bias):
        return jax_flashattn.attention(q, k, v, bias, is_causal=True, local_window_size=(1, 1))

    jax.test_util.check_grads(f, (q, k, v, bias), order=1, modes=["rev"], eps=1e-2, atol=5e-2,
                              rtol=5e-2)


def test_residuals_have_no_t_by_s_tensor(rng):
    """The forward saves only q, k, v, out, lse and the optional inputs: no [T, S] tensor."""
    b, t, s, n, k, h = 1, 64, 96, 2, 1, 8
    q, kk, v = random_qkv(rng, b, t, s, n, k, h, jnp.float32)
    q_lens, kv_lens = jnp.asarray([50]), jnp.asarray([90])

    def f(q, kk, v):
        return jax_flashattn.attention(q, kk, v, is_causal=True, query_seq_lengths=q_lens,
                                       key_value_seq_lengths=kv_lens)

    _, vjp = jax.vjp(f, q, kk, v)
    shapes = sorted(tuple(x.shape) for x in jax.tree_util.tree_leaves(vjp))
    allowed = {q.shape, kk.shape, (b, n, t), (b,)}  # q/out, k/v, lse [B, N, T], lengths
    assert (b, n, t) in shapes, f"the lse is not among the residuals {shapes}"
    assert set(shapes) <= allowed, f"unexpected residuals {shapes}"
    assert max(np.prod(x) for x in shapes) < t * s

    # Nothing in the whole gradient computation is [T, S]-sized either.
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(q, kk, v)

    found = list(jaxpr_sizes(jaxpr.jaxpr))
    assert sum(prim == "ffi_call" for _, prim in found) == 2, "expected the fwd and bwd calls"
    big = [(size, prim) for size, prim in found if size >= t * s]
    assert not big, f"[T, S]-sized intermediates: {big}"


def test_backward_kernel_query_on_cpu():
    q = jax.ShapeDtypeStruct((2, 10, 4, 64), jnp.bfloat16)
    assert jax_flashattn.backward_kernel(q, q, device=jax.devices("cpu")[0]) == "cpu"


def temp_bytes(fn, *args) -> int:
    """The compiled function's temporary memory (XLA's buffer assignment)."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("how", ["other_argument", "stop_gradient"])
def test_no_bias_gradient_memory_where_not_needed(rng, how):
    """The gradient of q with a [1, 1, 1, S] bias held constant (not differentiated, or behind
    stop_gradient) allocates no [B, N, T, S] float32 dbias: the compiled gradient's temporary
    memory stays within 10% of the same gradient without a bias (a full dbias here would be
    four times all the rest together)."""
    b, t, s, n = 1, 512, 512, 4
    q, k, v = random_qkv(rng, b, t, s, n, n, 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 1, 1, s)), jnp.float32)

    def loss(q, bias):
        if how == "stop_gradient":
            bias = jax.lax.stop_gradient(bias)
        return jnp.sum(jax_flashattn.attention(q, k, v, bias))

    def loss_without_bias(q):
        return jnp.sum(jax_flashattn.attention(q, k, v))

    grad_q = jax.grad(loss) if how == "other_argument" else jax.grad(loss, argnums=(0, 1))
    with_bias = temp_bytes(grad_q, q, bias)
    without = temp_bytes(jax.grad(loss_without_bias), q)
    full_dbias = 4 * b * n * t * s
    assert with_bias <= 1.1 * without + 4 * s, (with_bias, without, full_dbias)
    got = grad_q(q, bias)
    got = got[0] if isinstance(got, tuple) else got
    want = jax.grad(lambda q: jnp.sum(reference.attention(q, k, v, bias)))(q)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_gradient_of_lse_alone_is_zero(rng):
    """Only the lse of return_residual=True used: its cotangent is the only one, and it carries
    no gradient (as in jax.nn), so every input's gradient is 0 with no kernel call."""
    q, k, v = random_qkv(rng, 1, 9, 11, 2, 2, 8, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 2, 9, 11)), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(jax_flashattn.attention(*a, return_residual=True)[1]),
                     argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, x in zip(grads, (q, k, v, bias)):
        assert g.shape == x.shape and not np.asarray(g).any()


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_bias_gradient_memory_is_the_bias_shape(rng, deterministic):
    """The gradient of a [1, 1, 1, S] bias is summed inside the kernels: the compiled gradient
    of (q, bias) needs within 10% of the temporary memory of q's gradient without a bias, not
    a [B, N, T, S] float32 dbias (four times all the rest here). deterministic_backward keeps
    the full one, summed after (one writer per element, so no atomics on the GPU)."""
    b, t, s, n = 1, 512, 512, 4
    q, k, v = random_qkv(rng, b, t, s, n, n, 16, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 1, 1, s)), jnp.float32)

    def loss(q, bias):
        return jnp.sum(jax_flashattn.attention(q, k, v, bias,
                                               deterministic_backward=deterministic))

    both = temp_bytes(jax.grad(loss, argnums=(0, 1)), q, bias)
    without = temp_bytes(jax.grad(lambda q: jnp.sum(jax_flashattn.attention(q, k, v))), q)
    full_dbias = 4 * b * n * t * s
    if deterministic:
        assert both >= full_dbias, (both, without)
    else:
        assert both <= 1.1 * without + 4 * s, (both, without, full_dbias)
    got = jax.grad(loss, argnums=(0, 1))(q, bias)
    want = jax.grad(lambda q, bias: jnp.sum(reference.attention(q, k, v, bias)),
                    argnums=(0, 1))(q, bias)
    for name, g, w in zip(("dq", "dbias"), got, want):
        assert_grads_close(g, w, normwise=1e-4, name=name)


def test_backward_call_carries_the_planned_dq_semaphores():
    """The backward call's int32 workspace has the planner's size, B N ceil(T / 64) for a
    deterministic call (vmap's batch included) and none otherwise: a wrong size would send the
    Hopper kernel's deterministic calls to the mma.sync family without a word."""
    import re
    q = jnp.zeros((3, 130, 4, 64), jnp.bfloat16)
    k = jnp.zeros((3, 200, 2, 64), jnp.bfloat16)

    def workspace_sizes(deterministic, vmapped):
        def loss(q, k, v):
            return jnp.sum(jax_flashattn.attention(
                q, k, v, implementation="cpu",
                deterministic_backward=deterministic).astype(jnp.float32))
        fn, args = jax.grad(loss), (q, k, k)
        if vmapped:
            fn, args = jax.vmap(fn), tuple(jnp.stack([x, x]) for x in args)
        text = jax.jit(fn).lower(*args).compile().as_text()
        return [re.findall(r"s32\[(\d+)\]", line) for line in text.splitlines()
                if "jax_flashattn_bwd" in line]

    assert workspace_sizes(True, False) == [[str(3 * 4 * 3)]]
    assert workspace_sizes(True, True) == [[str(2 * 3 * 4 * 3)]]
    assert workspace_sizes(False, False) == [["0"]]
    assert workspace_sizes(False, True) == [["0"]]
