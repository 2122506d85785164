"""FP8 attention (query, key and value of float8_e4m3fn) against our bfloat16 forward and
cuDNN's (jax.nn, bfloat16), in one process, and its accuracy.

    python3 benchmarks/bench_fp8_attention.py [--seqlen 2048,8192] [--head-dim 128]

The standard grid's shapes (B = 16384 / T, N = 2048 / H, T = S), full and causal. The e4m3
inputs are the bfloat16 ones quantised per (batch entry, kv head) by quantize_fp8 outside the
timed call; the call itself includes laying out V for the kernels (fp8.kernel_values). Each
implementation runs a jitted call 20 times back to back, in alternation with the others, five
rounds; the best round's mean per call gives TFLOP/s (4 B N T S H, half when causal). Accuracy:
at B = 1, N = 8, T = S = 2048 (full), --head-dim, the normwise error of the FP8 call against the float32
reference on the dequantised inputs, and that of the same computation with P rounded to e4m3
(tests/test_gpu_fp8_attention.py's rule: the first within twice the second)."""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashattn
from jax_flashattn import reference

E4M3 = jnp.float8_e4m3fn


def best_mean(fn, args, calls=20):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def quantized(x, kv_heads):
    """x [B, L, N, H] as e4m3 with a [B, K] descale (N / K heads per group)."""
    b, l, n, h = x.shape
    values, descale = jax_flashattn.quantize_fp8(x.reshape(b, l, kv_heads, n // kv_heads * h))
    return values.reshape(x.shape), descale


def accuracy(rng, h):
    b, t, n = 1, 2048, 8
    x = [jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3)]
    (q8, dq), (k8, dk), (v8, dv) = (quantized(y, n) for y in x)
    q, k, v = (jax_flashattn.dequantize_fp8(y, d) for y, d in ((q8, dq), (k8, dk), (v8, dv)))
    out = jax_flashattn.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    ref = np.asarray(reference.attention(q, k, v), np.float64)
    w = np.asarray(reference.attention_weights(q, k), np.float64)  # [B, N, T, S]
    p = 256.0 * w / w.max(axis=-1, keepdims=True)
    p8 = np.asarray(jnp.asarray(p, jnp.float32).astype(E4M3), np.float64)
    rounded = np.einsum("bnts,bsnh->btnh", p8, np.asarray(v, np.float64)) / p.sum(
        axis=-1).transpose(0, 2, 1)[..., None]
    norm = np.linalg.norm(ref)
    return (np.linalg.norm(np.asarray(out, np.float64) - ref) / norm,
            np.linalg.norm(rounded - ref) / norm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", default="2048,4096,8192,16384")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    print(f"{device.device_kind}, jax {jax.__version__}")
    print("| T | causal | fp8 TFLOP/s | bf16 TFLOP/s | cuDNN TFLOP/s | fp8/bf16 | fp8/cuDNN |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    h = args.head_dim
    for t in (int(s) for s in args.seqlen.split(",")):
        b, n = 16384 // t, 2048 // h
        x = [jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16) for _ in range(3)]
        fp8_inputs = [y for z in x for y in quantized(z, n)]
        for causal in (False, True):
            calls = {
                "fp8": (jax.jit(lambda q, dq, k, dk, v, dv: jax_flashattn.attention(
                    q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, is_causal=causal)),
                        fp8_inputs),
                "bf16": (jax.jit(lambda q, k, v: jax_flashattn.attention(
                    q, k, v, is_causal=causal)), x),
                "cudnn": (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")), x),
            }
            best = {name: float("inf") for name in calls}
            for _ in range(5):
                for name, (fn, inputs) in calls.items():
                    best[name] = min(best[name], best_mean(fn, inputs))
            flops = 4 * b * n * t * t * h / (2 if causal else 1)
            tf = {name: flops / s / 1e12 for name, s in best.items()}
            print(f"| {t} | {'yes' if causal else 'no'} | {tf['fp8']:.0f} | {tf['bf16']:.0f} | "
                  f"{tf['cudnn']:.0f} | {tf['fp8'] / tf['bf16']:.2f} | "
                  f"{tf['fp8'] / tf['cudnn']:.2f} |", flush=True)
    error, rounded = accuracy(rng, h)
    print(f"accuracy: error {error:.3e}, with P rounded to e4m3 {rounded:.3e}, "
          f"ratio {error / rounded:.2f}")


if __name__ == "__main__":
    main()
