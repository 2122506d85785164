// FlashAttention-2 backward, dK/dV pass, with mma.sync (sm_80 and newer).
//
// One block per (key block, kv head, batch). For every query head of the GQA group and every Q
// tile that can see the block (Q and dO double-buffered with cp.async, with the tile's -lse
// log2(e) and D staged in shared memory beside them):
//   S^T  = K Q^T;  P^T from S^T and the saved lse   (warp: 16 keys x kSdpCols queries)
//   dP^T = V dO^T; dS^T = P^T (dP^T - D)            (dbias from dS when there is a bias, the
//                                                    ALiBi slopes' gradient from dS when it is
//                                                    needed; then, soft-capped, dS^T times the
//                                                    cap's slope)
//   dV  += P^T dO,  dK += dS^T Q         (warp: 16 keys x kDkvCols head-dim columns)
//   dQ  += dS K                          (warp: kDqRows queries x kDqCols; red.add into float32)
// Computing the transposed scores puts the keys on the rows, so P^T and dS^T are A operands
// [key][query] for dV and dK as they are computed. When a warp's S^T covers the whole tile
// (Traits::kPInRegisters) they feed dV and dK straight from its registers; otherwise they go
// through shared memory to the warps that own the other head-dim columns. dQ, which reduces
// over keys, reads dS^T from shared memory transposed (ldmatrix.trans). In deterministic mode
// the dQ product is skipped and backward_dq_kernel computes dQ instead.
//
// Barriers per Q tile: two. The one that starts tile i also retires tile i - 1 (its Q/dO
// buffer, P^T / dS^T and lse / D slots), so tile i + 1 is loaded into them right after it; the
// second one publishes P^T / dS^T (before dV/dK when they come from shared memory, before dQ
// when they come from registers).
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

// HeadTerms' per-element terms for the elements (t0 + r, s0 + c) of one thread, 0 <= r < 32,
// 0 <= c < 16: 32-bit tile-relative visibility and per-thread base offsets, so the unrolled
// element loops hold a few registers instead of a 64-bit index per element. kSegments: the
// segment ids too (HeadTerms::make<true>).
template <bool kSegments>
struct SubTileTerms {
  static constexpr int kSpan = 32;
  cuda::TileVisibility tile;  // lengths and window, rows r = queries, columns c = keys
  const bool* mask;           // element (r, c) at mask[r * mask_row + c * mask_col], or nullptr
  int64_t mask_row, mask_col;
  const int32_t* q_ids = nullptr;  // kSegments: segment ids of rows r and keys c
  const int32_t* kv_ids = nullptr;
  int64_t bias_offset;        // of element (0, 0); bias strides from p
  float* dbias;               // element (0, 0), or nullptr; strides p.dbias_strides
  int rows, keys;             // elements inside [T, S]: r < rows, c < keys

  __device__ SubTileTerms(const AttentionParams& p, const HeadTerms& head, int64_t t0,
                          int64_t s0) {
    tile = cuda::TileVisibility::make(head.vis, t0, s0, kSpan);
    mask = head.vis.mask.present() ? head.vis.mask.keep + head.vis.mask.slice.at(t0, s0)
                                   : nullptr;
    mask_row = head.vis.mask.slice.row;
    mask_col = head.vis.mask.slice.col;
    if constexpr (kSegments) {
      q_ids = head.vis.segments.q + t0;
      kv_ids = head.vis.segments.kv + s0;
    }
    bias_offset = head.bias_offset + t0 * p.bias_strides.row + s0 * p.bias_strides.col;
    dbias = head.dbias ? head.dbias + t0 * p.dbias_strides.row + s0 * p.dbias_strides.col
                       : nullptr;
    rows = clamp(p.seqlen_q - t0);
    keys = clamp(p.seqlen_k - s0);
  }

  __device__ static int clamp(int64_t x) {
    return int(x < -kSpan ? -kSpan : (x > kSpan ? kSpan : x));
  }

  __device__ bool visible(int r, int c) const {
    const bool seen = tile.visible(r, c) && (mask == nullptr || mask[r * mask_row + c * mask_col]);
    if constexpr (kSegments) return seen && q_ids[r] == kv_ids[c];
    return seen;
  }

  // log2(e) bias, 0 without a bias or outside [T, S].
  __device__ float bias_log2(const AttentionParams& p, int r, int c) const {
    if (p.bias == nullptr || r >= rows || c >= keys) return 0.f;
    return cuda::kLog2e *
           variant::AdditiveBias::element(p.bias, p.bias_dtype,
                                          bias_offset + r * p.bias_strides.row +
                                              c * p.bias_strides.col);
  }

  // dbias from the warp's dS^T sub-tile, whose element (8 mt + e % 2, 8 (e / 2)) this thread
  // holds as ds[mt][e] (every lane calls it: the quad's lanes reduce together). Inside [T, S],
  // a dbias with one writer per element stores it; one summed over broadcast dims adds it,
  // and where every query shares the bias (row stride 0) the thread's queries and then its
  // quad's (lane % 4: the same keys) are summed first, one atomic add per key and quad.
  template <int kTiles8>
  __device__ void store_dbias(const AttentionParams& p, const float (&ds)[kTiles8][4]) const {
    if (dbias == nullptr) return;
    const int64_t row = p.dbias_strides.row, col = p.dbias_strides.col;
    if (p.dbias_accumulates && row == 0) {
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int mt = 0; mt < kTiles8; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (mt * 8 + e % 2 < rows) sum[e / 2] += ds[mt][e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        if (threadIdx.x % 4 == 0 && h * 8 < keys) ptx::red_add_f32(dbias + h * 8 * col, sum[h]);
      }
      return;
    }
#pragma unroll
    for (int mt = 0; mt < kTiles8; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = mt * 8 + e % 2, c = (e / 2) * 8;
        if (r >= rows || c >= keys) continue;
        float* element = dbias + r * row + c * col;
        if (p.dbias_accumulates)
          ptx::red_add_f32(element, ds[mt][e]);
        else
          *element = ds[mt][e];
      }
  }
};

// kSegments: the instantiation for calls with segment ids: their test in the other one would
// cost every call (docs/decisions/segment-ids.md). kSoftCap: soft-capped logits, in
// instantiations of their own for the same reason (their slopes take registers). kAlibi: ALiBi,
// in instantiations of their own too: read at run time beside the bias, its code moved the
// other calls' register allocation and spills (128-key tiles at head dim 128).
template <typename Elem, typename Traits, bool kSegments, bool kSoftCap, bool kAlibi>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    backward_dkdv_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kSmemDim = Traits::kSmemDim, kDsDim = Traits::kDsDim;
  constexpr bool kPInRegisters = Traits::kPInRegisters;
  constexpr int kKSteps = Traits::kHeadDim / 16;   // S^T, dP^T reduction steps
  constexpr int kSubCols = Traits::kSubCols;       // queries per S^T sub-tile of a warp
  constexpr int kSubTiles = Traits::kSdpCols / kSubCols;
  constexpr int kSubSteps = kSubCols / 16;         // 16-query steps of a sub-tile
  constexpr int kSubTiles8 = kSubCols / 8;         // 8-query column tiles of a sub-tile
  constexpr int kDkvTiles = Traits::kDkvCols / 8;  // 8-wide column tiles of a warp's dK, dV
  constexpr int kDqSteps = Traits::kDqRows / 16;   // 16-query steps of a warp's dQ
  constexpr int kDqTiles = Traits::kDqCols / 8;    // 8-wide column tiles of a warp's dQ
  static_assert(Traits::kStages == 2, "tile i + 1 loads into the buffer of tile i - 1");
  static_assert(Traits::kParts <= kDslopesWriters, "each part of a key slab is a dslopes writer");

  // Every kernel's smem_raw has the forward's alignment: extern __shared__ declarations of one
  // name must agree wherever two kernels' headers meet in a translation unit.
  extern __shared__ __align__(512) unsigned char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);            // [kBlockN][kSmemDim]
  Elem* sV = sK + kBlockN * kSmemDim;                      // [kBlockN][kSmemDim]
  Elem* sQ = sV + kBlockN * kSmemDim;                      // [kStages][kBlockM][kSmemDim]
  Elem* sdO = sQ + Traits::kStages * kBlockM * kSmemDim;   // [kStages][kBlockM][kSmemDim]
  Elem* sdS = sdO + Traits::kStages * kBlockM * kSmemDim;  // dS^T [kBlockN][kDsDim]
  Elem* sP = sdS + kBlockN * kDsDim;  // P^T [kBlockN][kDsDim], unless kPInRegisters
  // [kStages][2][kBlockM]: -lse log2(e), then D, of the stage's queries.
  float* sStats = reinterpret_cast<float*>(sdS + Traits::kDsTiles * kBlockN * kDsDim);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);  // mma accumulator coordinates
  const int key_row0 = (warp % Traits::kKeySlabs) * 16;      // this warp's 16 keys
  const int part = Traits::kParts == 1 ? 0 : warp / Traits::kKeySlabs;
  const int sdp_col0 = part * Traits::kSdpCols;  // ... its queries
  const int dkv_col0 = part * Traits::kDkvCols;  // ... its dK/dV columns
  const int dq_row0 = (warp % Traits::kDqSlabs) * Traits::kDqRows;     // its dQ queries
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
  // the group; only a mask differs, and it is applied per element). A dbias with one writer
  // per element has every tile visited, so that each element is stored (0 where hidden).
  const cuda::Visibility group_vis = cuda::Visibility::make(p, b, head0);
  int64_t t_lo, t_hi;
  group_vis.query_range(key0, key0 + kBlockN, t_lo, t_hi);
  // Only the rows the spans of the ids or the mask allow (a no-op without them).
  variant::VisibleSpans::rows_of_keys(p, b).narrow(key0, key0 + kBlockN, t_lo, t_hi);
  if (p.dbias != nullptr && !p.dbias_accumulates) t_lo = 0, t_hi = p.seqlen_q;
  // Tile and head indices fit 32 bits (T and N do); element offsets stay 64-bit.
  const int tile_begin = int(t_lo / kBlockM);
  const int tile_end = t_hi > t_lo ? int((t_hi + kBlockM - 1) / kBlockM) : tile_begin;
  // (head, Q tile) pairs, heads outermost: head0 + step / tiles, tile_begin + step % tiles,
  // tracked incrementally (no 64-bit division per step).
  const int64_t steps = (tile_end - tile_begin) * group;

  // load_tile for the Q and dO tiles of a step, with its per-thread terms kept out of the step
  // loop: thread tid copies 16-byte chunk tid % kLoadChunks of rows tid / kLoadChunks +
  // i kLoadRows, over the padded row (chunks past head_dim are zero-filled, and never read).
  constexpr int kLoadChunks = kSmemDim / 8;
  constexpr int kLoadRows = Traits::kThreads / kLoadChunks;
  static_assert(Traits::kThreads % kLoadChunks == 0 && kBlockM % kLoadRows == 0,
                "every thread copies one chunk column of whole row strides");
  const int load_row = tid / kLoadChunks, load_chunk = tid % kLoadChunks;
  const bool load_chunk_valid = load_chunk * 8 < p.head_dim;
  const uint32_t load_smem = ptx::smem_address(sQ + swizzled<kSmemDim>(load_row, load_chunk));
  constexpr uint32_t kStageBytes = kBlockM * kSmemDim * sizeof(Elem);
  constexpr uint32_t kDoBytes = Traits::kStages * kStageBytes;  // sdO - sQ
  auto load_q_do = [&](int64_t n, int64_t q0, int stage) {
    const int64_t offset = b * p.q_batch_stride + n * p.q_head_stride +
                           (q0 + load_row) * p.q_row_stride + load_chunk * 8;
    const Elem* q = static_cast<const Elem*>(p.q) + offset;
    const Elem* d_out = static_cast<const Elem*>(p.d_out) + offset;
    const int64_t rows = p.seqlen_q - q0 - load_row;
    const uint32_t smem = load_smem + stage * kStageBytes;
#pragma unroll
    for (int i = 0; i < kBlockM / kLoadRows; ++i) {
      // Rows i kLoadRows apart keep row % 8, hence the swizzle: whole rows apart in smem.
      const bool valid = load_chunk_valid && i * kLoadRows < rows;
      const int64_t step_offset = valid ? i * kLoadRows * p.q_row_stride : 0;
      const uint32_t dst = smem + i * kLoadRows * kSmemDim * sizeof(Elem);
      ptx::cp_async_16(dst, q + step_offset, valid);
      ptx::cp_async_16(dst + kDoBytes, d_out + step_offset, valid);
    }
  };
  // Thread tid < kBlockM holds -lse log2(e) of query tid of the step's tile (-inf where the row
  // saw no key or lies past T), thread kBlockM + i holds D of query i (0 past T). Loaded into a
  // register one tile ahead and stored at the end of the tile, so the load's latency hides
  // behind the tile's products.
  auto load_stat = [&](int64_t n, int64_t q0) -> float {
    const int i = tid % kBlockM;
    const int64_t t = q0 + i;
    const int64_t row = (b * p.num_heads + n) * p.seqlen_q + t;
    if (tid >= 2 * kBlockM || t >= p.seqlen_q) return tid < kBlockM ? -INFINITY : 0.f;
    if (tid >= kBlockM) return p.delta[row];
    const float lse = p.lse[row];
    return lse == -INFINITY ? -INFINITY : -lse * cuda::kLog2e;
  };
  auto store_stat = [&](int stage, float value) {
    if (tid < 2 * kBlockM) sStats[stage * 2 * kBlockM + tid] = value;
  };

  // Prologue: K, V (zero past the batch entry's key length: a padded cache may hold NaN or Inf
  // there, which hidden probabilities of 0 would still multiply), the first Q/dO tile and its
  // lse / D.
  if (steps > 0) {
    const int64_t loaded_keys = group_vis.kv_len - key0;
    load_tile<Traits, kBlockN>(sK, k + key0 * p.kv_row_stride, p.kv_row_stride, loaded_keys,
                               p.head_dim, tid);
    load_tile<Traits, kBlockN>(sV, v + key0 * p.kv_row_stride, p.kv_row_stride, loaded_keys,
                               p.head_dim, tid);
    load_q_do(head0, int64_t(tile_begin) * kBlockM, 0);
  }
  ptx::cp_async_commit();
  if (steps > 0) store_stat(0, load_stat(head0, int64_t(tile_begin) * kBlockM));

  float dk_acc[kDkvTiles][4] = {};
  float dv_acc[kDkvTiles][4] = {};
  const float scale_log2 = p.scale * cuda::kLog2e;
  [[maybe_unused]] const auto soft_cap =
      kSoftCap ? cuda::SoftCapLogits::make(p) : cuda::SoftCapLogits{};
  const bool accumulate_dq = !p.deterministic && warp < Traits::kDqWarps;

  // ldmatrix row addresses, one register per operand (LdmatrixAddress): lane l addresses row
  // l % 8 of matrix l / 8. Operands whose 16 x 16 matrices run (rows 0-7, chunk 0),
  // (8-15, 0), (0-7, 1), (8-15, 1) — A from [m][k], B from [k][n] (transposed) — take
  // `rows_first`; those that run (0-7, 0), (0-7, 1), (8-15, 0), (8-15, 1) — B from [n][k],
  // A from [k][m] (transposed) — take `chunks_first` (common/fragments.cuh has the same orders).
  const int ld_row = lane % 8, ld_matrix = lane / 8;
  const int rows_first_row = (ld_matrix & 1) * 8 + ld_row, rows_first_chunk = ld_matrix >> 1;
  const int chunks_first_row = (ld_matrix >> 1) * 8 + ld_row, chunks_first_chunk = ld_matrix & 1;
  using Address = LdmatrixAddress<SwizzledRows<kSmemDim>>;  // Q, dO, K and V tiles
  using DsAddress = LdmatrixAddress<SwizzledRows<kDsDim>>;  // P and dS tiles
  const Address k_mk(sK + key_row0 * kSmemDim, rows_first_row, rows_first_chunk);  // (0, k-step)
  const Address v_mk(sV + key_row0 * kSmemDim, rows_first_row, rows_first_chunk);  // (0, k-step)
  const Address k_kn(sK, rows_first_row, rows_first_chunk);  // (key, col)
  // acc = A B^T over this warp's 16 keys (A: K or V, `key_mk`) and the 16-query steps
  // step0.. of a sub-tile (B: Q or dO, `query_nk`), both K-major in shared memory: S^T = K Q^T
  // and dP^T = V dO^T.
  const auto keys_by_queries = [&](float (&acc)[kSubTiles8][4], const Address& key_mk,
                                   const Address& query_nk, int step0) {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t key_frag[4];
      ptx::ldmatrix_x4(key_frag, key_mk(0, ks));
#pragma unroll
      for (int mp = 0; mp < kSubSteps; ++mp) {
        uint32_t query_frag[4];
        ptx::ldmatrix_x4(query_frag, query_nk(step0 + mp, ks));
        mma_pair<Elem>(acc, mp, key_frag, query_frag);
      }
    }
  };
  const DsAddress p_mk(sP + key_row0 * kDsDim, rows_first_row,
                       rows_first_chunk);  // (0, query step)
  const DsAddress ds_mk(sdS + key_row0 * kDsDim, rows_first_row,
                        rows_first_chunk);  // (0, query step)
  const DsAddress ds_km(sdS, chunks_first_row, chunks_first_chunk);  // (key, query)

  int n = int(head0), tile = tile_begin;  // the step's query head and Q tile
  for (int64_t step = 0; step < steps; ++step) {
    const int stage = int(step % Traits::kStages);
    const Elem* sQ_stage = sQ + stage * kBlockM * kSmemDim;
    const Elem* sdO_stage = sdO + stage * kBlockM * kSmemDim;
    const float* sLse = sStats + stage * 2 * kBlockM;  // -lse log2(e) of the tile's queries
    const float* sDelta = sLse + kBlockM;               // D of the tile's queries
    const int64_t q0 = int64_t(tile) * kBlockM;
    int next_n = n, next_tile = tile + 1;
    if (next_tile == tile_end) next_n = n + 1, next_tile = tile_begin;
    const HeadTerms head = HeadTerms::make<kSegments>(p, b, n);
    const Address q_nk(sQ_stage + sdp_col0 * kSmemDim, chunks_first_row,
                       chunks_first_chunk);  // (query step, k-step)
    const Address do_nk(sdO_stage + sdp_col0 * kSmemDim, chunks_first_row,
                        chunks_first_chunk);  // (query step, k-step)
    const Address q_kn(sQ_stage, rows_first_row, rows_first_chunk);    // (query step, col step)
    const Address do_kn(sdO_stage, rows_first_row, rows_first_chunk);  // (query step, col step)

    ptx::cp_async_wait<0>();
    // Tile `step` and its lse / D have landed, and every warp is done with tile step - 1: its
    // Q/dO buffer, lse / D slot, P^T and dS^T are free.
    __syncthreads();
    const bool prefetch = step + 1 < steps;
    if (prefetch) load_q_do(next_n, int64_t(next_tile) * kBlockM, stage ^ 1);
    ptx::cp_async_commit();
    const float next_stat = prefetch ? load_stat(next_n, int64_t(next_tile) * kBlockM) : 0.f;

    // The warp's kSdpCols queries in sub-tiles of kSubCols, each taken from S^T to dS^T (and,
    // with kPInRegisters, through dV and dK) before the next, so that only one sub-tile's
    // S^T / dP^T accumulators are live beside dK and dV.
#pragma unroll 1
    for (int sub = 0; sub < kSubTiles; ++sub) {
      const int sub_col0 = sdp_col0 + sub * kSubCols;  // tile-relative first query
      const int sub_step0 = sub * kSubSteps;            // ... in 16-query steps of the warp part

      // S^T = K Q^T over this warp's 16 keys x kSubCols queries, then P^T in place.
      float s_acc[kSubTiles8][4] = {};
      keys_by_queries(s_acc, k_mk, q_nk, sub_step0);
      // This thread's elements: queries t0 + 8 mt + (e % 2), keys s0 + 8 (e / 2). Only
      // sub-tiles that straddle a boundary (or carry a mask) test elements.
      const int64_t sub_q0 = q0 + sub_col0;
      const bool check =
          !head.vis.all_visible(sub_q0, sub_q0 + kSubCols, warp_key0, warp_key0 + 16);
      const SubTileTerms<kSegments> terms(p, head, sub_q0 + quad_col, warp_key0 + quad_row);
      // kAlibi: ALiBi's distances from one origin per sub-tile, moved to the thread's first
      // element (t0, s0): element (r, c) lies c - r from it. Its slope and diagonal are made
      // from p at each use (loads that hit L1): held through the step, they took the 128-key
      // instantiations at head dim 128 from 60 to 136 bytes of spill stores (sm_80 and sm_90a,
      // bf16). plus_alibi adds its term.
      const auto alibi_origin = [&] {
        return AlibiOrigin::at(cuda::AlibiLogits::make(p, b, n), sub_q0, warp_key0)
            .moved(quad_row - quad_col);
      };
      [[maybe_unused]] AlibiOrigin alibi{};
      if constexpr (kAlibi) alibi = alibi_origin();
      const auto plus_alibi = [&](float x, int r, int c) {
        if constexpr (kAlibi) return alibi.add_term(x, c - r);
        return x;
      };
      [[maybe_unused]] float slope[kSoftCap ? kSubTiles8 : 1][4];  // the cap's, per element
#pragma unroll
      for (int mt = 0; mt < kSubTiles8; ++mt) {
        const float2 neg_lse2 =
            *reinterpret_cast<const float2*>(sLse + sub_col0 + mt * 8 + quad_col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = mt * 8 + e % 2, c = (e / 2) * 8;
          const bool visible = !check || terms.visible(r, c);
          float& score = s_acc[mt][e];
          float score_scale = scale_log2;
          if constexpr (kSoftCap) {
            score = soft_cap.apply(score);
            slope[mt][e] = soft_cap.slope(score);
            score_scale = 1.f;
          }
          score = visible ? ptx::exp2_approx(fmaf(
                                score, score_scale,
                                plus_alibi(terms.bias_log2(p, r, c) +
                                               (e % 2 ? neg_lse2.y : neg_lse2.x),
                                           r, c)))
                          : 0.f;
        }
      }

      // dP^T = V dO^T over the same queries, then dS^T = P^T (dP^T - D) in place.
      float dp_acc[kSubTiles8][4] = {};
      keys_by_queries(dp_acc, v_mk, do_nk, sub_step0);
#pragma unroll
      for (int mt = 0; mt < kSubTiles8; ++mt) {
        const float2 delta =
            *reinterpret_cast<const float2*>(sDelta + sub_col0 + mt * 8 + quad_col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dp_acc[mt][e] = s_acc[mt][e] * (dp_acc[mt][e] - (e % 2 ? delta.y : delta.x));
        }
      }
      terms.store_dbias(p, dp_acc);
      // kAlibi: the slopes' gradient, where it is needed: the warp's sum of |t + shift - s| dS
      // (the dS dbias takes, before the cap's slope) over the elements P shows visible (a hidden
      // one's dS is 0 times dP - D, which must not count where that is not finite), added per
      // sub-tile by the warp, the one writer of its slot: its keys start at warp_key0, and the
      // kParts warps of that key slab are writers 0, 1, ... by part (dslopes_slots). Key slabs
      // past S have no slot (and no visible element).
      if constexpr (kAlibi) {
        if (p.dslopes != nullptr && warp_key0 < p.seqlen_k) {
          const AlibiOrigin origin = alibi_origin();
          float distance_ds = 0.f;
#pragma unroll
          for (int mt = 0; mt < kSubTiles8; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (s_acc[mt][e] != 0.f)
                distance_ds = fmaf(origin.distance((e / 2) * 8 - mt * 8 - e % 2), dp_acc[mt][e],
                                   distance_ds);
          cuda::add_dslopes(p, b, n, cuda::dslopes_slot(warp_key0, part), distance_ds);
        }
      }
      if constexpr (kSoftCap) {  // a dS of 0 stays 0, whatever the slope (NaN at a hidden key)
#pragma unroll
        for (int mt = 0; mt < kSubTiles8; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (dp_acc[mt][e] != 0.f) dp_acc[mt][e] *= slope[mt][e];
      }

      // P^T and dS^T rounded to Elem: the A operands of dV and dK (16 keys x 16 queries per
      // query step), stored as [key][query] rows for the warps that read them from shared
      // memory.
      uint32_t p_frag[kSubSteps][4], ds_frag[kSubSteps][4];
#pragma unroll
      for (int kk = 0; kk < kSubSteps; ++kk) {
        pack_a<Elem>(p_frag[kk], s_acc, kk);
        pack_a<Elem>(ds_frag[kk], dp_acc, kk);
      }
#pragma unroll
      for (int mt = 0; mt < kSubTiles8; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // Register (mt % 2) * 2 + h of step mt / 2 holds row quad_row + 8 h, columns
          // 8 mt + quad_col, +1 (pack_a's order).
          const int offset =
              swizzled<kDsDim>(key_row0 + quad_row + h * 8, sub_col0 / 8 + mt) + quad_col;
          *reinterpret_cast<uint32_t*>(sdS + offset) = ds_frag[mt / 2][(mt % 2) * 2 + h];
          if constexpr (!kPInRegisters)
            *reinterpret_cast<uint32_t*>(sP + offset) = p_frag[mt / 2][(mt % 2) * 2 + h];
        }

      // dV += P^T dO and dK += dS^T Q over this warp's 16 keys x every head-dim column,
      // reducing over the sub-tile's queries.
      if constexpr (kPInRegisters) {
#pragma unroll
        for (int kk = 0; kk < kSubSteps; ++kk)
#pragma unroll
          for (int dp = 0; dp < kDkvTiles / 2; ++dp) {
            uint32_t do_frag[4], q_frag[4];
            ptx::ldmatrix_x4_trans(do_frag, do_kn(sub_step0 + kk, dp));
            mma_pair<Elem>(dv_acc, dp, p_frag[kk], do_frag);
            ptx::ldmatrix_x4_trans(q_frag, q_kn(sub_step0 + kk, dp));
            mma_pair<Elem>(dk_acc, dp, ds_frag[kk], q_frag);
          }
      }
    }

    if constexpr (!kPInRegisters) {
      __syncthreads();  // P^T and dS^T of the whole block
      // dV += P^T dO and dK += dS^T Q over this warp's 16 keys x kDkvCols columns, reducing
      // over the tile's queries.
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t p_a[4], ds_a[4];
        ptx::ldmatrix_x4(p_a, p_mk(0, kk));
        ptx::ldmatrix_x4(ds_a, ds_mk(0, kk));
#pragma unroll
        for (int dp = 0; dp < kDkvTiles / 2; ++dp) {
          uint32_t do_frag[4], q_frag[4];
          ptx::ldmatrix_x4_trans(do_frag, do_kn(kk, dkv_col0 / 16 + dp));
          mma_pair<Elem>(dv_acc, dp, p_a, do_frag);
          ptx::ldmatrix_x4_trans(q_frag, q_kn(kk, dkv_col0 / 16 + dp));
          mma_pair<Elem>(dk_acc, dp, ds_a, q_frag);
        }
      }
    } else if (!p.deterministic) {
      __syncthreads();  // dS^T of the whole block, for dQ (a block-uniform condition)
    }

    // dQ += dS K over this warp's kDqRows queries x kDqCols columns, reducing over the block's
    // keys; other key blocks add to the same rows, hence red.add into the float32 accumulator.
    if (accumulate_dq) {
      float dq_acc[kDqSteps][kDqTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t ds_a[kDqSteps][4];
#pragma unroll
        for (int r = 0; r < kDqSteps; ++r)
          ptx::ldmatrix_x4_trans(ds_a[r], ds_km(kk, dq_row0 / 16 + r));
#pragma unroll
        for (int dp = 0; dp < kDqTiles / 2; ++dp) {
          uint32_t k_frag[4];
          ptx::ldmatrix_x4_trans(k_frag, k_kn(kk, dq_col0 / 16 + dp));
#pragma unroll
          for (int r = 0; r < kDqSteps; ++r) mma_pair<Elem>(dq_acc[r], dp, ds_a[r], k_frag);
        }
      }
      // This thread's rows t0 + 16 r + 8 h and columns col0 + 8 j + c: one base pointer and
      // two bounds, so the unrolled stores use immediate offsets.
      const int64_t t0 = q0 + dq_row0 + quad_row;
      const int col0 = dq_col0 + quad_col;
      float* dq_base = p.dq_accum + b * p.q_batch_stride + n * p.q_head_stride +
                       t0 * p.q_row_stride + col0;
      const int64_t rows = head.vis.q_len - t0;  // rows past q_len have dS = 0
      const int cols = int(p.head_dim) - col0;
#pragma unroll
      for (int r = 0; r < kDqSteps; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (r * 16 + h * 8 >= rows) continue;
          float* row = dq_base + (r * 16 + h * 8) * p.q_row_stride;
#pragma unroll
          for (int j = 0; j < kDqTiles; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              if (j * 8 + c < cols) ptx::red_add_f32(row + j * 8 + c, dq_acc[r][j][2 * h + c]);
        }
    }

    if (prefetch) store_stat(stage ^ 1, next_stat);  // read after the next tile's barrier
    n = next_n, tile = next_tile;
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

}  // namespace jax_flashattn::mma_sync
