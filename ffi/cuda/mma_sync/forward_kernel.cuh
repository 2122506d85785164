// FlashAttention-2 forward with mma.sync (sm_80 and newer).
//
// One block per (query tile, head, batch). Per K/V tile j:
//   S = Q K_j^T          (K from swizzled shared memory; Q fragments kept in registers, or
//                         re-read from shared memory where registers are short)
//   soft-cap, bias, ALiBi, mask (only on tiles that straddle a boundary, without a cap or an
//                         elementwise term)
//   online softmax       (exp2 with the scale folded into one FFMA)
//   O += P V_j           (P re-packed from the S accumulators, V via ldmatrix.trans)
// while tile j + 1 is in flight: with cp.async, or on Hopper (kTmaKV) by TMA, which one thread
// issues per tile and which completes on an mbarrier (and then the warps are not held together
// per tile). O is normalised once at the end and written through shared memory with 16-byte
// stores.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/fragments.cuh"
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/cuda/common/soft_cap.cuh"
#include "ffi/cuda/common/softmax.cuh"
#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/mma_sync/alibi_origin.cuh"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

// kElementwise: the call has a bias, a boolean mask or ALiBi, applied element by element on
// every tile. Without one, only tiles that straddle a length or window boundary are masked,
// with int32 tile-relative compares; keeping the 64-bit bias/mask indexing out of that
// instantiation keeps its registers for the accumulators.
// kSegments (with kElementwise): also segment ids, in an instantiation of their own: as a test of
// the bias and mask instantiation they cost its rows 16-24% (docs/decisions/segment-ids.md).
// kSoftCap (with kElementwise): the logits are soft-capped (cuda::SoftCapLogits), in
// instantiations of their own, so that the others keep their code.
// kAlibi (with kElementwise): ALiBi (cuda::AlibiLogits), in instantiations of their own for the
// same reason: read at run time beside the bias, its code moved the bias and mask
// instantiations' register allocation, and their spills, both ways.
// kTmaKV (Hopper): K and V tiles come by TMA (maps.k, maps.v, boxes of kBlockN rows) in TMA's
// 128-byte-swizzled span layout: one thread issues two to eight loads per tile instead of every
// thread's cp.async with its 64-bit address arithmetic, and the stage's mbarrier, not a block
// barrier, says they landed. No block barrier says that a stage is free either: each warp
// counts itself done with it, and the last one refills it, so a warp waits only for data, never
// for the other warps (docs/decisions/mma-sync-tma-kv-loads-on-hopper.md).
template <typename Elem, typename Traits, bool kElementwise, bool kTmaKV, bool kSegments,
          bool kSoftCap, bool kAlibi>
__device__ __forceinline__ void forward_block(const AttentionParams& p, const wgmma::KVMaps& maps) {
  static_assert(kElementwise || !kSegments, "segment ids are an elementwise term");
  static_assert(kElementwise || !kSoftCap, "the soft-cap is an elementwise term");
  static_assert(kElementwise || !kAlibi, "ALiBi is an elementwise term");
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kSlabs = Traits::kSlabs, kSmemDim = Traits::kSmemDim;
  constexpr int kKSteps = Traits::kHeadDim / 16;  // QK^T reduction steps
  constexpr int kNTiles = kBlockN / 8;            // 8-key column tiles of S
  constexpr int kDTiles = Traits::kHeadDim / 8;   // 8-wide column tiles of O

  // Aligned to a whole swizzled row (at most 512 bytes) for LdmatrixAddress's XOR; with kTmaKV
  // to 1024 bytes (the period of TMA's swizzle, which SwizzledSpans' addressing assumes), up to
  // 1 KiB further in.
  extern __shared__ __align__(512) unsigned char smem_raw[];
  unsigned char* smem = smem_raw;
  if constexpr (kTmaKV) smem += (1024 - ptx::smem_address(smem_raw) % 1024) % 1024;
  Elem* sQ = reinterpret_cast<Elem*>(smem);                      // [kBlockM][kSmemDim]
  Elem* sK = sQ + kBlockM * kSmemDim;                            // [kStages][kBlockN][kSmemDim]
  Elem* sV = sK + Traits::kStages * kBlockN * kSmemDim;          // [kStages][kBlockN][kSmemDim]
  // kTmaKV: stage s's K and V tiles landed (one arrival with their bytes, then the bytes), and
  // how many times a warp has finished reading stage s (kWarps per use of the stage).
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(sV + Traits::kStages * kBlockN * kSmemDim);
  uint32_t* kv_done = reinterpret_cast<uint32_t*>(kv_full + Traits::kStages);
  using KVLayout = std::conditional_t<kTmaKV, SwizzledSpans<kBlockN>, SwizzledRows<kSmemDim>>;
  using KVAddress = LdmatrixAddress<KVLayout>;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);  // mma accumulator coordinates
  // Block order. Without a window every query tile has the same work: tiles vary fastest, so
  // the blocks resident together share one head's K/V, read from DRAM once and then from L2.
  // Under a window (causal included) highest tiles go first across all heads: they have the
  // most keys, so the long blocks start early and the short ones fill the tail
  // (docs/decisions/mma-sync-forward-tile-configs.md).
  const uint32_t heads = uint32_t(p.batch * p.num_heads), m_blocks = gridDim.x / heads;
  const bool equal_work = p.unwindowed();
  const uint32_t head = equal_work ? blockIdx.x / m_blocks : blockIdx.x % heads;
  const uint32_t m_block = equal_work ? blockIdx.x % m_blocks : m_blocks - 1 - blockIdx.x / heads;
  const int64_t b = head / p.num_heads, n = head % p.num_heads;
  const int64_t kv_head = n / p.group_size();
  const int64_t row0 = int64_t(m_block) * kBlockM;
  const int warp_row0 = warp * kSlabs * 16;

  const Elem* q = static_cast<const Elem*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  const Elem* v = static_cast<const Elem*>(p.v) + b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  Elem* out = static_cast<Elem*>(p.out) + b * p.q_batch_stride + n * p.q_head_stride;
  float* lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;

  const cuda::Visibility vis = cuda::Visibility::make(p, b, n);
  int64_t key_lo, key_hi;
  vis.key_range(row0, row0 + kBlockM, key_lo, key_hi);
  // kElementwise: only the keys the spans allow (a no-op without them): with segment ids the
  // keys of the documents the block's rows are in (a causal packed row then costs about its
  // documents' causal work, not the row's), with a mask those between its rows' first and last
  // kept key.
  if constexpr (kElementwise)
    variant::VisibleSpans::keys_of_rows(p, b).narrow(row0, row0 + kBlockM, key_lo, key_hi);
  const int64_t valid_rows = p.seqlen_q - row0 < kBlockM ? p.seqlen_q - row0 : kBlockM;

  if (key_hi <= key_lo) {  // no row of this tile sees a key: O = 0, lse = -inf
    zero_rows<Traits>(out + row0 * p.q_row_stride, p.q_row_stride, valid_rows, p.head_dim, tid);
    for (int row = tid; row < valid_rows; row += Traits::kThreads) lse[row0 + row] = -INFINITY;
    return;
  }

  const int64_t tile_begin = key_lo / kBlockN, tile_end = (key_hi + kBlockN - 1) / kBlockN;
  // TMA reads keys past S (and head dims past H) as zeros, as load_kv_tile's zero-fill does.
  // kTmaKV: issued by one thread (the last warp done with the stage, or thread 0 at the start).
  auto issue_kv_tma = [&](int64_t tile, int stage) {
    if constexpr (kTmaKV) {
      constexpr int kSpans = Traits::kTmaSpans, kSpanElems = Traits::kSpanElems;
      constexpr int kSpanBytes = KVLayout::kSpanBytes;  // [kBlockN][128 bytes]
      const uint32_t full = ptx::smem_address(&kv_full[stage]);
      const uint32_t k_tile = ptx::smem_address(sK + stage * kBlockN * kSmemDim);
      const uint32_t v_tile = ptx::smem_address(sV + stage * kBlockN * kSmemDim);
      ptx::mbarrier_arrive_expect_tx(full, 2 * kSpans * kSpanBytes);
#pragma unroll
      for (int span = 0; span < kSpans; ++span) {
        ptx::tma_load_4d(k_tile + span * kSpanBytes, &maps.k, full, span * kSpanElems,
                         int(kv_head), int(tile * kBlockN), int(b));
        ptx::tma_load_4d(v_tile + span * kSpanBytes, &maps.v, full, span * kSpanElems,
                         int(kv_head), int(tile * kBlockN), int(b));
      }
    }
  };
  auto load_kv = [&](int64_t tile, int stage) {
    if constexpr (kTmaKV) {
      if (tid == 0) issue_kv_tma(tile, stage);
    } else {
      load_kv_tile<Traits>(sK + stage * kBlockN * kSmemDim, sV + stage * kBlockN * kSmemDim, k,
                           v, tile * kBlockN, vis.kv_len, p, tid);
    }
  };

  // Prologue: Q and the first K/V tile in group 0, the second K/V tile (if any) in group 1
  // (kTmaKV: Q alone in group 0, waited for here; the K/V tiles on their barriers, which are
  // initialised before anything may arrive on them).
  if constexpr (kTmaKV) {
    if (tid == 0) {
      for (int s = 0; s < Traits::kStages; ++s) {
        ptx::mbarrier_init(ptx::smem_address(&kv_full[s]), 1);
        kv_done[s] = 0;
      }
      ptx::fence_barrier_init();
    }
    __syncthreads();
  }
  load_tile<Traits, kBlockM>(sQ, q + row0 * p.q_row_stride, p.q_row_stride, valid_rows,
                             p.head_dim, tid);
  load_kv(tile_begin, 0);
  ptx::cp_async_commit();
  if (tile_begin + 1 < tile_end) load_kv(tile_begin + 1, 1);
  ptx::cp_async_commit();
  if constexpr (kTmaKV) {
    ptx::cp_async_wait<0>();
    __syncthreads();
  }

  // Q fragments: all k-steps held for the whole loop, or one k-step at a time re-read from
  // shared memory (which frees the registers for a second slab per warp).
  constexpr bool kQInRegisters = Traits::kQInRegisters;
  uint32_t q_frag[kSlabs][kQInRegisters ? kKSteps : 1][4];
  float o_acc[kSlabs][kDTiles][4] = {};
  cuda::OnlineSoftmax<kSlabs> softmax;
  softmax.init();
  // Whether every row of this warp below the query length has a finite row maximum, which
  // exponentiate_against_settled_max needs (rows past the query length never see a key and
  // stay at -inf). A row below it that has seen no key yet keeps the warp on the full update.
  bool settled = false;
  // With a bias, ALiBi or a soft-cap the scores are moved to the log2 domain before the
  // softmax (the bias and ALiBi are added after scaling, the cap bends the scaled logit);
  // without any the scale is folded into the softmax's FFMA.
  const bool has_bias = kElementwise && p.bias != nullptr;
  const float scale_log2 = p.scale * cuda::kLog2e;
  // On the scores the bias meets (kAlibi: ALiBi's pass has scaled them where there is no cap).
  const float bias_score_scale = kSoftCap || kAlibi ? 1.f : scale_log2;
  const float softmax_scale = has_bias || kAlibi || kSoftCap ? 1.f : scale_log2;
  [[maybe_unused]] const auto soft_cap =
      kSoftCap ? cuda::SoftCapLogits::make(p) : cuda::SoftCapLogits{};
  [[maybe_unused]] const auto alibi =
      kAlibi ? cuda::AlibiLogits::make(p, b, n) : cuda::AlibiLogits{};

  // ldmatrix row address pattern: lane l addresses row l % 8 of matrix l / 8. A operands
  // (Q) take matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15); the
  // B operands of two adjacent 8-key tiles (K) take (keys 0-7, k 0-7), (0-7, 8-15),
  // (8-15, 0-7), (8-15, 8-15); V, transposed, takes keys as rows like Q.
  const int ld_row = lane % 8, ld_matrix = lane / 8;
  const LdmatrixAddress<SwizzledRows<kSmemDim>> q_address(
      sQ + warp_row0 * kSmemDim, (ld_matrix & 1) * 8 + ld_row, ld_matrix >> 1);
  auto load_q = [&](int ks, int slot) {
#pragma unroll
    for (int m = 0; m < kSlabs; ++m) ptx::ldmatrix_x4(q_frag[m][slot], q_address(m, ks));
  };

  // kSegments: the block's ids, made once (a copy per use cost instructions, and ptxas spilled
  // more), and the range of the ids of this warp's rows below the query length (empty, lo > hi,
  // where it has none).
  [[maybe_unused]] const auto ids =
      kSegments ? variant::SegmentIds::make(p, b) : variant::SegmentIds{};
  [[maybe_unused]] int32_t warp_id_lo = 0, warp_id_hi = -1;
  if constexpr (kSegments) {
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int i = lane; i < kSlabs * 16; i += 32) {
      const int64_t row = row0 + warp_row0 + i;
      if (row < vis.q_len) lo = min(lo, ids.q[row]), hi = max(hi, ids.q[row]);
    }
    warp_id_lo = __reduce_min_sync(0xffffffffu, lo);
    warp_id_hi = __reduce_max_sync(0xffffffffu, hi);
  }

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int stage = int((tile - tile_begin) % Traits::kStages);
    const KVAddress k_address(sK + stage * kBlockN * kSmemDim, (ld_matrix >> 1) * 8 + ld_row,
                              ld_matrix & 1);
    const KVAddress v_address(sV + stage * kBlockN * kSmemDim, (ld_matrix & 1) * 8 + ld_row,
                              ld_matrix >> 1);
    if constexpr (kTmaKV) {
      // The n-th use of a stage completes its barrier's phase n.
      ptx::mbarrier_wait(ptx::smem_address(&kv_full[stage]),
                         uint32_t((tile - tile_begin) / Traits::kStages) & 1);
      // The tensor map spans S, so the tile that holds a batch entry's key length brought the
      // cache's rows past it: V's are zeroed before any P V reads them (K's scores are masked;
      // docs/decisions/keys-past-the-length-never-read.md).
      // Between block barriers: the first orders the stage's reads of its previous tile (which
      // the refill followed through the counts, not a barrier) before the stores, the second the
      // stores before this tile's reads; the proxy fence orders them before the TMA refill.
      if (vis.kv_len < p.seqlen_k && (tile + 1) * kBlockN > vis.kv_len) {
        __syncthreads();
        zero_tile_rows<KVLayout, kBlockN, Traits::kTmaSpans * 8>(
            sV + stage * kBlockN * kSmemDim, int(vis.kv_len - tile * kBlockN), tid,
            Traits::kThreads);
        ptx::fence_proxy_async_shared();
        __syncthreads();
      }
    } else {
      ptx::cp_async_wait<1>();
      __syncthreads();
    }

    if (kQInRegisters && tile == tile_begin) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) load_q(ks, ks);
    }

    // S = Q K^T, then lengths and windows, then bias, ALiBi and mask: a tile with neither
    // boundary nor elementwise term looks at no element.
    float s_acc[kSlabs][kNTiles][4];
    auto compute_scores = [&] {
#pragma unroll
      for (int m = 0; m < kSlabs; ++m)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s_acc[m][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        if (!kQInRegisters) load_q(ks, 0);
        const int q_slot = kQInRegisters ? ks : 0;
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t k_frag[4];
          ptx::ldmatrix_x4(k_frag, k_address(np, ks));
#pragma unroll
          for (int m = 0; m < kSlabs; ++m) mma_pair<Elem>(s_acc[m], np, q_frag[m][q_slot], k_frag);
        }
      }

      const int64_t key0 = tile * kBlockN;
      // kAlibi: every element's term, hidden ones too (the masks below, or the -inf they left,
      // still hide them). Without a cap it comes first and scales the scores into the log2
      // domain, where the bias then meets them; with one it follows the cap and the bias. Its
      // distances from one origin per tile, moved to the thread's first element: the others lie
      // at constant offsets from it.
      [[maybe_unused]] const auto add_alibi = [&](float score_scale) {
        const AlibiOrigin origin =
            AlibiOrigin::at(alibi, row0, key0).moved(quad_col - warp_row0 - quad_row);
#pragma unroll
        for (int m = 0; m < kSlabs; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& score = s_acc[m][nt][2 * h + e];
                score = origin.add_term(score * score_scale, nt * 8 + e - m * 16 - h * 8);
              }
      };
      if constexpr (kAlibi && !kSoftCap) add_alibi(scale_log2);

      const bool all_visible = vis.all_visible(row0 + warp_row0, row0 + warp_row0 + kSlabs * 16,
                                               key0, key0 + kBlockN);
      if (kElementwise || !all_visible) {
        // Each element's visibility from a bit of its row (TileVisibility::column_bits), not four
        // compares, which hold more registers and spill more at head dims 96 and 128. With Q in
        // registers (head dim 32) and a bias or mask, the bits spill far more, so that
        // instantiation keeps the compares
        // (docs/decisions/int32-bounds-and-column-bits-masking.md).
        constexpr bool kColumnBits = !(kElementwise && kQInRegisters);
        const cuda::TileVisibility tile_vis =
            cuda::TileVisibility::make(vis, row0, key0, kBlockM + kBlockN);
#pragma unroll
        for (int m = 0; m < kSlabs; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp_row0 + m * 16 + quad_row + h * 8;
            uint32_t bits[(2 * kNTiles + 31) / 32];  // this thread's visible elements of row r
            if constexpr (kColumnBits) tile_vis.column_bits<kNTiles>(r, quad_col, bits);
            [[maybe_unused]] int64_t bias_base = 0, mask_base = 0;
            if constexpr (kElementwise) {
              bias_base = has_bias ? p.bias_strides.offset(b, p.batch_inner, n, row0 + r, key0) : 0;
              mask_base = vis.mask.slice.at(row0 + r, key0);
            }
            // Row r's segment id (none past the query length, where nothing is visible) and
            // the tile's key ids.
            [[maybe_unused]] int32_t row_id = 0;
            [[maybe_unused]] const int32_t* key_ids = nullptr;
            if constexpr (kSegments) {
              row_id = row0 + r < vis.q_len ? ids.q[row0 + r] : 0;
              key_ids = ids.kv + key0;
            }
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int c = nt * 8 + quad_col + e;
                float& score = s_acc[m][nt][2 * h + e];
                // Visible elements lie inside [seqlen_q, seqlen_k): only they are read.
                bool keep = kColumnBits ? cuda::TileVisibility::column_visible(bits, 2 * nt + e)
                                        : tile_vis.visible(r, c);
                if constexpr (kSoftCap)
                  if (keep) score = soft_cap.apply(score);
                if constexpr (kElementwise) {
                  if (keep && has_bias)
                    score = fmaf(score, bias_score_scale,
                                 cuda::kLog2e * variant::AdditiveBias::element(
                                                    p.bias, p.bias_dtype,
                                                    bias_base + c * p.bias_strides.col));
                  if (keep && vis.mask.present())
                    keep = vis.mask.keep[mask_base + c * vis.mask.slice.col];
                  if constexpr (kSegments)
                    if (keep) keep = key_ids[c] == row_id;
                }
                if (!keep) score = -INFINITY;
              }
          }
      }
      if constexpr (kAlibi && kSoftCap) add_alibi(1.f);
    };

    // P against the settled row maxima where every row of the warp has one; otherwise, or
    // where a score rose too far above its maximum, the full update, which looks for the new
    // maxima and rescales O (on scores recomputed, as the first attempt spent them). Written
    // as two calls, not a retry loop: in a loop the compiler hoists the masking predicates of
    // every element out of it and evaluates them on every tile.
    // The elementwise instantiation keeps the full update on every tile: the second copy of
    // its scores (with the bias and mask reads) spills heavily
    // (docs/decisions/settled-row-maxima.md).
    // kSegments: a warp none of whose rows shares a segment id range with the tile's keys
    // computes nothing on it (it still counts itself done with the stage below).
    bool warp_computes = true;
    if constexpr (kSegments) {
      int32_t lo = INT32_MAX, hi = INT32_MIN;
      for (int i = lane; i < kBlockN; i += 32) {
        const int64_t key = tile * kBlockN + i;
        if (key < vis.kv_len) lo = min(lo, ids.kv[key]), hi = max(hi, ids.kv[key]);
      }
      lo = __reduce_min_sync(0xffffffffu, lo);
      hi = __reduce_max_sync(0xffffffffu, hi);
      warp_computes = lo <= warp_id_hi && warp_id_lo <= hi;
    }
    if (warp_computes) {
      compute_scores();
      if (kElementwise || !settled ||
          !softmax.exponentiate_against_settled_max(s_acc, softmax_scale)) {
        if (!kElementwise && settled) compute_scores();
        softmax.update(s_acc, o_acc, softmax_scale);
        if constexpr (!kElementwise) {
          bool rows_settled = true;
#pragma unroll
          for (int m = 0; m < kSlabs; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              rows_settled =
                  rows_settled && (softmax.row_max[m][h] > -INFINITY ||
                                   row0 + warp_row0 + m * 16 + quad_row + h * 8 >= vis.q_len);
          settled = __all_sync(0xffffffff, rows_settled);
        }
      }

      // O += P V: the S accumulators of key tiles 2kk, 2kk+1 are exactly the A operand layout.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t p_frag[kSlabs][4];
#pragma unroll
        for (int m = 0; m < kSlabs; ++m) pack_a<Elem>(p_frag[m], s_acc[m], kk);
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t v_frag[4];
          ptx::ldmatrix_x4_trans(v_frag, v_address(kk, dp));
#pragma unroll
          for (int m = 0; m < kSlabs; ++m) mma_pair<Elem>(o_acc[m], dp, p_frag[m], v_frag);
        }
      }
    }

    if constexpr (kTmaKV) {
      // This warp is done with the stage: its lanes' reads, ordered by __syncwarp and the fence,
      // come before its count. The warp whose count completes the stage's use refills it, its
      // reads and the others' (seen through their counts) ordered before TMA's writes by the
      // fences. Faster than a __syncthreads and one thread's refill here
      // (docs/decisions/mma-sync-tma-kv-loads-on-hopper.md).
      __syncwarp();
      if (lane == 0) {
        __threadfence_block();
        const uint32_t counted = atomicAdd(&kv_done[stage], 1u) + 1;
        if (counted % Traits::kWarps == 0 && tile + Traits::kStages < tile_end) {
          __threadfence_block();
          ptx::fence_proxy_async_shared();
          issue_kv_tma(tile + Traits::kStages, stage);
        }
      }
    } else {
      __syncthreads();  // every warp is done with this stage before it is refilled
      if (tile + Traits::kStages < tile_end) load_kv(tile + Traits::kStages, stage);
      ptx::cp_async_commit();  // possibly empty, so wait<1> keeps meaning "this tile landed"
    }
  }

  // Epilogue: normalise, stage O in the Q tile (each warp in its own rows, which only it has
  // read: no barrier before, even where warps leave the loop at different times), then 16-byte
  // coalesced stores.
  float row_lse[kSlabs][2];
  softmax.finalize(o_acc, softmax_scale, row_lse);
#pragma unroll
  for (int m = 0; m < kSlabs; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + m * 16 + quad_row + h * 8;
#pragma unroll
      for (int d = 0; d < kDTiles; ++d)
        *reinterpret_cast<uint32_t*>(sQ + swizzled<kSmemDim>(row, d) + quad_col) =
            ptx::pack2<Elem>(o_acc[m][d][2 * h], o_acc[m][d][2 * h + 1]);
      if (lane % 4 == 0 && row < valid_rows) lse[row0 + row] = row_lse[m][h];
    }
  __syncthreads();
  store_tile<Traits, kBlockM>(out + row0 * p.q_row_stride, p.q_row_stride, sQ, valid_rows,
                              p.head_dim, tid);
}

// kTmaKV bodies exist only in the sm_90a image (TMA, mbarrier try_wait); the launcher picks them
// only on compute capability 9.0 (wgmma::tma_loads_apply).
template <typename Elem, typename Traits, bool kElementwise, bool kTmaKV, bool kSegments,
          bool kSoftCap, bool kAlibi>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    forward_kernel(const __grid_constant__ AttentionParams p,
                   const __grid_constant__ wgmma::KVMaps maps) {
  if constexpr (kTmaKV) {
#ifdef JAX_FLASHATTN_SM90_BODY
    forward_block<Elem, Traits, kElementwise, true, kSegments, kSoftCap, kAlibi>(p, maps);
#endif
  } else {
    forward_block<Elem, Traits, kElementwise, false, kSegments, kSoftCap, kAlibi>(p, maps);
  }
}

}  // namespace jax_flashattn::mma_sync
