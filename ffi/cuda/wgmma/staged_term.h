// Which bias or mask a Hopper kernel copies into shared memory by cp.async, a 16-byte chunk at a
// time, rather than reading each element from global memory: the forward's WithStagedTerm
// (forward_bias_and_mask.cuh) and the backward's BackwardWithStagedTerm
// (backward_bias_and_mask.cuh) take the calls staged_term names.
#pragma once

#include <cstdint>

#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// The term a call stages: a bias of 2-byte elements alone, or a mask alone, whose rows start at
// 16-byte boundaries and whose key count is a whole number of 16-byte chunks (no chunk
// straddles S); kNone: each thread reads its elements from global memory.
enum class StagedTerm { kNone, kBFloat16Bias, kFloat16Bias, kMask };

JAX_FLASHATTN_HOST_DEVICE inline bool rows_aligned(const void* base, const BroadcastStrides& st,
                                                   int64_t elems, int64_t seqlen_k) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 &&
         (st.batch_outer | st.batch_inner | st.head | st.row | seqlen_k) % elems == 0;
}

JAX_FLASHATTN_HOST_DEVICE inline StagedTerm staged_term(const AttentionParams& p) {
  if (p.bias != nullptr && p.mask == nullptr &&
      rows_aligned(p.bias, p.bias_strides, 8, p.seqlen_k)) {
    if (p.bias_dtype == ElemType::kBFloat16) return StagedTerm::kBFloat16Bias;
    if (p.bias_dtype == ElemType::kFloat16) return StagedTerm::kFloat16Bias;
  }
  if (p.mask != nullptr && p.bias == nullptr &&
      rows_aligned(p.mask, p.mask_strides, 16, p.seqlen_k))
    return StagedTerm::kMask;
  return StagedTerm::kNone;
}

// Whether the staged term has a row of its own per query: a term every query shares (row
// stride 0: a [.., 1, S] bias, a key padding mask) would have each warp copy that one row into
// each of its rows from L2 (cp.async.cg bypasses L1), where each thread's own reads hit in L1.
JAX_FLASHATTN_HOST_DEVICE inline bool staged_rows_differ(const AttentionParams& p) {
  const StagedTerm term = staged_term(p);
  return term != StagedTerm::kNone &&
         (term == StagedTerm::kMask ? p.mask_strides.row : p.bias_strides.row) != 0;
}

}  // namespace jax_flashattn::wgmma
