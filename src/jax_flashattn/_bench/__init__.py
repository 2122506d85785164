"""Benchmark machinery shared by `benchmarks/bench_attention.py` and `python -m jax_flashattn`.

Modules, in import order: `configs` (cases, FLOP counts, grids), `packed` (the packed preset's
documents and cuDNN's packed path), `impls` (the implementations and their inputs), `checks`
(the float32 reference slice and verdicts), `timing` (the timed loop, interleaved rounds, copy
bandwidth), `driver` (`run_benchmark`), `report` (environment, markdown tables, failures).
This package re-exports what the scripts and the main job use.

What is measured
----------------
* FLOPs: forward = 4·B·N·T·S·H (the two matmuls), halved when causal; backward = 2.5x
  forward, so forward+backward counts 3.5x forward (FlashAttention's convention, and the one
  behind the numbers in docs/performance.md). The variants preset (`variants_grid`) counts only
  the logits a call computes: each visible (t, s) pair costs 4·H per query head in the forward,
  3.5x that forward+backward, with the pairs counted exactly (`Config.visible_pairs`: each
  query row sees one interval of keys, cut by its causal and window bounds, the row's and the
  batch entry's lengths and, for the document mask, its document). Rows without such a
  restriction keep the counts above (causal: T·S/2, the convention, where the exact count is
  T(T+1)/2 for T = S, 0.01% more at T = 4096), so the preset's baselines match the standard
  grid. The bias rows count as full; GQA counts query heads, as everywhere. The packed preset
  (`packed_grid`) counts the same way: each document's causal pairs, L(L+1)/2 for a document
  of L positions; its dense causal rows have no restriction and keep T·S/2. Decode configs
  also report the bytes of K and V read, and the benchmark script sets that rate against the
  device's copy bandwidth (`copy_bandwidth`: cudaMemcpy device to device, bytes read plus
  written), measured before and after the cases (why that yardstick:
  docs/decisions/decode-benchmark-yardstick.md). Its paged rows (`decode_grid`'s page sizes)
  count the same K and V bytes, read through a page table from pages scattered over a pool
  (`impls._paged_cache`, built outside the timed call), and are set against the same call on
  contiguous K and V. Its e4m3 rows (`decode_grid`'s fp8) make the plain row's call on K and
  V quantised to float8_e4m3fn outside the timed call (`impls._e4m3_kv`), count one byte per
  K/V element, and are checked against the reference on those e4m3 values times their
  descales and set against the plain row by their calls per second.
* "fwdbwd" is one `jax.vjp` of attention with a fixed random cotangent g: the forward, then
  dq, dk, dv. That is `jax.value_and_grad` of the scalar loss sum(out * g) minus the loss's own
  reduction, which would add the same memory pass to every implementation.

How it is timed (`prepare`, `time_interleaved`)
-----------------------------------------------
* One timed run executes one jitted program: a `lax.fori_loop` with a static trip count whose
  body calls attention once on each of `n_sets` (2 by default) independently drawn input
  sets, so consecutive calls read different buffers (each set's K and V alone outsize the L2
  cache on the standard grid) and Python dispatch and the program's launch are paid once per
  run, not once per call. Nothing is subtracted.
* Each call depends on the previous call on the same set, so XLA can neither hoist it out of
  the loop nor overlap it: q[0, 0, 0, 0] is rewritten as `where(isnan(r), r, q0)` with r the
  sum of the first elements of every output of that set's previous call (out, and dq, dk, dv
  for "fwdbwd") and q0 that element as it was before the loop. The value never changes
  (unless an output is NaN), and every output of every call feeds the next, so no call or
  gradient is dead code (each round's outputs replace the last ones in the loop carry: with
  only out feeding the next call, XLA dropped all but the last of the unrolled rounds'
  backward calls, for every implementation alike, and forward+backward rows read far too
  fast). (XLA's own backward may still hoist dP = dO V^T, whose inputs no round changes, out
  of the loop: the "xla" forward+backward rows are an upper bound.) The update does not read
  q inside the loop, so XLA writes it in place: one one-element kernel per call. (Built from
  q's own element, the update made XLA copy all of q before every call, a cost every
  implementation paid that pulled the short rows' ratios towards one.)
* Inputs and outputs are donated and fed back, so the program copies nothing. The variants'
  extra arguments (bias, mask, lengths: `Inputs.extras`) are arguments of the program, one
  copy shared by the sets and not donated. They do not change inside the loop, so XLA may
  hoist work on them alone out of it (the "xla" rows' combined mask, the bias cast): such
  rows are upper bounds, like the "xla" forward+backward rows.
* The loop runs RUNNER_UNROLL rounds per iteration: each iteration of a GPU while loop waits
  on the host for its condition, and the launches of the next iteration then run with the GPU
  idle. That wait depends on each implementation's host-side launch cost, so with one round
  per iteration it would weigh on the implementations unequally.
* The trip count is picked from a FLOP/byte estimate so that a run lasts about `target_s`
  (25 ms; decode configs `decode_target_s`, 100 ms); the first run (after a separate, untimed
  compile) is a warm-up whose outputs feed the correctness check; then the median over
  `repeats` runs of run time / calls.
* Decode runs are longer because a run's fixed cost (dispatch, the first launch, the wait for
  the last; the same whatever the loop's unrolling) weighs on short calls. The decode rows are
  judged in TB/s against the card's copy bandwidth, where that overhead would count in full;
  the standard grid keeps 25 ms runs (its rows are compared as ratios, and each of its cases
  would take ~3x as long). cuDNN's calls at T = 8-16, which compute more than they read, run a
  few percent slower in the longer runs, which raises those rows' ratios by as much. (The
  measurements: docs/decisions/decode-benchmark-yardstick.md.)
* Every implementation goes through the same loop in the same process, so the ratios are
  like for like; on a shared, noisy GPU they are what to compare. The implementations of one
  case are compiled, warmed up and checked first, then run once more untimed (the first run
  after the checks, which leave the GPU idle, comes out slow), then timed in alternation
  (ABBA: A B, B A, A B, ...) for 7-15 rounds of about 0.6 s in all, so that a drift of the
  GPU's clocks or load during the case reaches every implementation alike instead of landing
  in the ratio (back-to-back blocks of runs let the short rows' ratios move between runs of
  the same code).
* Why each of these, with measurements: docs/decisions/benchmark-timing-method.md.

Correctness gate (`reference_slice`, `forward_verdict`, `grad_verdict`)
-----------------------------------------------------------------------
Before any timing, the output (and gradients) of the warm-up run on input set 0 are compared
with `reference.attention` in float32 on a slice of the full-size problem: batch entries 0 and
B-1, the first kv heads (with their query-head groups), and, for the forward check, the first
and last FORWARD_CHECK_ROWS/2 query rows (all keys; causal masking by the rows' true
positions). Batch entries, heads and query rows are independent in the forward, so the slice of
the full-size result must equal the reference on the sliced inputs. The forward+backward
check needs every query row (dk and dv sum over them) and so covers fewer heads. The references
run on the host's CPU backend: no GPU compile (and autotuning) per shape, nothing on the GPU
that is being measured. A forward+backward check past CHUNKED_GRADIENT_LOGITS logits (one
131072-token sequence) runs on the benchmark's device instead, by chunks of query rows at
float32's full matmul precision, before the timing.
* forward, bf16/fp16, each element: |out - ref| <= max(2 · max |ref_rounded - ref|, ulp(ref),
  u · sum_j p_j |v_j| + ulp(ref) / 2) + 1e-5 (max |ref| + 1), where ref_rounded rounds P and
  the output to the input dtype, ulp(ref) is the input dtype's spacing at that element and u
  its unit roundoff: `reference.error_budget`'s rule.
  float32: max |out - ref| <= 2e-5 (max |ref| + 1) (the tests also scale this by the largest
  logit; the benchmark inputs keep logits small).
* gradients: per tensor, normwise relative error <= GRAD_RTOL[dtype] and max abs error
  <= 4 · GRAD_RTOL[dtype] · max |ref| (so that one wrong row cannot hide in the norm).
* NaN or inf never passes. A failing config is reported as FAIL and not timed.
* The variants' options are part of the reference: the bias and mask are sliced like the
  logits ([B or 1, N or 1, T, S]: the checked batch entries, heads and query rows), the lengths
  like the batch, and the forward check's causal, window, length and mask bounds are applied
  at the rows' true positions (`_row_visibility`); the forward+backward reference takes them
  as `reference.attention`'s own arguments. The packed rows' documents reach the reference as
  their segment ids, whatever form an implementation takes them in (cuDNN's lengths and
  offsets for "cudnn-packed"). Query rows past a query length are checked too:
  jax.nn's "xla" and our kernels both return 0 there (and pass no gradient through them), and
  so did cuDNN (H100, JAX 0.11.2).
"""

from __future__ import annotations

from jax_flashattn._bench.checks import Verdict, forward_verdict, grad_verdict
from jax_flashattn._bench.configs import (
    ALL_IMPLS, DECODE_SEQLENS, DECODE_SHAPE, DTYPES, IMPLS, MODE_TITLES, MODES, RUNNER_UNROLL,
    STANDARD_HEAD_DIMS, STANDARD_HIDDEN, STANDARD_SEQLENS, STANDARD_TOKENS, VARIANTS_SEQLENS,
    VARIANTS_SHAPE, Config, attention_flops, decode_grid, document_bounds, document_ids,
    standard_grid, variants_grid)
from jax_flashattn._bench.driver import config_record, run_benchmark
from jax_flashattn._bench.packed import (
    CUDNN_PACKED_EXTRA, PACKED_MEANS, PACKED_SEQLENS, PACKED_SHAPE, PACKED_SIGMA, PACKED_TOKENS,
    Unavailable, cudnn_packed_api, cudnn_packed_arrays, draw_documents, packed_grid)
from jax_flashattn._bench.impls import (
    Inputs, attention_fn, available_impls, on_gpu, ours_implementation)
from jax_flashattn._bench.report import (
    environment, environment_lines, failures, forward_kernel_summary, markdown_tables)
from jax_flashattn._bench.timing import TimingSettings, build_runner, copy_bandwidth

__all__ = [
    "ALL_IMPLS",
    "CUDNN_PACKED_EXTRA",
    "Config",
    "DECODE_SEQLENS",
    "DECODE_SHAPE",
    "DTYPES",
    "IMPLS",
    "Inputs",
    "MODES",
    "MODE_TITLES",
    "PACKED_MEANS",
    "PACKED_SEQLENS",
    "PACKED_SHAPE",
    "PACKED_SIGMA",
    "PACKED_TOKENS",
    "RUNNER_UNROLL",
    "STANDARD_HEAD_DIMS",
    "STANDARD_HIDDEN",
    "STANDARD_SEQLENS",
    "STANDARD_TOKENS",
    "TimingSettings",
    "Unavailable",
    "VARIANTS_SEQLENS",
    "VARIANTS_SHAPE",
    "Verdict",
    "attention_flops",
    "attention_fn",
    "available_impls",
    "build_runner",
    "config_record",
    "copy_bandwidth",
    "cudnn_packed_api",
    "cudnn_packed_arrays",
    "decode_grid",
    "document_bounds",
    "document_ids",
    "draw_documents",
    "environment",
    "environment_lines",
    "failures",
    "forward_kernel_summary",
    "forward_verdict",
    "grad_verdict",
    "markdown_tables",
    "on_gpu",
    "ours_implementation",
    "packed_grid",
    "run_benchmark",
    "standard_grid",
    "variants_grid",
]
