"""Compare two benchmark runs case by case: the performance guard of a kernel change.

    python benchmarks/compare_results.py BEFORE/results.json AFTER/results.json [--tolerance 0.02]

Both files are what bench_attention.py --out writes. Cases match on every field that describes
the case (grid, dtype, shape, options, mode); for each, our time per call before and after,
and, where both runs timed cuDNN too, our speed relative to cuDNN's in the same process before
and after. GPUs vary by several percent between runs and cards, while cuDNN in the same process
sees the same card and clocks, so the verdict uses the change of that ratio where it exists and
the raw change otherwise. A case that lost more than the tolerance is marked LOSS; run it again
to tell noise from a loss. Exit status 1 when a case is marked LOSS or ours ran in one run only.
"""

from __future__ import annotations

import argparse
import json
import sys

# Fields that are results of a run, not part of what was run.
MEASURED = {
    "impl", "status", "message", "lower_s", "compile_s", "warmup_s", "iterations", "calls",
    "check_s", "check", "seconds", "times_s", "repeats", "tflops", "kv_tbps", "flops",
    "kv_bytes", "draw_s", "reference_s",
}


def case_key(row: dict) -> tuple:
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in row.items()
                        if k not in MEASURED))


def case_label(row: dict) -> str:
    shape = f"T={row['seqlen_q']}" + (f" S={row['seqlen_k']}" if row["seqlen_k"] != row["seqlen_q"]
                                      else "")
    parts = [row.get("variant") or "", row["dtype"], f"H={row['head_dim']}", shape,
             "causal" if row.get("causal") else "", row["mode"]]
    return " ".join(p for p in parts if p)


def percent(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-4 else x:+.1%}"  # no "-0.0%" for a change that rounds to 0


def timed(rows: list[dict]) -> dict:
    """{case key: {impl: (seconds per call, row)}} of the rows that ran."""
    cases: dict = {}
    for row in rows:
        if row.get("status") == "ok" and row.get("seconds"):
            cases.setdefault(case_key(row), {})[row["impl"]] = (row["seconds"], row)
    return cases


def compare(before: list[dict], after: list[dict], tolerance: float):
    """(table lines, cases marked LOSS, cases in one run only)."""
    old, new = timed(before), timed(after)
    lines = ["| case | ours before | ours after | change | vs cuDNN before | vs cuDNN after | "
             "change vs cuDNN | verdict |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    losses, unmatched = [], []

    def order(key):
        row = next(iter((old.get(key) or new[key]).values()))[1]
        return (row.get("kind", ""), row.get("variant") or "", row["dtype"], row["head_dim"],
                row["seqlen_q"], row["seqlen_k"], bool(row.get("causal")), row["mode"])

    for key in sorted(set(old) | set(new), key=order):
        ours = [run[key]["ours"] for run in (old, new) if "ours" in run.get(key, {})]
        if len(ours) < 2:
            if ours:
                unmatched.append(case_label(ours[0][1]))
            continue
        (t0, row), (t1, _) = old[key]["ours"], new[key]["ours"]
        change = t0 / t1 - 1  # > 0: faster after
        cells = [f"{t0 * 1e3:.4g} ms", f"{t1 * 1e3:.4g} ms", percent(change), "", "", ""]
        verdict_change = change
        if "cudnn" in old[key] and "cudnn" in new[key]:
            r0, r1 = old[key]["cudnn"][0] / t0, new[key]["cudnn"][0] / t1
            verdict_change = r1 / r0 - 1
            cells[3:] = [f"{r0:.3f}", f"{r1:.3f}", percent(verdict_change)]
        verdict = "LOSS" if verdict_change < -tolerance else "ok"
        if verdict == "LOSS":
            losses.append(case_label(row))
        lines.append(f"| {case_label(row)} | " + " | ".join(cells) + f" | {verdict} |")
    return lines, losses, unmatched


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="the largest loss that passes, as a fraction (default 0.02)")
    args = parser.parse_args(argv)
    runs = []
    for path in (args.before, args.after):
        with open(path) as f:
            runs.append(json.load(f)["results"])
    lines, losses, unmatched = compare(*runs, args.tolerance)
    print("\n".join(lines))
    for label in unmatched:
        print(f"ours timed in one run only: {label}")
    print(f"{len(losses)} case(s) lost more than {args.tolerance:.1%}"
          + (": " + ", ".join(losses) if losses else ""))
    return 1 if losses or unmatched else 0


if __name__ == "__main__":
    sys.exit(main())
