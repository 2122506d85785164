"""Attention TFLOP/s: jax_flashattn against jax.nn.dot_product_attention (cuDNN and XLA) and,
on packed sequences, cuDNN's own packed-sequence path.

Every implementation runs in this one process on the same inputs. Each (config, implementation,
mode) is first checked against the float32 reference (reported FAIL, and not timed, when it is
wrong), then timed; OOMs and errors are reported in the table and never end the run. The
method (FLOP counts, the jitted timing loop, the correctness rule) is described at the top of
src/jax_flashattn/_bench/__init__.py.

    python benchmarks/bench_attention.py --quick                  # < 1 min on an H100/H200
    python benchmarks/bench_attention.py --out bench_out/full     # standard grid, ~5 min
    python benchmarks/bench_attention.py --mode fwdbwd --head-dim 128   # ~4 min
    python benchmarks/bench_attention.py --decode                 # decode preset, K/V TB/s
    python benchmarks/bench_attention.py --variants --mode both   # options preset, ~3 min (H100)
    python benchmarks/bench_attention.py --packed --mode both     # packed rows, ~3 min (H200)

Most of the time goes to compiling (the XLA baseline above all) and to the correctness
references, not to the timed runs; --mode both on the whole grid takes ~15 min.

Standard grid: bf16 and fp16, B = tokens/T with 16384 tokens, N = 2048/H, H in {64,128,256}, T=S
in {512, ..., 16384}, causal and full. Decode preset: B=8, N=32, K=8, H=128, T in {1,8,16},
S=65536; a decode run also measures the device's copy bandwidth before and after its cases and
gives our K/V rate as a fraction of it (the decode target is 0.85:
docs/decisions/decode-benchmark-yardstick.md); --soft-cap CAP caps its rows (ours only), --bias
adds a serving bias [B, N, 1, S] to them (every implementation), --paged 16,64,256 adds a row
causal at the bottom right per T and that row through a paged KV cache of each page size
(ours only, jax_flashattn.paged_attention; ours/contiguous sets them against it), --fp8 adds
after each T's plain row that call on K and V stored as float8_e4m3fn with [B, K] descales
(ours only, quantised outside the timed call; TB/s counts one byte per K/V element, and
ours/<dtype> cache gives its calls per second over the plain row's).
Variants preset: bf16, B=4, T=S=4096, N=16, H=128, one row per option users pass: full, causal,
causal sliding window local_window_size=(1024, 0), per-batch lengths (query and key/value lengths
4096, 3072, 2048, 1024), GQA (16 query heads over 4 kv heads, causal), a bias of q's dtype
[1,N,T,S], [B,1,T,S] and [B,N,T,S], a boolean mask [B,1,T,S] of packed documents (1, 2, 4, 8 per
batch entry), the same documents as segment ids, full and causal (jax.nn gets them as that mask,
built inside the timed call), logits soft-capped at 50 (Gemma 2's cap), and attention sinks
(gpt-oss's), each full and causal (ours only: jax.nn has neither), ALiBi with BLOOM's slopes, full
and causal (jax.nn gets the dense [1,N,T,S] bias, built inside the timed call), and a prefill of
T/16 queries against T keys, causal with the diagonal at the bottom right (jax.nn gets the mask it
stands for); its FLOPs count only the visible logits. The rows with a bias or a mask also give our
time of the full row over theirs (ours/plain) and the bias's or mask's bytes per second of ours
(term GB/s). --seqlen, --dtype, --head-dim and --hidden (N = hidden/H) override its sizes, --rows
keeps some of its rows, --tokens sets B = tokens/T (e.g. one 131072-token sequence: --seqlen
131072 --tokens 131072 --rows GQA); --causal does not apply. Packed
preset: bf16, N=16, H=128, causal, T in {8192, 32768} at 32768 tokens per batch (B = 32768/T),
rows packed with documents whose lengths are drawn (fixed seed, each row its own draw) from a
log-normal of mean 1024, and of mean 4096 (sigma 1 of the logarithm), the last one cut at T;
FLOPs count each document's causal pairs. Each mean first gets a dense causal row at T = the
mean (our yardstick for the packed rows: the ours/dense column; cudnn-packed sees one document
per row there). Implementations: ours (segment ids), cudnn (jax.nn with the boolean mask
[B,1,T,T] of the documents) and cudnn-packed (cuDNN's packed path through
jax._src.cudnn.fused_attention_stablehlo: per-document lengths and offsets, PADDING_CAUSAL;
"unavailable" where this JAX lacks it). --seqlen, --tokens, --dtype, --head-dim and --hidden
override its sizes; --causal does not apply.
Exit status 1 when one of our configs is FAIL or error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

# XLA's C++ warnings (an OOM dumps the allocator's whole state) would bury the progress lines;
# set TF_CPP_MIN_LOG_LEVEL=0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from jax_flashattn import _bench  # noqa: E402

QUICK = dict(dtype=["bf16"], head_dim=[128], seqlen=[1024, 4096, 16384], causal="both")
VARIANTS = dict(dtype=["bf16"], head_dim=[_bench.VARIANTS_SHAPE["head_dim"]],
                seqlen=list(_bench.VARIANTS_SEQLENS))
PACKED = dict(dtype=["bf16"], head_dim=[_bench.PACKED_SHAPE["head_dim"]],
              seqlen=list(_bench.PACKED_SEQLENS), tokens=_bench.PACKED_TOKENS,
              hidden=_bench.PACKED_SHAPE["hidden"], impls=["ours", "cudnn", "cudnn-packed"])
PRESETS = ("decode", "variants", "packed")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _page_sizes(text: str) -> tuple[int, ...]:
    from jax_flashattn.paged import PAGE_SIZES
    try:
        sizes = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}")
    if not sizes or any(size not in PAGE_SIZES for size in sizes):
        raise argparse.ArgumentTypeError(f"page sizes must be among {PAGE_SIZES}, got {text!r}")
    return sizes


def _row_names(text: str) -> list[str]:
    """The comma list of --rows, split outside brackets: row names such as bias [B,N,T,S]
    hold commas."""
    return [x for x in re.split(r",(?![^\[]*\])", text) if x]


def _names(choices):
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a 1-2 minute subset: bf16, H=128, T in {1024, 4096, 16384}, causal "
                        "and full (flags given explicitly still win)")
    p.add_argument("--decode", action="store_true",
                   help="the decode preset (B=8, N=32, K=8, H=128, T in {1, 8, 16}, "
                        "S=65536) instead of the standard grid; reports K/V TB/s and us")
    p.add_argument("--variants", action="store_true",
                   help="the options preset (bf16, B=4, T=S=4096, N=16, H=128; full, causal, "
                        "window 1024, lengths, GQA 16/4, bias [1,N,T,S], [B,1,T,S] and "
                        "[B,N,T,S], mask [B,1,T,S], "
                        "segment ids, soft-cap 50, sinks and ALiBi, each full and causal; a "
                        "bottom-right causal prefill of T/16 queries) "
                        "instead of the standard grid; FLOPs count visible logits only")
    p.add_argument("--rows", type=_row_names, default=None,
                   help="variants preset only: comma list of the rows to keep, each by the "
                        "start of its name (e.g. full,causal,soft-cap; bias keeps the three "
                        "bias rows, 'bias [B,N,T,S]' that one)")
    p.add_argument("--packed", action="store_true",
                   help="the packed-sequence preset (bf16, N=16, H=128, causal, T in {8192, "
                        "32768}, 32768 tokens, documents of log-normal lengths of mean 1024 and "
                        "4096; implementations ours,cudnn,cudnn-packed by default) instead of "
                        "the standard grid; FLOPs count visible pairs only")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "both"), default="fwd",
                   help="forward, forward+backward (3.5x forward FLOPs), or both")
    p.add_argument("--dtype", type=_names(("bf16", "fp16", "fp32")), default=None,
                   help="comma list (default bf16,fp16)")
    p.add_argument("--head-dim", type=_ints, default=None, help="comma list (default 64,128,256)")
    p.add_argument("--seqlen", type=_ints, default=None,
                   help="comma list of T (default 512,...,16384; decode: 1,8,16; "
                        "variants: 4096; packed: 8192,32768)")
    p.add_argument("--causal", choices=("both", "true", "false"), default=None,
                   help="causal, full or both (default both)")
    p.add_argument("--impls", type=_names(_bench.ALL_IMPLS), default=None,
                   help="comma list of ours,cudnn,xla (default), ours-deterministic (ours "
                        "with deterministic_backward=True), cudnn-packed (packed rows only; the "
                        "packed preset's default is ours,cudnn,cudnn-packed); cudnn and "
                        "cudnn-packed are dropped off a GPU")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per batch: B = tokens / T (default %d; packed: %d; variants: "
                        "B = %d)" % (_bench.STANDARD_TOKENS, _bench.PACKED_TOKENS,
                                     _bench.VARIANTS_SHAPE["batch"]))
    p.add_argument("--hidden", type=int, default=None,
                   help="N = hidden / H (default %d)" % _bench.STANDARD_HIDDEN)
    p.add_argument("--kv-len", type=int, default=None,
                   help="decode only: S (default %d)" % _bench.DECODE_SHAPE["kv_len"])
    p.add_argument("--bias", action="store_true",
                   help="decode only: an additive bias [B, N, 1, S] of the rows' dtype, given "
                        "to every implementation")
    p.add_argument("--paged", type=_page_sizes, default=None,
                   help="decode only: comma list of page sizes (powers of two, 16-256): each T "
                        "also gets a row causal at the bottom right and that row through a "
                        "paged KV cache of each size, pages scattered at random (ours only)")
    p.add_argument("--fp8", action="store_true",
                   help="decode only: each T also gets its plain row's call on K and V stored "
                        "as float8_e4m3fn with [B, K] descales (ours only), set against the "
                        "plain row")
    p.add_argument("--soft-cap", type=_positive_float, default=None,
                   help="decode only: logits soft-capped at this cap (ours only: jax.nn has no "
                        "soft-capping)")
    p.add_argument("--copy-bytes", type=_positive, default=2 << 30,
                   help="decode only: bytes of the device copy the K/V rate is compared with "
                        "(default 2 GiB)")
    p.add_argument("--repeats", type=_positive, default=None,
                   help="timed runs per implementation and case, at most")
    p.add_argument("--target-ms", type=float, default=None,
                   help="wall time of one timed run (a jitted loop of calls; default 25, "
                        "decode 100)")
    p.add_argument("--sets", type=int, default=None, help="input sets the calls rotate through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="directory for results.md, results.json and PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    args = p.parse_args(argv)
    chosen = [name for name in PRESETS if getattr(args, name)]
    if len(chosen) > 1:
        p.error(" and ".join(f"--{name}" for name in chosen) + " are presets: pick one")
    if args.rows is not None and not args.variants:
        p.error("--rows picks rows of the variants preset: it needs --variants")
    if args.soft_cap is not None and not args.decode:
        p.error("--soft-cap caps the decode preset's rows: it needs --decode")
    if args.bias and not args.decode:
        p.error("--bias adds a bias to the decode preset's rows: it needs --decode")
    if args.paged and not args.decode:
        p.error("--paged adds paged rows to the decode preset: it needs --decode")
    if args.fp8 and not args.decode:
        p.error("--fp8 adds e4m3 rows to the decode preset: it needs --decode")
    if args.paged and args.bias:
        p.error("--paged and --bias: paged_attention takes no bias")
    for name, preset in (("variants", VARIANTS), ("packed", PACKED)):
        if getattr(args, name):
            for key, value in preset.items():
                if getattr(args, key) is None:
                    setattr(args, key, value)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) is None and not (args.decode and key in ("head_dim", "seqlen")):
                setattr(args, key, value)
    args.dtype = args.dtype or ["bf16", "fp16"]
    args.causal = args.causal or "both"
    args.impls = args.impls or list(_bench.IMPLS)
    if not args.variants:  # the variants preset's B is 4 unless --tokens sets it
        args.tokens = args.tokens or _bench.STANDARD_TOKENS
    args.hidden = args.hidden or _bench.STANDARD_HIDDEN
    return args


def build_configs(args) -> list[_bench.Config]:
    if args.decode:
        configs = _bench.decode_grid(args.dtype, args.seqlen or _bench.DECODE_SEQLENS, args.kv_len,
                                     args.paged or (), args.fp8)
        return [dataclasses.replace(c, soft_cap=args.soft_cap,
                                    bias_shape=((c.batch, c.num_heads, 1, c.seqlen_k)
                                                if args.bias else None))
                for c in configs]
    if args.variants:
        configs = _bench.variants_grid(args.dtype, args.seqlen, args.head_dim, hidden=args.hidden,
                                       tokens=args.tokens)
        if args.rows:
            unknown = [r for r in args.rows if not any(c.variant.startswith(r) for c in configs)]
            if unknown:
                raise SystemExit(f"--rows: no variants row starts with {unknown}; the rows are "
                                 f"{sorted({c.variant for c in configs})}")
            configs = [c for c in configs if any(c.variant.startswith(r) for r in args.rows)]
        return configs
    if args.packed:
        return _bench.packed_grid(args.dtype, args.seqlen, args.head_dim, args.tokens,
                                  args.hidden)
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    return _bench.standard_grid(args.dtype, args.head_dim or _bench.STANDARD_HEAD_DIMS,
                                args.seqlen or _bench.STANDARD_SEQLENS, causal, args.tokens,
                                args.hidden)


def plot(records, impls, out_dir: str, device: str = "") -> list[str]:
    """One PNG per (kind, dtype, mode): TFLOP/s (decode: K/V TB/s) against T, one panel per
    (H, causal), one line per implementation; the variants and packed presets: bars per row
    (`_plot_variants`). Points that failed are left out."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    paths = []
    groups: dict = {}
    for r in records:
        groups.setdefault((r["kind"], r["dtype"], r["mode"]), []).append(r)
    for (kind, dtype, mode), rs in groups.items():
        if kind in ("variants", "packed"):
            paths.append(_plot_variants(plt, rs, impls, out_dir, device, dtype, mode, kind))
            continue
        key = "kv_tbps" if kind == "decode" else "tflops"
        panels = sorted({(r["head_dim"], r["causal"]) for r in rs})
        heads = sorted({h for h, _ in panels})
        causals = sorted({c for _, c in panels})
        fig, axes = plt.subplots(len(heads), len(causals), squeeze=False, sharex=True,
                                 figsize=(5.5 * len(causals), 3.6 * len(heads)))
        for (h, causal) in panels:
            ax = axes[heads.index(h)][causals.index(causal)]
            # One line per implementation and, on the decode preset's paged and e4m3 rows, per
            # variant ("contiguous", "paged P", "e4m3").
            variants = sorted({r.get("variant", "") for r in rs})
            for impl in impls:
                for variant in variants:
                    pts = sorted((r["seqlen_q"], r[key]) for r in rs if r["impl"] == impl and
                                 r["head_dim"] == h and r["causal"] == causal and
                                 r.get("variant", "") == variant and r["status"] == "ok")
                    if pts:
                        ax.plot(*zip(*pts), marker="o",
                                label=f"{impl}, {variant}" if variant else impl)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["seqlen_q"] for r in rs})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_ylim(bottom=0)
            if kind == "decode":  # causal only on the paged rows and their yardstick
                ax.set_title(f"H={h}" + (", causal at the bottom right" if causal else ""))
            else:
                ax.set_title(f"H={h}" + (", causal" if causal else ", full"))
            ax.set_xlabel("T (query length)")
            ax.set_ylabel("K/V read TB/s" if kind == "decode" else "TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"{device}: {dtype} {_bench.MODE_TITLES[mode]}"
                     + (" (decode)" if kind == "decode" else ""))
        fig.tight_layout()
        path = os.path.join(out_dir, f"{kind}_{dtype}_{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_variants(plt, rs, impls, out_dir: str, device: str, dtype: str, mode: str,
                   kind: str = "variants") -> str:
    """The variants (or packed) preset: TFLOP/s (visible logits) per option (or row), one bar
    per implementation. Points that failed are left out."""
    seqlens = sorted({r["seqlen_q"] for r in rs})
    names = []  # (T, variant) in first-seen order
    for r in rs:
        if (r["seqlen_q"], r["variant"]) not in names:
            names.append((r["seqlen_q"], r["variant"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) * max(1, len(impls)) / 2), 4.2))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, name in enumerate(names):
            for r in rs:
                if ((r["seqlen_q"], r["variant"]) == name and r["impl"] == impl
                        and r["status"] == "ok"):
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r["tflops"])
        ax.bar(xs, ys, width, label=impl)
    labels = [v if len(seqlens) == 1 else f"{v}\nT={t}" for t, v in names]
    ax.set_xticks(range(len(names)), labels, rotation=20, ha="right")
    ax.set_ylabel("TFLOP/s (visible logits)")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    first = rs[0]
    batches = sorted({r["batch"] for r in rs})
    ax.set_title(f"{device}: {dtype} {_bench.MODE_TITLES[mode]}, "
                 + (f"B={batches[0]}, " if len(batches) == 1 else "")
                 + f"N={first['num_heads']}, H={first['head_dim']}"
                 + (f", T=S={seqlens[0]}" if len(seqlens) == 1 else ""))
    fig.tight_layout()
    path = os.path.join(out_dir, f"{kind}_{dtype}_{mode}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    env = _bench.environment()
    impls = _bench.available_impls(args.impls)
    modes = ["fwd", "fwdbwd"] if args.mode == "both" else [args.mode]
    configs = build_configs(args)
    overrides = {k: v for k, v in dict(repeats=args.repeats, n_sets=args.sets,
                                       seed=args.seed).items() if v is not None}
    if args.target_ms is not None:
        overrides["target_s"] = overrides["decode_target_s"] = args.target_ms / 1e3
    settings = _bench.TimingSettings.for_backend(**overrides)

    header = _bench.environment_lines(env)
    dropped = [i for i in args.impls if i not in impls]
    header.append(f"implementations: {', '.join(impls)}"
                  + (f" ({', '.join(dropped)}: needs a GPU)" if dropped else ""))
    header.append(f"timing: median of {min(settings.min_repeats, settings.repeats)}-"
                  f"{settings.repeats} runs of a "
                  f"jitted loop over {settings.n_sets} input sets, ~"
                  f"{(settings.decode_target_s if args.decode else settings.target_s) * 1e3:g} "
                  "ms per run, the implementations of a case in alternation after an untimed "
                  "round; "
                  "FLOPs 4*B*N*T*S*H forward (/2 causal), 3.5x for forward+backward"
                  + ("; options: 4*N*H per visible (t, s) pair, counted exactly"
                     if args.variants else "")
                  + ("; packed rows: 4*N*H per visible (t, s) pair, each document's causal "
                     "pairs" if args.packed else ""))
    if args.packed:
        header.append(f"packed rows: document lengths log-normal (sigma "
                      f"{_bench.PACKED_SIGMA:g} of the logarithm, fixed seed), at least 1, "
                      "each row its own draw, the last document cut at T; ours/dense divides "
                      "by our dense causal row at T = the mean; cudnn-packed gets each row's "
                      "document lengths (unused slots 0) and starts (unused slots: T, then "
                      "one -1), computed outside the timed call, and on the dense rows one "
                      "document per row")
    if "ours" in impls:
        header.append("our forward kernel: " + _bench.forward_kernel_summary(configs))
    for line in header:
        print(line)
    print(flush=True)

    # The yardstick of the decode rows (GPU only): measured before and after the cases, so
    # that a card whose bandwidth drifts during the run is compared with its better figure.
    copy_before = _bench.copy_bandwidth(args.copy_bytes) if args.decode else None
    records = _bench.run_benchmark(configs, impls, modes, settings,
                                   progress=not args.no_progress)
    copy_after = _bench.copy_bandwidth(args.copy_bytes) if copy_before is not None else None
    copy_tbps = []
    if copy_after is not None:
        copy_tbps = [copy_before / 1e12, copy_after / 1e12]
        line = (f"device copy bandwidth (cudaMemcpy of {args.copy_bytes / 2**30:g} GiB device "
                f"to device, bytes read + written per second, median of 10): "
                f"{copy_tbps[0]:.3f} TB/s before the cases, {copy_tbps[1]:.3f} after; "
                "ours/copy divides by the larger")
        header.append(line)
        print(line)
    elapsed = time.perf_counter() - start

    tables = _bench.markdown_tables(records, impls, max(copy_tbps, default=None))
    body = "\n\n".join(f"### {title}\n\n{table}" for title, table in tables)
    bad = _bench.failures(records)
    notes = [f"{r['dtype']} T={r['seqlen_q']} H={r['head_dim']} "
             f"{'causal' if r['causal'] else 'full'}"
             f"{' ' + r['variant'] if r.get('variant') not in (None, 'full', 'causal') else ''}"
             f" {r['mode']} {r['impl']}: {r['status']}: "
             f"{r.get('message', '')}" for r in records
             if r["status"] in ("FAIL", "error", "unavailable")]
    report = "\n".join(["# Attention benchmark", ""] + [f"- {line}" for line in header]
                       + [f"- elapsed: {elapsed:.0f} s", "", body])
    if notes:
        report += ("\n\nFailures, errors and unavailable implementations:\n\n"
                   + "\n".join(f"- {n}" for n in notes))
    print(body)
    if notes:
        print("\nFailures, errors and unavailable implementations:")
        for n in notes:
            print(f"- {n}")
    print(f"\nelapsed: {elapsed:.0f} s")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(report + "\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(dict(environment=env, impls=impls, modes=modes, elapsed_s=elapsed,
                           copy_tbps=copy_tbps,
                           settings=vars(settings), results=records), f, indent=1)
        paths = plot(records, impls, args.out, env["device"])
        print(f"wrote {args.out}/results.md, results.json"
              + "".join(f", {os.path.basename(p)}" for p in paths))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
