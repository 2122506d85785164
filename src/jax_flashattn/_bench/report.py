"""Reports: the environment, markdown tables of the records, and the failures. (Method: the
package docstring.)"""

from __future__ import annotations

import datetime
import shlex
import sys
from typing import Sequence

import jax

from jax_flashattn._bench.configs import MODE_TITLES


def environment() -> dict:
    """Device, versions, build: the header of every report."""
    import jax_flashattn
    device = jax.devices()[0]
    return dict(
        device=getattr(device, "device_kind", str(device)), platform=device.platform,
        device_count=jax.device_count(), jax_version=jax.__version__,
        jax_flashattn_version=getattr(jax_flashattn, "__version__", "?"),
        cuda_built=jax_flashattn.cuda_built(),
        cuda_architectures=list(jax_flashattn.cuda_architectures()),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        command=_command_line())


def forward_kernel_summary(configs) -> str:
    """The dispatcher's forward kernel family per (dtype, head dim) of the configs, e.g.
    "bf16 H=128 sm90, bf16 H=256 sm80"."""
    import jax_flashattn
    seen = {}
    for cfg in configs:
        key = (cfg.dtype, cfg.head_dim)
        if key not in seen:
            q = jax.ShapeDtypeStruct(cfg.q_shape, cfg.jnp_dtype)
            k = jax.ShapeDtypeStruct(cfg.kv_shape, cfg.jnp_dtype)
            seen[key] = jax_flashattn.forward_kernel(q, k)
    return ", ".join(f"{d} H={h} {kernel}" for (d, h), kernel in seen.items())


def _command_line() -> str:
    python = sys.executable.rsplit("/", 1)[-1] or "python"
    argv = list(sys.argv)
    if argv and argv[0].replace("\\", "/").endswith("jax_flashattn/__main__.py"):
        argv[0:1] = ["-m", "jax_flashattn"]
    return shlex.join([python] + argv)


def environment_lines(env: dict) -> list[str]:
    archs = ", ".join(env["cuda_architectures"]) or "-"
    return [f"device: {env['device']} ({env['platform']}, {env['device_count']} device(s))",
            f"jax {env['jax_version']}, jax_flashattn {env['jax_flashattn_version']}, "
            f"CUDA kernels built: {env['cuda_built']} (architectures: {archs})",
            f"date: {env['date']}",
            f"command: {env['command']}"]


def _number(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _cell(record: dict | None, key: str, scale: float = 1.0) -> str:
    if record is None:
        return "-"
    if record["status"] != "ok":
        return record["status"]
    return _number(record[key] * scale)


def _ratio(ours: dict | None, base: dict | None, key: str, invert: bool = False) -> str:
    if not ours or not base or ours["status"] != "ok" or base["status"] != "ok":
        return "-"
    r = base[key] / ours[key] if invert else ours[key] / base[key]
    return f"{r:.2f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _group(records):
    """{(kind, dtype, mode): {config key: {impl: record}}}, in first-seen order."""
    groups: dict = {}
    for r in records:
        key = (r["kind"], r["dtype"], r["mode"])
        ckey = (r["seqlen_q"], r["seqlen_k"], r["head_dim"], r["causal"], r["batch"],
                r["num_heads"], r["num_kv_heads"], r.get("variant", ""))
        groups.setdefault(key, {}).setdefault(ckey, {})[r["impl"]] = r
    return groups


def markdown_tables(records: Sequence[dict], impls: Sequence[str],
                    copy_tbps: float | None = None) -> list[tuple[str, str]]:
    """[(title, markdown table)] per (kind, dtype, mode). With the device's copy bandwidth
    (`copy_bandwidth`, TB/s), decode tables add our K/V read rate as a fraction of it."""
    base = "cudnn" if "cudnn" in impls else ("xla" if "xla" in impls else None)
    tables = []
    for (kind, dtype, mode), rows_by_config in _group(records).items():
        first = next(iter(next(iter(rows_by_config.values())).values()))
        if kind == "decode":
            capped = (f", logits soft-capped at {first['soft_cap']:g}"
                      if first.get("soft_cap") is not None else "")
            if first.get("bias_shape") is not None:
                capped += ", bias [B,N,1,S]"
            title = (f"{dtype} decode {MODE_TITLES[mode]}: B={first['batch']}, "
                     f"N={first['num_heads']}, K={first['num_kv_heads']}, "
                     f"H={first['head_dim']}{capped}; K/V read TB/s and time per call")
            # With page sizes (decode_grid) each T has a plain row, a "contiguous" one (causal
            # at the bottom right) and its "paged P" rows, set against it; with fp8 an "e4m3"
            # row, set against the plain one.
            variants = any(r.get("variant") for by_impl in rows_by_config.values()
                           for r in by_impl.values())
            header = (["T", "S"] + (["variant"] if variants else [])
                      + [f"{i} TB/s" for i in impls] + [f"{i} us" for i in impls])
            rows = []
            for (t, s, h, causal, *_), by_impl in rows_by_config.items():
                variant = next(iter(by_impl.values())).get("variant") or "plain"
                rows.append([str(t), str(s)] + ([variant] if variants else [])
                            + [_cell(by_impl.get(i), "kv_tbps") for i in impls]
                            + [_cell(by_impl.get(i), "seconds", 1e6) for i in impls])
                if "ours" in impls and base and base != "ours":
                    rows[-1].append(_ratio(by_impl.get("ours"), by_impl.get(base), "kv_tbps"))
            if "ours" in impls and base and base != "ours":
                header.append(f"ours/{base}")
            if "ours" in impls and copy_tbps:
                header.append("ours/copy")
                for row, by_impl in zip(rows, rows_by_config.values()):
                    ours = by_impl.get("ours")
                    row.append(f"{ours['kv_tbps'] / copy_tbps:.2f}"
                               if ours and ours["status"] == "ok" else "-")
            if "ours" in impls and any(r.get("page_size") for by_impl in rows_by_config.values()
                                       for r in by_impl.values()):
                header.append("ours/contiguous")
                title += "; ours/contiguous: a paged row's rate over the contiguous row's"
                contiguous = {(key[0], key[1]): by_impl.get("ours")
                              for key, by_impl in rows_by_config.items()
                              if next(iter(by_impl.values())).get("variant") == "contiguous"}
                for row, (key, by_impl) in zip(rows, rows_by_config.items()):
                    paged = next(iter(by_impl.values())).get("page_size")
                    row.append(_ratio(by_impl.get("ours"), contiguous.get((key[0], key[1])),
                                      "kv_tbps") if paged else "-")
            if "ours" in impls and any(r.get("kv_fp8") for by_impl in rows_by_config.values()
                                       for r in by_impl.values()):
                # Calls per second, not TB/s: the e4m3 row reads fewer bytes for the same call,
                # and what they buy is the time of a call.
                header.append(f"ours/{dtype} cache")
                title += (f"; ours/{dtype} cache: an e4m3 row's calls per second over the plain "
                          f"row's ({dtype} K/V)")
                plain = {(key[0], key[1]): by_impl.get("ours")
                         for key, by_impl in rows_by_config.items()
                         if not next(iter(by_impl.values())).get("variant")}
                for row, (key, by_impl) in zip(rows, rows_by_config.items()):
                    fp8 = next(iter(by_impl.values())).get("kv_fp8")
                    row.append(_ratio(by_impl.get("ours"), plain.get((key[0], key[1])),
                                      "seconds", invert=True) if fp8 else "-")
        elif kind == "variants":
            title = (f"{dtype} {MODE_TITLES[mode]} TFLOP/s, options: B={first['batch']}, "
                     f"N={first['num_heads']}, H={first['head_dim']}, T = S; FLOPs count the "
                     f"visible logits only (visible: their share of B*T*S)")
            header = (["T", "variant", "causal", "visible"] + [f"{i} TFLOP/s" for i in impls]
                      + [f"{i} ms" for i in impls])
            with_ratio = "ours" in impls and base and base != "ours"
            if with_ratio:
                header.append(f"ours/{base}")
            # A bias or mask should cost no more than its bytes: those rows are set against our
            # plain full row of the same shape, and their bytes against our time.
            plain = {_shape(r): by_impl.get("ours") for by_impl in rows_by_config.values()
                     for r in by_impl.values() if r["variant"] == "full"}
            with_terms = "ours" in impls and any(r.get("term_bytes")
                                                 for by_impl in rows_by_config.values()
                                                 for r in by_impl.values())
            if with_terms:
                header += ["ours/plain", "term GB/s"]
                title += ("; ours/plain: our time of the full row over this row's, term GB/s: "
                          "the bias's or mask's bytes as passed over our time")
            rows = []
            for by_impl in rows_by_config.values():
                r = next(iter(by_impl.values()))
                row = [str(r["seqlen_q"]), r["variant"], "yes" if r["causal"] else "no",
                       f"{r['visible']:.2f}"]
                row += [_cell(by_impl.get(i), "tflops") for i in impls]
                row += [_cell(by_impl.get(i), "seconds", 1e3) for i in impls]
                if with_ratio:
                    row.append(_ratio(by_impl.get("ours"), by_impl.get(base), "tflops"))
                if with_terms:
                    row += _term_cells(by_impl.get("ours"), plain.get(_shape(r)))
                rows.append(row)
        elif kind == "packed":
            title, header, rows = _packed_table(dtype, mode, rows_by_config, impls, base,
                                                records)
        else:
            tokens = first["batch"] * first["seqlen_q"]
            title = (f"{dtype} {MODE_TITLES[mode]} TFLOP/s: {tokens} tokens per batch "
                     f"(B = {tokens}/T), hidden {first['num_heads'] * first['head_dim']} "
                     f"(N = hidden/H)")
            header = ["T", "H", "causal"] + [f"{i} TFLOP/s" for i in impls]
            with_ratio = "ours" in impls and base and base != "ours"
            if with_ratio:
                header.append(f"ours/{base}")
            rows = []
            for (t, s, h, causal, *_), by_impl in rows_by_config.items():
                row = [str(t), str(h), "yes" if causal else "no"]
                row += [_cell(by_impl.get(i), "tflops") for i in impls]
                if with_ratio:
                    row.append(_ratio(by_impl.get("ours"), by_impl.get(base), "tflops"))
                rows.append(row)
        tables.append((title, _markdown(header, rows)))
    return tables


def _shape(record: dict) -> tuple:
    """What a variants row shares with its plain full row: the sizes."""
    return (record["batch"], record["seqlen_q"], record["seqlen_k"], record["num_heads"],
            record["head_dim"])


def _term_cells(ours: dict | None, plain: dict | None) -> list[str]:
    """A variants row's ours/plain (`plain`'s time over `ours`'s: 1.00 when the bias or mask
    costs nothing) and term GB/s (the bias's and mask's bytes as passed over our time); "-"
    for a row without either, and where a time is missing."""
    if not ours or not ours.get("term_bytes"):
        return ["-", "-"]
    rate = (_number(ours["term_bytes"] / ours["seconds"] / 1e9) if ours["status"] == "ok"
            else "-")
    return [_ratio(ours, plain, "seconds", invert=True), rate]


def _packed_table(dtype, mode, rows_by_config, impls, base, records):
    """The packed preset's table: TFLOP/s of visible pairs and ms per implementation, ours
    over cudnn-packed and over `base`, and ours over our own dense causal row at T = the mean
    document length (where the records hold one)."""
    first = next(iter(next(iter(rows_by_config.values())).values()))
    tokens = first["batch"] * first["seqlen_q"]
    title = (f"{dtype} {MODE_TITLES[mode]} TFLOP/s, packed documents: {tokens} tokens per "
             f"batch (B = {tokens}/T), N={first['num_heads']}, H={first['head_dim']}, causal; "
             f"FLOPs count the visible pairs only (each document's causal pairs; visible: "
             f"their share of B*T*T)")
    bases = ([b for b in ("cudnn-packed", base) if b in impls and b != "ours"]
             if "ours" in impls else [])
    dense = {r["seqlen_q"]: r for r in records
             if r["kind"] == "packed" and r["mode"] == mode and r["dtype"] == dtype
             and r["impl"] == "ours" and r.get("doc_mean") is None}
    with_dense = "ours" in impls and any(r["doc_mean"] in dense
                                         for by_impl in rows_by_config.values()
                                         for r in by_impl.values() if r.get("doc_mean"))
    header = (["T", "B", "documents", "docs per row", "visible"] + [f"{i} TFLOP/s" for i in impls]
              + [f"{i} ms" for i in impls] + [f"ours/{b}" for b in bases]
              + (["ours/dense at T=mean"] if with_dense else []))
    rows = []
    for by_impl in rows_by_config.values():
        r = next(iter(by_impl.values()))
        mean = r.get("doc_mean")
        row = [str(r["seqlen_q"]), str(r["batch"]), r["variant"],
               f"{r['docs_per_row']:.1f}" if mean else "-", f"{r['visible']:.3f}"]
        row += [_cell(by_impl.get(i), "tflops") for i in impls]
        row += [_cell(by_impl.get(i), "seconds", 1e3) for i in impls]
        row += [_ratio(by_impl.get("ours"), by_impl.get(b), "tflops") for b in bases]
        if with_dense:
            row.append(_ratio(by_impl.get("ours"), dense.get(mean), "tflops") if mean else "-")
        rows.append(row)
    return title, header, rows


def failures(records: Sequence[dict], impl: str = "ours") -> list[dict]:
    return [r for r in records if r["impl"] == impl and r["status"] in ("FAIL", "error")]
