"""The benchmark driver: runs a grid case by case (draw, check, time) with progress lines.
(Method: the package docstring.)"""

from __future__ import annotations

import gc
import sys
import time
from typing import Sequence

import jax

from jax_flashattn._bench.checks import reference_slice
from jax_flashattn._bench.configs import Config
from jax_flashattn._bench.impls import Inputs
from jax_flashattn._bench.packed import packed_record
from jax_flashattn._bench.timing import (TimingSettings, is_oom, prepare, short_message,
    time_interleaved)


class Progress:
    """A progress bar on stderr: rich, else tqdm, when stderr is a terminal; else one plain
    line per step (readable in logs)."""

    def __init__(self, total: int, description: str = "", enabled: bool = True):
        self.total, self.done, self.description = total, 0, description
        self._kind, self._bar = "plain", None
        self._start = time.perf_counter()
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                           TextColumn, TimeElapsedColumn)
                self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                         MofNCompleteColumn(), TimeElapsedColumn(),
                                         console=Console(stderr=True), transient=False)
                self._task = self._bar.add_task(description, total=total)
                self._kind = "rich"
            except ImportError:
                try:
                    from tqdm import tqdm
                    self._bar = tqdm(total=total, desc=description, file=sys.stderr)
                    self._kind = "tqdm"
                except ImportError:
                    pass
        self._enabled = enabled

    def __enter__(self):
        if self._kind == "rich":
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._kind == "rich":
            self._bar.stop()
        elif self._kind == "tqdm":
            self._bar.close()

    def step(self, label: str):
        """Announces the step about to run."""
        if self._kind == "rich":
            self._bar.update(self._task, description=label)
        elif self._kind == "tqdm":
            self._bar.set_description(label)
        elif self._enabled:
            elapsed = time.perf_counter() - self._start
            print(f"[{self.done + 1}/{self.total} {elapsed:6.1f}s] {label}", file=sys.stderr,
                  flush=True)

    def advance(self, n: int = 1):
        self.done += n
        if self._kind == "rich":
            self._bar.advance(self._task, n)
        elif self._kind == "tqdm":
            self._bar.update(n)

    def log(self, message: str):
        if self._kind == "rich":
            self._bar.console.print(message, markup=False, highlight=False)
        elif self._kind == "tqdm":
            self._bar.write(message, file=sys.stderr)
        elif self._enabled:
            print(message, file=sys.stderr, flush=True)


def config_record(cfg: Config) -> dict:
    record = dict(kind=cfg.kind, dtype=cfg.dtype, batch=cfg.batch, seqlen_q=cfg.seqlen_q,
                  seqlen_k=cfg.seqlen_k, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, causal=cfg.causal)
    if cfg.kind == "variants":
        # The options, the share of the B·T·S logits a call computes (FLOPs count those), and
        # the bytes of the bias and mask (the tables' term GB/s).
        record.update(variant=cfg.variant, window=cfg.window, q_lens=cfg.q_lens,
                      kv_lens=cfg.kv_lens, bias_shape=cfg.bias_shape, mask_docs=cfg.mask_docs,
                      segment_docs=cfg.segment_docs, soft_cap=cfg.soft_cap, sinks=cfg.sinks,
                      alibi=cfg.alibi,
                      bottom_right=cfg.bottom_right,
                      visible=cfg.visible_pairs() / (cfg.batch * cfg.seqlen_q * cfg.seqlen_k),
                      term_bytes=cfg.term_bytes())
    elif cfg.kind == "packed":
        record.update(packed_record(cfg))
    elif cfg.kind == "decode":
        if cfg.soft_cap is not None:
            record.update(soft_cap=cfg.soft_cap)
        if cfg.bias_shape is not None:
            record.update(bias_shape=cfg.bias_shape)
        if cfg.variant:  # "contiguous" or "paged P" (decode_grid's page sizes), or "e4m3"
            record.update(variant=cfg.variant, bottom_right=cfg.bottom_right,
                          page_size=cfg.page_size, kv_fp8=cfg.kv_fp8)
    return record


def run_benchmark(configs: Sequence[Config], impls: Sequence[str], modes: Sequence[str],
                  settings: TimingSettings | None = None, progress: bool = True) -> list[dict]:
    """Every (config, mode, impl), checked then timed, the implementations of a (config, mode)
    in alternation (`time_interleaved`); one flat list of records."""
    settings = settings or TimingSettings.for_backend()
    jobs = [(cfg, mode) for cfg in configs for mode in modes
            if not (cfg.kind == "decode" and mode != "fwd")]
    records = []
    # Steps: each implementation's check of a (config, mode), then its timing, one step.
    with Progress(len(jobs) * (len(impls) + 1), "attention", enabled=progress) as bar:
        for cfg in configs:
            cfg_modes = [m for c, m in jobs if c == cfg]
            if not cfg_modes:
                continue
            inputs = None
            t_draw = time.perf_counter()
            try:
                inputs = Inputs(cfg, settings.n_sets, settings.seed)
                jax.block_until_ready(inputs.sets)
                t_draw = time.perf_counter() - t_draw
            except Exception as e:  # noqa: BLE001
                failure = dict(status="OOM" if is_oom(e) else "error",
                               message="drawing inputs: " + short_message(e))
            for mode in cfg_modes:
                ref, ref_error = None, None
                t_ref = time.perf_counter()
                if inputs is not None:
                    try:
                        inputs.ensure_alive()
                        ref = reference_slice(cfg, inputs, mode == "fwdbwd",
                                              settings.check_budget)
                        t_ref = time.perf_counter() - t_ref
                    except Exception as e:  # noqa: BLE001
                        ref_error = "reference check failed: " + short_message(e)
                        inputs.invalidate()
                case_records, timers = [], []
                for impl in impls:
                    bar.step(f"{cfg.label()} {mode} {impl}")
                    if inputs is None:
                        record = dict(impl=impl, mode=mode, **failure)
                    elif ref is None:
                        record = dict(impl=impl, mode=mode, status="error", message=ref_error)
                    else:
                        record, timer = prepare(cfg, impl, mode, inputs, ref, settings)
                        if timer is not None:
                            timers.append(timer)
                    case_records.append(record)
                    bar.advance()
                bar.step(f"{cfg.label()} {mode}: timing {', '.join(impls)}")
                if timers:
                    time_interleaved(cfg, mode, timers, inputs, settings)
                bar.advance()
                for record in case_records:
                    record = dict(config_record(cfg), **record, flops=cfg.flops(mode),
                                  kv_bytes=cfg.kv_bytes(), draw_s=t_draw, reference_s=t_ref)
                    records.append(record)
                    bar.log(format_record(cfg, record))
                del ref, timers
            del inputs
            gc.collect()
    return records


def format_record(cfg: Config, record: dict) -> str:
    head = f"  {cfg.label()} {record['mode']} {record['impl']}:"
    if record["status"] != "ok":
        return f"{head} {record['status']} {record.get('message', '')}"[:400]
    extra = (f"{record['kv_tbps']:.2f} TB/s, {record['seconds'] * 1e6:.1f} us"
             if cfg.kind == "decode" else f"{record['tflops']:.4g} TFLOP/s")
    return f"{head} {extra} (median of {record['repeats']} runs of {record['calls']} calls)"
