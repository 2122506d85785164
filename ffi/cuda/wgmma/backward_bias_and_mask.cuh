// The Hopper backward's bias, boolean mask and ALiBi (BackwardWithBiasAndMask), read the way
// the forward reads them (forward_bias_and_mask.cuh), on the transposed tile: as a step's S^T
// lands, each consumer thread reads its own elements of the bias and mask from global memory
// (the tensors broadcast to [batch, N, T, S] with unit stride along the keys:
// bias_and_mask_fit), adds the bias and ALiBi's term (alibi_terms.cuh) to its base-2 logits and
// marks the elements the mask hides, and once dS^T is computed writes its elements of dbias and
// adds the slopes' gradient. Element [j][e] of a thread's S^T is query
// q0 + 8 j + quad_col + e % 2, key key0 + quad_row + 8 (e / 2), so a warp's load of one
// [j][e] reads 8 consecutive keys of 4 query rows. BackwardWithStagedTerm's calls (a 2-byte
// bias alone or a mask alone) take their elements from the step's tile in shared memory
// instead (backward_term_tile.cuh): the bias by ldmatrix as S^T lands, the mask's bits before.
//
// dbias (float32, contiguous, broadcastable like the bias) is dS: with one writer per element
// each visible element is stored, and the dispatcher zeroes dbias first wherever a step or an
// element of [T, S] may not be visited (bounds, lengths, a mask); summed over broadcast
// dimensions it is added with float32 atomics into the dbias the dispatcher zeroed, one per
// key and quad where every query shares the bias (row stride 0). dslopes gets one partial sum
// per step from each warp, in a slot of the warp's own (add_slope_gradient).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/scalar.cuh"
#include "ffi/cuda/common/softmax.cuh"  // kLog2e
#include "ffi/cuda/wgmma/alibi_terms.cuh"
#include "ffi/cuda/wgmma/backward_dq_add.cuh"  // BackwardConsumerThread, BackwardStep
#include "ffi/cuda/wgmma/backward_term_tile.cuh"
#include "ffi/cuda/wgmma/staged_term.h"
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
  int lane;
  int warp_key;    // its warp's first key in the block
  uint32_t terms;  // stage 0's tile of a staged term (BackwardWithStagedTerm)

  // Whether this thread writes dbias for 8-query tile j: with the head dim split both
  // consumers hold the whole S^T, so each writes half of the tiles.
  __device__ __forceinline__ bool writes_tile(int j) const {
    return !Traits::kSplitHeadDim || (j < kQTiles / 2) == (consumer == 0);
  }

  // The offset of this thread's element [0][0] of query head n's tile at q0 in a tensor that
  // broadcasts to [batch, N, T, S] with unit stride along the keys (or a single key). 32-bit
  // batch indices (indices_fit_32_bits).
  __device__ __forceinline__ int64_t offset_of(const BroadcastStrides& st, int n, int q0) const {
    return st.head_offset32(b, p.batch_inner32(), n) + int64_t(q0 + quad_col) * st.row +
           key * st.col;
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

  // kStagedTerm: the elements of step s's tile that a staged mask hides, one bit each as in
  // the consumer's `hidden`; none for a bias. The bits do not depend on S^T, so they are read
  // before it lands, while its registers are not yet live beside dP^T's, two 8-query tiles at
  // a time (ptxas, head dim 128: the 32 byte reads as S^T landed spilled 124 bytes; before it,
  // all unrolled, 144).
  // Element [j][e]: row 8 j + quad_col + e % 2, key warp_key + lane / 4 + 8 (e / 2), in the
  // warp's one chunk of each row.
  __device__ __forceinline__ HiddenBits staged_mask_bits(const BackwardStep& s) const {
    HiddenBits bits = 0;
    if (staged_term(p) != StagedTerm::kMask) return bits;
    using Tile = BackwardTermTile<Traits, 1>;
    const uint32_t tile = terms + s.stage * Traits::kTermStageBytes;
#pragma unroll 2
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * j + quad_col + e % 2;
        const uint32_t at = Tile::chunk_at(r, warp_key / 16) + lane / 4 + 8 * (e / 2);
        if (ptx::ld_shared_u8(tile + at) == 0) bits |= HiddenBits(1) << (4 * j + e);
      }
    return bits;
  }

  // add for a staged bias of element type Term, from the step's tile in shared memory
  // (BackwardTermTile). Every element is added, hidden ones too: probabilities() zeroes their P
  // whatever their logit.
  template <typename Term>
  __device__ __forceinline__ void add_staged_bias(const BackwardStep& s, float scale_log2,
                                                  float (&s_acc)[kQTiles][4]) const {
    using Tile = BackwardTermTile<Traits, int(sizeof(Term))>;
    // Lane l gives row l % 8 of 8 x 8 block l / 8: query tile 2 jj + l / 16, the warp's chunk
    // (l / 8) % 2. Transposed, register m of a lane holds keys lane / 4 + 8 (m % 2), queries
    // quad_col, +1 of query tile 2 jj + m / 2: elements [j][2 (m % 2)], +1.
    const uint32_t at = terms + s.stage * Traits::kTermStageBytes +
                        Tile::chunk_at(8 * (lane / 16) + lane % 8, warp_key / 8 + (lane / 8) % 2);
#pragma unroll
    for (int jj = 0; jj < kQTiles / 2; ++jj) {
      uint32_t x[4];
      ptx::ldmatrix_x4_trans(x, at + jj * 16 * Tile::kRowBytes);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float2 pair = cuda::pair_to_float2<Term>(x[m]);
        float* element = &s_acc[2 * jj + m / 2][2 * (m % 2)];
        element[0] = fmaf(cuda::kLog2e, pair.x, element[0] * scale_log2);
        element[1] = fmaf(cuda::kLog2e, pair.y, element[1] * scale_log2);
      }
    }
  }

  // add for the call's bias type or (kStagedTerm) staged term, chosen once per step.
  __device__ __forceinline__ void add_bias_and_mask(const BackwardStep& s, float scale_log2,
                                                    HiddenBits& hidden,
                                                    float (&s_acc)[kQTiles][4]) const {
    if constexpr (Traits::kStagedTerm) {
      // A staged mask's bits are in `hidden` already (staged_mask_bits).
      switch (staged_term(p)) {
        case StagedTerm::kBFloat16Bias:
          return add_staged_bias<__nv_bfloat16>(s, scale_log2, s_acc);
        case StagedTerm::kFloat16Bias: return add_staged_bias<__half>(s, scale_log2, s_acc);
        default:
#pragma unroll
          for (auto& tile : s_acc)
#pragma unroll
            for (float& x : tile) x *= scale_log2;
          return;
      }
    }
    if (p.bias == nullptr) return add<void>(s, scale_log2, hidden, s_acc);
    switch (p.bias_dtype) {
      case ElemType::kBFloat16: return add<__nv_bfloat16>(s, scale_log2, hidden, s_acc);
      case ElemType::kFloat16: return add<__half>(s, scale_log2, hidden, s_acc);
      default: return add<float>(s, scale_log2, hidden, s_acc);
    }
  }

  // The offset of element [j][e]'s distance t + shift - s from that of element [0][0].
  __device__ __forceinline__ static constexpr int distance_offset(int j, int e) {
    return 8 * j + e % 2 - 8 * (e / 2);
  }

  // S^T times factor plus ALiBi's base-2 term -slope2 |t + shift - s| (the sign of the slope a
  // template parameter: alibi_terms.cuh); base: slope2 times element [0][0]'s distance. Hidden
  // elements take a term too: probabilities() zeroes their P.
  template <bool kNegative>
  __device__ __forceinline__ void add_alibi(float factor, float slope2, float base,
                                            float (&s_acc)[kQTiles][4]) const {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s_acc[j][e] = with_alibi_term<kNegative>(s_acc[j][e], factor, slope2, base,
                                                 distance_offset(j, e));
  }
  __device__ __forceinline__ void add_alibi(const BackwardStep& s, float factor,
                                            float (&s_acc)[kQTiles][4]) const {
    const cuda::AlibiLogits alibi = cuda::AlibiLogits::make(p, b, s.n);
    const float base = alibi.slope2 * float(s.q0 + quad_col + alibi.shift - key);
    if (alibi.slope2 < 0.f) return add_alibi<true>(factor, alibi.slope2, base, s_acc);
    add_alibi<false>(factor, alibi.slope2, base, s_acc);
  }

  // S^T as base-2 logits with the call's terms, and the mask's hidden elements added to
  // `hidden`. Whether ALiBi is on is decided once per step: calls without it run add alone.
  // With ALiBi alone nothing is read (the lengths and the window are in `hidden` already): add
  // is skipped and the scale's multiply goes into the term's FFMA. (add is inlined once, and
  // ALiBi's term on two paths of its own: with add on a path that skips it for ALiBi alone,
  // the consumers spilled registers held through the step loop at head dims 64 and 128.)
  __device__ __forceinline__ void apply(const BackwardStep& s, float scale_log2,
                                        HiddenBits& hidden, float (&s_acc)[kQTiles][4]) const {
    if (p.alibi_slopes != nullptr && p.bias == nullptr && p.mask == nullptr)
      return add_alibi(s, scale_log2, s_acc);
    add_bias_and_mask(s, scale_log2, hidden, s_acc);
    if (p.alibi_slopes != nullptr) add_alibi(s, 1.f, s_acc);
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

  // The slopes' gradient, a step at a time: this thread's |t + shift - s| dS summed over its
  // visible elements of dS^T (of its half of the query tiles with the head dim split; hidden
  // ones skipped, as in store_dbias); 0 where the call needs no dslopes.
  __device__ __forceinline__ float distance_ds(const BackwardStep& s, HiddenBits hidden,
                                               const float (&ds)[kQTiles][4]) const {
    if (p.dslopes == nullptr) return 0.f;
    const int64_t shift = cuda::AlibiLogits::make(p, b, s.n).shift;
    // Element [0][0]'s distance; every element's is exact in float32 (alibi.cuh).
    const float r = float(s.q0 + quad_col + shift - key);
    // One partial sum per e: four dependent FFMA chains rather than one.
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kQTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (writes_tile(j) && !((hidden >> (4 * j + e)) & 1))
          sum[e] = fmaf(fabsf(r + float(distance_offset(j, e))), ds[j][e], sum[e]);
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
  }

  // The step's distance_ds of every lane, summed over the warp and added into the warp's slot
  // of (b, n): slot (first key / 16) 4 + consumer. The warp's 16 keys start at a multiple of 16
  // (the block's first key plus 16 per warp), so no other warp of the block, nor of another
  // block (kBlockN keys each, a multiple of 16), has its first key in that granule, except with
  // the head dim split the other consumer's warp of the same keys, which the consumer index
  // tells apart; each head n of the block's GQA group has slots of its own. The writer adds
  // once per step, in step order. Every lane of the warp calls it.
  __device__ __forceinline__ void add_slope_gradient(const BackwardStep& s,
                                                     float distance_ds) const {
    if (p.dslopes == nullptr) return;
    // The warp's first key (quad_row < 8 keys below this thread's). A warp whose keys lie past
    // S (the last block's last warps) has no slot, nor any element to add; the test is
    // warp-uniform, so every lane or none reaches add_dslopes.
    const int64_t first_key = key / kDslopesGranule * kDslopesGranule;
    if (first_key >= p.seqlen_k) return;
    cuda::add_dslopes(p, b, s.n, cuda::dslopes_slot(first_key, consumer), distance_ds);
  }
};

}  // namespace jax_flashattn::wgmma
