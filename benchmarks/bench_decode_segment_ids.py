"""Decoding with segment ids: time per call (us) of the split-KV decode kernels without ids,
with every id 0 (the id test on every key, nothing hidden), with packed keys (documents of
log-normal lengths, mean 4096, each row's queries in its last document) and with the same
packing as a boolean mask [B, 1, T, S].

    python3 benchmarks/bench_decode_segment_ids.py

bf16, B = 8, N = 32, K = 8, H = 128, S = 65536, T = 1 and 16; each time the median of 7 runs
of the benchmark's timed loop (jax_flashattn._bench.timing.build_runner: 20 dependent calls,
unrolled), without the grid's alternation. Also prints the kernel each call takes and the
largest difference between the ids' output and the mask's."""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn
from jax_flashattn._bench.timing import build_runner

CALLS = 20


def time_per_call(q, k, v, options):
    """us per call of attention(q, k, v, **options) in the benchmark's timed loop, which donates
    the inputs it is given: it runs on copies."""
    run = build_runner(jax_flashattn.attention, "fwd", CALLS)
    sets, results = [tuple(jnp.copy(x) for x in (q, k, v))], [(jnp.zeros(q.shape, q.dtype),)]
    sets, results = jax.block_until_ready(run(sets, results, None, options))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        sets, results = jax.block_until_ready(run(sets, results, None, options))
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times)) / CALLS


def packed_key_ids(rng, batch, seqlen_k):
    """[batch, seqlen_k] ids of consecutive documents of log-normal lengths (mean 4096)."""
    ids = np.zeros((batch, seqlen_k), np.int32)
    for row in ids:
        lengths = np.maximum(1, rng.lognormal(np.log(4096) - 0.5, 1.0, 64).astype(int))
        for start in np.cumsum(lengths):
            if start < seqlen_k:
                row[start:] += 1
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-len", type=int, default=65536)
    parser.add_argument("--seqlen", default="1,16", help="comma list of query lengths T")
    args = parser.parse_args()
    b, n, kv, h, s = 8, 32, 8, 128, args.kv_len
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}: B = {b}, N = {n}, K = {kv}, H = {h}, S = {s}, bf16")
    print("| T | kernel | documents of the queries (keys) | plain | ids all 0 | packed ids | "
          "packed as mask | ids - mask |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for t in (int(x) for x in args.seqlen.split(",")):
        keys = jax.random.split(jax.random.PRNGKey(t), 3)
        q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, kv, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, kv, h), jnp.bfloat16)
        kv_ids = packed_key_ids(rng, b, s)
        q_ids = np.repeat(kv_ids[:, -1:], t, axis=1)
        zeros = dict(query_segment_ids=jnp.zeros((b, t), jnp.int32),
                     key_value_segment_ids=jnp.zeros((b, s), jnp.int32))
        packed = dict(query_segment_ids=jnp.asarray(q_ids),
                      key_value_segment_ids=jnp.asarray(kv_ids))
        mask = jnp.asarray((q_ids[:, :, None] == kv_ids[:, None, :])[:, None])
        kernels = {jax_flashattn.forward_kernel(q, k, **kw) for kw in ({}, zeros, packed)}
        kernels.add(jax_flashattn.forward_kernel(q, k, mask=mask))
        out = jax_flashattn.attention(q, k, v, **packed)
        ref = jax_flashattn.attention(q, k, v, mask=mask)
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        last = (kv_ids == kv_ids[:, -1:]).sum(1)
        times = [time_per_call(q, k, v, kw) for kw in ({}, zeros, packed, dict(mask=mask))]
        print(f"| {t} | {', '.join(sorted(kernels))} | {int(last.min())}-{int(last.max())} | "
              + " | ".join(f"{x:.1f}" for x in times) + f" | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
