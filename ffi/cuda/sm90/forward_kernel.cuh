// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One block per (kBlockM-row query tile, head, batch). Warpgroup 0 is the producer: one thread
// issues every TMA load, Q once and then K_j, V_j into a ring of kStages buffers, each guarded
// by a full barrier (the load landed) and an empty barrier (every consumer warp is done with
// it). Warpgroups 1.. are consumers of 64 query rows each; per K/V tile j they compute
//   S_j = Q K_j^T              wgmma, both operands in shared memory
//   mask                       only on tiles that straddle a length or window boundary
//   P_j = exp2(S_j - max)      online softmax, the scale folded into one FFMA
//   O += P_j V_j               wgmma, P from registers
// with the products of two tiles in flight together: S_{j+1} = Q K_{j+1}^T is issued before
// O += P_j V_j, and the softmax of S_{j+1} runs while P_j V_j is still computing; only the
// rescaling of O waits for it. The two consumer warpgroups take turns issuing their products
// (ping-pong on named barriers), so one's softmax runs under the other's tensor-core work. O
// is normalised once, staged in the consumer's rows of the Q tile and written with a TMA
// store (which also clips rows past T).
#pragma once

#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/sm80/fragments.cuh"
#include "ffi/cuda/sm90/ptx.cuh"
#include "ffi/cuda/sm90/tensor_maps.h"
#include "ffi/params.h"

namespace jax_flashattn::sm90 {

// The kernel body exists only in the sm_90a compilation (wgmma, setmaxnreg); the other
// targets of a multi-architecture build get an empty kernel the dispatcher never launches.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FLASHATTN_SM90_BODY 1
#endif

template <typename Traits>
struct ForwardBarriers {
  uint64_t q_full;
  uint64_t k_full[Traits::kStages], v_full[Traits::kStages];
  uint64_t k_empty[Traits::kStages], v_empty[Traits::kStages];
};

// Rows of a query tile that no key is visible to: O = 0 and lse = -inf, plain stores.
template <typename Elem>
__device__ void write_unseen_rows(const AttentionParams& p, int64_t b, int64_t n, int64_t row0,
                                  int64_t rows, int tid, int threads) {
  Elem* out = static_cast<Elem*>(p.out) + b * p.q_batch_stride + n * p.q_head_stride;
  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
  const int64_t valid = p.seqlen_q - row0 < rows ? p.seqlen_q - row0 : rows;
  for (int64_t i = tid; i < valid * p.head_dim; i += threads)
    out[(row0 + i / p.head_dim) * p.q_row_stride + i % p.head_dim] = Elem(0.f);
  for (int64_t i = tid; i < valid; i += threads) lse[row0 + i] = -INFINITY;
}

template <typename Elem, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    forward_kernel(const __grid_constant__ AttentionParams p,
                   const __grid_constant__ ForwardMaps maps) {
#ifdef JAX_FLASHATTN_SM90_BODY
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kHeadDim = Traits::kHeadDim;
  constexpr int kSpans = Traits::kSpans, kSpanElems = Traits::kSpanElems;
  constexpr int kKSteps = kHeadDim / 16;  // k16 steps of S = Q K^T
  constexpr int kPSteps = kBlockN / 16;   // k16 steps of O += P V
  constexpr int kNTiles = kBlockN / 8;    // 8-key column tiles of S
  constexpr int kDTiles = kHeadDim / 8;   // 8-wide column tiles of O
  constexpr uint32_t kRowBytes = 128;     // one swizzle span of one row
  constexpr uint32_t kGroupBytes = 8 * kRowBytes;  // 8-row core-matrix groups (descriptor SBO)

  // Tiles at 1024-byte boundaries (the 128-byte swizzle's period): Q, K stages, V stages,
  // then the barriers.
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_address = ptx::smem_address(smem_raw);
  const uint32_t base = (raw_address + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw_address);
  const uint32_t sQ = base;
  const auto sK = [&](int stage) { return base + Traits::kQBytes + stage * Traits::kKVBytes; };
  const auto sV = [&](int stage) {
    return base + Traits::kQBytes + (kStages + stage) * Traits::kKVBytes;
  };
  auto& bars = *reinterpret_cast<ForwardBarriers<Traits>*>(
      smem + Traits::kQBytes + 2 * kStages * Traits::kKVBytes);
  const auto bar = [](uint64_t& barrier) { return ptx::smem_address(&barrier); };

  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x / p.num_heads, n = blockIdx.x % p.num_heads;
  const int64_t kv_head = n / p.group_size();
  // Highest query tiles first: under causal masking they have the most keys.
  const int64_t row0 = int64_t(gridDim.y - 1 - blockIdx.y) * kBlockM;

  const cuda::Visibility vis = cuda::Visibility::make(p, b, n);
  int64_t key_lo, key_hi;
  vis.key_range(row0, row0 + kBlockM, key_lo, key_hi);
  if (key_hi <= key_lo) {
    write_unseen_rows<Elem>(p, b, n, row0, kBlockM, tid, Traits::kThreads);
    return;
  }
  const int tile_begin = int(key_lo / kBlockN);
  const int num_tiles = int((key_hi + kBlockN - 1) / kBlockN) - tile_begin;

  if (tid == 0) {
    ptx::mbarrier_init(bar(bars.q_full), 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(bar(bars.k_full[s]), 1);
      ptx::mbarrier_init(bar(bars.v_full[s]), 1);
      ptx::mbarrier_init(bar(bars.k_empty[s]), Traits::kConsumerWarps);
      ptx::mbarrier_init(bar(bars.v_empty[s]), Traits::kConsumerWarps);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    // Producer. Use u of stage s (tile j = u * kStages + s) waits for the consumers' release
    // of use u - 1, i.e. for phase u - 1 of the empty barrier.
    ptx::setmaxnreg_dec<Traits::kProducerRegisters>();
    if (tid == 0) {
      const int batch = int(b), head = int(n), kv = int(kv_head);
      ptx::mbarrier_arrive_expect_tx(bar(bars.q_full), Traits::kQBytes);
      for (int span = 0; span < kSpans; ++span)
        ptx::tma_load_4d(sQ + span * kBlockM * kRowBytes, &maps.q, bar(bars.q_full),
                         span * kSpanElems, head, int(row0), batch);
      for (int j = 0; j < num_tiles; ++j) {
        const int stage = j % kStages, use = j / kStages;
        const int key0 = (tile_begin + j) * kBlockN;
        if (use > 0) ptx::mbarrier_wait(bar(bars.k_empty[stage]), (use - 1) & 1);
        ptx::mbarrier_arrive_expect_tx(bar(bars.k_full[stage]), Traits::kKVBytes);
        for (int span = 0; span < kSpans; ++span)
          ptx::tma_load_4d(sK(stage) + span * kBlockN * kRowBytes, &maps.k,
                           bar(bars.k_full[stage]), span * kSpanElems, kv, key0, batch);
        if (use > 0) ptx::mbarrier_wait(bar(bars.v_empty[stage]), (use - 1) & 1);
        ptx::mbarrier_arrive_expect_tx(bar(bars.v_full[stage]), Traits::kKVBytes);
        for (int span = 0; span < kSpans; ++span)
          ptx::tma_load_4d(sV(stage) + span * kBlockN * kRowBytes, &maps.v,
                           bar(bars.v_full[stage]), span * kSpanElems, kv, key0, batch);
      }
    }
    return;
  }

  // Consumers.
  ptx::setmaxnreg_inc<Traits::kConsumerRegisters>();
  const int consumer = warpgroup - 1, warp = (tid / 32) % 4, lane = tid % 32;
  const int wg_row0 = consumer * 64;           // this warpgroup's rows of the tile
  const int warp_row0 = wg_row0 + warp * 16;   // this warp's 16 rows (its accumulator rows)
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);

  // Descriptors. Q and K are K-major (head dim contiguous): k-step ks lies in span ks / 4, 32
  // bytes per step into each 128-byte row. V is MN-major for O += P V (head dim contiguous,
  // keys along the reduction): k-step kk is 16 rows down, spans kBlockN rows apart (LBO).
  const auto q_desc = [&](int ks) {
    return ptx::smem_descriptor_sw128(
        sQ + (ks / 4) * kBlockM * kRowBytes + wg_row0 * kRowBytes + (ks % 4) * 32, 16,
        kGroupBytes);
  };
  const auto k_desc = [&](int stage, int ks) {
    return ptx::smem_descriptor_sw128(
        sK(stage) + (ks / 4) * kBlockN * kRowBytes + (ks % 4) * 32, 16, kGroupBytes);
  };
  const auto v_desc = [&](int stage, int kk) {
    return ptx::smem_descriptor_sw128(sV(stage) + kk * 16 * kRowBytes, kBlockN * kRowBytes,
                                      kGroupBytes);
  };

  float s_acc[1][kNTiles][4];
  float o_acc[1][kDTiles][4];
  uint32_t p_frag[kPSteps][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_acc[0][d][e] = 0.f;
  cuda::OnlineSoftmax<1> softmax;
  softmax.init();
  const float scale_log2 = p.scale * cuda::kLog2e;

  const auto fence_s = [&] {
#pragma unroll
    for (int t = 0; t < kNTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_register(s_acc[0][t][e]);
  };
  const auto fence_o = [&] {
#pragma unroll
    for (int t = 0; t < kDTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::fence_register(o_acc[0][t][e]);
  };
  const auto issue_qk = [&](int stage) {  // S = Q K^T, overwriting S
    fence_s();
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      ptx::wgmma_ss<kBlockN, Elem>(s_acc[0], q_desc(ks), k_desc(stage, ks), ks > 0);
    ptx::wgmma_commit_group();
  };
  const auto issue_pv = [&](int stage) {  // O += P V
    fence_o();
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk)
      ptx::wgmma_rs<kHeadDim, Elem>(o_acc[0], p_frag[kk], v_desc(stage, kk));
    ptx::wgmma_commit_group();
  };
  // Ping-pong: consumer c issues its products only while it holds the turn (named barrier
  // kTurnBarrier + c, completed by the other consumer's hand-over) and hands it over right after
  // issuing. Each consumer issues num_tiles + 1 times; consumer 1 gives consumer 0 the first
  // turn and skips its last hand-over, so every barrier sees as many arrivals as waits.
  static_assert(Traits::kConsumers == 2, "the ping-pong alternates two consumer warpgroups");
  constexpr int kTurnBarrier = 1 + Traits::kConsumers;  // after the epilogue barriers 1, 2
  const auto take_turn = [&] { ptx::named_barrier_sync(kTurnBarrier + consumer, 256); };
  const auto hand_over = [&] { ptx::named_barrier_arrive(kTurnBarrier + 1 - consumer, 256); };
  const auto release = [&](uint64_t& barrier) {
    if (lane == 0) ptx::mbarrier_arrive(bar(barrier));
  };
  // Masks tile j's scores where it straddles a boundary, then turns them into probabilities.
  const auto softmax_step = [&](int j, float (&correction)[1][2]) {
    const int64_t key0 = int64_t(tile_begin + j) * kBlockN;
    if (!vis.all_visible(row0 + warp_row0, row0 + warp_row0 + 16, key0, key0 + kBlockN)) {
      const cuda::TileVisibility tile_vis =
          cuda::TileVisibility::make(vis, row0, key0, kBlockM + kBlockN);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!tile_vis.visible(warp_row0 + quad_row + 8 * h, t * 8 + quad_col + e))
              s_acc[0][t][2 * h + e] = -INFINITY;
    }
    softmax.exponentiate(s_acc, scale_log2, correction);
  };
  // The S accumulators of 8-key tiles 2 kk, 2 kk + 1 are the A operand of k-step kk.
  const auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) sm80::pack_a<Elem>(p_frag[kk], s_acc[0], kk);
  };

  if (consumer == 1) hand_over();
  ptx::mbarrier_wait(bar(bars.q_full), 0);
  ptx::mbarrier_wait(bar(bars.k_full[0]), 0);
  take_turn();
  issue_qk(0);
  hand_over();
  ptx::wgmma_wait<0>();
  fence_s();
  release(bars.k_empty[0]);
  {
    float correction[1][2];  // O is still zero: nothing to rescale
    softmax_step(0, correction);
  }

  for (int j = 1; j < num_tiles; ++j) {
    const int stage = j % kStages, prev = (j - 1) % kStages;
    pack_p();
    ptx::mbarrier_wait(bar(bars.k_full[stage]), (j / kStages) & 1);
    ptx::mbarrier_wait(bar(bars.v_full[prev]), ((j - 1) / kStages) & 1);
    take_turn();
    issue_qk(stage);
    issue_pv(prev);
    hand_over();
    ptx::wgmma_wait<1>();  // S_j landed; P_{j-1} V_{j-1} may still be running
    fence_s();
    release(bars.k_empty[stage]);
    float correction[1][2];
    softmax_step(j, correction);
    ptx::wgmma_wait<0>();
    fence_o();
    release(bars.v_empty[prev]);
    cuda::OnlineSoftmax<1>::rescale(o_acc, correction);
  }
  pack_p();
  const int last = (num_tiles - 1) % kStages;
  ptx::mbarrier_wait(bar(bars.v_full[last]), ((num_tiles - 1) / kStages) & 1);
  take_turn();
  issue_pv(last);
  if (consumer == 0) hand_over();
  ptx::wgmma_wait<0>();
  fence_o();

  // Epilogue: normalise, write lse, stage O as Elem in this warpgroup's rows of the Q tile
  // (its own S products, the only readers of those rows, have completed) in the swizzled
  // layout the TMA store reads, then one thread stores each span.
  float row_lse[1][2];
  softmax.finalize(o_acc, scale_log2, row_lse);
  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + quad_row + 8 * h;
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) {
      const int span = d / 8, chunk = d % 8;
      const uint32_t offset =
          span * kBlockM * kRowBytes + row * kRowBytes + ((chunk ^ (row & 7)) << 4) + quad_col * 2;
      *reinterpret_cast<uint32_t*>(smem + offset) =
          ptx::pack2<Elem>(o_acc[0][d][2 * h], o_acc[0][d][2 * h + 1]);
    }
    if (lane % 4 == 0 && row0 + row < p.seqlen_q) lse[row0 + row] = row_lse[0][h];
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1 + consumer, 128);
  if (tid % 128 == 0) {
#pragma unroll
    for (int span = 0; span < kSpans; ++span)
      ptx::tma_store_4d(&maps.out, sQ + span * kBlockM * kRowBytes + wg_row0 * kRowBytes,
                        span * kSpanElems, int(n), int(row0 + wg_row0), int(b));
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read_all();
  }
#endif
}

}  // namespace jax_flashattn::sm90
