"""The benchmark's decode preset on the CPU at tiny size: its grid (with the serving bias,
the soft-cap, the paged and the e4m3 rows), its copy-bandwidth yardstick, tables and script."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashattn import _bench
from helpers import load_benchmark_script


def _load_bench_script():
    return load_benchmark_script("bench_attention")


def test_bench_script_decode_smoke(capsys):
    bench = _load_bench_script()
    status = bench.main(["--decode", "--seqlen", "2", "--kv-len", "64", "--dtype", "bf16",
                         "--impls", "ours", "--no-progress", "--repeats", "2",
                         "--copy-bytes", str(64 << 20)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    if _bench.copy_bandwidth(1 << 20) is None:
        assert "| T | S | ours TB/s | ours us |" in printed and "ours/copy" not in printed
    else:
        assert "| T | S | ours TB/s | ours us | ours/copy |" in printed
        assert "device copy bandwidth (cudaMemcpy of 0.0625 GiB" in printed


def test_bench_script_decode_soft_cap():
    """--soft-cap caps every row of the decode preset, and only that preset."""
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--decode", "--soft-cap", "30"]))
    assert configs and {c.soft_cap for c in configs} == {30.0}
    assert {c.soft_cap for c in bench.build_configs(bench.parse_args(["--decode"]))} == {None}
    with pytest.raises(SystemExit):
        bench.parse_args(["--soft-cap", "30"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--decode", "--soft-cap", "0"])
    record = dict(_bench.config_record(configs[0]), impl="ours", mode="fwd", status="ok",
                  seconds=1e-3, kv_tbps=3.4)
    (title, _), = _bench.markdown_tables([record], ["ours"])
    assert "logits soft-capped at 30;" in title


def test_bench_script_decode_bias():
    """--bias gives every row of the decode preset a bias [B, N, 1, S], and only that preset."""
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--decode", "--bias", "--seqlen", "1,8"]))
    assert [c.bias_shape for c in configs] == [(8, 32, 1, 65536)] * 4
    assert {c.bias_shape for c in bench.build_configs(bench.parse_args(["--decode"]))} == {None}
    with pytest.raises(SystemExit):
        bench.parse_args(["--bias"])
    record = dict(_bench.config_record(configs[0]), impl="ours", mode="fwd", status="ok",
                  seconds=1e-3, kv_tbps=3.4)
    (title, _), = _bench.markdown_tables([record], ["ours"])
    assert ", bias [B,N,1,S];" in title


def test_decode_table_divides_our_rate_by_the_copy_bandwidth():
    cfg = _bench.decode_grid(("bf16",), (1,), 256)[0]
    record = dict(_bench.config_record(cfg), impl="ours", mode="fwd", status="ok",
                  seconds=1e-3, kv_tbps=3.4)
    (_, table), = _bench.markdown_tables([record], ["ours"], copy_tbps=4.0)
    assert table.splitlines()[0] == "| T | S | ours TB/s | ours us | ours/copy |"
    assert table.splitlines()[2] == "| 1 | 256 | 3.4 | 1000 | 0.85 |"
    (_, table), = _bench.markdown_tables([record], ["ours"])
    assert "copy" not in table


def test_copy_bandwidth_warns_and_gives_none_when_the_copy_fails(monkeypatch):
    import types
    import jax_flashattn
    from jax_flashattn import _ffi

    def fail(device, nbytes, runs):
        raise RuntimeError("copy bandwidth: cudaMalloc: out of memory")

    monkeypatch.setattr(_bench.timing, "on_gpu", lambda: True)
    monkeypatch.setattr(jax_flashattn, "cuda_built", lambda: True)
    monkeypatch.setattr(_ffi, "_ext", types.SimpleNamespace(cuda_copy_bandwidth=fail))
    with pytest.warns(UserWarning, match="not measured: copy bandwidth: cudaMalloc"):
        assert _bench.copy_bandwidth(1 << 20) is None


@pytest.mark.gpu
def test_copy_bandwidth_on_the_device():
    from jax_flashattn import _ffi
    device = jax.devices()[0].local_hardware_id
    median, best = _ffi._ext.cuda_copy_bandwidth(device, 256 << 20, 5)
    # Read plus written bytes per second: far above PCIe, below any HBM there is.
    assert 1e11 < median <= best < 2e13
    with pytest.raises(ValueError, match="positive"):
        _ffi._ext.cuda_copy_bandwidth(device, 0, 5)
    with pytest.raises(RuntimeError, match="cudaSetDevice"):
        _ffi._ext.cuda_copy_bandwidth(jax.device_count() + 64, 1 << 20, 1)

def test_bench_script_decode_paged():
    """--paged P,..: each T gets its plain row, a contiguous row causal at the bottom right
    with the lengths a paged call passes, and that row through a paged cache of each size;
    only with --decode, not with --bias, page sizes among paged_attention's."""
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--decode", "--paged", "16,256",
                                                    "--seqlen", "1,8", "--dtype", "bf16"]))
    assert [(c.seqlen_q, c.variant, c.page_size, c.causal, c.bottom_right) for c in configs] == [
        (t, variant, size, causal, causal) for t in (1, 8)
        for variant, size, causal in (("", None, False), ("contiguous", None, True),
                                      ("paged 16", 16, True), ("paged 256", 256, True))]
    s = configs[0].seqlen_k
    assert [c.kv_lens for c in configs[1:4]] == [(s,) * configs[0].batch] * 3
    for argv in (["--paged", "16"], ["--decode", "--paged", "16", "--bias"],
                 ["--decode", "--paged", "8"], ["--decode", "--paged", "48"],
                 ["--decode", "--paged", "x"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_paged_cache_holds_the_sequences_in_its_pages(rng):
    """The paged rows' inputs: page table entry (b, j) holds tokens [j P, (j + 1) P) of
    sequence b, the last page zero past S, every page of the pool used once."""
    from jax_flashattn._bench import impls
    k = jnp.asarray(rng.standard_normal((3, 50, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 50, 2, 4)), jnp.float32)
    extras = impls._paged_cache(k, v, 16, seed=5)
    table = np.asarray(extras["page_table"])
    assert table.shape == (3, 4) and sorted(table.ravel()) == list(range(12))
    for name, x in (("key_cache", k), ("value_cache", v)):
        pool = np.asarray(extras[name])
        for b in range(3):
            tokens = pool[table[b]].reshape(64, 2, 4)
            np.testing.assert_array_equal(tokens[:50], np.asarray(x[b]))
            assert not tokens[50:].any()


def test_bench_script_decode_paged_smoke(capsys):
    """The paged rows pass the reference check and the table sets them against the
    contiguous row."""
    bench = _load_bench_script()
    status = bench.main(["--decode", "--seqlen", "2", "--kv-len", "40", "--dtype", "bf16",
                         "--impls", "ours", "--no-progress", "--repeats", "2", "--paged", "16",
                         "--copy-bytes", str(16 << 20)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "| T | S | variant | ours TB/s | ours us |" in printed
    assert "ours/contiguous |" in printed
    row = next(line for line in printed.splitlines() if "| paged 16 |" in line)
    assert row.split("|")[-2].strip() not in ("-", "")


def test_decode_grid_fp8_adds_an_e4m3_row_after_each_plain_row():
    """fp8: each T's plain row is followed by the same call on e4m3 K/V, which reads one byte
    per K/V element (half the plain row's bf16 bytes); it combines with the page sizes."""
    configs = _bench.decode_grid(("bf16",), (1, 8), 256, (16,), fp8=True)
    assert [(c.seqlen_q, c.variant, c.kv_fp8) for c in configs] == [
        (t, variant, variant == "e4m3") for t in (1, 8)
        for variant in ("", "e4m3", "contiguous", "paged 16")]
    plain, e4m3 = configs[:2]
    assert e4m3 == dataclasses.replace(plain, kv_fp8=True, variant="e4m3")
    assert e4m3.kv_bytes() == plain.kv_bytes() // 2 == 8 * 256 * 8 * 128 * 2
    assert not any(c.kv_fp8 for c in _bench.decode_grid(("bf16",), (1,), 256, (16,)))


def test_bench_script_decode_fp8():
    """--fp8 adds the e4m3 rows, only with --decode."""
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--decode", "--fp8", "--seqlen", "1,8",
                                                    "--dtype", "bf16"]))
    assert [(c.seqlen_q, c.variant, c.kv_fp8) for c in configs] == [
        (1, "", False), (1, "e4m3", True), (8, "", False), (8, "e4m3", True)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--fp8"])


def test_decode_table_sets_the_e4m3_row_against_the_plain_row():
    """ours/bf16 cache: the e4m3 row's calls per second over the plain row's of its T; "-" on
    the other rows, and no such column without an e4m3 row."""
    configs = _bench.decode_grid(("bf16",), (1, 8), 256, fp8=True)
    seconds = {(1, ""): 2e-3, (1, "e4m3"): 1.25e-3, (8, ""): 3e-3, (8, "e4m3"): 2e-3}
    records = [dict(_bench.config_record(c), impl="ours", mode="fwd", status="ok",
                    seconds=seconds[c.seqlen_q, c.variant],
                    kv_tbps=c.kv_bytes() / seconds[c.seqlen_q, c.variant] / 1e12)
               for c in configs]
    (title, table), = _bench.markdown_tables(records, ["ours"])
    assert "; ours/bf16 cache: an e4m3 row's calls per second over the plain row's" in title
    lines = table.splitlines()
    assert lines[0] == "| T | S | variant | ours TB/s | ours us | ours/bf16 cache |"
    assert [line.split("|")[3:4] + line.split("|")[-2:-1] for line in lines[2:]] == [
        [" plain ", " - "], [" e4m3 ", " 1.60 "], [" plain ", " - "], [" e4m3 ", " 1.50 "]]
    (_, table), = _bench.markdown_tables(records[:1], ["ours"])
    assert "cache" not in table


def test_e4m3_row_calls_ours_on_e4m3_kv_and_passes_the_gate():
    """An e4m3 row's extras are set 0's k and v as e4m3 with [B, K] descales; ours on them
    matches the plain call to e4m3's precision and passes the gate (its reference reads the
    e4m3 values), and the other implementations are unavailable."""
    from jax_flashattn._bench import checks, impls
    plain = _bench.Config(2, 2, 40, 4, 2, 32, "bf16", False, kind="decode")
    cfg = dataclasses.replace(plain, kv_fp8=True, variant="e4m3")
    inputs = _bench.Inputs(cfg, 1)
    extras = inputs.extras
    assert set(extras) == set(impls.FP8_EXTRAS)
    assert extras["key_e4m3"].dtype == jnp.float8_e4m3fn
    assert extras["descale_v"].shape == (2, 2) and extras["descale_v"].dtype == jnp.float32
    q, k, v = inputs.sets[0]
    out = impls.config_attention_fn("ours", cfg)(q, k, v, **extras)
    expected = impls.config_attention_fn("ours", plain)(q, k, v)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert np.allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=0.1)
    ref = checks.reference_slice(cfg, inputs, with_grads=False)
    verdict = checks.check_outputs(cfg, (out,), ref)
    assert verdict.ok, verdict.detail
    with pytest.raises(_bench.Unavailable):
        impls.config_attention_fn("xla", cfg)


def test_bench_script_decode_fp8_smoke(capsys):
    """The e4m3 rows pass the reference check and the table sets them against the plain
    row."""
    bench = _load_bench_script()
    status = bench.main(["--decode", "--seqlen", "2", "--kv-len", "40", "--dtype", "bf16",
                         "--impls", "ours", "--no-progress", "--repeats", "2", "--fp8",
                         "--copy-bytes", str(16 << 20)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "ours/bf16 cache |" in printed
    row = next(line for line in printed.splitlines() if "| e4m3 |" in line)
    assert row.split("|")[-2].strip() not in ("-", "")
