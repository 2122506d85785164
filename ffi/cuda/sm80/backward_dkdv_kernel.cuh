// FlashAttention-2 backward, dK/dV pass, with mma.sync (sm_80 and newer).
//
// One block per (key block, kv head, batch). For every query head of the GQA group and every Q
// tile that can see the block (Q and dO double-buffered with cp.async):
//   S^T  = K Q^T,  dP^T = V dO^T         (warp: 16 keys x kSdpCols queries)
//   P^T  from S^T and the saved lse;  dS^T = P^T (dP^T - D)   (dbias = dS when there is a bias)
//   P^T, dS^T -> shared memory
//   dV  += P^T dO,  dK += dS^T Q         (warp: 16 keys x kDkvCols head-dim columns)
//   dQ  += dS K                          (warp: 16 queries x kDqCols; red.add into float32)
// Computing the transposed scores puts the keys on the rows, so P^T and dS^T are stored as
// they are computed and read back as A operands [key][query] for dV and dK; dQ, which reduces
// over keys, reads dS^T transposed (ldmatrix.trans). In deterministic mode the dQ product is
// skipped and backward_dq_kernel computes dQ instead.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/sm80/backward_terms.cuh"
#include "ffi/cuda/sm80/fragments.cuh"
#include "ffi/cuda/sm80/smem_tile.cuh"
#include "ffi/params.h"

namespace jax_flashattn::sm80 {

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    backward_dkdv_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kSmemDim = Traits::kSmemDim, kDsDim = Traits::kDsDim;
  constexpr int kKSteps = Traits::kHeadDim / 16;   // S^T, dP^T reduction steps
  constexpr int kSdpTiles = Traits::kSdpCols / 8;  // 8-query column tiles of a warp's S^T
  constexpr int kDkvTiles = Traits::kDkvCols / 8;  // 8-wide column tiles of a warp's dK, dV
  constexpr int kDqTiles = Traits::kDqCols / 8;    // 8-wide column tiles of a warp's dQ

  // Every kernel's smem_raw has the forward's alignment: extern __shared__ declarations of one
  // name must agree wherever two kernels' headers meet in a translation unit.
  extern __shared__ __align__(512) unsigned char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);            // [kBlockN][kSmemDim]
  Elem* sV = sK + kBlockN * kSmemDim;                      // [kBlockN][kSmemDim]
  Elem* sQ = sV + kBlockN * kSmemDim;                      // [kStages][kBlockM][kSmemDim]
  Elem* sdO = sQ + Traits::kStages * kBlockM * kSmemDim;   // [kStages][kBlockM][kSmemDim]
  Elem* sP = sdO + Traits::kStages * kBlockM * kSmemDim;   // P^T [kBlockN][kDsDim]
  Elem* sdS = sP + kBlockN * kDsDim;                       // dS^T [kBlockN][kDsDim]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);  // mma accumulator coordinates
  const int key_row0 = (warp % Traits::kKeySlabs) * 16;      // this warp's 16 keys
  const int sdp_col0 = (warp / Traits::kKeySlabs) * Traits::kSdpCols;  // ... its queries
  const int dkv_col0 = (warp / Traits::kKeySlabs) * Traits::kDkvCols;  // ... its dK/dV columns
  const int dq_row0 = (warp % Traits::kDqSlabs) * 16;                  // its dQ queries
  const int dq_col0 = (warp / Traits::kDqSlabs) * Traits::kDqCols;     // ... and columns

  const int64_t b = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const int64_t key0 = int64_t(blockIdx.y) * kBlockN;
  const int64_t warp_key0 = key0 + key_row0;
  const int64_t group = p.group_size(), head0 = kv_head * group;
  const int64_t valid_keys = p.seqlen_k - key0 < kBlockN ? p.seqlen_k - key0 : kBlockN;

  const int64_t kv_offset = b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + kv_offset;
  const Elem* v = static_cast<const Elem*>(p.v) + kv_offset;

  // The Q tiles that can see this block (the lengths and window are the same for every head of
  // the group; only a mask differs, and it is applied per element). With a bias every tile is
  // visited, so that every dbias element is written (0 where hidden).
  int64_t t_lo, t_hi;
  cuda::Visibility::make(p, b, head0).query_range(key0, key0 + kBlockN, t_lo, t_hi);
  if (p.dbias != nullptr) t_lo = 0, t_hi = p.seqlen_q;
  const int64_t tile_begin = t_lo / kBlockM;
  const int64_t tiles = t_hi > t_lo ? (t_hi + kBlockM - 1) / kBlockM - tile_begin : 0;
  const int64_t steps = tiles * group;  // (head, Q tile) pairs, heads outermost

  auto load_q_do = [&](int64_t step, int stage) {
    const int64_t n = head0 + step / tiles, q0 = (tile_begin + step % tiles) * kBlockM;
    const int64_t offset = b * p.q_batch_stride + n * p.q_head_stride + q0 * p.q_row_stride;
    load_tile<Traits, kBlockM>(sQ + stage * kBlockM * kSmemDim,
                               static_cast<const Elem*>(p.q) + offset, p.q_row_stride,
                               p.seqlen_q - q0, p.head_dim, tid);
    load_tile<Traits, kBlockM>(sdO + stage * kBlockM * kSmemDim,
                               static_cast<const Elem*>(p.d_out) + offset, p.q_row_stride,
                               p.seqlen_q - q0, p.head_dim, tid);
  };

  // Prologue: K, V and the first Q/dO tile in group 0, the second Q/dO tile in group 1.
  if (steps > 0) {
    load_tile<Traits, kBlockN>(sK, k + key0 * p.kv_row_stride, p.kv_row_stride, valid_keys,
                               p.head_dim, tid);
    load_tile<Traits, kBlockN>(sV, v + key0 * p.kv_row_stride, p.kv_row_stride, valid_keys,
                               p.head_dim, tid);
    load_q_do(0, 0);
  }
  ptx::cp_async_commit();
  if (steps > 1) load_q_do(1, 1);
  ptx::cp_async_commit();

  float dk_acc[kDkvTiles][4] = {};
  float dv_acc[kDkvTiles][4] = {};
  const float scale_log2 = p.scale * cuda::kLog2e;
  const bool accumulate_dq = !p.deterministic && warp < Traits::kDqWarps;

  for (int64_t step = 0; step < steps; ++step) {
    const int stage = int(step % Traits::kStages);
    const Elem* sQ_stage = sQ + stage * kBlockM * kSmemDim;
    const Elem* sdO_stage = sdO + stage * kBlockM * kSmemDim;
    const int64_t n = head0 + step / tiles, q0 = (tile_begin + step % tiles) * kBlockM;
    const HeadTerms head = HeadTerms::make(p, b, n);

    // lse and D of this thread's query columns, loaded before the wait so that their latency
    // overlaps it.
    float neg_lse2[kSdpTiles][2], delta[kSdpTiles][2];
#pragma unroll
    for (int mt = 0; mt < kSdpTiles; ++mt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t t = q0 + sdp_col0 + mt * 8 + quad_col + c;
        neg_lse2[mt][c] = head.neg_lse_log2(p, t);
        delta[mt][c] = head.row_delta(p, t);
      }

    ptx::cp_async_wait<1>();
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T over this warp's 16 keys x kSdpCols queries.
    float s_acc[kSdpTiles][4] = {};
    float dp_acc[kSdpTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t k_frag[4], v_frag[4];
      load_a_mk<kSmemDim>(k_frag, sK, key_row0, ks, lane);
      load_a_mk<kSmemDim>(v_frag, sV, key_row0, ks, lane);
#pragma unroll
      for (int mp = 0; mp < kSdpTiles / 2; ++mp) {
        uint32_t q_frag[4], do_frag[4];
        load_b_nk<kSmemDim>(q_frag, sQ_stage, sdp_col0 + mp * 16, ks, lane);
        load_b_nk<kSmemDim>(do_frag, sdO_stage, sdp_col0 + mp * 16, ks, lane);
        mma_pair<Elem>(s_acc, mp, k_frag, q_frag);
        mma_pair<Elem>(dp_acc, mp, v_frag, do_frag);
      }
    }

    // P^T and dS^T, rounded to Elem into shared memory; only parts that straddle a boundary
    // (or carry a mask) test elements.
    const int64_t warp_q0 = q0 + sdp_col0;
    const bool check = !head.vis.all_visible(warp_q0, warp_q0 + Traits::kSdpCols, warp_key0,
                                             warp_key0 + 16);
#pragma unroll
    for (int mt = 0; mt < kSdpTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t s = warp_key0 + quad_row + (e / 2) * 8;
        const int64_t t = warp_q0 + mt * 8 + quad_col + (e % 2);
        const float prob =
            head.prob(p, t, s, s_acc[mt][e], scale_log2, neg_lse2[mt][e % 2], check);
        const float ds = prob * (dp_acc[mt][e] - delta[mt][e % 2]);
        head.store_dbias(p, t, s, ds);
        s_acc[mt][e] = prob;
        dp_acc[mt][e] = ds;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int offset = swizzled<kDsDim>(key_row0 + quad_row + h * 8, sdp_col0 / 8 + mt) + quad_col;
        *reinterpret_cast<uint32_t*>(sP + offset) =
            ptx::pack2<Elem>(s_acc[mt][2 * h], s_acc[mt][2 * h + 1]);
        *reinterpret_cast<uint32_t*>(sdS + offset) =
            ptx::pack2<Elem>(dp_acc[mt][2 * h], dp_acc[mt][2 * h + 1]);
      }
    }
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q over this warp's 16 keys x kDkvCols columns, reducing over
    // the tile's queries.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t p_frag[4], ds_frag[4];
      load_a_mk<kDsDim>(p_frag, sP, key_row0, kk, lane);
      load_a_mk<kDsDim>(ds_frag, sdS, key_row0, kk, lane);
#pragma unroll
      for (int dp = 0; dp < kDkvTiles / 2; ++dp) {
        uint32_t do_frag[4], q_frag[4];
        load_b_kn<kSmemDim>(do_frag, sdO_stage, kk * 16, dkv_col0 + dp * 16, lane);
        load_b_kn<kSmemDim>(q_frag, sQ_stage, kk * 16, dkv_col0 + dp * 16, lane);
        mma_pair<Elem>(dv_acc, dp, p_frag, do_frag);
        mma_pair<Elem>(dk_acc, dp, ds_frag, q_frag);
      }
    }

    // dQ += dS K over this warp's 16 queries x kDqCols columns, reducing over the block's keys;
    // other key blocks add to the same rows, hence red.add into the float32 accumulator.
    if (accumulate_dq) {
      float dq_acc[kDqTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t ds_frag[4];
        load_a_km<kDsDim>(ds_frag, sdS, dq_row0, kk * 16, lane);
#pragma unroll
        for (int dp = 0; dp < kDqTiles / 2; ++dp) {
          uint32_t k_frag[4];
          load_b_kn<kSmemDim>(k_frag, sK, kk * 16, dq_col0 + dp * 16, lane);
          mma_pair<Elem>(dq_acc, dp, ds_frag, k_frag);
        }
      }
      float* dq_accum = p.dq_accum + b * p.q_batch_stride + n * p.q_head_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t t = q0 + dq_row0 + quad_row + h * 8;
        if (t >= head.vis.q_len) continue;  // rows past q_len have dS = 0
        float* row = dq_accum + t * p.q_row_stride;
#pragma unroll
        for (int j = 0; j < kDqTiles; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = dq_col0 + j * 8 + quad_col + c;
            if (col < p.head_dim) ptx::red_add_f32(row + col, dq_acc[j][2 * h + c]);
          }
      }
    }

    __syncthreads();  // every warp is done with this stage, sP and sdS before they are reused
    if (step + Traits::kStages < steps) load_q_do(step + Traits::kStages, stage);
    ptx::cp_async_commit();  // possibly empty, so wait<1> keeps meaning "this tile landed"
  }

  // Epilogue: dK = scale dS^T Q and dV, staged in the (now idle) K and V tiles, then 16-byte
  // coalesced stores. Keys no query sees (and keys past kv_len) store zeros.
  ptx::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = key_row0 + quad_row + h * 8;
#pragma unroll
    for (int d = 0; d < kDkvTiles; ++d) {
      const int offset = swizzled<kSmemDim>(row, dkv_col0 / 8 + d) + quad_col;
      *reinterpret_cast<uint32_t*>(sK + offset) =
          ptx::pack2<Elem>(p.scale * dk_acc[d][2 * h], p.scale * dk_acc[d][2 * h + 1]);
      *reinterpret_cast<uint32_t*>(sV + offset) =
          ptx::pack2<Elem>(dv_acc[d][2 * h], dv_acc[d][2 * h + 1]);
    }
  }
  __syncthreads();
  Elem* dk = static_cast<Elem*>(p.dk) + kv_offset + key0 * p.kv_row_stride;
  Elem* dv = static_cast<Elem*>(p.dv) + kv_offset + key0 * p.kv_row_stride;
  // store_tile's loop, fused over dK and dV so they share the index arithmetic.
  for (int i = tid; i < kBlockN * Traits::kChunks; i += Traits::kThreads) {
    const int row = i / Traits::kChunks, chunk = i % Traits::kChunks;
    if (row < valid_keys && chunk * 8 < p.head_dim) {
      const int64_t offset = row * p.kv_row_stride + chunk * 8;
      *reinterpret_cast<uint4*>(dk + offset) =
          *reinterpret_cast<const uint4*>(sK + swizzled<kSmemDim>(row, chunk));
      *reinterpret_cast<uint4*>(dv + offset) =
          *reinterpret_cast<const uint4*>(sV + swizzled<kSmemDim>(row, chunk));
    }
  }
}

}  // namespace jax_flashattn::sm80
