"""Multi-device attention: batch/head-sharded attention against one device, and ring attention
over a long sequence split across the local devices.

    python benchmarks/bench_sharding.py              # every local device; ~2-3 min on 2 H200s
    python benchmarks/bench_sharding.py --seq-len 262144 --modes fwd
    python benchmarks/bench_sharding.py --devices 2 --no-single   # skip the 1-device ring baseline

Cases (bf16 by default, causal, H=128, N=16 so hidden = 2048):
- batch: B = 4 x devices, T = 4096, sharded on B; the same global problem on one device.
- heads: B = 4, T = 4096, sharded on heads (q and k/v together); the same on one device.
- ring: B = 1, T = --seq-len (128k), q/k/v sharded on T under jit: ring attention, contiguous
  shards re-laid out zig-zag inside for causal balance; the same sequence on one device.
- ring zigzag: the same through `ring_attention(layout="zigzag")` in `shard_map` on inputs
  already in zig-zag order (no re-layout), to show what the re-layout costs.

Each row: median wall time of --repeats runs after a compile+warm-up run (each run is one jitted
program, synchronised with block_until_ready), TFLOP/s over all devices and per device, and the
speedup over the one-device run of the same global problem. FLOPs: forward 4*B*N*T*S*H, halved
when causal; forward+backward 3.5x forward. Sharded results are checked against the one-device
result (bf16 tolerance: the ring merges bf16 partial outputs in float32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashattn
from jax_flashattn import _bench, sharding
from jax_flashattn._bench import DTYPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None, help="local devices to use (default all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=131072, help="ring attention's global T")
    p.add_argument("--short-seq-len", type=int, default=4096, help="T of the batch/head cases")
    p.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
    p.add_argument("--cases", default="batch,heads,ring,ring-zigzag")
    p.add_argument("--full", action="store_true", help="non-causal instead of causal")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-single", action="store_true",
                   help="skip the one-device runs of the ring cases (the slowest part)")
    return p.parse_args(argv)


def _program(attend, mode):
    """jit-able f(q, k, v, g): the forward, or the forward and dq, dk, dv (vjp with g)."""
    if mode == "fwd":
        return lambda q, k, v, g: attend(q, k, v)

    def f(q, k, v, g):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(g)
    return f


def _time(fn, args, repeats):
    result = jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _first(result):
    return result if not isinstance(result, tuple) else result[0]


def _mismatch(got, want) -> str:
    got = np.asarray(jnp.asarray(_first(got), jnp.float32))
    want = np.asarray(jnp.asarray(_first(want), jnp.float32))
    if not np.isfinite(got).all():
        return "NaN/inf"
    err = float(np.max(np.abs(got - want)))
    return "ok" if err <= 2e-2 * (float(np.max(np.abs(want))) + 1) else f"MISMATCH {err:.2g}"


def _inputs(key, b, t, n, kv, h, dtype):
    kq, kk, kv_, kg = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, n, h), dtype)
    k = jax.random.normal(kk, (b, t, kv, h), dtype)
    v = jax.random.normal(kv_, (b, t, kv, h), dtype)
    g = jax.random.normal(kg, (b, t, n, h), dtype)
    return q, k, v, g


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = jax.local_devices()[:args.devices or len(jax.local_devices())]
    d = len(devices)
    dtype = DTYPES[args.dtype]
    n, h = args.heads, args.head_dim
    kv = args.kv_heads or n
    causal = not args.full
    modes = [m for m in args.modes.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    attend = lambda q, k, v: jax_flashattn.attention(q, k, v, is_causal=causal)  # noqa: E731

    print(f"# jax_flashattn sharding benchmark\n\n{d} x {devices[0].device_kind}, "
          f"jax {jax.__version__}, {args.dtype}, {'causal' if causal else 'full'}, "
          f"N={n}, K={kv}, H={h}, median of {args.repeats}\n")
    print("| case | devices | B x T | mode | ms | TFLOP/s | TFLOP/s per device | "
          "speedup vs 1 device | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False

    def row(case, ndev, b, t, mode, seconds, speedup="", check=""):
        flops = _bench.attention_flops(b, n, t, t, h, causal, mode)
        tf = flops / seconds / 1e12
        print(f"| {case} | {ndev} | {b} x {t} | {mode} | {seconds * 1e3:.1f} | {tf:.3g} | "
              f"{tf / ndev:.3g} | {speedup} | {check} |", flush=True)

    def error_row(case, ndev, b, t, mode, error):
        nonlocal failed
        failed = True
        message = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        print(f"| {case} | {ndev} | {b} x {t} | {mode} | error: {message} | | | | |", flush=True)

    key = jax.random.PRNGKey(0)
    baselines = {}  # (B, T, mode) -> (seconds, output) of the one-device runs
    for case in cases:
        if case == "batch":
            b, t, spec, zig = 4 * d, args.short_seq_len, P("x"), False
        elif case == "heads":
            if n % d or kv % d:
                print(f"| heads | {d} | | | skipped: N={n}, K={kv} do not split {d} ways "
                      "| | | | |")
                continue
            b, t, spec, zig = 4, args.short_seq_len, P(None, None, "x"), False
        elif case in ("ring", "ring-zigzag"):
            b, t, spec, zig = 1, args.seq_len, P(None, "x"), case == "ring-zigzag"
        else:
            raise SystemExit(f"unknown case {case!r}")
        host = _inputs(key, b, t, n, kv, h, dtype)
        for mode in modes:
            single = None
            if (b, t, mode) in baselines:  # the ring cases share their one-device run
                single_seconds, single = baselines[(b, t, mode)]
            elif not (case.startswith("ring") and args.no_single):
                try:
                    single_inputs = [jax.device_put(x, devices[0]) for x in host]
                    seconds, single = _time(jax.jit(_program(attend, mode)), single_inputs,
                                            args.repeats)
                    del single_inputs
                    row(case, 1, b, t, mode, seconds)
                    single_seconds, single = seconds, _first(single)
                    baselines[(b, t, mode)] = (seconds, single)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    error_row(case, 1, b, t, mode, e)
            try:
                if zig:
                    order = lambda x: sharding.zigzag(x, d)  # noqa: E731
                    ring = lambda q, k, v: sharding.ring_attention(  # noqa: E731
                        q, k, v, axis_name="x", is_causal=causal, layout="zigzag")
                    fn = jax.jit(jax.shard_map(_program(ring, mode), mesh=mesh,
                                               in_specs=(spec,) * 4,
                                               out_specs=spec if mode == "fwd"
                                               else (spec, (spec,) * 3),
                                               check_vma=False))
                else:
                    order = lambda x: x  # noqa: E731
                    fn = jax.jit(_program(attend, mode))
                sharded = [jax.device_put(order(x), NamedSharding(mesh, spec)) for x in host]
                seconds, result = _time(fn, sharded, args.repeats)
                check = ""
                if single is not None:
                    got = _first(result)
                    if zig:
                        got = sharding.unzigzag(got, d)
                    check = _mismatch(got, single)
                    failed |= check != "ok"
                speedup = f"{single_seconds / seconds:.2f}x" if single is not None else ""
                row(case, d, b, t, mode, seconds, speedup, check)
            except Exception as e:  # noqa: BLE001 - reported in the table
                error_row(case, d, b, t, mode, e)
            del single
        del host
    if "ring" in cases or "ring-zigzag" in cases:
        work = sharding.ring_schedule(d, args.seq_len, is_causal=causal).work()
        print(f"\nRing work per device ((query, key) pairs, from the schedule): "
              f"{', '.join(f'{w:,}' for w in work)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
