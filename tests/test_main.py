"""The `python -m jax_flashattn` checks at tiny size, and a CPU smoke test of the benchmark:
its verdicts, FLOP counts, timed loop, failures and progress, the standard grid's script and
the script's arguments (its decode, variants and packed presets: test_bench_presets.py)."""

import dataclasses
import importlib.util
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashattn import _bench
from jax_flashattn import __main__ as main_job
from helpers import load_benchmark_script


def _load_bench_script():
    return load_benchmark_script("bench_attention")


def test_main_checks_pass_at_tiny_size():
    results = main_job.run_checks("tiny", out=None)
    assert len(results) == len(main_job.check_specs("tiny"))
    failed = [f"{spec.name}: {verdict.detail}" for spec, verdict in results if not verdict.ok]
    assert not failed, "\n".join(failed)


def test_main_says_what_the_cpu_path_is_for(capsys):
    assert main_job.main(["--skip-checks", "--skip-bench"]) == 0
    printed = capsys.readouterr().out
    assert (main_job.CPU_NOTE in printed) == (jax.default_backend() != "gpu")


def test_main_check_fails_on_a_wrong_kernel(monkeypatch):
    import jax_flashattn
    real = jax_flashattn.attention
    monkeypatch.setattr(jax_flashattn, "attention", lambda *a, **k: real(*a, **k) * 1.01)
    spec = main_job.check_specs("tiny")[0]
    assert not main_job.run_check(spec).ok


def test_forward_verdict_rejects_nan_and_one_bad_row():
    rng = np.random.default_rng(0)
    exact = rng.standard_normal((1, 64, 2, 16)).astype(np.float32)
    rounded = jnp.asarray(exact, jnp.bfloat16)
    assert _bench.forward_verdict(rounded, exact, rounded, "bf16").ok
    assert not _bench.forward_verdict(rounded.at[0, 0, 0, 0].set(jnp.nan), exact, rounded,
                                      "bf16").ok
    assert not _bench.forward_verdict(rounded.at[0, 5].set(0), exact, rounded, "bf16").ok
    ref = dict(dq=exact)
    assert _bench.grad_verdict(dict(dq=rounded), ref, "bf16").ok
    assert not _bench.grad_verdict(dict(dq=rounded.at[0, 5].set(0)), ref, "bf16").ok


def test_flops_and_grid():
    grid = _bench.standard_grid()
    assert len(grid) == 2 * 3 * 6 * 2
    assert all(c.batch * c.seqlen_q == 16384 and c.num_heads * c.head_dim == 2048 for c in grid)
    full = _bench.Config(2, 512, 512, 16, 16, 128, "bf16", False)
    assert full.flops() == 4 * 2 * 16 * 512 * 512 * 128
    assert dataclasses.replace(full, causal=True).flops() == full.flops() / 2
    assert full.flops("fwdbwd") == 3.5 * full.flops()
    decode = _bench.decode_grid(("bf16",), (1,))[0]
    assert decode.kv_bytes() == 2 * 8 * 65536 * 8 * 128 * 2


def test_decode_runs_take_their_own_length():
    settings = _bench.TimingSettings(target_s=0.01, decode_target_s=0.04, max_iters=10**6,
                                     decode_max_iters=10**6, est_flops=1e30, est_bandwidth=1e12)
    decode = _bench.Config(1, 1, 2 ** 16, 1, 1, 8, "bf16", False, kind="decode")
    standard = dataclasses.replace(decode, kind="standard")
    assert settings.iterations(decode, "fwd") == pytest.approx(
        4 * settings.iterations(standard, "fwd"), abs=4)  # each rounded up
    assert _bench.TimingSettings(decode_max_iters=3).iterations(decode, "fwd") == 3


def test_timed_loop_keeps_every_backward():
    """Every round of the unrolled timed loop runs its backward: each call's gradients feed the
    next call, so XLA drops none of them (it once kept 2 of 16 backward calls per iteration,
    the last round's, and forward+backward read far past the card's peak)."""
    cfg = _bench.Config(1, 64, 64, 2, 2, 32, "bf16", False)
    inputs = _bench.Inputs(cfg, 2)
    fn = _bench.attention_fn("ours", cfg.causal)
    results = _bench.timing._empty_results(fn, "fwdbwd", inputs)
    iters = _bench.RUNNER_UNROLL
    hlo = _bench.build_runner(fn, "fwdbwd", iters).lower(inputs.sets, results,
                                                         inputs.g).compile().as_text()
    calls = iters * len(inputs.sets)
    assert hlo.count('custom_call_target="jax_flashattn_bwd"') == calls
    assert hlo.count('custom_call_target="jax_flashattn_fwd"') == calls


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_timed_loop_updates_q_in_place(mode):
    # The dependency between calls rewrites one element of q: the compiled loop must not copy
    # q for it (a copy of q per call once cost more than a short attention call).
    cfg = _bench.Config(2, 256, 256, 4, 4, 64, "bf16", True)
    inputs = _bench.Inputs(cfg, 2)
    fn = _bench.attention_fn("ours", cfg.causal)
    results = _bench.timing._empty_results(fn, mode, inputs)
    compiled = _bench.build_runner(fn, mode, 12).lower(inputs.sets, results, inputs.g).compile()
    q_bytes = inputs.sets[0][0].nbytes
    # Forward only: the backward's own workspaces (dq accumulator, delta) are temporaries of
    # q's size and more, so the bound says nothing there; both modes check the results.
    if mode == "fwd":
        assert compiled.memory_analysis().temp_size_in_bytes < q_bytes
    sets, results = compiled(inputs.sets, results, inputs.g)
    reference = jax.jit(fn)(*_bench.Inputs(cfg, 2).sets[1])
    assert jnp.array_equal(results[1][0], reference)


def test_benchmark_marks_a_wrong_implementation_fail(monkeypatch):
    real = _bench.attention_fn

    def broken(impl, causal, *options):
        fn = real(impl, causal, *options)
        return (lambda q, k, v: fn(q, k, v) + 1) if impl == "ours" else fn

    monkeypatch.setattr(_bench.impls, "attention_fn", broken)
    cfg = _bench.Config(1, 32, 32, 2, 2, 32, "bf16", True)
    records = _bench.run_benchmark([cfg], ["ours"], ["fwd"], progress=False)
    assert [r["status"] for r in records] == ["FAIL"]
    assert "seconds" not in records[0]
    assert _bench.failures(records)


def test_benchmark_times_implementations_in_alternation(monkeypatch):
    # A case's implementations run one untimed round, then are timed in ABBA rounds, the
    # same number of runs each, so that a drift during the case reaches both alike; each
    # record's median is of its own runs.
    order = []
    real_run = _bench.timing._Timed.run

    def logged(self, inputs):
        order.append(self.record["impl"])
        return real_run(self, inputs)

    monkeypatch.setattr(_bench.timing._Timed, "run", logged)
    settings = _bench.TimingSettings.for_backend(repeats=4, min_repeats=4, target_s=0.001,
                                                 time_budget_s=0.0)
    cfg = _bench.Config(1, 32, 32, 2, 2, 32, "bf16", False)
    records = _bench.run_benchmark([cfg], ["ours", "xla"], ["fwd"], settings, progress=False)
    assert order == ["ours", "xla"] + ["ours", "xla", "xla", "ours"] * 2  # untimed round first
    for r in records:
        assert r["status"] == "ok" and r["repeats"] == 4 and len(r["times_s"]) == 4
        assert r["seconds"] == statistics.median(r["times_s"])


def test_benchmark_survives_an_implementation_failing_mid_case(monkeypatch):
    # xla fails on its third run, after donating the inputs: it is marked, dropped from the
    # remaining rounds, and ours is still timed on redrawn inputs.
    real_run = _bench.timing._Timed.run
    runs = {"ours": 0, "xla": 0}

    def flaky(self, inputs):
        impl = self.record["impl"]
        runs[impl] += 1
        if impl == "xla" and runs[impl] == 3:
            inputs.sets = None
            raise RuntimeError("injected failure")
        return real_run(self, inputs)

    monkeypatch.setattr(_bench.timing._Timed, "run", flaky)
    settings = _bench.TimingSettings.for_backend(repeats=4, min_repeats=4, target_s=0.001,
                                                 time_budget_s=0.0)
    cfg = _bench.Config(1, 32, 32, 2, 2, 32, "bf16", False)
    ours, xla = _bench.run_benchmark([cfg], ["ours", "xla"], ["fwd"], settings, progress=False)
    assert ours["status"] == "ok" and ours["repeats"] == 4
    assert xla["status"] == "error" and "injected failure" in xla["message"]
    assert "seconds" not in xla


def test_benchmark_progress_counts_to_its_total(capsys):
    """The plain progress lines (stderr not a terminal) number every step, timing included,
    from 1 to the total, never past it."""
    settings = _bench.TimingSettings.for_backend(repeats=2, min_repeats=2, target_s=0.001,
                                                 time_budget_s=0.0)
    configs = [_bench.Config(1, 32, 32, 2, 2, 32, "bf16", causal) for causal in (False, True)]
    _bench.run_benchmark(configs, ["ours", "xla"], ["fwd"], settings)
    steps = [line[1:].split()[0].split("/") for line in capsys.readouterr().err.splitlines()
             if line.startswith("[")]
    assert [int(done) for done, _ in steps] == list(range(1, 7))
    assert {int(total) for _, total in steps} == {6}


def test_bench_script_smoke(tmp_path, capsys):
    bench = _load_bench_script()
    out = tmp_path / "bench"
    status = bench.main(["--seqlen", "128", "--head-dim", "64", "--tokens", "256",
                         "--hidden", "128", "--dtype", "bf16", "--impls", "ours,xla",
                         "--out", str(out), "--no-progress", "--repeats", "2"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "| T | H | causal | ours TFLOP/s | xla TFLOP/s | ours/xla |" in printed
    assert "device: " in printed and "command: " in printed
    report = json.loads((out / "results.json").read_text())
    assert {r["status"] for r in report["results"]} == {"ok"}
    assert {(r["impl"], r["causal"]) for r in report["results"]} == {
        ("ours", False), ("ours", True), ("xla", False), ("xla", True)}
    assert "ours/xla" in (out / "results.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "standard_bf16_fwd.png").stat().st_size > 0


@pytest.mark.parametrize("argv, expected", [
    (["--quick"], dict(dtype=["bf16"], head_dim=[128], seqlen=[1024, 4096, 16384])),
    (["--quick", "--seqlen", "512"], dict(seqlen=[512])),
    ([], dict(dtype=["bf16", "fp16"], causal="both", mode="fwd")),
    (["--variants"], dict(variants=True, dtype=["bf16"], head_dim=[128], seqlen=[4096])),
    (["--variants", "--seqlen", "256", "--mode", "both"], dict(seqlen=[256], mode="both")),
    ([], dict(tokens=16384, hidden=2048, impls=["ours", "cudnn", "xla"])),
    (["--packed"], dict(packed=True, dtype=["bf16"], head_dim=[128], seqlen=[8192, 32768],
                        tokens=32768, hidden=2048, impls=["ours", "cudnn", "cudnn-packed"])),
    (["--packed", "--seqlen", "256", "--tokens", "512", "--impls", "ours"],
     dict(seqlen=[256], tokens=512, impls=["ours"])),
])
def test_bench_script_arguments(argv, expected):
    args = _load_bench_script().parse_args(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value
