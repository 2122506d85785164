"""NaN and Inf: a NaN or Inf that reaches a visible logit makes that row NaN (output, lse and
gradients), as jax.nn does; a row whose visible logits are all -inf (or that sees no key) is 0
with lse -inf; keys and values past a batch entry's length are never read.

These run on the default backend's kernels (the CPU here, the CUDA kernels on a GPU, where
tests/test_gpu_nonfinite.py also forces each kernel family).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn
from helpers import assert_attention_close, fill_past_lengths, gradient_nan_rows, random_qkv

DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


def ours(q, k, v, *args, **kwargs):
    return jax.jit(lambda q, k, v, *a: jax_flashattn.attention(
        q, k, v, *a, return_residual=True, **kwargs))(q, k, v, *args)


def xla(q, k, v, *args, **kwargs):
    """jax.nn's XLA path, its float32 products in full float32 (not TF32, a GPU's default)."""
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(q, k, v, *args, implementation="xla", **kwargs)


def nan_rows(x):
    """[..., T, N]: whether each query row of each head holds a NaN."""
    return np.isnan(np.asarray(x, np.float32)).any(axis=-1)


def check_against_jax_nn(q, k, v, *args, jit_reference=False, **kwargs):
    """Our output is NaN in exactly the rows where jax.nn's is, lse NaN there too, and every
    other row within the error budget of the (NaN-propagating) float32 reference
    (`jit_reference`: as assert_attention_close's, for shapes no other check shares)."""
    out, lse = ours(q, k, v, *args, **kwargs)
    want = nan_rows(xla(q, k, v, *args, **kwargs))
    ref_lse = assert_attention_close(out, q, k, v, *args, nan_rows=True,
                                     jit_reference=jit_reference, **kwargs)
    # Where every logit a row sees is -inf (+inf in k times a negative q element, the row's only
    # key), jax.nn's softmax gives NaN and ours 0 with lse -inf, the documented difference: the
    # reference's lse is -inf there.
    want &= ~np.isneginf(ref_lse)
    np.testing.assert_array_equal(nan_rows(out), want, "NaN rows differ from jax.nn's")
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), want, "NaN lse rows")
    return want


def poison(x, index, value):
    return x.at[index].set(jnp.asarray(value, x.dtype))


# name -> (q, k, v, bias) -> (q, k, v, bias) with one non-finite value where some row sees it.
INJECTIONS = {
    "nan_key": lambda q, k, v, b: (q, poison(k, (0, 5, 1, 3), np.nan), v, b),
    # +inf times a positive element of the other operand (set, so that some row surely sees a
    # +inf logit; elsewhere the sign decides between NaN rows and hidden keys).
    "inf_key": lambda q, k, v, b: (poison(q, (1, 5, 0, 0), 1.0), poison(k, (1, 2, 0, 0), np.inf),
                                   v, b),
    "nan_query": lambda q, k, v, b: (poison(q, (0, 7, 2, 1), np.nan), k, v, b),
    "inf_query": lambda q, k, v, b: (poison(q, (1, 3, 3, 4), np.inf), poison(k, (1, 0, 1, 4), 1.0),
                                     v, b),
    "nan_bias": lambda q, k, v, b: (q, k, v, poison(b, (0, 0, 9, 4), np.nan)),
    "inf_bias": lambda q, k, v, b: (q, k, v, poison(b, (1, 0, 4, 2), np.inf)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_non_finite_logit_makes_its_rows_nan(rng, name, is_causal, dtype):
    q, k, v = random_qkv(rng, 2, 13, 11, 4, 2, 16, dtype)
    bias = jnp.asarray(rng.standard_normal((2, 1, 13, 11), dtype=np.float32))
    q, k, v, bias = INJECTIONS[name](q, k, v, bias)
    want = check_against_jax_nn(q, k, v, bias, is_causal=is_causal)
    assert want.any() and not want.all(), "the injection must reach some rows and not others"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float32_logit_overflow_is_nan(rng, dtype):
    """Logits past float32's range (inputs x 1e20): inf - inf in the softmax, NaN in every row,
    where jax.nn's are."""
    q, k, v = random_qkv(rng, 1, 4, 6, 1, 1, 8, jnp.float32)
    q, k = (jnp.abs(x).astype(dtype) * 1e19 + 1e19 for x in (q, k))
    want = check_against_jax_nn(q, k, v.astype(dtype))
    assert want.all()


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["key", "query"])
def test_nan_logit_gradients(rng, where, is_causal):
    """dq is NaN in the rows that see a NaN logit, dk and dv in the keys those rows see, and
    never NaN where jax.nn's gradients are finite (and as jax.nn's there). jax.nn's are NaN in
    more rows where masking hides the NaN (its hidden probabilities are NaN in a NaN row, and
    0 x NaN counts in its products); the kernels' tile products can reach some of those too."""
    q, k, v = random_qkv(rng, 2, 9, 12, 4, 2, 8, jnp.float32)
    if where == "key":
        k = poison(k, (0, 4, 1, 2), np.nan)
    else:
        q = poison(q, (1, 6, 0, 3), np.nan)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32))

    def grads(fn):
        return jax.vjp(lambda q, k, v: fn(q, k, v, is_causal=is_causal), q, k, v)[1](d_out)

    got = grads(lambda *a, **kw: jax_flashattn.attention(*a, **kw))
    want = grads(xla)
    rows, keys = gradient_nan_rows(q, k, is_causal=is_causal)
    for name, g, w, required in zip(("dq", "dk", "dv"), got, want, (rows, keys, keys)):
        g, w = np.asarray(g), np.asarray(w)
        assert required.any() and not required.all(), name
        assert (nan_rows(g) >= required).all(), f"{name}: a row that must be NaN is finite"
        assert (nan_rows(g) <= nan_rows(w)).all(), f"{name}: NaN where jax.nn's is finite"
        finite = ~nan_rows(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-4, atol=1e-5, err_msg=name)


def test_jax_debug_nans_sees_the_nan(rng):
    """Under jax_debug_nans a NaN logit raises, as with jax.nn, instead of passing as zeros."""
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 1, 8, jnp.float32)
    k = poison(k, (0, 1, 0, 0), np.nan)
    with jax.debug_nans(True), pytest.raises(FloatingPointError):
        jax.block_until_ready(jax_flashattn.attention(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_minus_inf_bias_hides_keys(rng, dtype):
    """-inf in the bias hides a key as a mask does: jax.nn's result where a row keeps a finite
    logit; a row whose visible logits are all -inf is 0 with lse -inf (jax.nn: NaN), like a
    row that sees no key, and its gradients are 0."""
    q, k, v = random_qkv(rng, 1, 6, 8, 2, 1, 16, dtype)
    bias = jnp.asarray(rng.standard_normal((1, 2, 6, 8)), jnp.float32)
    bias = bias.at[0, 0, :, ::2].set(-jnp.inf).at[0, 1, 3, :].set(-jnp.inf)
    out, lse = ours(q, k, v, bias)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isfinite(out).all()
    assert (out[0, 3, 1] == 0).all() and lse[0, 3, 1] == -np.inf
    assert_attention_close(out, q, k, v, bias)
    keep = np.ones(out.shape[:-1], bool)
    keep[0, 3, 1] = False
    np.testing.assert_allclose(out[keep], np.asarray(xla(q, k, v, bias), np.float32)[keep],
                               atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
    dq, dbias = jax.grad(lambda q, b: jax_flashattn.attention(q, k, v, b).astype(
        jnp.float32).sum(), argnums=(0, 1))(q, bias)
    assert np.isfinite(np.asarray(dq, np.float32)).all() and np.isfinite(dbias).all()
    assert (np.asarray(dq, np.float32)[0, 3, 1] == 0).all()


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_keys_past_the_length_never_read(rng, fill, is_causal):
    """NaN or Inf in K/V past a batch entry's length (a padded cache) changes nothing, forward
    and backward; dK and dV past the length are 0."""
    q, k, v = random_qkv(rng, 3, 20, 40, 4, 2, 16, jnp.bfloat16)
    kv_lens = np.array([13, 40, 1], np.int32)
    poisoned = fill_past_lengths(k, v, kv_lens, fill)
    d_out = jnp.asarray(rng.standard_normal(q.shape, dtype=np.float32), jnp.bfloat16)

    def run(k, v):
        def f(q, k, v):
            return jax_flashattn.attention(q, k, v, key_value_seq_lengths=jnp.asarray(kv_lens),
                                           is_causal=is_causal)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    for name, g, w in zip(("out", "dq", "dk", "dv"), run(*poisoned), run(k, v)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2, err_msg=name)
    for name, g in zip(("dk", "dv"), run(*poisoned)[2:]):
        for b, length in enumerate(kv_lens):
            assert (np.asarray(g, np.float32)[b, length:] == 0).all(), name


def random_case(rng):
    """Shapes and options drawn at random, and a few NaN or +inf entries in q, k or the bias."""
    b, n = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    kv = int(rng.choice([k for k in (1, 2, 4) if n % k == 0]))
    t, s, h = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.choice([8, 16, 24]))
    dtype = [jnp.float32, jnp.bfloat16, jnp.float16][int(rng.integers(3))]
    q, k, v = random_qkv(rng, b, t, s, n, kv, h, dtype)
    kwargs = dict(is_causal=bool(rng.integers(2)))
    if rng.integers(2):
        kwargs["local_window_size"] = (int(rng.integers(0, 10)), int(rng.integers(0, 10)))
    if rng.integers(2):
        kwargs["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
    bias = None
    if rng.integers(2):
        bias = jnp.asarray(rng.standard_normal((b, n, t, s)), jnp.float32)
    targets = ["q", "k"] + (["bias"] if bias is not None else [])
    arrays = dict(q=q, k=k, bias=bias)
    for _ in range(int(rng.integers(1, 4))):
        name = targets[int(rng.integers(len(targets)))]
        x = arrays[name]
        index = tuple(int(rng.integers(d)) for d in x.shape)
        arrays[name] = poison(x, index, [np.nan, np.inf][int(rng.integers(2))])
    args = () if bias is None else (arrays["bias"],)
    return (arrays["q"], arrays["k"], v, *args), kwargs


@pytest.mark.parametrize("case", range(8))
def test_property_nan_rows_match_jax_nn(rng, case):
    """For random shapes and options with non-finite logits: NaN rows as jax.nn's, every other
    row finite and within the error budget."""
    del case  # each case draws its own shapes from its fresh generator
    args, kwargs = random_case(rng)
    # Shapes of its own: the reference as one program, not ~35 eager ones compiled anew.
    check_against_jax_nn(*args, jit_reference=True, **kwargs)
