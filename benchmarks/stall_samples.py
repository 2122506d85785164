"""Where a kernel's warps wait: ncu's warp-stall samples per SASS instruction, summed.

    ncu --kernel-name regex:backward_kernel --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --import-source no -o REPORT \\
        python3 benchmarks/profile_backward.py --head-dim 256 --seqlen 4096 --batch 4
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python3 benchmarks/stall_samples.py source.csv [--top 25] [--region REDG]

Prints the kernel's stall samples by reason (ncu's stall_* columns, each as a share of all
samples), then the --top instructions with the most samples and their three largest reasons.
--region REGEX: the share of the samples, and of each reason's, that fall from the first
instruction whose SASS matches REGEX to the last one (a code region such as the dQ additions,
`REDG`), which a list of single instructions spreads over many lines."""

from __future__ import annotations

import argparse
import csv
import re
import sys

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = " (Not Issued)"


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


class Samples:
    """One kernel's source page: per instruction its SASS, its samples and each reason's."""

    def __init__(self, lines):
        rows = list(csv.reader(lines))
        try:
            start = next(i for i, row in enumerate(rows) if "Source" in row and ALL_SAMPLES in row)
        except StopIteration:
            raise ValueError(f"no header with 'Source' and '{ALL_SAMPLES}': not ncu's source "
                             "page as CSV (--page source --csv --print-source sass)") from None
        header = rows[start]
        source, samples = header.index("Source"), header.index(ALL_SAMPLES)
        reasons = [(i, name) for i, name in enumerate(header)
                   if name.startswith("stall_") and not name.endswith(NOT_ISSUED)]
        self.reasons = [name for _, name in reasons]
        self.sass, self.samples, self.by_reason = [], [], []
        for row in rows[start + 1:]:
            if len(row) != len(header):
                break  # the next kernel's page, or the end
            self.sass.append(row[source].strip())
            self.samples.append(_number(row[samples]))
            self.by_reason.append([_number(row[i]) for i, _ in reasons])
        self.total = sum(self.samples)
        if self.total == 0:
            raise ValueError("the page holds no stall samples")

    def reason_shares(self, lines=None) -> dict:
        """Each reason's samples over lines (all by default) as a share of all samples."""
        lines = range(len(self.sass)) if lines is None else lines
        sums = [sum(self.by_reason[i][r] for i in lines) for r in range(len(self.reasons))]
        return {name: s / self.total for name, s in zip(self.reasons, sums)}

    def top(self, count: int):
        """(share, SASS, [(share, reason)] x 3) of the count instructions with most samples."""
        order = sorted(range(len(self.sass)), key=lambda i: -self.samples[i])[:count]
        return [(self.samples[i] / self.total, self.sass[i],
                 sorted(((v / self.total, name) for v, name in zip(self.by_reason[i], self.reasons)
                         if v), reverse=True)[:3]) for i in order]

    def region(self, pattern: str) -> range:
        """The lines from the first instruction matching pattern to the last one."""
        hits = [i for i, sass in enumerate(self.sass) if re.search(pattern, sass)]
        if not hits:
            raise ValueError(f"no instruction matches {pattern!r}")
        return range(hits[0], hits[-1] + 1)


def _reason(name: str) -> str:
    """ncu's column name without its stall_ prefix."""
    return name[len("stall_"):]


def report(samples: Samples, top: int, region: str | None) -> str:
    whole = samples.reason_shares()
    by_share = sorted(whole, key=lambda name: -whole[name])
    out = [f"{samples.total:.0f} stall samples over {len(samples.sass)} instructions",
           "by reason: " + ", ".join(f"{_reason(name)} {whole[name]:.1%}"
                                     for name in by_share if whole[name] >= 0.005)]
    if region is not None:
        lines = samples.region(region)
        share = sum(samples.samples[i] for i in lines) / samples.total
        inside = samples.reason_shares(lines)
        out.append(f"region {region!r}: {len(lines)} instructions, {share:.1%} of the samples; "
                   "of each reason's: " + ", ".join(
                       f"{_reason(name)} {inside[name] / whole[name]:.0%}"
                       for name in by_share if whole[name] >= 0.02))
    for share, sass, reasons in samples.top(top):
        out.append(f"{share:6.1%}  {sass[:64]:64s}  " +
                   ", ".join(f"{_reason(name)} {s:.1%}" for s, name in reasons))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--region", help="a SASS regex: the samples from its first to last match")
    args = parser.parse_args(argv)
    with open(args.csv, errors="replace") as f:
        samples = Samples(f)
    print(report(samples, args.top, args.region))


if __name__ == "__main__":
    sys.exit(main())
