// The Hopper backward's bias and boolean mask (BackwardWithBiasAndMask), read the way the
// forward reads them (forward_bias_and_mask.cuh), on the transposed tile: as a step's S^T
// lands, each consumer thread reads its own elements from global memory (the tensors
// broadcast to [batch, N, T, S] with unit stride along the keys: bias_and_mask_fit), adds the
// bias to its base-2 logits and marks the elements the mask hides, and once dS^T is computed
// writes its elements of dbias. Element [j][e] of a thread's S^T is query
// q0 + 8 j + quad_col + e % 2, key key0 + quad_row + 8 (e / 2), so a warp's load of one
// [j][e] reads 8 consecutive keys of 4 query rows.
//
// dbias (float32, contiguous, broadcastable like the bias) is dS: with one writer per element
// each visible element is stored, and the dispatcher zeroes dbias first wherever a step or an
// element of [T, S] may not be visited (bounds, lengths, a mask); summed over broadcast
// dimensions it is added with float32 atomics into the dbias the dispatcher zeroed, one per
// key and quad where every query shares the bias (row stride 0).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/scalar.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/cuda/wgmma/backward_dq_add.cuh"  // BackwardConsumerThread, BackwardStep
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

template <typename Traits, typename HiddenBits>
struct BackwardBiasAndMask {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kQTiles = kBlockM / 8;  // 8-query column tiles of S^T

  const AttentionParams& p;
  int b;          // the block's batch entry
  int64_t key;    // this thread's first key: the block's, the warp's, then quad_row
  int quad_col;   // its first query of each 8-query column tile
  int consumer;   // its warpgroup's index among the consumers

  // Whether this thread writes dbias for 8-query tile j: with the head dim split both
  // consumers hold the whole S^T, so each writes half of the tiles.
  __device__ __forceinline__ bool writes_tile(int j) const {
    return !Traits::kSplitHeadDim || (j < kQTiles / 2) == (consumer == 0);
  }

  // The offset of this thread's element [0][0] of query head n's tile at q0 in a tensor that
  // broadcasts to [batch, N, T, S] with unit stride along the keys (or a single key). 32-bit
  // batch indices (indices_fit_32_bits).
  __device__ __forceinline__ int64_t offset_of(const BroadcastStrides& st, int n, int q0) const {
    const uint32_t inner = uint32_t(p.batch_inner > 0 ? p.batch_inner : 1);
    return int64_t(uint32_t(b) / inner) * st.batch_outer +
           int64_t(uint32_t(b) % inner) * st.batch_inner + int64_t(n) * st.head +
           int64_t(q0 + quad_col) * st.row + key * st.col;
  }

  // S^T (raw scores) as base-2 logits, scale_log2 times the score plus the bias times
  // log2(e), and the mask's hidden elements added to `hidden`. Elements already hidden (by
  // the lengths or the window, which also hide everything past [T, S]) are not read. Bias of
  // element type BiasElem; void: none.
  template <typename BiasElem>
  __device__ __forceinline__ void add(const BackwardStep& s, float scale_log2,
                                      HiddenBits& hidden, float (&s_acc)[kQTiles][4]) const {
    [[maybe_unused]] const BiasElem* bias = nullptr;
    [[maybe_unused]] int64_t bias_row = 0;
    if constexpr (!std::is_void_v<BiasElem>) {
      bias = static_cast<const BiasElem*>(p.bias) + offset_of(p.bias_strides, s.n, s.q0);
      bias_row = p.bias_strides.row;
    }
    const bool* keep =
        p.mask == nullptr ? nullptr : p.mask + offset_of(p.mask_strides, s.n, s.q0);
    const int64_t mask_row = p.mask_strides.row;
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * j + e % 2, c = 8 * (e / 2);
        bool visible = !((hidden >> (4 * j + e)) & 1);
        if (keep != nullptr && visible && !keep[r * mask_row + c]) {
          visible = false;
          hidden |= HiddenBits(1) << (4 * j + e);
        }
        float logit = s_acc[j][e] * scale_log2;
        if constexpr (!std::is_void_v<BiasElem>)
          if (visible) logit = fmaf(cuda::kLog2e, cuda::to_float(bias[r * bias_row + c]), logit);
        s_acc[j][e] = logit;
      }
  }

  // add for the call's bias type, chosen once per step.
  __device__ __forceinline__ void apply(const BackwardStep& s, float scale_log2,
                                        HiddenBits& hidden, float (&s_acc)[kQTiles][4]) const {
    if (p.bias == nullptr) return add<void>(s, scale_log2, hidden, s_acc);
    switch (p.bias_dtype) {
      case ElemType::kBFloat16: return add<__nv_bfloat16>(s, scale_log2, hidden, s_acc);
      case ElemType::kFloat16: return add<__half>(s, scale_log2, hidden, s_acc);
      default: return add<float>(s, scale_log2, hidden, s_acc);
    }
  }

  // This thread's elements of dS^T (of its half of the query tiles with the head dim split)
  // into dbias: stored or added at the visible ones, or, where every query shares the bias
  // (row stride 0), the visible ones summed over the thread's queries and then its quad's (the
  // lanes of the same keys), one atomic add per key and quad for keys inside S. Hidden elements
  // are skipped, not added as 0: a row past T holds another head's D, which may be NaN.
  __device__ __forceinline__ void store_dbias(const BackwardStep& s, HiddenBits hidden,
                                              const float (&ds)[kQTiles][4]) const {
    if (p.dbias == nullptr) return;
    float* dbias = p.dbias + offset_of(p.dbias_strides, s.n, s.q0);
    const int64_t row = p.dbias_strides.row;
    if (p.dbias_accumulates && row == 0) {
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kQTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (writes_tile(j) && !((hidden >> (4 * j + e)) & 1)) sum[e / 2] += ds[j][e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        if (threadIdx.x % 4 == 0 && key + 8 * h < p.seqlen_k)
          ptx::red_add_f32(dbias + 8 * h * p.dbias_strides.col, sum[h]);
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!writes_tile(j) || ((hidden >> (4 * j + e)) & 1)) continue;
        float* element = dbias + (8 * j + e % 2) * row + 8 * (e / 2) * p.dbias_strides.col;
        if (p.dbias_accumulates)
          ptx::red_add_f32(element, ds[j][e]);
        else
          *element = ds[j][e];
      }
  }
};

}  // namespace jax_flashattn::wgmma
