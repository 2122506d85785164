"""benchmarks/compare_results.py, the performance guard's case-by-case comparison (CPU only)."""

import json

import pytest

from helpers import load_benchmark_script


def _load():
    return load_benchmark_script("compare_results")


def _row(impl, seconds, t=1024, causal=False, mode="fwd", status="ok"):
    return dict(kind="standard", dtype="bf16", batch=16384 // t, seqlen_q=t, seqlen_k=t,
                num_heads=16, num_kv_heads=16, head_dim=128, causal=causal, impl=impl,
                mode=mode, status=status, seconds=seconds, tflops=1.0, times_s=[seconds])


def _write(path, rows):
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def test_a_loss_against_cudnn_fails_and_card_drift_does_not(tmp_path, capsys):
    """The verdict follows our speed relative to cuDNN in the same run: a card 10% slower
    for both passes, our kernel 5% slower against an unchanged cuDNN fails."""
    compare = _load()
    before = [_row("ours", 1.0), _row("cudnn", 1.1), _row("ours", 2.0, causal=True),
              _row("cudnn", 2.0, causal=True)]
    after = [_row("ours", 1.1), _row("cudnn", 1.21), _row("ours", 2.1, causal=True),
             _row("cudnn", 2.0, causal=True)]
    status = compare.main([_write(tmp_path / "a.json", before), _write(tmp_path / "b.json", after)])
    printed = capsys.readouterr().out
    assert status == 1
    lines = [line for line in printed.splitlines() if line.startswith("| bf16")]
    assert lines[0].endswith("| ok |") and "+0.0%" in lines[0]  # full: drift only
    assert lines[1].endswith("| LOSS |") and "causal" in lines[1]  # -4.8% against cuDNN
    assert "1 case(s) lost more than 2.0%: bf16 H=128 T=1024 causal fwd" in printed


def test_without_cudnn_the_raw_change_decides(tmp_path, capsys):
    compare = _load()
    paths = [_write(tmp_path / "a.json", [_row("ours", 1.0)]),
             _write(tmp_path / "b.json", [_row("ours", 1.01)])]
    assert compare.main(paths) == 0  # -1%: within the tolerance
    assert compare.main(paths + ["--tolerance", "0.005"]) == 1
    capsys.readouterr()


@pytest.mark.parametrize("after", [[], [_row("ours", 1.0, status="error")]],
                         ids=["missing", "failed"])
def test_a_case_timed_in_one_run_only_fails(tmp_path, capsys, after):
    compare = _load()
    paths = [_write(tmp_path / "a.json", [_row("ours", 1.0), _row("ours", 1.0, t=2048)]),
             _write(tmp_path / "b.json", [_row("ours", 1.0)] + after)]
    assert compare.main(paths) == 1
    assert "ours timed in one run only: bf16 H=128 T=2048 fwd" in capsys.readouterr().out
