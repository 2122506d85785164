"""jax_flashattn.flax against Flax's own attention, inside Linen and NNX modules, and the
GPT example (examples/gpt.py) at toy size."""

import functools
import importlib.util
import inspect
import re
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flashattn.flax as jfa_flax  # noqa: E402
from jax_flashattn import reference  # noqa: E402
from helpers import jitted_reference, random_qkv  # noqa: E402

B, T, F, HEADS = 2, 16, 32, 4
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def _tol():
    """float32 tolerance; looser on a GPU, where Flax's matmuls may round through TF32."""
    return dict(rtol=2e-5, atol=2e-5) if jax.default_backend() == "cpu" else dict(rtol=2e-3,
                                                                                  atol=2e-3)


def assert_trees_close(a, b, **tol):
    tol = tol or _tol()
    flat_a, tree_a = jax.tree_util.tree_flatten(a)
    flat_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(flat_a, flat_b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert not np.isnan(x).any(), "NaN"
        scale = max(np.max(np.abs(y), initial=0.0), 1.0)
        np.testing.assert_allclose(x, y, rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.fixture
def inputs(rng):
    x = jnp.asarray(rng.standard_normal((B, T, F), dtype=np.float32))
    lengths = np.array([T, T - 5])  # batch 1 has 5 padded positions
    valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
    return x, valid


# ---------------------------------------------------------------------------------------------
# Linen: nn.MultiHeadDotProductAttention(attention_fn=...)


def _row_weights(shape, valid=None):
    return jnp.ones(shape, jnp.float32) if valid is None else valid.astype(jnp.float32)


def _linen_outputs_and_grads(x, cases, row_weights):
    """For each (attention_fn, mask) in `cases`: the module's output and the gradients of a
    row-weighted loss w.r.t. its parameters and input, all under one jit (one compilation)."""
    params = nn.MultiHeadDotProductAttention(num_heads=HEADS).init(jax.random.key(0), x)

    @jax.jit
    def run(params, x):
        results = []
        for attention_fn, mask in cases:
            module = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=attention_fn)

            def loss(params, x):
                y = module.apply(params, x, mask=mask)
                return jnp.sum(jnp.sin(y) * row_weights[..., None]), y
            (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
            results.append((y, grads))
        return results
    return run(params, x)


@pytest.mark.parametrize("case", ["causal_fn", "causal_and_key_padding"])
def test_linen_matches_flax(inputs, case):
    x, valid = inputs
    causal = nn.make_causal_mask(x[..., 0])
    if case == "causal_fn":  # ours is causal without a mask array; Flax gets the mask
        ours = (jfa_flax.make_attention_fn(is_causal=True), None)
        ref = (nn.dot_product_attention, causal)
    else:
        mask = nn.combine_masks(causal, nn.make_attention_mask(jnp.ones((B, T), bool), valid))
        ours, ref = (jfa_flax.dot_product_attention, mask), (nn.dot_product_attention, mask)
    result, expected = _linen_outputs_and_grads(x, [ours, ref], _row_weights((B, T)))
    assert_trees_close(result, expected)


def test_linen_extra_batch_dims(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, T, F), dtype=np.float32))
    valid = jnp.asarray(rng.random((3, T)) < 0.7).at[:, 0].set(True)
    mask = nn.combine_masks(nn.make_causal_mask(x[..., 0]),  # [2, 3, 1, T, T]
                            nn.make_attention_mask(jnp.ones((3, T)), valid)[None])
    result, expected = _linen_outputs_and_grads(
        x, [(jfa_flax.dot_product_attention, mask), (nn.dot_product_attention, mask)],
        jnp.ones((2, 3, T)))
    assert_trees_close(result, expected)


def test_linen_sow_weights(inputs):
    x, valid = inputs
    mask = nn.combine_masks(nn.make_causal_mask(x[..., 0]),
                            nn.make_attention_mask(jnp.ones((B, T)), valid))
    results = []
    for fn in (jfa_flax.dot_product_attention, nn.dot_product_attention):
        module = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
        params = module.init(jax.random.key(0), x)
        y, state = module.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
        results.append((y, state["intermediates"]["attention_weights"]))
    assert results[0][1][0].shape == (B, HEADS, T, T)
    assert_trees_close(results[0], results[1])


def test_linen_dtype_bfloat16(inputs):
    """dtype=bfloat16 on the module: q/k/v and the output are bfloat16, as with Flax."""
    x, _ = inputs
    mask = nn.make_causal_mask(x[..., 0])
    outs = []
    for fn in (jfa_flax.dot_product_attention, nn.dot_product_attention):
        module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16,
                                                 attention_fn=fn)
        params = module.init(jax.random.key(0), x)
        outs.append(module.apply(params, x, mask=mask))
    assert outs[0].dtype == outs[1].dtype == jnp.bfloat16
    assert_trees_close(outs[0], outs[1], rtol=0.05, atol=0.03)


def test_linen_dropout_in_training_raises(inputs):
    x, _ = inputs
    module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1,
                                             attention_fn=jfa_flax.dot_product_attention)
    params = module.init(jax.random.key(0), x, deterministic=True)
    with pytest.raises(NotImplementedError, match="attention dropout"):
        module.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    # Evaluation mode: the rate does not matter and the result is Flax's.
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1)
    assert_trees_close(module.apply(params, x, deterministic=True),
                       ref.apply(params, x, deterministic=True))


# ---------------------------------------------------------------------------------------------
# NNX: nnx.MultiHeadAttention(attention_fn=...), including grouped-query attention

# Older Flax releases lack NNX's grouped-query heads and the is_causal call argument.
NNX_HAS_GQA = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters
NNX_HAS_IS_CAUSAL = "is_causal" in inspect.signature(nnx.MultiHeadAttention.__call__).parameters
needs_nnx_gqa = pytest.mark.skipif(not (NNX_HAS_GQA and NNX_HAS_IS_CAUSAL),
                                   reason="this Flax's nnx.MultiHeadAttention has no "
                                          "num_kv_heads / is_causal")
needs_nnx_capture = pytest.mark.skipif(not hasattr(nnx, "capture"),
                                       reason="this Flax has no nnx.capture")


def _nnx_outputs_and_grads(model, x, mask, is_causal, row_weights):
    """Output and gradients (parameters, input) with our attention and with NNX's default,
    under one jit."""
    @nnx.jit
    def run(model, x):
        results = []
        for attention_fn in (jfa_flax.dot_product_attention, nnx.dot_product_attention):
            model.attention_fn = attention_fn

            def loss(model, x):
                y = model(x, mask=mask, is_causal=is_causal)
                return jnp.sum(jnp.sin(y) * row_weights[..., None]), y
            (_, y), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model,
                                                                                         x)
            results.append((y, nnx.to_pure_dict(grads), dx))
        return results
    return run(model, x)


@needs_nnx_gqa
@pytest.mark.parametrize("num_kv_heads,case", [(HEADS, "causal"), (2, "causal_and_key_padding"),
                                               (1, "query_and_key_padding")])
def test_nnx_matches_flax(inputs, num_kv_heads, case):
    """nnx.MultiHeadAttention with multi-head, grouped-query (num_kv_heads=2) and multi-query
    attention, NNX's is_causal, and padding masks from nnx.make_attention_mask."""
    x, valid = inputs
    model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, num_kv_heads=num_kv_heads,
                                   decode=False, rngs=nnx.Rngs(0))
    weights, keep = _row_weights((B, T)), np.ones((B, T), bool)
    mask = None
    if case == "causal_and_key_padding":
        mask = nnx.make_attention_mask(jnp.ones((B, T)), valid)
    elif case == "query_and_key_padding":
        mask = nnx.make_attention_mask(valid, valid)
        weights, keep = _row_weights((B, T), valid), np.asarray(valid)
    is_causal = case != "query_and_key_padding"
    (y, *grads), (y_ref, *grads_ref) = _nnx_outputs_and_grads(model, x, mask, is_causal, weights)
    assert_trees_close((np.asarray(y)[keep], grads), (np.asarray(y_ref)[keep], grads_ref))


@needs_nnx_gqa
@needs_nnx_capture
def test_nnx_sow_weights_gqa(inputs):
    """Sown weights collected with nnx.capture (Flax's way: sowing outside it is deprecated),
    with no warning, as Flax's own attention sows them."""
    x, _ = inputs
    model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, num_kv_heads=2,
                                   decode=False, rngs=nnx.Rngs(0))

    @nnx.capture(nnx.Intermediate)
    def forward(model, x):
        return model(x, is_causal=True, sow_weights=True)

    sown = []
    for fn in (jfa_flax.dot_product_attention, nnx.dot_product_attention):
        model.attention_fn = fn
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            y, intermediates = forward(model, x)
        sown.append((y, jax.tree_util.tree_leaves(intermediates["attention_weights"])))
    assert sown[0][1][0].shape == (B, HEADS, T, T)
    assert_trees_close(sown[0], sown[1])


def test_nnx_dropout_in_training_raises(inputs):
    x, _ = inputs
    model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, dropout_rate=0.1,
                                   decode=False, attention_fn=jfa_flax.dot_product_attention,
                                   rngs=nnx.Rngs(0, dropout=1))
    with pytest.raises(NotImplementedError, match="attention dropout"):
        model(x, deterministic=False)
    y = model(x, deterministic=True)
    model.attention_fn = nnx.dot_product_attention
    assert_trees_close(y, model(x, deterministic=True))


# ---------------------------------------------------------------------------------------------
# The function itself: Flax's arguments and conventions


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_function_batch_dims_bias_and_float_mask(rng, lead):
    q, k, v = random_qkv(rng, lead, 5, 7, 4, 4, 8, jnp.float32)
    bias = jnp.asarray(rng.standard_normal((4, 5, 7), dtype=np.float32))
    mask = jnp.asarray(rng.random(lead[-1:] + (1, 5, 7)) < 0.6, jnp.float32)
    mask = mask.at[..., 0].set(1.0)  # every query row sees a key
    out = jfa_flax.dot_product_attention(q, k, v, bias, mask)
    ref = nn.dot_product_attention(q, k, v, bias, mask)
    assert out.shape == ref.shape == q.shape
    assert_trees_close(out, ref)


def test_function_gqa_and_positional_args(rng):
    q, k, v = random_qkv(rng, (2,), 6, 6, 6, 2, 8, jnp.float32)
    mask = nnx.make_causal_mask(jnp.ones((2, 6)))
    # Positionally: bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic.
    out = jfa_flax.dot_product_attention(q, k, v, None, mask, True, None, 0.0, False)
    assert_trees_close(out, nnx.dot_product_attention(q, k, v, mask=mask))


def test_function_dtype_promotion(rng):
    q, k, v = random_qkv(rng, (2,), 8, 8, 2, 2, 16, jnp.float32)
    out = jfa_flax.dot_product_attention(q, k, v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    out = jfa_flax.dot_product_attention(q.astype(jnp.bfloat16), k, v)  # promotes to float32
    assert out.dtype == jnp.float32


def test_function_fully_masked_row_returns_zero(rng):
    """The documented difference: Flax averages V over a row that sees no key; we return 0."""
    q, k, v = random_qkv(rng, (1,), 3, 4, 1, 1, 8, jnp.float32)
    mask = jnp.ones((1, 1, 3, 4), bool).at[0, 0, 1].set(False)
    out = np.asarray(jfa_flax.dot_product_attention(q, k, v, mask=mask))
    ref = np.asarray(nn.dot_product_attention(q, k, v, mask=mask))
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_allclose(ref[0, 1], np.asarray(v)[0].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert_trees_close(np.delete(out, 1, axis=1), np.delete(ref, 1, axis=1))


def test_function_segment_ids_with_batch_dims(rng):
    """Ids [batch..., T] and [batch..., S] with two batch dims: the reference on the folded
    batch (T != S packed differently), and Flax's attention with the ids' equality as its mask
    (query and key ids equal, so no row is empty)."""
    lead, t, s = (2, 3), 11, 14
    q, k, v = random_qkv(rng, lead, t, s, 4, 2, 8, jnp.float32)
    q_ids = jnp.asarray(np.sort(rng.integers(0, 4, lead + (t,)), axis=-1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 4, lead + (s,)), axis=-1), jnp.int32)
    out = jfa_flax.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=q_ids,
                                         key_value_segment_ids=kv_ids)
    assert out.shape == q.shape
    folded = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v, q_ids, kv_ids)]
    ref = reference.attention(*folded[:3], is_causal=True, query_segment_ids=folded[3],
                              key_value_segment_ids=folded[4])
    assert_trees_close(out, ref.reshape(out.shape))
    plain = jfa_flax.dot_product_attention(q, k, v, is_causal=True)
    assert np.max(np.abs(np.asarray(out) - np.asarray(plain))) > 0.1
    q, k, v = random_qkv(rng, lead, t, t, 4, 4, 8, jnp.float32)
    out = jfa_flax.dot_product_attention(q, k, v, query_segment_ids=q_ids,
                                         key_value_segment_ids=q_ids)
    mask = nn.make_attention_mask(q_ids, q_ids, pairwise_fn=jnp.equal)  # [2, 3, 1, T, T]
    assert_trees_close(out, nn.dot_product_attention(q, k, v, mask=mask))


def test_function_dropout_and_custom_einsums_raise(rng):
    q, k, v = random_qkv(rng, (1,), 4, 4, 2, 2, 8, jnp.float32)
    with pytest.raises(NotImplementedError, match="attention dropout"):
        jfa_flax.dot_product_attention(q, k, v, dropout_rate=0.5, deterministic=False,
                                       dropout_rng=jax.random.key(0))
    assert_trees_close(
        jfa_flax.dot_product_attention(q, k, v, dropout_rate=0.5, deterministic=True),
        nn.dot_product_attention(q, k, v))
    with pytest.raises(NotImplementedError, match="einsum"):
        jfa_flax.dot_product_attention(q, k, v, qk_attn_weights_einsum=jnp.einsum,
                                       attn_weights_value_einsum=jnp.einsum)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda r: jfa_flax.dot_product_attention(q, k, v, dropout_rate=r))(0.1)


def test_make_attention_fn_signature_and_causal_or():
    fn = jfa_flax.make_attention_fn(is_causal=True)
    params = inspect.signature(fn).parameters
    for name in ("mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic",
                 "dtype", "precision", "module", "force_fp32_for_softmax",
                 "qk_attn_weights_einsum", "attn_weights_value_einsum", "is_causal"):
        assert name in params  # Linen passes only the arguments it finds here
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, (1,), 5, 5, 2, 2, 8, jnp.float32)
    causal = jfa_flax.dot_product_attention(q, k, v, is_causal=True)
    assert_trees_close(fn(q, k, v, is_causal=False), causal)  # NNX passes is_causal=False
    with pytest.raises(ValueError, match="implementation"):
        jfa_flax.make_attention_fn(implementation="triton")


@pytest.mark.parametrize("deterministic", [False, True])
def test_make_attention_fn_deterministic_backward(deterministic):
    """The option reaches the backward custom call's attributes."""
    fn = jfa_flax.make_attention_fn(is_causal=True, deterministic_backward=deterministic)
    q, k, v = random_qkv(np.random.default_rng(0), (1,), 6, 6, 2, 2, 8, jnp.float32)
    grad = jax.grad(lambda q: jnp.sum(fn(q, k, v) ** 2))
    text = jax.jit(grad).lower(q).compile().as_text()
    config = re.search(r'custom_call_target="jax_flashattn_bwd".*?backend_config=(\{[^}]*\})',
                       text).group(1)
    assert re.search(r"deterministic = (\d)", config).group(1) == str(int(deterministic))
    with pytest.raises(TypeError, match="deterministic_backward"):
        jfa_flax.make_attention_fn(deterministic_backward=1)


# ---------------------------------------------------------------------------------------------
# examples/gpt.py at toy size


@functools.lru_cache(maxsize=None)
def _example():
    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_example_losses_match_and_fall(capsys):
    """A few training steps with each attention, from the same weights on the same data: the
    losses agree step by step (the first, before any update, to float32 rounding) and fall."""
    gpt = _example()
    steps = 20
    results = gpt.main(["--size", "toy", "--attention", "flash,flax", "--steps", str(steps),
                        "--warmup", "1", "--no-progress", "--num-layers", "1", "--d-model",
                        "32", "--num-heads", "2", "--seq-len", "32", "--batch-size", "8",
                        "--vocab-size", "64", "--learning-rate", "1e-2", "--warmup-steps", "1"])
    flash, flax_default = (np.asarray(r.losses) for r in results)
    assert flash.shape == flax_default.shape == (steps,)
    np.testing.assert_allclose(flash[0], flax_default[0], rtol=1e-5)
    np.testing.assert_allclose(flash[:5], flax_default[:5], rtol=1e-4)
    np.testing.assert_allclose(flash, flax_default, rtol=1e-3)
    assert flash[-3:].mean() < flash[:3].mean() - 0.1, flash
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("summary")]
    assert [line.split()[1] for line in lines] == ["attention=flash", "attention=flax"]
    assert all("step_ms=" in line and "tokens_per_s=" in line for line in lines)


def test_example_packed_losses_match_and_fall(capsys):
    """--packed: segment ids through our kernels and a combined causal and document mask
    through Flax's attention give the same losses, which fall."""
    gpt = _example()
    steps = 12
    results = gpt.main(["--size", "toy", "--attention", "flash,flax", "--steps", str(steps),
                        "--warmup", "1", "--no-progress", "--num-layers", "1", "--d-model",
                        "32", "--num-heads", "2", "--seq-len", "48", "--batch-size", "4",
                        "--vocab-size", "64", "--learning-rate", "1e-2", "--warmup-steps", "1",
                        "--packed"])
    flash, flax_default = (np.asarray(r.losses) for r in results)
    np.testing.assert_allclose(flash[0], flax_default[0], rtol=1e-5)
    np.testing.assert_allclose(flash, flax_default, rtol=1e-3)
    assert flash[-3:].mean() < flash[:3].mean() - 0.1, flash
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("summary")]
    assert all("packed=True" in line for line in lines)


def test_example_packed_data():
    """Packed rows: ids rise by 0 or 1, positions restart where the id changes, and the first
    document starts the row."""
    gpt = _example()
    tokens, ids, positions = gpt.SyntheticText(50, 40, seed=3).packed_batch(3)
    assert tokens.shape == ids.shape == positions.shape == (3, 41)
    assert np.all(ids[:, 0] == 0) and np.all(positions[:, 0] == 0)
    step = np.diff(ids, axis=1)
    assert set(np.unique(step)) <= {0, 1} and step.sum() > 0
    np.testing.assert_array_equal(positions[:, 1:] == 0, step == 1)


def test_example_data_is_deterministic():
    gpt = _example()
    a = gpt.SyntheticText(50, 40, seed=3).batch(4)
    b = gpt.SyntheticText(50, 40, seed=3).batch(4)
    assert a.shape == (4, 41) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 0 and a.max() < 50


# ---------------------------------------------------------------------------------------------
# An NNX attention layer with a soft-cap and learnable sinks (Gemma 2's cap, gpt-oss's sinks)


class _CappedSinkAttention(nnx.Module):
    """Causal self-attention whose logits are soft-capped and whose softmax takes one learnable
    sink per head, through `attention_fn` (jax_flashattn.flax or the reference)."""

    def __init__(self, attention_fn, *, rngs):
        self.qkv = nnx.Linear(F, 3 * F, rngs=rngs)
        self.out = nnx.Linear(F, F, rngs=rngs)
        self.sinks = nnx.Param(jnp.linspace(-1.0, 1.0, HEADS))
        self.attention_fn = attention_fn

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x).reshape(*x.shape[:-1], 3 * HEADS, F // HEADS), 3, -2)
        y = self.attention_fn(q, k, v, is_causal=True, logits_soft_cap=2.0,
                              sinks=self.sinks[...])
        return self.out(y.reshape(x.shape))


def test_nnx_layer_with_soft_cap_and_sinks(inputs):
    """The layer's output and the gradients of every parameter, the sinks included, through the
    kernels as through the float32 reference."""
    x, _ = inputs

    results = []
    # The reference jitted: eagerly, its forward and backward operations compiled one by one.
    for attention_fn in (jfa_flax.dot_product_attention, jitted_reference):
        model = _CappedSinkAttention(attention_fn, rngs=nnx.Rngs(0))

        def loss(model, x):
            y = model(x)
            return jnp.sum(jnp.sin(y)), y
        (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(model, x)
        grads = nnx.to_pure_dict(grads)
        assert float(jnp.max(jnp.abs(grads["sinks"]))) > 0
        results.append((y, grads))
    assert_trees_close(results[0], results[1])


# ---------------------------------------------------------------------------------------------
# examples/generate.py (paged KV cache) at toy size


@functools.lru_cache(maxsize=None)
def _generate_example():
    path = EXAMPLE.with_name("generate.py")
    spec = importlib.util.spec_from_file_location("generate_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GENERATE_ARGS = ["--steps", "10", "--prompts", "3", "--prompt-len", "14", "--new-tokens", "12",
                 "--page-size", "16", "--chunk", "5"]


def test_generate_example_matches_whole_sequences(capsys):
    """Ragged prompts prefilled in chunks of 5 across pages of 16, then 12 greedy steps: the
    model on the whole sequences without a cache picks every generated token."""
    result = _generate_example().main(GENERATE_ARGS)
    assert result.mismatches == 0 and result.near_ties == 0
    assert result.tokens.shape == (3, result.prompt_lens.max() + 12)
    assert np.all((result.prompt_lens >= 7) & (result.prompt_lens <= 14))
    assert "mismatches=0" in capsys.readouterr().out


def test_generate_example_check_finds_wrong_attention(monkeypatch):
    """The check is not vacuous: attention that drops all but the last three cached tokens
    generates tokens the whole-sequence run does not pick."""
    generate = _generate_example()
    paged = generate.jax_flashattn.paged_attention
    monkeypatch.setattr(generate.jax_flashattn, "paged_attention",
                        functools.partial(paged, local_window_size=(2, 0)))
    assert generate.main(GENERATE_ARGS).mismatches > 0
