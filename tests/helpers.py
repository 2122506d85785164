"""Shared test utilities: random inputs and the error-ratio comparison of DESIGN.md."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_flashattn import reference


def random_qkv(rng, b, t, s, n, k, h, dtype, magnitude=1.0):
    """Normal q [B, T, N, H], k/v [B, S, K, H] in `dtype` (b=None gives unbatched arrays)."""
    lead = () if b is None else (b,)
    q = rng.standard_normal(lead + (t, n, h), dtype=np.float32) * magnitude
    kk = rng.standard_normal(lead + (s, k, h), dtype=np.float32) * magnitude
    v = rng.standard_normal(lead + (s, k, h), dtype=np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v))


def assert_attention_close(out, query, key, value, *args, **kwargs):
    """Checks `out` against the float32 reference with the error-ratio rule: a float32 result
    must match to ~1e-5 relative; a low-precision one may err by at most ~2x what the
    reference itself errs when it rounds P and the output to the input dtype."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert not np.isnan(out).any(), "NaN in output"
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (query, key, value))
    ref = np.asarray(reference.attention(q32, k32, v32, *args, **kwargs), np.float64)
    if jnp.asarray(query).dtype == jnp.float32:
        bound = 2e-5 * (np.max(np.abs(ref), initial=0.0) + 1)
    else:
        bound = reference.error_bound(query, key, value, *args, **kwargs)
    err = np.max(np.abs(out - ref), initial=0.0)
    assert err <= bound, f"max error {err:.3g} exceeds bound {bound:.3g}"
