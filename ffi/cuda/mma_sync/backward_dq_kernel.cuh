// FlashAttention-2 backward, dQ pass of the deterministic mode, with mma.sync.
//
// One block per (query tile, head, batch), shaped like the forward: each warp owns 16 query
// rows; Q and dO stay in shared memory (as register fragments they spilled at head dim 128)
// while K/V tiles stream through it (double-buffered with cp.async). Per K/V tile j:
//   S = Q K_j^T,  dP = dO V_j^T,  P from S and the saved lse,  dS = P (dP - D)
//   (soft-capped: P from the capped S, and dS times the cap's slope; with ALiBi, P with its term)
//   dQ += dS K_j     (the dS accumulators are already the A operand, K via ldmatrix.trans)
// Each dQ element has one writer and a fixed summation order: bit-identical across runs, at
// the cost of recomputing S and dP a second time (the dK/dV pass computes them too).
#pragma once

#include <cstdint>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/cuda/common/soft_cap.cuh"
#include "ffi/cuda/mma_sync/alibi_origin.cuh"
#include "ffi/cuda/mma_sync/backward_terms.cuh"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

// kSegments, kSoftCap, kAlibi: as backward_dkdv_kernel's.
template <typename Elem, typename Traits, bool kSegments, bool kSoftCap, bool kAlibi>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    backward_dq_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kSmemDim = Traits::kSmemDim;
  constexpr int kKSteps = Traits::kHeadDim / 16;  // S, dP reduction steps
  constexpr int kNTiles = kBlockN / 8;            // 8-key column tiles of S
  constexpr int kDTiles = Traits::kHeadDim / 8;   // 8-wide column tiles of dQ

  // Every kernel's smem_raw has the forward's alignment: extern __shared__ declarations of one
  // name must agree wherever two kernels' headers meet in a translation unit.
  extern __shared__ __align__(512) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);          // [kBlockM][kSmemDim]
  Elem* sdO = sQ + kBlockM * kSmemDim;                   // [kBlockM][kSmemDim]
  Elem* sK = sdO + kBlockM * kSmemDim;                   // [kStages][kBlockN][kSmemDim]
  Elem* sV = sK + Traits::kStages * kBlockN * kSmemDim;  // [kStages][kBlockN][kSmemDim]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const int64_t b = blockIdx.x / p.num_heads, n = blockIdx.x % p.num_heads;
  const int64_t kv_head = n / p.group_size();
  // Highest query tiles first: under causal masking they see the most keys.
  const int64_t row0 = int64_t(gridDim.y - 1 - blockIdx.y) * kBlockM;
  const int warp_row0 = warp * 16;

  const int64_t q_offset = b * p.q_batch_stride + n * p.q_head_stride + row0 * p.q_row_stride;
  const int64_t kv_offset = b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + kv_offset;
  const Elem* v = static_cast<const Elem*>(p.v) + kv_offset;
  Elem* dq = static_cast<Elem*>(p.dq) + q_offset;

  const HeadTerms head = HeadTerms::make<kSegments>(p, b, n);
  int64_t key_lo, key_hi;
  head.vis.key_range(row0, row0 + kBlockM, key_lo, key_hi);
  // Only the keys the spans of the ids or the mask allow (a no-op without them).
  variant::VisibleSpans::keys_of_rows(p, b).narrow(row0, row0 + kBlockM, key_lo, key_hi);
  const int64_t valid_rows = p.seqlen_q - row0 < kBlockM ? p.seqlen_q - row0 : kBlockM;

  if (key_hi <= key_lo) {  // no row of this tile sees a key: dQ = 0
    zero_rows<Traits>(dq, p.q_row_stride, valid_rows, p.head_dim, tid);
    return;
  }

  const int64_t tile_begin = key_lo / kBlockN, tile_end = (key_hi + kBlockN - 1) / kBlockN;
  auto load_kv = [&](int64_t tile, int stage) {
    load_kv_tile<Traits>(sK + stage * kBlockN * kSmemDim, sV + stage * kBlockN * kSmemDim, k, v,
                         tile * kBlockN, head.vis.kv_len, p, tid);
  };

  // Prologue: Q, dO and the first K/V tile in group 0, the second K/V tile in group 1.
  load_tile<Traits, kBlockM>(sQ, static_cast<const Elem*>(p.q) + q_offset, p.q_row_stride,
                             valid_rows, p.head_dim, tid);
  load_tile<Traits, kBlockM>(sdO, static_cast<const Elem*>(p.d_out) + q_offset, p.q_row_stride,
                             valid_rows, p.head_dim, tid);
  load_kv(tile_begin, 0);
  ptx::cp_async_commit();
  if (tile_begin + 1 < tile_end) load_kv(tile_begin + 1, 1);
  ptx::cp_async_commit();

  // lse and D of this thread's two rows (quad_row and quad_row + 8 of the warp's slab).
  float neg_lse2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t t = row0 + warp_row0 + quad_row + h * 8;
    neg_lse2[h] = head.neg_lse_log2(p, t);
    delta[h] = head.row_delta(p, t);
  }

  float dq_acc[kDTiles][4] = {};
  const float scale_log2 = p.scale * cuda::kLog2e;
  [[maybe_unused]] const auto soft_cap =
      kSoftCap ? cuda::SoftCapLogits::make(p) : cuda::SoftCapLogits{};
  [[maybe_unused]] const auto alibi_head =
      kAlibi ? cuda::AlibiLogits::make(p, b, n) : cuda::AlibiLogits{};

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int stage = int((tile - tile_begin) % Traits::kStages);
    const Elem* sK_stage = sK + stage * kBlockN * kSmemDim;
    const Elem* sV_stage = sV + stage * kBlockN * kSmemDim;
    ptx::cp_async_wait<1>();
    __syncthreads();

    // S = Q K^T and dP = dO V^T over this warp's 16 rows.
    float s_acc[kNTiles][4] = {};
    float dp_acc[kNTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t q_frag[4], do_frag[4];
      load_a_mk<kSmemDim>(q_frag, sQ, warp_row0, ks, lane);
      load_a_mk<kSmemDim>(do_frag, sdO, warp_row0, ks, lane);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t k_frag[4], v_frag[4];
        load_b_nk<kSmemDim>(k_frag, sK_stage, np * 16, ks, lane);
        load_b_nk<kSmemDim>(v_frag, sV_stage, np * 16, ks, lane);
        mma_pair<Elem>(s_acc, np, q_frag, k_frag);
        mma_pair<Elem>(dp_acc, np, do_frag, v_frag);
      }
    }

    // dS in place of dP. kAlibi: ALiBi's term per element, its distances from one origin per
    // tile moved to the thread's first element: the others lie at constant offsets from it.
    const int64_t key0 = tile * kBlockN;
    const bool check = !head.vis.all_visible(row0 + warp_row0, row0 + warp_row0 + 16, key0,
                                             key0 + kBlockN);
    [[maybe_unused]] AlibiOrigin alibi{};
    if constexpr (kAlibi)
      alibi = AlibiOrigin::at(alibi_head, row0 + warp_row0, key0).moved(quad_col - quad_row);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t t = row0 + warp_row0 + quad_row + (e / 2) * 8;
        const int64_t s = key0 + nt * 8 + quad_col + (e % 2);
        float score = s_acc[nt][e], score_scale = scale_log2;
        [[maybe_unused]] float slope = 1.f;
        if constexpr (kSoftCap) {
          score = soft_cap.apply(score);
          slope = soft_cap.slope(score);
          score_scale = 1.f;
        }
        float terms_log2 = neg_lse2[e / 2];  // and, kAlibi, ALiBi's term
        if constexpr (kAlibi)
          terms_log2 = alibi.add_term(terms_log2, nt * 8 + e % 2 - (e / 2) * 8);
        const float prob = head.prob(p, t, s, score, score_scale, terms_log2, check);
        dp_acc[nt][e] = prob * (dp_acc[nt][e] - delta[e / 2]);
        if constexpr (kSoftCap)  // a dS of 0 stays 0, whatever the slope (NaN at a hidden key)
          if (dp_acc[nt][e] != 0.f) dp_acc[nt][e] *= slope;
      }

    // dQ += dS K, reducing over the tile's keys.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t ds_frag[4];
      pack_a<Elem>(ds_frag, dp_acc, kk);
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t k_frag[4];
        load_b_kn<kSmemDim>(k_frag, sK_stage, kk * 16, dp * 16, lane);
        mma_pair<Elem>(dq_acc, dp, ds_frag, k_frag);
      }
    }

    __syncthreads();  // every warp is done with this stage before it is refilled
    if (tile + Traits::kStages < tile_end) load_kv(tile + Traits::kStages, stage);
    ptx::cp_async_commit();
  }

  // Epilogue: dQ = scale dS K, staged in the (now idle) Q tile, then 16-byte stores.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + quad_row + h * 8;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
      *reinterpret_cast<uint32_t*>(sQ + swizzled<kSmemDim>(row, d) + quad_col) =
          ptx::pack2<Elem>(p.scale * dq_acc[d][2 * h], p.scale * dq_acc[d][2 * h + 1]);
  }
  __syncthreads();
  store_tile<Traits, kBlockM>(dq, p.q_row_stride, sQ, valid_rows, p.head_dim, tid);
}

}  // namespace jax_flashattn::mma_sync
