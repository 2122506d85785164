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
