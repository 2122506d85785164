"""benchmarks/stall_samples.py: its reading of ncu's source page (CPU only)."""

import pytest

from helpers import load_benchmark_script

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","# Samples","stall_long_sb","stall_wait",'
          '"stall_long_sb (Not Issued)","stall_wait (Not Issued)"')


def _page(rows):
    lines = ['"Kernel Name","void backward_kernel<bf16, 256>(AttentionParams)",', HEADER]
    for address, sass, long_sb, wait in rows:
        total = long_sb + wait
        lines.append(f'"{address}","      {sass}","{total:,}","{total}","{total}","{long_sb:,}",'
                     f'"{wait}","{long_sb}","0"')
    return lines


ROWS = [("0x10", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", 0, 100),
        ("0x20", "LEA R24, P0, R20, UR8, 0x2", 1200, 0),
        ("0x30", "REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR6][R24.64], R28", 300, 100),
        ("0x40", "LEA R24, P0, R20, UR8, 0x2", 500, 0),
        ("0x50", "REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR6][R24.64+0x20], R30", 0, 0),
        ("0x60", "FADD R28, R33, -R230", 0, 1800)]


def test_shares_by_reason_instruction_and_region():
    stalls = load_benchmark_script("stall_samples")
    samples = stalls.Samples(_page(ROWS))
    assert samples.total == 4000
    assert samples.reasons == ["stall_long_sb", "stall_wait"]  # not the "(Not Issued)" copies
    assert samples.reason_shares() == {"stall_long_sb": 0.5, "stall_wait": 0.5}
    top = samples.top(2)
    assert [(share, sass[:4]) for share, sass, _ in top] == [(0.45, "FADD"), (0.3, "LEA ")]
    assert top[1][2] == [(0.3, "stall_long_sb")]
    lines = samples.region("REDG")
    assert list(lines) == [2, 3, 4]
    assert samples.reason_shares(lines) == {"stall_long_sb": 0.2, "stall_wait": 0.025}
    text = stalls.report(samples, 3, "REDG")
    assert "region 'REDG': 3 instructions, 22.5% of the samples" in text
    assert "long_sb 40%, wait 5%" in text


def test_pages_without_samples_or_a_header_are_errors():
    stalls = load_benchmark_script("stall_samples")
    with pytest.raises(ValueError, match="not ncu's source page"):
        stalls.Samples(['"ID","Kernel Name","Metric Value"', '"0","k","1"'])
    with pytest.raises(ValueError, match="no stall samples"):
        stalls.Samples(_page([("0x10", "NOP", 0, 0)]))
    with pytest.raises(ValueError, match="no instruction matches"):
        stalls.Samples(_page(ROWS)).region("BAR.SYNC")
