"""Each GPU kernel's duration in one forward+backward (or forward) call, ours against cuDNN:

    python3 benchmarks/kernel_times.py --impl ours,cudnn --head-dim 128 --seqlen 1024

For each implementation it runs itself under Nsight Compute (`ncu --metrics
gpu__time_duration.sum`, which serialises the kernels and times each alone), on the standard
grid's shape: B = --tokens / T, N = --hidden / H, T = S = --seqlen. The child process calls the
jitted function twice, then a marker kernel (a sine), then once more; the table lists the
kernels after the marker, so compilation, autotuning and warm-up launches are left out (XLA's
autotuning is off in the child). Sums of these durations leave out the gaps between launches
that the benchmark's timing includes: compare kernels with it, not calls.

`--documents MEAN` gives our calls segment ids: rows packed with documents of log-normal
lengths of that mean (the packed preset's draw), or one document per row for 0 (every id 0:
what the ids alone cost)."""

import argparse
import csv
import os
import subprocess
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def child(args):
    import jax
    import jax.numpy as jnp

    import jax_flashattn

    t = args.seqlen
    shape = (max(1, args.tokens // t), t, args.hidden // args.head_dim, args.head_dim)
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[args.dtype]
    q, k, v = (jax.random.normal(key, shape, dtype)
               for key in jax.random.split(jax.random.PRNGKey(0), 3))
    ids = {}
    if args.documents is not None:
        import numpy as np

        from jax_flashattn._bench.configs import document_ids
        from jax_flashattn._bench.packed import draw_documents
        if args.documents == 0:
            rows = jnp.zeros(shape[:2], jnp.int32)
        else:
            docs = draw_documents(shape[0], t, args.documents)
            rows = jnp.asarray(np.stack([document_ids(d, t) for d in docs]), jnp.int32)
        ids = dict(query_segment_ids=rows, key_value_segment_ids=rows)
    if args.impl == "ours":
        def attention(q, k, v):
            return jax_flashattn.attention(q, k, v, is_causal=args.causal, **ids)
    else:
        def attention(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal,
                                                implementation=args.impl)
    if args.mode == "fwd":
        fn = jax.jit(attention)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)),
                              argnums=(0, 1, 2)))
    marker = jax.jit(jnp.sin)
    for _ in range(2):
        jax.block_until_ready(fn(q, k, v))
    jax.block_until_ready(marker(jnp.ones((1024,), jnp.float32)))
    jax.block_until_ready(fn(q, k, v))


def kernels_after_marker(lines):
    """[(kernel name, us)] of the launches after the last sine kernel in ncu's CSV lines."""
    rows = []
    for r in csv.DictReader(line for line in lines if line.startswith('"')):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r["Metric Unit"]
        if unit not in UNITS:
            raise ValueError(f"unknown duration unit {unit!r} in ncu's output")
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * UNITS[unit]))
    marks = [i for i, (name, _) in enumerate(rows) if "sine" in name.lower()]
    if not marks:
        raise ValueError("no marker kernel in ncu's output")
    return rows[marks[-1] + 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="ours,cudnn",
                        help="comma-separated: ours, cudnn, xla (jax.nn's implementations)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=None, metavar="MEAN",
                        help="segment ids for our calls: documents of this mean length "
                             "(0: one per row)")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.documents is not None and args.impl != "ours":
        parser.error("--documents times our kernels alone: give --impl ours")
    if args.documents is not None and args.documents < 0:
        parser.error("--documents: a mean document length >= 1, or 0 for one per row")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    shape = (f"B = {max(1, args.tokens // args.seqlen)}, T = S = {args.seqlen}, "
             f"N = {args.hidden // args.head_dim}, H = {args.head_dim}, {args.dtype}, "
             f"{'causal' if args.causal else 'full'}, {args.mode}"
             + ("" if args.documents is None else f", documents of mean {args.documents}"))
    print(shape)
    for impl in args.impl.split(","):
        command = [args.ncu, "--metrics", "gpu__time_duration.sum", "--csv", sys.executable,
                   os.path.abspath(__file__), "--child", "--impl", impl,
                   "--head-dim", str(args.head_dim), "--seqlen", str(args.seqlen),
                   "--dtype", args.dtype, "--mode", args.mode, "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden)] + (["--causal"] if args.causal else []) + (
                       [] if args.documents is None else ["--documents", str(args.documents)])
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{impl}: ncu exited with {run.returncode}\n{run.stderr[-2000:]}")
            continue
        kernels = kernels_after_marker(run.stdout.splitlines())
        print(f"\n{impl}: {len(kernels)} kernels, {sum(us for _, us in kernels):.1f} us")
        for name, us in kernels:
            print(f"  {us:10.1f} us  {name[:100]}")


if __name__ == "__main__":
    main()
