"""The test helpers' own behaviour: the batch-split reference must equal the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import random_qkv
from jax_flashattn import reference


@pytest.mark.parametrize("bias_batch,mask_batch,kwargs", [
    (None, None, dict()),
    (1, 3, dict(local_window_size=(5, 2))),
    (3, None, dict(is_causal=True, p_dtype=jnp.bfloat16)),
    (None, 1, dict(query_seq_lengths=np.array([9, 0, 4], np.int32),
                   key_value_seq_lengths=np.array([3, 11, 0], np.int32), is_causal=True)),
])
def test_split_reference_matches(rng, monkeypatch, bias_batch, mask_batch, kwargs):
    """With the split threshold at 0 every batched call goes one entry at a time: out and lse
    must equal the one-piece reference exactly, with bias and mask that do (batch 1) and do
    not broadcast over the batch, lengths, windows and a rounded P."""
    monkeypatch.setattr(helpers, "_SPLIT_LOGITS", 0)
    q, k, v = random_qkv(rng, 3, 9, 11, 4, 2, 8, jnp.float32)
    bias = (None if bias_batch is None else
            jnp.asarray(rng.standard_normal((bias_batch, 4, 9, 11)), jnp.float32))
    mask = None if mask_batch is None else jnp.asarray(rng.random((mask_batch, 1, 9, 11)) > 0.2)
    want_out, want_lse = reference.attention(q, k, v, bias, mask, return_residual=True, **kwargs)
    out, lse = helpers.reference_attention(q, k, v, bias, mask, return_residual=True, **kwargs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    np.testing.assert_array_equal(
        np.asarray(helpers.reference_attention(q, k, v, bias, mask, **kwargs)),
        np.asarray(want_out))


@pytest.mark.parametrize("dtype,top_ulp", [(jnp.bfloat16, 2.0 ** -8), (jnp.float16, 2.0 ** -11)])
def test_error_budget_is_at_least_one_ulp_of_each_output(dtype, top_ulp):
    """Where the rounded reference errs most a binade below its largest outputs, twice that
    error is less than one ulp of them; the budget still admits the neighbour one ulp away of a
    largest output (what a kernel gives when its value lies near a rounding midpoint), but not
    an error that large on a small output. Where twice the error exceeds an element's ulp, it
    is that element's budget, as before."""
    exact = np.array([-0.5546875 - 1e-6, 0.2601, 0.01], np.float64)
    rounded = np.asarray(jnp.asarray(exact, dtype).astype(jnp.float32), np.float64)
    twice_err = 2 * np.max(np.abs(rounded - exact))
    assert np.argmax(np.abs(rounded - exact)) != 0 and twice_err < top_ulp
    bound = reference.error_budget(exact, rounded, dtype)
    small = 1e-5 * (0.5546885 + 1)
    np.testing.assert_allclose(bound, [top_ulp + small, max(twice_err, top_ulp / 2) + small,
                                       max(twice_err, top_ulp / 64) + small])
    neighbour = exact.copy()
    neighbour[0] = -0.5546875 + top_ulp
    err, err_bound = reference.worst_against_budget(np.abs(neighbour - exact), bound)
    assert err <= err_bound
    off = exact.copy()
    off[2] += top_ulp  # one ulp of the largest output, on an output 55 times smaller
    err, err_bound = reference.worst_against_budget(np.abs(off - exact), bound)
    assert err > err_bound and err_bound < top_ulp / 2
    far = exact.copy()
    far[2] += 4 * top_ulp
    np.testing.assert_allclose(reference.error_budget(exact, far, dtype), 8 * top_ulp + small)


def test_error_budget_admits_the_rounding_of_a_dominant_probability():
    """An output that one key with a large value dominates (p = 0.31, v = -2.95): rounding P to
    bf16 may move it by u sum_j p_j |v_j| (u = 2^-8) even where the rounded reference happens to
    err by far less; beyond that bound an error still fails."""
    exact = np.array([-0.7659912705421448, 0.1], np.float64)
    rounded = np.asarray(jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32), np.float64)
    magnitude = np.array([1.2, 0.1])
    kernel = np.array([-0.76171875, 0.1])  # two bf16 values from exact, as measured
    without = reference.error_budget(exact, rounded, jnp.bfloat16)
    err, bound = reference.worst_against_budget(np.abs(kernel - exact), without)
    assert err > bound
    budget = reference.error_budget(exact, rounded, jnp.bfloat16, magnitude)
    err, bound = reference.worst_against_budget(np.abs(kernel - exact), budget)
    assert err <= bound
    np.testing.assert_allclose(budget[0], 2.0 ** -8 * 1.2 + 2.0 ** -9 + 1e-5 * (0.766 + 1),
                               rtol=1e-3)
    err, bound = reference.worst_against_budget(np.abs(kernel - exact) + [0.003, 0], budget)
    assert err > bound
