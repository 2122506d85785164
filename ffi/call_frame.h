// Decoding of the FFI call frame into AttentionParams, shared by the CPU and CUDA handlers so
// both platforms accept exactly the same operands under the same target names.
#pragma once

#include <utility>

#include "ffi/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flashattn {

namespace ffi = xla::ffi;

// Attributes every call carries (see src/jax_flashattn/_ops.py).
struct CallAttrs {
  float scale;
  // > 0: the logits become cap tanh(logits / cap) before bias and masks (0: none).
  float logits_soft_cap;
  int64_t window_left;
  int64_t window_right;
  // Nonzero: the window moves per batch entry (AttentionParams::align_window_to_lengths).
  int32_t align_window_to_lengths;
  int32_t has_bias;
  int32_t has_mask;
  int32_t has_q_seqlens;
  int32_t has_kv_seqlens;
  // q_segment_ids, kv_segment_ids after the lengths
  int32_t has_segment_ids;
  // q_key_spans, kv_query_spans after the segment ids: the keys each 16 query rows may see and
  // the rows each 16 keys may be seen by (AttentionParams::q_key_spans), from the ids, the
  // mask or both; the kernels skip the tiles outside them.
  int32_t has_spans;
  // ALiBi slopes (float32 [..., B, N]) after the segment ids' operands, and the static part of
  // their diagonal (AttentionParams::alibi_shift).
  int32_t has_alibi;
  int64_t alibi_shift;
  // Forward only: k and v are a pool of pages [P, page_size, K, H] and the last optional operand
  // is the page table, int32 [B, max_pages] (AttentionParams::page_table); q is [B, T, N, H].
  int32_t has_page_table;
  // Forward only: k and v are float8_e4m3fn beside a float32, bfloat16 or float16 q (the CUDA
  // kernels: bfloat16 or float16), and their descales
  // (float32 [..., B, K] each, AttentionParams::k_descale / v_descale) follow the ALiBi slopes.
  int32_t has_kv_descale;
  // Backward only (the forward passes 0): dQ without atomics, bit-identical across runs.
  int32_t deterministic;
  // Backward only: the slopes' gradient is a result (after dbias, if any).
  int32_t want_dslopes;
  // The kernel switches (AttentionParams::disable_sm90, sm80_cp_async).
  int32_t disable_sm90;
  int32_t sm80_cp_async;
};

// Fills every field of p for a forward call: inputs, the optional inputs (which follow the fixed
// operands in `optional`, in the order bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
// kv_segment_ids, q_key_spans, kv_query_spans, alibi_slopes, k_descale, v_descale,
// page_table, each only when flagged), out, lse and the workspaces. Returns InvalidArgument
// naming the operand when a shape is wrong.
ffi::Error DecodeForward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::RemainingArgs& optional,
                         ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& lse,
                         ffi::Result<ffi::AnyBuffer>& workspace,
                         ffi::Result<ffi::AnyBuffer>& decode_workspace, const CallAttrs& attrs,
                         AttentionParams& p);

// The same for a backward call: also out, lse, d_out, dq, dk, dv, the workspaces dq_accum and
// delta, dbias where the caller needs the bias gradient (only with a bias) and dslopes where it
// needs the ALiBi slopes' (want_dslopes, only with them).
ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                          const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                          const ffi::AnyBuffer& lse, const ffi::AnyBuffer& d_out,
                          const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& dq,
                          ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                          ffi::Result<ffi::AnyBuffer>& dq_accum,
                          ffi::Result<ffi::AnyBuffer>& delta,
                          ffi::Result<ffi::AnyBuffer>& dq_semaphores,
                          const ffi::RemainingRets& dbias,
                          const CallAttrs& attrs, AttentionParams& p);

// The operands, results and attributes of the two targets, after any platform context, so the
// CPU and CUDA handlers bind exactly the same call.
template <typename Binding>
auto BindForward(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q [..., B, T, N, H]
      .template Arg<ffi::AnyBuffer>()  // k [..., B, S, K, H] (paged: [P, page_size, K, H])
      .template Arg<ffi::AnyBuffer>()  // v, like k
      .RemainingArgs()                 // bias?, mask?, q_seqlens?, kv_seqlens?,
                                       // q_segment_ids?, kv_segment_ids?,
                                       // q_key_spans?, kv_query_spans?, alibi_slopes?,
                                       // k_descale?, v_descale?, page_table?
      .template Ret<ffi::AnyBuffer>()  // out [..., B, T, N, H]
      .template Ret<ffi::AnyBuffer>()  // lse float32 [..., B, N, T]
      .template Ret<ffi::AnyBuffer>()  // workspace: int32 [..., 1], the Hopper tile counter
      .template Ret<ffi::AnyBuffer>()  // workspace: float32 [..., W], the decode kernel's
                                       // split partials (W may be 0; ffi/decode_plan.h)
      .template Attrs<CallAttrs>();
}

template <typename Binding>
auto BindBackward(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // out (forward result)
      .template Arg<ffi::AnyBuffer>()  // lse (forward result)
      .template Arg<ffi::AnyBuffer>()  // d_out, like out
      .RemainingArgs()                 // bias?, mask?, q_seqlens?, kv_seqlens?,
                                       // q_segment_ids?, kv_segment_ids?,
                                       // q_key_spans?, kv_query_spans?, alibi_slopes?
      .template Ret<ffi::AnyBuffer>()  // dq, like q
      .template Ret<ffi::AnyBuffer>()  // dk, like k
      .template Ret<ffi::AnyBuffer>()  // dv, like v
      .template Ret<ffi::AnyBuffer>()  // workspace: dq_accum float32, shaped like q
      .template Ret<ffi::AnyBuffer>()  // workspace: delta float32 [..., B, N, T]
      .template Ret<ffi::AnyBuffer>()  // workspace: dq_semaphores int32 [D], the Hopper
                                       // kernel's deterministic mode (D may be 0; ffi/plan.h)
      .RemainingRets()                 // dbias? float32 broadcastable to [..., B, N, T, S]
                                       // (the bias's shape, or the full one in
                                       // deterministic mode), where needed; dslopes?
                                       // float32 [..., B, N] (want_dslopes)
      .template Attrs<CallAttrs>();
}

}  // namespace jax_flashattn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_flashattn::CallAttrs,
                                      xla::ffi::StructMember<float>("scale"),
                                      xla::ffi::StructMember<float>("logits_soft_cap"),
                                      xla::ffi::StructMember<int64_t>("window_left"),
                                      xla::ffi::StructMember<int64_t>("window_right"),
                                      xla::ffi::StructMember<int32_t>("align_window_to_lengths"),
                                      xla::ffi::StructMember<int32_t>("has_bias"),
                                      xla::ffi::StructMember<int32_t>("has_mask"),
                                      xla::ffi::StructMember<int32_t>("has_q_seqlens"),
                                      xla::ffi::StructMember<int32_t>("has_kv_seqlens"),
                                      xla::ffi::StructMember<int32_t>("has_segment_ids"),
                                      xla::ffi::StructMember<int32_t>("has_spans"),
                                      xla::ffi::StructMember<int32_t>("has_alibi"),
                                      xla::ffi::StructMember<int64_t>("alibi_shift"),
                                      xla::ffi::StructMember<int32_t>("has_page_table"),
                                      xla::ffi::StructMember<int32_t>("has_kv_descale"),
                                      xla::ffi::StructMember<int32_t>("deterministic"),
                                      xla::ffi::StructMember<int32_t>("want_dslopes"),
                                      xla::ffi::StructMember<int32_t>("disable_sm90"),
                                      xla::ffi::StructMember<int32_t>("sm80_cp_async"));

// The four handlers, one per (op, platform); module.cc exposes them to Python.
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_flashattn_forward_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_flashattn_backward_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_flashattn_forward_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jax_flashattn_backward_cuda);
