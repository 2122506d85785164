"""The benchmark's decode preset on the CPU at tiny size: its grid (with the serving bias,
the soft-cap and the paged rows), its copy-bandwidth yardstick, tables and script."""

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
