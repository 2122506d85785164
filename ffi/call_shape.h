// A call without its buffers: the shapes, dtype and options that decide which kernels run and
// how large the workspaces are. The FFI handlers lay their AttentionParams out from it
// (ffi/call_frame.cc); the planner (ffi/plan.h) answers from it before any buffer exists, for
// Python's workspace sizes and kernel queries. One layout rule serves both.
#pragma once

#include <cstdint>

#include "ffi/params.h"

namespace jax_flashattn {

struct CallShape {
  ElemType dtype = ElemType::kFloat32;
  int64_t batch = 1;        // product of the dimensions before [T, N, H]
  int64_t batch_inner = 1;  // the user's B, the innermost of those
  int64_t seqlen_q = 0;     // T
  int64_t seqlen_k = 0;     // S
  int64_t num_heads = 0;    // N
  int64_t num_kv_heads = 1;  // K
  int64_t head_dim = 0;     // H
  float scale = 1.0f;
  float logits_soft_cap = 0.0f;  // AttentionParams::logits_soft_cap
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  bool align_window_to_lengths = false;  // AttentionParams::align_window_to_lengths
  // Which optional operands the call passes (read by the planner; the handlers take them from
  // the operands themselves).
  bool has_bias = false;
  bool has_mask = false;
  bool has_q_seqlens = false;
  bool has_kv_seqlens = false;
  bool has_segment_ids = false;  // query and key/value segment ids, both
  bool has_alibi = false;        // ALiBi slopes (AttentionParams::alibi_slopes)
  // A bias or mask of one key broadcast over S > 1 (its last dimension 1; the others are
  // read key by key).
  bool bias_broadcasts_keys = false;
  bool mask_broadcasts_keys = false;
  // Backward only: gradients bit-identical across runs (AttentionParams::deterministic).
  bool deterministic = false;
  // The kernel switches (AttentionParams::disable_sm90, sm80_cp_async).
  bool disable_sm90 = false;
  bool sm80_cp_async = false;
  // FP8 attention (AttentionParams::e4m3_attention; dtype is out's).
  bool e4m3_attention = false;
};

// The keys of FP8 attention's V^T (AttentionParams::vt_keys): S rounded up to whole 32-key
// steps of its P fragments.
inline int64_t VtKeys(int64_t seqlen_k) { return (seqlen_k + 31) / 32 * 32; }

// p's sizes, the strides of q-like [batch, T, N, H] and k-like [batch, S, K, H] tensors laid out
// contiguous and row-major (as XLA passes every operand), scale, window, deterministic flag and
// switches for `s`. Leaves every pointer, and so every optional operand, to the caller.
inline void SetLayout(const CallShape& s, AttentionParams& p) {
  p.dtype = s.dtype;
  p.batch = s.batch;
  p.batch_inner = s.batch_inner;
  p.seqlen_q = s.seqlen_q;
  p.seqlen_k = s.seqlen_k;
  p.num_heads = s.num_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.head_dim = s.head_dim;
  p.q_head_stride = s.head_dim;
  p.q_row_stride = s.num_heads * s.head_dim;
  p.q_batch_stride = s.seqlen_q * p.q_row_stride;
  p.kv_head_stride = s.head_dim;
  p.kv_row_stride = s.num_kv_heads * s.head_dim;
  p.kv_batch_stride = s.seqlen_k * p.kv_row_stride;
  p.scale = s.scale;
  p.logits_soft_cap = s.logits_soft_cap;
  p.window_left = s.window_left;
  p.window_right = s.window_right;
  p.align_window_to_lengths = s.align_window_to_lengths;
  p.deterministic = s.deterministic;
  p.disable_sm90 = s.disable_sm90;
  p.sm80_cp_async = s.sm80_cp_async;
  p.e4m3_attention = s.e4m3_attention;
  p.vt_keys = s.e4m3_attention ? VtKeys(s.seqlen_k) : 0;
}

}  // namespace jax_flashattn
