"""The test helpers' own behaviour: the batch-split reference must equal the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from helpers import random_qkv
from jax_flashattn import reference


@pytest.mark.parametrize("extra", [
    dict(),
    dict(bias_batch=1, mask_batch=3, local_window_size=(5, 2)),
    dict(bias_batch=3, is_causal=True, p_dtype=jnp.bfloat16),
    dict(mask_batch=1, query_seq_lengths=np.array([9, 0, 4], np.int32),
         key_value_seq_lengths=np.array([3, 11, 0], np.int32), is_causal=True),
])
def test_split_reference_matches(rng, monkeypatch, extra):
    """With the split threshold at 0 every batched call goes one entry at a time: out and lse
    must equal the one-piece reference exactly, with bias and mask that do and do not
    broadcast over the batch, lengths, windows and a rounded P."""
    monkeypatch.setattr(helpers, "_SPLIT_LOGITS", 0)
    q, k, v = random_qkv(rng, 3, 9, 11, 4, 2, 8, jnp.float32)
    extra = dict(extra)
    args = []
    if "bias_batch" in extra or "mask_batch" in extra:
        bias_batch, mask_batch = extra.pop("bias_batch", None), extra.pop("mask_batch", None)
        args.append(None if bias_batch is None else
                    jnp.asarray(rng.standard_normal((bias_batch, 4, 9, 11)), jnp.float32))
        args.append(None if mask_batch is None else
                    jnp.asarray(rng.random((mask_batch, 1, 9, 11)) > 0.2))
    want_out, want_lse = reference.attention(q, k, v, *args, return_residual=True, **extra)
    out, lse = helpers.reference_attention(q, k, v, *args, return_residual=True, **extra)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    np.testing.assert_array_equal(
        np.asarray(helpers.reference_attention(q, k, v, *args, **extra)), np.asarray(want_out))
