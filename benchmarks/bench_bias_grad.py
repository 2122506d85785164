"""Forward+backward with a differentiated bias: time (ms) and compiled temp memory, for bias
shapes summed in-kernel (default) against the full dbias (deterministic_backward).

    python3 benchmarks/bench_bias_grad.py

bf16, B = 4, T = S = 2048, N = 16, H = 128; the gradient of q, k, v and the bias, jitted, 10
calls after one warm-up, timed by the wall clock around them (not the grid's method)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn

B, T, N, H = 4, 2048, 16, 128
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(3))
print(jax.devices()[0].device_kind)
for shape in [(1, N, T, T), (1, 1, 1, T), (B, N, T, T)]:
    bias = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    for det in (False, True):
        for causal in (False, True):
            def loss(q, k, v, bias):
                o = jax_flashattn.attention(q, k, v, bias, is_causal=causal,
                                            deterministic_backward=det)
                return jnp.sum(o.astype(jnp.float32))
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
            temp = g.lower(q, k, v, bias).compile().memory_analysis().temp_size_in_bytes
            jax.block_until_ready(g(q, k, v, bias))
            reps = 10
            t0 = time.perf_counter()
            for _ in range(reps):
                out = g(q, k, v, bias)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t0) / reps * 1e3
            print(f"bias {str(shape):22s} det={det!s:5s} causal={causal!s:5s} "
                  f"{ms:8.2f} ms  temp {temp / 2**20:8.1f} MiB  "
                  f"dbias finite {bool(jnp.isfinite(out[3].astype(jnp.float32)).all())}")
