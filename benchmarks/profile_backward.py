"""One forward+backward call of the standard grid's shape, for a profiler:

    ncu --kernel-name regex:backward_kernel --launch-count 1 --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 benchmarks/profile_backward.py --head-dim 128 --seqlen 4096

(with --section SourceCounters and -o REPORT, benchmarks/stall_samples.py sums the report's
stall samples by reason and instruction)

bf16, N = 2048 / H query heads (hidden 2048), B = --batch, T = S = --seqlen, full or causal;
gradients of q, k and v."""

import argparse

import jax
import jax.numpy as jnp

import jax_flashattn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    shape = (args.batch, args.seqlen, 2048 // args.head_dim, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16)
               for key in jax.random.split(jax.random.PRNGKey(0), 3))

    def loss(q, k, v):
        out = jax_flashattn.attention(q, k, v, is_causal=args.causal)
        return jnp.sum(out.astype(jnp.float32))

    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    print(f"{jax.devices()[0].device_kind}: H = {args.head_dim}, T = S = {args.seqlen}, "
          f"B = {args.batch}, causal = {args.causal}")


if __name__ == "__main__":
    main()
