"""Our CUDA handlers recorded into XLA's command buffers (CUDA graphs), replayed.

    XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 python3 tests/command_buffer_case.py

The handlers say they are command-buffer compatible, so XLA records their launches (by stream
capture) into the graph of the step around them; with the smallest graph size every step here
is one. Each case jits a step with fusions before and after `attention` (and its gradient),
then replays it on fresh inputs and checks each result against the float32 reference: both
decode merges (in the thread block cluster, and through the workspace with the combine's early
launch), the Hopper forward and the backward. A handler that did what stream capture forbids
(synchronise, allocate) fails here. Whether a call was recorded is not visible in the compiled
HLO of jax 0.11 (XLA forms command buffers from its thunks); the benchmarks show the effect
(docs/decisions/command-buffer-compatible-handlers.md). Run in a process of its own by
tests/test_gpu_forward.py (XLA_FLAGS is read once per process).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn
from helpers import assert_attention_close, random_qkv  # tests/ is this script's directory


def forward_case(rng, name, sizes, **kwargs):
    def step(q, k, v):
        out = jax_flashattn.attention(q * 1.5, k, v, implementation="cuda", **kwargs)
        return out.astype(jnp.float32) * 2.0

    step = jax.jit(step)
    for _ in range(3):
        q, k, v = random_qkv(rng, *sizes, jnp.bfloat16)
        out = step(q, k, v) / 2.0
        assert_attention_close(out.astype(jnp.bfloat16), (q * 1.5).astype(jnp.bfloat16), k, v,
                               **kwargs)
    print(f"ok: {name}")


def gradient_case(rng, sizes):
    def loss(q, k, v):
        out = jax_flashattn.attention(q, k, v, implementation="cuda", is_causal=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1])))

    def reference_loss(q, k, v):
        out = jax_flashattn.reference.attention(q, k, v, is_causal=True)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1])))

    step = jax.jit(jax.grad(lambda q, k, v: 3.0 * loss(q + 0.0, k, v), argnums=(0, 1, 2)))
    for _ in range(3):
        q, k, v = random_qkv(rng, *sizes, jnp.bfloat16)
        got = step(q, k, v)
        want = jax.grad(lambda *a: 3.0 * reference_loss(*a), argnums=(0, 1, 2))(
            *(x.astype(jnp.float32) for x in (q, k, v)))
        for name, a, r in zip("qkv", got, want):
            a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
            err = np.linalg.norm(a - r) / np.linalg.norm(r)
            assert err < 3e-2, f"d{name}: relative error {err:.3g}"
    print("ok: gradient")


def main():
    rng = np.random.default_rng(0)
    # (B, T, S, N, K, H): 8 splits per kv head (on Hopper merged in their cluster), 4 splits of
    # 64 kv heads (on Hopper with 128+ SMs two per block, merged in clusters of 2), 17 splits
    # (the workspace and the combine kernel), T = 1 with lengths, and a full forward.
    forward_case(rng, "decode, 8 splits", (2, 16, 2048, 8, 2, 128))
    forward_case(rng, "decode, paired splits", (8, 16, 1500, 32, 8, 128))
    forward_case(rng, "decode, 17 splits", (2, 16, 4097, 8, 2, 128))
    forward_case(rng, "decode, T = 1, lengths", (2, 1, 3000, 8, 2, 128),
                 key_value_seq_lengths=jnp.array([3000, 1234], jnp.int32))
    forward_case(rng, "forward", (2, 300, 333, 4, 2, 128), is_causal=True)
    gradient_case(rng, (2, 200, 250, 4, 2, 64))


if __name__ == "__main__":
    main()
