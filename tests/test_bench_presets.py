"""The benchmark's variants and packed presets on the CPU at tiny size: their grids, FLOP
counts, gates, tables and scripts (the decode preset: test_bench_decode.py)."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashattn import _bench, reference
from helpers import load_benchmark_script


def _load_bench_script():
    return load_benchmark_script("bench_attention")


# --------------------------------------------------------------------------- variants preset


def test_bench_script_variants_preset_and_exclusive_with_decode():
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--variants"]))
    assert [c.variant for c in configs] == ["full", "causal", "window 1024", "lengths",
                                            "GQA 16/4", "bias [1,N,T,S]", "bias [B,1,T,S]",
                                            "bias [B,N,T,S]", "mask [B,1,T,S]",
                                            "segment ids", "segment ids, causal",
                                            "soft-cap 50", "soft-cap 50, causal",
                                            "sinks", "sinks, causal", "ALiBi", "ALiBi, causal",
                                            "prefill 256, bottom-right"]
    assert [c.causal for c in configs[-9:]] == [False, True] * 4 + [True]
    assert [c.soft_cap for c in configs] == [None] * 11 + [50.0, 50.0] + [None] * 5
    assert [c.sinks for c in configs] == [False] * 13 + [True, True] + [False] * 3
    assert [c.alibi for c in configs] == [False] * 15 + [True, True, False]
    assert [(c.bottom_right, c.seqlen_q, c.seqlen_k) for c in configs][-2:] == [
        (False, 4096, 4096), (True, 256, 4096)]
    rows = bench.build_configs(bench.parse_args(["--variants", "--rows", "full,causal,soft-cap"]))
    assert [c.variant for c in rows] == ["full", "causal", "soft-cap 50", "soft-cap 50, causal"]
    with pytest.raises(SystemExit):  # --rows without the preset it picks from
        bench.parse_args(["--rows", "full"])
    with pytest.raises(SystemExit, match="no variants row starts with"):
        bench.build_configs(bench.parse_args(["--variants", "--rows", "full,sof-cap"]))
    # A name's own commas, inside its brackets, do not split the list.
    rows = bench.build_configs(bench.parse_args(["--variants", "--rows", "bias"]))
    assert [c.variant for c in rows] == ["bias [1,N,T,S]", "bias [B,1,T,S]", "bias [B,N,T,S]"]
    rows = bench.build_configs(bench.parse_args(["--variants", "--rows",
                                                 "full,bias [B,N,T,S],mask [B,1,T,S]"]))
    assert [c.variant for c in rows] == ["full", "bias [B,N,T,S]", "mask [B,1,T,S]"]
    # --tokens sets B = tokens / T: one 131072-token sequence, or two entries of 4096.
    rows = bench.build_configs(bench.parse_args(["--variants", "--rows", "GQA", "--seqlen",
                                                 "131072", "--tokens", "131072"]))
    assert [(c.batch, c.seqlen_q, c.seqlen_k, c.num_heads, c.num_kv_heads, c.causal)
            for c in rows] == [(1, 131072, 131072, 16, 4, True)]
    rows = bench.build_configs(bench.parse_args(["--variants", "--rows", "lengths,bias [B,1,T,S]",
                                                 "--tokens", "8192"]))
    assert [(c.batch, c.q_lens, c.bias_shape) for c in rows] == [
        (2, (4096, 2048), None), (2, None, (2, 1, 4096, 4096))]
    assert all(c.soft_cap is None for c in _bench.variants_grid(soft_cap=None))
    assert {(c.dtype, c.batch, c.seqlen_q, c.seqlen_k, c.num_heads, c.head_dim)
            for c in configs[:-1]} == {("bf16", 4, 4096, 4096, 16, 128)}
    by_name = {c.variant: c for c in configs}
    assert by_name["window 1024"].window == (1024, 0) and by_name["window 1024"].causal
    assert by_name["lengths"].kv_lens == by_name["lengths"].q_lens == (4096, 3072, 2048, 1024)
    assert by_name["GQA 16/4"].num_kv_heads == 4 and by_name["GQA 16/4"].causal
    assert by_name["bias [1,N,T,S]"].bias_shape == (1, 16, 4096, 4096)
    assert by_name["bias [B,1,T,S]"].bias_shape == (4, 1, 4096, 4096)
    assert by_name["bias [B,N,T,S]"].bias_shape == (4, 16, 4096, 4096)
    for name in ("bias [1,N,T,S]", "bias [B,1,T,S]", "bias [B,N,T,S]"):
        cfg = by_name[name]
        assert not cfg.causal and not cfg.restricted and cfg.flops() == by_name["full"].flops()
        assert cfg.term_bytes() == 2 * np.prod(cfg.bias_shape)  # bf16, as q
    assert by_name["mask [B,1,T,S]"].term_bytes() == 4 * 4096 * 4096
    assert by_name["full"].term_bytes() == by_name["segment ids"].term_bytes() == 0
    assert by_name["segment ids"].segment_docs == by_name["mask [B,1,T,S]"].mask_docs
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "--decode"])


def _brute_force_pairs(cfg) -> int:
    """The visible (t, s) pairs of one head, summed over the batch, from the reference's own
    visibility mask."""
    mask = None
    docs = cfg.mask_docs if cfg.mask_docs is not None else cfg.segment_docs
    if docs is not None:
        ids = np.stack([_bench.document_ids(d, cfg.mask_length) for d in docs])
        mask = jnp.asarray(ids[:, None, :cfg.seqlen_q, None] == ids[:, None, None, :cfg.seqlen_k])
    lens = [None if x is None else jnp.asarray(x, jnp.int32) for x in (cfg.q_lens, cfg.kv_lens)]
    keep = reference.visibility(cfg.seqlen_q, cfg.seqlen_k, batch=cfg.batch,
                                is_causal=cfg.causal, window=cfg.window, q_lens=lens[0],
                                kv_lens=lens[1], mask=mask,
                                shift=cfg.diagonal_shift if cfg.bottom_right else 0)
    return int(jnp.sum(keep, dtype=jnp.int32))


def test_variants_flops_count_the_visible_pairs():
    # The preset's restricted rows, at full size, and odd shapes (T != S, a right window,
    # lengths with causal, uneven documents), against a count over the reference's mask.
    preset = [c for c in _bench.variants_grid() if c.restricted]
    assert [c.variant for c in preset] == ["window 1024", "lengths", "mask [B,1,T,S]",
                                           "segment ids", "segment ids, causal",
                                           "prefill 256, bottom-right"]
    odd = [_bench.Config(2, 48, 80, 2, 2, 16, "bf16", True, kind="variants", window=(7, 3),
                         q_lens=(48, 20), kv_lens=(80, 33)),
           _bench.Config(2, 48, 80, 2, 2, 16, "bf16", False, kind="variants", window=(5, 9)),
           _bench.Config(3, 40, 56, 2, 2, 16, "bf16", False, kind="variants",
                         mask_docs=(1, 3, 5), q_lens=(40, 17, 3), kv_lens=(1, 56, 30)),
           _bench.Config(2, 37, 37, 2, 2, 16, "bf16", True, kind="variants", mask_docs=(2, 7)),
           _bench.Config(2, 37, 50, 2, 2, 16, "bf16", True, kind="variants",
                         segment_docs=(3, 5))]
    for cfg in preset + odd:
        pairs = _brute_force_pairs(cfg)
        assert cfg.visible_pairs() == pairs, cfg.label()
        forward = 4 * cfg.num_heads * cfg.head_dim * pairs
        assert cfg.flops("fwd") == forward and cfg.flops("fwdbwd") == 3.5 * forward
    window = next(c for c in preset if c.window)
    # Closed form: row t sees min(t, 1024) + 1 keys.
    t = np.arange(4096)
    assert window.visible_pairs() == 4 * np.sum(np.minimum(t, 1024) + 1)
    # Rows without a restriction keep the standard grid's counts (causal: T*S/2).
    for cfg in _bench.variants_grid():
        if not cfg.restricted:
            assert cfg.flops() == _bench.attention_flops(cfg.batch, cfg.num_heads, cfg.seqlen_q,
                                                         cfg.seqlen_k, cfg.head_dim, cfg.causal)


def _tiny_variants():
    # T = 64, B = 4, N = 4 (K = 1 for GQA), H = 16: window 16, lengths 64, 48, 32, 16; a cap of
    # 1 that bends the logits (standard normal here), so that a dropped cap fails the check.
    return _bench.variants_grid(seqlens=(64,), head_dims=(16,), batch=4, hidden=64,
                                soft_cap=1.0)


_TINY_SETTINGS = dict(repeats=1, min_repeats=1, target_s=1e-4, time_budget_s=0.0)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_variants_grid_runs_and_passes_the_gate(monkeypatch, mode):
    # The forward check takes 8 + 8 of the 64 query rows: every option is sliced by rows.
    monkeypatch.setattr(_bench.checks, "FORWARD_CHECK_ROWS", 16)
    configs = _tiny_variants()
    settings = _bench.TimingSettings.for_backend(**_TINY_SETTINGS)
    records = _bench.run_benchmark(configs, ["ours", "xla"], [mode], settings, progress=False)
    # jax.nn has no soft-capping and no sinks: xla's rows of those are reported, not run.
    capped = {(c.variant, "xla") for c in configs if c.soft_cap is not None or c.sinks}
    assert capped and all(r["status"] == "unavailable" for r in records
                          if (r["variant"], r["impl"]) in capped)
    bad = [f"{r['variant']} {r['impl']}: {r['status']} {r.get('message', '')}"
           for r in records if r["status"] != "ok" and (r["variant"], r["impl"]) not in capped]
    assert not bad, "\n".join(bad)
    assert len(records) == 2 * len(configs)
    for cfg, r in zip([c for c in configs for _ in range(2)], records):
        assert r["variant"] == cfg.variant and r["flops"] == cfg.flops(mode)
        assert r["visible"] == cfg.visible_pairs() / (4 * cfg.seqlen_q * cfg.seqlen_k)
        if r["status"] == "ok":
            assert r["tflops"] == pytest.approx(cfg.flops(mode) / r["seconds"] / 1e12)
    (title, table), = _bench.markdown_tables(records, ["ours", "xla"])
    assert "visible logits only" in title
    lines = table.splitlines()
    assert lines[0] == ("| T | variant | causal | visible | ours TFLOP/s | xla TFLOP/s | "
                        "ours ms | xla ms | ours/xla | ours/plain | term GB/s |")
    assert [line.split(" | ")[1] for line in lines[2:]] == [c.variant for c in configs]
    assert lines[4].startswith("| 64 | window 16 | yes | 0.23 |")  # sum_t min(t, 16) + 1
    assert lines[4].endswith(" | - | - |")
    ours = {r["variant"]: r for r in records if r["impl"] == "ours"}
    for line in lines[2:]:
        cells = line.strip("| ").split(" | ")
        if cells[1].startswith(("bias", "mask")):
            assert cells[-2] == f"{ours['full']['seconds'] / ours[cells[1]]['seconds']:.2f}"
        else:
            assert cells[-2:] == ["-", "-"]


def _variants_record(cfg, impl, mode, seconds):
    """A record as the driver makes it, timed at `seconds` per call (None: a FAIL)."""
    if seconds is None:
        return dict(_bench.config_record(cfg), impl=impl, mode=mode, status="FAIL",
                    message="wrong")
    return dict(_bench.config_record(cfg), impl=impl, mode=mode, status="ok", seconds=seconds,
                tflops=cfg.flops(mode) / seconds / 1e12)


def test_variants_table_sets_bias_and_mask_rows_against_our_plain_row():
    """ours/plain is our time of the full row at the same T and mode over the row's own; term
    GB/s the bias's (or mask's) bytes as passed over our time; "-" where either is missing."""
    configs = [c for c in _bench.variants_grid(seqlens=(2048, 8192))
               if c.variant in ("full", "causal", "bias [1,N,T,S]", "bias [B,1,T,S]",
                                "bias [B,N,T,S]", "mask [B,1,T,S]", "segment ids")]
    # Our times: the plain row 1 ms at T = 2048, 8 ms at 8192, and the backward 3x; each
    # bias or mask row a fixed multiple of that. cuDNN's: all 2 ms.
    slower = {"causal": 0.5, "bias [1,N,T,S]": 1.25, "bias [B,1,T,S]": 2.0,
              "bias [B,N,T,S]": 4.0, "mask [B,1,T,S]": 1.6, "segment ids": 1.1}
    records = []
    for mode, factor in (("fwd", 1.0), ("fwdbwd", 3.0)):
        for cfg in configs:
            plain = (1e-3 if cfg.seqlen_q == 2048 else 8e-3) * factor
            records += [_variants_record(cfg, "ours", mode, plain * slower.get(cfg.variant, 1)),
                        _variants_record(cfg, "cudnn", mode, 2e-3)]
    tables = _bench.markdown_tables(records, ["ours", "cudnn"])
    assert len(tables) == 2
    for (title, table), factor in zip(tables, (1.0, 3.0)):
        assert "ours/plain: our time of the full row over this row's" in title
        lines = table.splitlines()
        assert lines[0] == ("| T | variant | causal | visible | ours TFLOP/s | cudnn TFLOP/s | "
                            "ours ms | cudnn ms | ours/cudnn | ours/plain | term GB/s |")
        cells = {(int(c[0]), c[1]): c[-2:] for c in
                 (line.strip("| ").split(" | ") for line in lines[2:])}
        for t, plain in ((2048, 1e-3 * factor), (8192, 8e-3 * factor)):
            for variant in ("full", "causal", "segment ids"):
                assert cells[(t, variant)] == ["-", "-"]
            # B = 4, N = 16, bf16: 2 bytes an element of the bias, 1 of the mask.
            for variant, elements, itemsize in (("bias [1,N,T,S]", 16 * t * t, 2),
                                                ("bias [B,1,T,S]", 4 * t * t, 2),
                                                ("bias [B,N,T,S]", 4 * 16 * t * t, 2),
                                                ("mask [B,1,T,S]", 4 * t * t, 1)):
                ratio, rate = cells[(t, variant)]
                assert ratio == f"{1 / slower[variant]:.2f}"
                seconds = plain * slower[variant]
                assert float(rate) == pytest.approx(elements * itemsize / seconds / 1e9,
                                                    rel=6e-3)  # 3 digits
    # B = 4, N = 16, T = 2048, 4 ms forward: the [B,N,T,S] bias, 512 MiB, moves 134 GB/s.
    assert tables[0][1].splitlines()[6].startswith("| 2048 | bias [B,N,T,S] | no | 1.00 |")
    assert tables[0][1].splitlines()[6].endswith(" | 0.25 | 134 |")

    # Without the plain row (filtered out) or with our row failed, ours/plain is "-"; a failed
    # row has no rate either.
    unplain = [r for r in records if r["variant"] != "full"]
    (_, table), _ = _bench.markdown_tables(unplain, ["ours", "cudnn"])
    row = next(line for line in table.splitlines() if "| 2048 | bias [B,N,T,S] |" in line)
    assert row.endswith(" | - | 134 |")
    failed = [_variants_record(configs[0], "ours", "fwd", 1e-3),
              _variants_record(configs[4], "ours", "fwd", None)]
    (_, table), = _bench.markdown_tables(failed, ["ours"])
    assert table.splitlines()[3] == "| 2048 | bias [B,N,T,S] | no | 1.00 | FAIL | FAIL | - | - |"
    # Only with our rows, and only where a row carries a bias or a mask.
    (title, table), = _bench.markdown_tables([r for r in records if r["impl"] == "cudnn"
                                              and r["mode"] == "fwd"], ["cudnn"])
    assert "ours/plain" not in title + table
    (title, table), = _bench.markdown_tables(
        [r for r in records if r["mode"] == "fwd" and r["variant"] in ("full", "causal")],
        ["ours", "cudnn"])
    assert "ours/plain" not in title + table and table.splitlines()[0].endswith("| ours/cudnn |")


@pytest.mark.parametrize("dropped", ["local_window_size", "key_value_seq_lengths",
                                     "query_seq_lengths", "bias", "mask", "segment_ids",
                                     "soft_cap", "sinks", "bottom_right"])
def test_variants_gate_checks_each_option(monkeypatch, dropped):
    """An implementation that ignores one of the options fails the check (query lengths: it
    leaves the padded rows nonzero, which the check covers)."""
    monkeypatch.setattr(_bench.checks, "FORWARD_CHECK_ROWS", 16)
    real = _bench.attention_fn

    def ignoring(impl, causal, window=None, soft_cap=None, bottom_right=False):
        fn = real(impl, causal, None if dropped == "local_window_size" else window,
                  None if dropped == "soft_cap" else soft_cap,
                  bottom_right and dropped != "bottom_right")
        return lambda q, k, v, **extras: fn(q, k, v, **{name: x for name, x in extras.items()
                                                        if not name.startswith(dropped)
                                                        and not name.endswith(dropped)})

    monkeypatch.setattr(_bench.impls, "attention_fn", ignoring)
    option = {"local_window_size": "window", "key_value_seq_lengths": "lengths",
              "query_seq_lengths": "lengths", "bias": "bias", "mask": "mask",
              "segment_ids": "segment ids", "soft_cap": "soft-cap", "sinks": "sinks",
              "bottom_right": "prefill"}[dropped]
    cfg = [c for c in _tiny_variants() if c.variant.startswith(option)][0]
    settings = _bench.TimingSettings.for_backend(**_TINY_SETTINGS)
    record, = _bench.run_benchmark([cfg], ["ours"], ["fwd"], settings, progress=False)
    assert record["status"] == "FAIL", record


def test_bench_script_variants_smoke(tmp_path, capsys):
    """The script end to end on some of the preset's rows (the grid tests above run every row
    through the same driver): the table, results.json and .md, the plot."""
    bench = _load_bench_script()
    out = tmp_path / "variants"
    status = bench.main(["--variants", "--seqlen", "64", "--head-dim", "16", "--hidden", "64",
                         "--rows", "full,window,bias [B,1,T,S],mask,soft-cap",
                         "--impls", "ours,xla", "--out", str(out), "--no-progress",
                         "--repeats", "1", "--target-ms", "0.1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "| T | variant | causal | visible | ours TFLOP/s | xla TFLOP/s |" in printed
    labels = ("full", "window 16", "bias [B,1,T,S]", "mask [B,1,T,S]", "soft-cap 50",
              "soft-cap 50, causal")
    for label in labels:
        assert f"| 64 | {label} |" in printed
    report = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in report["results"]] == [v for v in labels for _ in range(2)]
    # Every row runs, but xla's soft-cap rows: jax.nn has no soft-capping.
    assert {(r["status"], r["impl"]) for r in report["results"]
            if r["status"] != "ok"} == {("unavailable", "xla")}
    assert all(r["status"] == "ok" for r in report["results"]
               if r["soft_cap"] is None and not r["sinks"])
    assert {r["kind"] for r in report["results"]} == {"variants"}
    assert "window 16" in (out / "results.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "variants_bf16_fwd.png").stat().st_size > 0


# ----------------------------------------------------------------------------- packed preset


def test_bench_script_packed_preset_and_exclusive_with_the_others():
    bench = _load_bench_script()
    configs = bench.build_configs(bench.parse_args(["--packed"]))
    assert [(c.variant, c.seqlen_q, c.batch) for c in configs] == [
        ("dense causal", 1024, 32), ("packed, mean 1024", 8192, 4),
        ("packed, mean 1024", 32768, 1), ("dense causal", 4096, 8),
        ("packed, mean 4096", 8192, 4), ("packed, mean 4096", 32768, 1)]
    assert {(c.kind, c.dtype, c.num_heads, c.num_kv_heads, c.head_dim, c.causal)
            for c in configs} == {("packed", "bf16", 16, 16, 128, True)}
    for cfg in configs:
        assert cfg.seqlen_k == cfg.seqlen_q
        if cfg.variant == "dense causal":
            assert cfg.segment_docs is None and not cfg.restricted
            continue
        assert len(cfg.segment_docs) == cfg.batch
        for row in cfg.segment_docs:
            assert sum(row) == cfg.seqlen_q and min(row) >= 1
        if cfg.batch > 1:  # each row its own draw
            assert len(set(cfg.segment_docs)) == cfg.batch
    # A fixed seed: the same documents every time.
    assert bench.build_configs(bench.parse_args(["--packed"])) == configs
    for other in ("--variants", "--decode"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--packed", other])


def test_packed_documents_are_log_normal_draws_of_their_mean():
    # Long rows, so that few documents are cut: the drawn lengths average about the mean.
    rows = _bench.draw_documents(4, 1 << 20, 1024)
    lengths = np.concatenate([row[:-1] for row in rows])  # the last of a row is cut
    assert abs(lengths.mean() / 1024 - 1) < 0.05
    assert abs(np.log(lengths).std() - _bench.PACKED_SIGMA) < 0.05
    assert rows == _bench.draw_documents(4, 1 << 20, 1024)
    assert rows != _bench.draw_documents(4, 1 << 20, 1024, seed=1)


def _tiny_packed(**overrides):
    # T = 64 at 128 tokens (B = 2), N = 2, H = 16; documents of mean 8 and 32, and dense
    # causal rows at T = 8 (B = 16) and T = 32 (B = 4).
    options = dict(seqlens=(64,), head_dims=(16,), tokens=128, hidden=32, means=(8, 32))
    return _bench.packed_grid(**dict(options, **overrides))


def test_packed_flops_count_each_documents_causal_pairs():
    for cfg in _tiny_packed() + _bench.packed_grid():
        if cfg.segment_docs is None:  # the dense rows keep the standard grid's count
            assert cfg.flops() == _bench.attention_flops(cfg.batch, cfg.num_heads, cfg.seqlen_q,
                                                         cfg.seqlen_k, cfg.head_dim, True)
            continue
        pairs = sum(n * (n + 1) // 2 for row in cfg.segment_docs for n in row)
        assert cfg.visible_pairs() == pairs, cfg.label()
        if cfg.seqlen_q <= 64:
            assert _brute_force_pairs(cfg) == pairs
        forward = 4 * cfg.num_heads * cfg.head_dim * pairs
        assert cfg.flops("fwd") == forward and cfg.flops("fwdbwd") == 3.5 * forward


def test_cudnn_packed_arrays_pad_lengths_with_0_and_offsets_with_the_end_then_minus_1():
    rows = ((3, 5), (8,), (1, 2, 4, 1))
    lengths, offsets = _bench.cudnn_packed_arrays(rows, 8)
    assert lengths.dtype == offsets.dtype == np.int32
    np.testing.assert_array_equal(lengths, [[3, 5, 0, 0], [8, 0, 0, 0], [1, 2, 4, 1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 8, 8, -1], [0, 8, 8, 8, -1],
                                            [0, 1, 3, 7, -1]])
    # A count of equal documents, as the variants preset gives them, works too.
    lengths, offsets = _bench.cudnn_packed_arrays((2, 1), 6)
    np.testing.assert_array_equal(lengths, [[3, 3], [6, 0]])
    np.testing.assert_array_equal(offsets, [[0, 3, -1], [0, 6, -1]])
    # One document per row (the dense rows): still two slots, for jax's packed path.
    lengths, offsets = _bench.cudnn_packed_arrays((1, 1), 4)
    np.testing.assert_array_equal(lengths, [[4, 0], [4, 0]])
    np.testing.assert_array_equal(offsets, [[0, 4, -1], [0, 4, -1]])


def test_cudnn_packed_arrays_survive_jaxs_own_rearrangement():
    """What cuDNN sees: jax's packed path flattens lengths and offsets and moves their
    non-negative entries to the front (`_fix_seqlen_offsets`); document i must then be
    (lengths[i], offsets[i]) = (its length, b * T + its start), the unused slots empty."""
    module = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    fix = getattr(module, "_fix_seqlen_offsets", None)
    if fix is None:
        pytest.skip("this JAX rearranges the packed arrays elsewhere")
    _bench.cudnn_packed_api()  # the arguments the benchmark passes exist in this JAX
    n, h = 2, 4
    for cfg in _tiny_packed(means=(8,)):  # a dense row (one document per row), a packed one
        rows = _bench.packed.packed_rows(cfg)
        t = cfg.seqlen_q
        lengths, offsets = (jnp.asarray(x) for x in _bench.cudnn_packed_arrays(rows, t))
        q = jnp.zeros((cfg.batch, t, n, h), jnp.bfloat16)
        seen_lengths, _, seen_offsets, _ = fix(lengths, lengths, offsets, offsets, q, q)
        seen = [(int(length), int(offset) // (n * h)) for length, offset in
                zip(np.ravel(seen_lengths), np.ravel(seen_offsets)) if length > 0]
        bounds = [_bench.document_bounds(row, t) for row in rows]
        expected = [(int(end - start), b * t + int(start)) for b, row in enumerate(bounds)
                    for start, end in zip(row[:-1], row[1:])]
        assert seen == expected
        assert int(np.ravel(seen_offsets)[lengths.size]) // (n * h) == cfg.batch * t
    # The packed row's documents (the loop's last case) with each row's end after its starts,
    # then -1, and the lengths padded with 0 or -1: from the second row on, documents get
    # other documents' offsets (wrong rows on an H200, and no error).
    for pad in (0, -1):
        ends = np.full(offsets.shape, -1, np.int32)
        for b, row in enumerate(bounds):
            ends[b, :len(row)] = row
        padded = jnp.where(lengths > 0, lengths, pad)
        seen_lengths, _, seen_offsets, _ = fix(padded, padded, jnp.asarray(ends),
                                               jnp.asarray(ends), q, q)
        seen = [(int(length), int(offset) // (n * h)) for length, offset in
                zip(np.ravel(seen_lengths), np.ravel(seen_offsets)) if length > 0]
        assert seen[:len(bounds[0]) - 1] == expected[:len(bounds[0]) - 1]
        assert seen != expected


def test_cudnn_packed_is_unavailable_off_the_packed_rows():
    cfg = _bench.Config(1, 32, 32, 2, 2, 32, "bf16", True)
    with pytest.raises(_bench.Unavailable, match="packed preset"):
        _bench.impls.config_attention_fn("cudnn-packed", cfg)
    settings = _bench.TimingSettings.for_backend(**_TINY_SETTINGS)
    ours, packed = _bench.run_benchmark([cfg], ["ours", "cudnn-packed"], ["fwd"], settings,
                                        progress=False)
    assert ours["status"] == "ok"
    assert packed["status"] == "unavailable" and "packed preset" in packed["message"]
    assert not _bench.failures([ours, packed])
    assert _bench.available_impls(["ours", "cudnn-packed"]) == (
        ["ours", "cudnn-packed"] if _bench.on_gpu() else ["ours"])


def test_packed_grid_runs_and_passes_the_gate(monkeypatch):
    monkeypatch.setattr(_bench.checks, "FORWARD_CHECK_ROWS", 16)
    configs = _tiny_packed()
    settings = _bench.TimingSettings.for_backend(**_TINY_SETTINGS)
    records = _bench.run_benchmark(configs, ["ours", "xla"], ["fwd", "fwdbwd"], settings,
                                   progress=False)
    bad = [f"{r['variant']} {r['mode']} {r['impl']}: {r['status']} {r.get('message', '')}"
           for r in records if r["status"] != "ok"]
    assert not bad, "\n".join(bad)
    for r in records:
        assert r["kind"] == "packed"
        assert r["doc_mean"] == (None if r["variant"] == "dense causal"
                                 else int(r["variant"].rsplit(" ", 1)[1]))
    tables = _bench.markdown_tables(records, ["ours", "xla"])
    assert [title.split(" TFLOP/s")[0] for title, _ in tables] == ["bf16 forward",
                                                                   "bf16 forward+backward"]
    lines = tables[0][1].splitlines()
    assert lines[0] == ("| T | B | documents | docs per row | visible | ours TFLOP/s | xla TFLOP/s "
                        "| ours ms | xla ms | ours/xla | ours/dense at T=mean |")
    assert [line.split(" | ")[2] for line in lines[2:]] == [c.variant for c in configs]
    dense, packed = lines[2].split(" | "), lines[3].split(" | ")
    assert dense[0] == "| 8" and dense[-1] == "- |"
    ours = {(r["variant"], r["seqlen_q"]): r["tflops"] for r in records
            if r["mode"] == "fwd" and r["impl"] == "ours"}
    ratio = ours[("packed, mean 8", 64)] / ours[("dense causal", 8)]
    assert packed[-1] == f"{ratio:.2f} |"


def test_bench_script_packed_smoke(tmp_path, capsys):
    bench = _load_bench_script()
    out = tmp_path / "packed"
    status = bench.main(["--packed", "--seqlen", "256", "--tokens", "512", "--impls", "ours",
                         "--out", str(out), "--no-progress", "--repeats", "1",
                         "--target-ms", "0.1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "| T | B | documents | docs per row | visible | ours TFLOP/s | ours ms |" in printed
    assert "| 256 | 2 | packed, mean 1024 |" in printed
    assert "| 256 | 2 | packed, mean 4096 |" in printed
    assert "log-normal (sigma 1 of the logarithm" in printed
    report = json.loads((out / "results.json").read_text())
    assert {r["status"] for r in report["results"]} == {"ok"}
    assert {(r["kind"], r["batch"], r["num_heads"], r["head_dim"], r["causal"])
            for r in report["results"]} == {("packed", 2, 16, 128, True)}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "packed_bf16_fwd.png").stat().st_size > 0


def test_chunked_gradient_reference_matches_the_whole(monkeypatch):
    """The forward+backward reference by row chunks (what a sequence too long for the host's
    reference takes) gives every row's out and dq, and dk and dv summed over the chunks, as
    the whole-row reference does: the options whose terms depend on the rows (a bias, ids,
    ALiBi, the bottom-right diagonal; a window, lengths and GQA with T != S below), chunks of
    5 rows that do not divide T."""
    from jax_flashattn._bench import checks
    configs = [c for c in _tiny_variants()
               if c.variant.startswith(("bias [B,N", "segment ids, causal", "ALiBi, causal",
                                        "prefill"))]
    assert len(configs) == 4
    configs += [_bench.Config(2, 23, 37, 4, 2, 16, "bf16", True, kind="variants",
                              window=(9, 2), q_lens=(23, 11), kv_lens=(30, 37))]
    for cfg in configs:
        inputs = _bench.Inputs(cfg, 1)
        whole = checks.reference_slice(cfg, inputs, True, budget=1)
        monkeypatch.setattr(checks, "CHUNKED_GRADIENT_LOGITS", 0)
        monkeypatch.setattr(checks, "GRADIENT_CHUNK_LOGITS",
                            5 * 2 * cfg.group * cfg.seqlen_k)  # 5 rows of the two entries
        chunked = checks.reference_slice(cfg, inputs, True)
        monkeypatch.undo()
        assert chunked.rows is None and chunked.kv_heads == whole.kv_heads == 1, cfg.variant
        # The rounded outputs are bf16: a float32 value a hair apart may round an ulp away.
        for name, rtol in (("exact", 1e-5), ("rounded", 2.0 ** -6), ("magnitude", 1e-5)):
            np.testing.assert_allclose(np.asarray(getattr(chunked, name), np.float32),
                                       np.asarray(getattr(whole, name), np.float32),
                                       rtol=rtol, atol=1e-5, err_msg=f"{cfg.variant} {name}")
        for name in ("dq", "dk", "dv"):
            np.testing.assert_allclose(chunked.grads[name], whole.grads[name], rtol=1e-4,
                                       atol=1e-5, err_msg=f"{cfg.variant} {name}")
