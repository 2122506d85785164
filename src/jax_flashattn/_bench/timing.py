"""Timing: the jitted loop a run times, interleaved rounds of the implementations of a case,
and the device's copy bandwidth for the decode yardstick. (Method: the package docstring.)"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import statistics
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashattn._bench.checks import DEFAULT_CHECK_BUDGET, ReferenceSlice, check_outputs
from jax_flashattn._bench.configs import Config, RUNNER_UNROLL
from jax_flashattn._bench.impls import Inputs, call_once, config_attention_fn, on_gpu
from jax_flashattn._bench.packed import Unavailable


@dataclasses.dataclass
class TimingSettings:
    target_s: float = 0.025      # wall time of one timed run
    # Decode rows: longer runs. A run carries a fixed cost beside its calls (dispatch, the
    # first launch, the wait for the last), a share of each short decode call; the decode rows
    # are judged against the card's bandwidth, where that share counts in full (the package
    # docstring, "decode runs"; docs/decisions/decode-benchmark-yardstick.md).
    decode_target_s: float = 0.1
    repeats: int = 15            # timed runs per implementation and case (at most)
    min_repeats: int = 7
    time_budget_s: float = 0.6   # rounds (one run of every implementation) fill about this
    n_sets: int = 2              # input sets the calls rotate through
    max_iters: int = 256
    decode_max_iters: int = 1024
    seed: int = 0
    check_budget: int = DEFAULT_CHECK_BUDGET
    # Rough device speed, only used to pick the trip count before anything has run.
    est_flops: float = 4e14
    est_bandwidth: float = 3e12

    @classmethod
    def for_backend(cls, **overrides):
        if not on_gpu():
            overrides = dict(dict(target_s=0.02, decode_target_s=0.02, repeats=3,
                                  min_repeats=2, time_budget_s=0.2,
                                  n_sets=2, est_flops=2e10, est_bandwidth=1e10), **overrides)
        return cls(**overrides)

    def iterations(self, cfg: Config, mode: str) -> int:
        per_call = max(cfg.flops(mode) / self.est_flops, cfg.io_bytes(mode) / self.est_bandwidth)
        decode = cfg.kind == "decode"
        target = self.decode_target_s if decode else self.target_s
        cap = self.decode_max_iters if decode else self.max_iters
        return max(1, min(cap, math.ceil(target / (per_call * self.n_sets))))


def build_runner(fn: Callable, mode: str, iters: int):
    """jit(sets, results, g, extras=None) -> (sets, results): `iters` rounds of one call per
    set (each passed `extras`, not donated); see the package docstring for why each call depends
    on the previous one, and how."""
    def run(sets, results, g, extras=None):
        origin = (0,) * sets[0][0].ndim
        one = (1,) * sets[0][0].ndim
        # Materialized before the loop: XLA 0.11 otherwise re-slices each first element from
        # the original q inside the unrolled loop's updates, which keeps that q alive and so
        # makes it copy q once per run instead of updating it in place
        # (docs/decisions/benchmark-timing-method.md).
        firsts = lax.optimization_barrier([lax.slice(q, origin, one) for q, _, _ in sets])

        def body(_, carry):
            sets, results = carry
            new_sets, new_results = [], []
            for (q, k, v), previous, first in zip(sets, results, firsts):
                r = sum(lax.slice(x, origin, one).astype(jnp.float32) for x in previous)
                r = r.astype(q.dtype)
                q = lax.dynamic_update_slice(q, jnp.where(r != r, r, first), origin)
                new_sets.append((q, k, v))
                new_results.append(call_once(fn, mode, q, k, v, g, extras))
            return new_sets, new_results
        return lax.fori_loop(0, iters, body, (sets, results), unroll=min(iters, RUNNER_UNROLL))
    return jax.jit(run, donate_argnums=(0, 1))


def _empty_results(fn, mode, inputs: Inputs):
    shapes = jax.eval_shape(functools.partial(call_once, fn, mode), *inputs.sets[0], inputs.g,
                            inputs.extras)
    return [tuple(jnp.zeros(s.shape, s.dtype) for s in shapes) for _ in inputs.sets]


def is_oom(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                   "OOM", "Resource exhausted"))


def short_message(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


class _Timed:
    """One implementation of one (config, mode), compiled, warmed up and checked: `run()`
    times one run (of `calls` calls) and returns its seconds; `per_call` collects the timed
    rounds' seconds per call and `record` the outcome."""

    def __init__(self, record: dict, compiled, results, calls: int):
        self.record, self.compiled, self.results = record, compiled, results
        self.calls, self.per_call = calls, []

    def run(self, inputs: Inputs) -> float:
        t0 = time.perf_counter()
        inputs.sets, self.results = self.compiled(inputs.sets, self.results, inputs.g,
                                                  inputs.extras)
        jax.block_until_ready(self.results)
        return time.perf_counter() - t0


def _fail(record: dict, e: BaseException, inputs: Inputs) -> dict:
    record.update(status="OOM" if is_oom(e) else "error", message=short_message(e))
    inputs.invalidate()
    gc.collect()  # a failed run's traceback may hold device buffers
    return record


def prepare(cfg: Config, impl: str, mode: str, inputs: Inputs, ref: ReferenceSlice | None,
            settings: TimingSettings) -> tuple[dict, _Timed | None]:
    """Compiles, warms up and checks one (config, implementation, mode). Never raises:
    failures come back as status "FAIL" (wrong result), "OOM" or "error", and an
    implementation that cannot run the case here as "unavailable", with a message, and no
    timer."""
    record = dict(impl=impl, mode=mode, status="error", message="")
    try:
        fn = config_attention_fn(impl, cfg)
        iters = settings.iterations(cfg, mode)
        calls = iters * inputs.n_sets
        runner = build_runner(fn, mode, iters)
        inputs.ensure_alive()
        t0 = time.perf_counter()
        results = _empty_results(fn, mode, inputs)
        lowered = runner.lower(inputs.sets, results, inputs.g, inputs.extras)
        record["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        record["compile_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        inputs.sets, results = compiled(inputs.sets, results, inputs.g, inputs.extras)
        jax.block_until_ready(results)
        warm_s = time.perf_counter() - t0
        record.update(warmup_s=warm_s, iterations=iters, calls=calls)

        if ref is None:
            raise RuntimeError("no reference to check against")
        t0 = time.perf_counter()
        verdict = check_outputs(cfg, results[0], ref)
        record["check_s"] = time.perf_counter() - t0
        record["check"] = dict(verdict.metrics, detail=verdict.detail)
        if not verdict.ok:
            record.update(status="FAIL", message=verdict.detail)
            return record, None
        return record, _Timed(record, compiled, results, calls)
    except Unavailable as e:  # raised before anything ran: the inputs are intact
        record.update(status="unavailable", message=str(e))
        return record, None
    except Exception as e:  # noqa: BLE001 - one config must never end the run
        return _fail(record, e, inputs), None


def time_interleaved(cfg: Config, mode: str, timers: Sequence[_Timed], inputs: Inputs,
                     settings: TimingSettings) -> None:
    """Times the prepared implementations of one (config, mode) in alternation, ABBA order
    (A B, then B A, ...), the same number of runs each; each record gets the median of its
    runs' seconds per call. In alternation they share whatever the GPU's clocks and
    neighbours do during the case, which back-to-back blocks of runs do not: a drift within
    the case would otherwise land in the ratio. One untimed round goes first: after the
    correctness checks (on the host, GPU idle) the first run comes out slower than the next
    ones (docs/decisions/benchmark-timing-method.md). The rounds fill `time_budget_s`, as
    that round's times allow, within [min_repeats, repeats] (repeats, at least 1, is a hard
    cap). Every implementation's program and results stay alive until the case ends. Never
    raises: an implementation that fails here is marked and dropped from the remaining
    rounds."""
    live = list(timers)

    def one_round(order, keep: bool) -> float:
        nonlocal live
        total = 0.0
        for timer in order:
            try:
                inputs.ensure_alive()
                seconds = timer.run(inputs)
            except Exception as e:  # noqa: BLE001
                timer.results = timer.compiled = None  # so that _fail's collection frees them
                _fail(timer.record, e, inputs)
                live = [t for t in live if t is not timer]
                continue
            total += seconds
            if keep:
                timer.per_call.append(seconds / timer.calls)
        return total

    fill = int(settings.time_budget_s / max(one_round(live, keep=False), 1e-9))
    repeats = max(1, min(settings.repeats, max(settings.min_repeats, fill)))
    for round_index in range(repeats):
        one_round(live if round_index % 2 == 0 else live[::-1], keep=True)
    for timer in timers:
        if timer in live:
            seconds = statistics.median(timer.per_call)
            timer.record.update(status="ok", seconds=seconds, times_s=timer.per_call,
                                repeats=len(timer.per_call),
                                tflops=cfg.flops(mode) / seconds / 1e12,
                                kv_tbps=cfg.kv_bytes() / seconds / 1e12)
        timer.compiled = timer.results = None


def copy_bandwidth(nbytes: int = 2 << 30, runs: int = 10) -> float | None:
    """The first device's copy bandwidth in bytes per second (bytes read plus bytes written;
    the median of `runs` cudaMemcpy device-to-device copies of `nbytes`), the yardstick of the
    decode rows: the decode kernels aim to read K/V at no less than 85% of the card's measured
    copy bandwidth, and H200s differ by a few percent in it, so the benchmark measures it in its
    own process (docs/decisions/decode-benchmark-yardstick.md). None where there is no CUDA
    device or no CUDA build, and with a warning where the copy fails (its 2 x `nbytes` do not
    fit beside XLA's memory pool, say)."""
    import jax_flashattn
    if not on_gpu() or not jax_flashattn.cuda_built():
        return None
    from jax_flashattn import _ffi
    try:
        median, _ = _ffi._ext.cuda_copy_bandwidth(jax.devices()[0].local_hardware_id, nbytes,
                                                  runs)
    except RuntimeError as e:
        warnings.warn(f"device copy bandwidth not measured: {e}", stacklevel=2)
        return None
    return median
