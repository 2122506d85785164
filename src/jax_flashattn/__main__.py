"""`python -m jax_flashattn`: check the installed kernels, then a small benchmark.

The checks run our kernels (`implementation="cuda"` on a GPU, `"cpu"` otherwise, so a build
without CUDA fails loudly instead of falling back to XLA) against `jax_flashattn.reference`
in float32 on the default device: dtypes, causal, GQA/MQA, bias and mask, sequence lengths,
local windows, odd sizes, the log-sum-exp residual, and gradients against `jax.vjp` of the
reference. The rules are those of the benchmarks (see src/jax_flashattn/_bench/). The exit status
is 1 when any check (or a benchmark correctness gate of ours) fails.

    python -m jax_flashattn                  # checks + benchmark on the default device
    python -m jax_flashattn --skip-bench     # checks only
    python -m jax_flashattn --size tiny      # smallest sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn import _bench, reference

CPU_NOTE = ("On a CPU, the C++ kernels are for running and testing anywhere (laptops, CPU-only "
            "CI); the speed this package is built for is on NVIDIA GPUs.")

# Base lengths per size: (L, (odd T, odd S)). "cpu" keeps the whole job under a minute on two
# cores; "gpu" spans several tiles of every kernel in both directions.
SIZES = {"tiny": (64, (37, 91)), "cpu": (128, (77, 201)), "gpu": (1024, (333, 1111))}


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """One correctness check: shapes, options, and whether gradients are compared."""
    name: str
    b: int | None  # None: unbatched [T, N, H] inputs
    t: int
    s: int
    n: int
    k: int
    h: int
    dtype: str = "bf16"
    causal: bool = False
    window: tuple[int, int] | None = None
    bias: str | None = None   # "heads": [1, N, T, S] float32; "full": [B, N, T, S]
    mask: str | None = None   # "batch": [B, 1, T, S] random keep pattern
    lens: str | None = None   # "partial": some rows/keys padded; "empty": one batch sees no key
    segments: bool = False    # packed sequences: random documents, query and key ids apart
    grad: bool = False
    residual: bool = False


def check_specs(size: str) -> list[CheckSpec]:
    length, (odd_t, odd_s) = SIZES[size]
    L, half = length, length // 2
    return [
        CheckSpec("bf16 full", 2, L, L, 4, 4, 64),
        CheckSpec("fp16 causal H=128", 2, L, L, 4, 4, 128, "fp16", causal=True),
        CheckSpec("fp32 full", 1, half, half, 2, 2, 64, "fp32"),
        CheckSpec("bf16 causal GQA N=8 K=2", 2, L, L, 8, 2, 64, causal=True),
        CheckSpec("fp16 MQA K=1 causal T<S", 2, half, L, 4, 1, 64, "fp16", causal=True),
        CheckSpec("bf16 bias [1,N,T,S] + mask [B,1,T,S]", 2, L, L, 4, 4, 64, bias="heads",
                  mask="batch"),
        CheckSpec("bf16 seq lengths (one batch sees no key)", 2, L, L, 4, 4, 64, lens="empty"),
        CheckSpec("bf16 segment ids causal GQA", 2, L, L, 8, 2, 64, causal=True, segments=True),
        CheckSpec("bf16 local window", 2, L, L, 4, 4, 64, window=(L // 4, L // 8)),
        CheckSpec(f"bf16 odd sizes T={odd_t} S={odd_s} causal", 2, odd_t, odd_s, 4, 2, 64,
                  causal=True),
        CheckSpec("bf16 T=1 S=1", 3, 1, 1, 4, 4, 128),
        CheckSpec(f"bf16 decode T=1 S={odd_s} GQA", 2, 1, odd_s, 8, 2, 128),
        CheckSpec("bf16 unbatched [T,N,H]", None, half, L, 4, 4, 64, causal=True),
        CheckSpec("bf16 return_residual (lse)", 2, L, L, 4, 4, 64, causal=True, lens="partial",
                  residual=True),
        CheckSpec("grad bf16 causal", 2, L, L, 4, 4, 64, causal=True, grad=True),
        CheckSpec("grad fp16 GQA + seq lengths", 2, L, L, 8, 2, 128, "fp16", lens="partial",
                  grad=True),
        CheckSpec(f"grad bf16 bias (dbias) odd T={odd_t} S={odd_s}", 2, odd_t, odd_s, 4, 4, 64,
                  bias="heads", grad=True),
        CheckSpec("grad fp32 local window", 1, half, half, 2, 2, 64, "fp32",
                  window=(L // 8, L // 8), grad=True),
        CheckSpec(f"grad bf16 segment ids odd T={odd_t} S={odd_s}", 2, odd_t, odd_s, 4, 4, 64,
                  segments=True, grad=True),
    ]


def _inputs(spec: CheckSpec, rng: np.random.Generator):
    """Arrays (q, k, v, cotangent) in the spec's dtype plus the attention keyword arguments."""
    dtype = _bench.DTYPES[spec.dtype]
    lead = () if spec.b is None else (spec.b,)
    b = spec.b or 1

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    q = jnp.asarray(normal(*lead, spec.t, spec.n, spec.h), dtype)
    k = jnp.asarray(normal(*lead, spec.s, spec.k, spec.h), dtype)
    v = jnp.asarray(normal(*lead, spec.s, spec.k, spec.h), dtype)
    g = jnp.asarray(normal(*lead, spec.t, spec.n, spec.h), dtype)
    kwargs = dict(is_causal=spec.causal, local_window_size=spec.window)
    if spec.bias == "heads":
        kwargs["bias"] = jnp.asarray(normal(1, spec.n, spec.t, spec.s))
    elif spec.bias == "full":
        kwargs["bias"] = jnp.asarray(normal(b, spec.n, spec.t, spec.s))
    if spec.mask == "batch":
        kwargs["mask"] = jnp.asarray(rng.random((b, 1, spec.t, spec.s)) < 0.7)
    if spec.lens == "partial":
        kwargs["query_seq_lengths"] = jnp.asarray(
            rng.integers(1, spec.t + 1, size=b), jnp.int32).at[0].set(spec.t)
        kwargs["key_value_seq_lengths"] = jnp.asarray(
            rng.integers(1, spec.s + 1, size=b), jnp.int32).at[0].set(spec.s)
    elif spec.lens == "empty":
        kwargs["query_seq_lengths"] = jnp.asarray([spec.t] + [spec.t // 2] * (b - 1), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray([0] + [spec.s // 3] * (b - 1), jnp.int32)
    if spec.segments:  # ids rise by 0 or 1 per position: documents of random lengths
        kwargs["query_segment_ids"] = jnp.asarray(
            np.cumsum(rng.random((b, spec.t)) < 0.05, axis=1), jnp.int32)
        kwargs["key_value_segment_ids"] = jnp.asarray(
            np.cumsum(rng.random((b, spec.s)) < 0.05, axis=1), jnp.int32)
    return q, k, v, g, kwargs


def _lse_verdict(lse, ref_lse) -> _bench.Verdict:
    lse, ref_lse = (np.asarray(x, np.float64) for x in (lse, ref_lse))
    empty = np.isneginf(ref_lse)
    if not np.array_equal(np.isneginf(lse), empty):
        return _bench.Verdict(False, "lse is -inf on different rows than the reference", {})
    if not np.isfinite(lse[~empty]).all():
        return _bench.Verdict(False, "non-finite lse on rows that see keys", {})
    lse, ref_lse = lse[~empty], ref_lse[~empty]
    err = float(np.max(np.abs(lse - ref_lse) / (1 + np.abs(ref_lse)), initial=0.0))
    return _bench.Verdict(err <= 1e-3, f"lse rel err {err:.2g} (tol 1e-3)", dict(lse_err=err))


_STATIC = ("is_causal", "local_window_size")


def _reference_all(q, k, v, g, arrays, *, static, dtype, grad, residual):
    """Everything a check compares against: the float32 output, the output with P rounded to
    `dtype`, each element's sum_j p_j |v_j| (the error budget's P-rounding term), and the lse or
    the gradients (float32 throughout)."""
    q, k, v, g = (x.astype(jnp.float32) for x in (q, k, v, g))
    arrays = dict(arrays)
    bias = arrays.pop("bias", None)
    f = functools.partial(reference.attention, **arrays, **dict(static))
    rounded = f(q, k, v, bias, p_dtype=_bench.DTYPES[dtype]).astype(_bench.DTYPES[dtype])
    magnitude = f(q, k, jnp.abs(v), bias)
    exact, lse = f(q, k, v, bias, return_residual=True)
    grads = None
    if grad:
        primals = (q, k, v) if bias is None else (q, k, v, bias)
        _, vjp = jax.vjp(lambda q, k, v, *b: f(q, k, v, *b), *primals)
        grads = vjp(g)
    return exact, rounded, magnitude, (lse if residual else None), grads


def _ours_all(q, k, v, g, arrays, *, static, grad, residual):
    """Our kernels on the same inputs: (out, lse or None, gradients or None)."""
    import jax_flashattn
    arrays = dict(arrays)
    bias = arrays.pop("bias", None)
    f = functools.partial(jax_flashattn.attention, **arrays, **dict(static),
                          implementation=_bench.ours_implementation())
    if grad:
        primals = (q, k, v) if bias is None else (q, k, v, bias)
        out, vjp = jax.vjp(lambda q, k, v, *b: f(q, k, v, *b), *primals)
        return out, None, vjp(g)
    if residual:
        out, lse = f(q, k, v, bias, return_residual=True)
        return out, lse, None
    return f(q, k, v, bias), None, None


def run_check(spec: CheckSpec, seed: int = 0) -> _bench.Verdict:
    """Our kernels against the float32 reference for one spec. Never raises."""
    try:
        q, k, v, g, kwargs = _inputs(spec, np.random.default_rng(seed))
        flags = dict(static=tuple((name, kwargs.pop(name)) for name in _STATIC),
                     grad=spec.grad, residual=spec.residual)

        ours = functools.partial(_ours_all, **flags)
        ref = functools.partial(_reference_all, dtype=spec.dtype, **flags)
        if _bench.on_gpu():  # the reference on the host CPU: no GPU compile and autotuning
            out, lse, grads = jax.jit(ours)(q, k, v, g, kwargs)
            host = jax.devices("cpu")[0]
            exact, rounded, magnitude, ref_lse, ref_grads = jax.jit(ref)(
                *jax.device_put((q, k, v, g, kwargs), host))
        else:  # one program: ours and the reference side by side
            (out, lse, grads), (exact, rounded, magnitude, ref_lse, ref_grads) = jax.jit(
                lambda *a: (ours(*a), ref(*a)))(q, k, v, g, kwargs)
        if out.shape != q.shape or out.dtype != q.dtype:
            return _bench.Verdict(False, f"output {out.shape} {out.dtype}, expected "
                                         f"{q.shape} {q.dtype}", {})
        verdicts = [_bench.forward_verdict(out, exact, rounded, spec.dtype, magnitude)]
        if spec.residual:
            verdicts.append(_lse_verdict(lse, ref_lse))
        if spec.grad:
            names = ("dq", "dk", "dv", "dbias")[:len(grads)]
            verdicts.append(_bench.grad_verdict(dict(zip(names, grads)),
                                                dict(zip(names, ref_grads)), spec.dtype))
        return _bench.Verdict(all(x.ok for x in verdicts),
                              "; ".join(x.detail for x in verdicts), {})
    except Exception as e:  # noqa: BLE001 - a crash is a failed check, not a crashed job
        return _bench.Verdict(False, f"raised {type(e).__name__}: {str(e)[:400]}", {})


def run_checks(size: str | None = None, specs=None,
               out=print) -> list[tuple[CheckSpec, _bench.Verdict]]:
    """Runs every check, printing one PASS/FAIL line each through `out`."""
    specs = specs if specs is not None else check_specs(size or default_size())
    results = []
    for i, spec in enumerate(specs):
        start = time.perf_counter()
        verdict = run_check(spec)
        results.append((spec, verdict))
        if out:
            out(f"[{i + 1:2d}/{len(specs)}] {'PASS' if verdict.ok else 'FAIL'}  {spec.name:<42} "
                f"{verdict.detail}  ({time.perf_counter() - start:.1f}s)")
    return results


def default_size() -> str:
    return "gpu" if _bench.on_gpu() else "cpu"


def bench_configs(size: str) -> list[_bench.Config]:
    if size == "gpu":
        return _bench.standard_grid(("bf16",), (128,), (1024, 4096), (False, True))
    return _bench.standard_grid(("bf16",), (64,), (256, 512), (False, True), tokens=512,
                                hidden=256)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_flashattn",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default=None,
                   help="check and benchmark sizes (default: gpu on a GPU, else cpu)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "both"), default="fwd",
                   help="benchmark forward, forward+backward, or both")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    size = args.size or default_size()
    start = time.perf_counter()

    for line in _bench.environment_lines(_bench.environment()):
        print(line)
    print(f"our implementation: {_bench.ours_implementation()!r}; sizes: {size}", flush=True)
    if not _bench.on_gpu():
        print(CPU_NOTE, flush=True)

    failed = []
    if not args.skip_checks:
        print("\nCorrectness against the float32 reference:")
        results = run_checks(size)
        failed = [spec.name for spec, verdict in results if not verdict.ok]
        print(f"{len(results) - len(failed)}/{len(results)} checks passed", flush=True)

    if not args.skip_bench:
        impls = _bench.available_impls(_bench.IMPLS)
        modes = ["fwd", "fwdbwd"] if args.mode == "both" else [args.mode]
        configs = bench_configs("gpu" if size == "gpu" else "cpu")
        print(f"\nBenchmark ({', '.join(impls)}; each config checked, then timed):", flush=True)
        print("our forward kernel: " + _bench.forward_kernel_summary(configs), flush=True)
        records = _bench.run_benchmark(configs, impls, modes)
        for title, table in _bench.markdown_tables(records, impls):
            print(f"\n{title}\n\n{table}")
        failed += [f"benchmark {r['dtype']} T={r['seqlen_q']} {r['mode']}: {r['status']}"
                   for r in _bench.failures(records)]

    print(f"\nelapsed: {time.perf_counter() - start:.0f} s")
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
