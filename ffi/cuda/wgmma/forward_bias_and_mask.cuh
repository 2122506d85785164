// The Hopper forward's bias, boolean mask and ALiBi (WithBiasAndMask): as each key tile's
// scores land in a consumer thread's accumulator (its two rows, 8 apart; kBlockN / 8 pairs of
// adjacent keys each), they become base-2 logits with the bias and ALiBi's term added, and -inf
// where the mask hides them. Each thread reads its own elements of the bias and mask from
// global memory, at constant offsets from its row's start (keys at unit stride:
// bias_and_mask_fit), having prefetched them into L2 while the tile before computed; or
// (WithStagedTerm: a 2-byte bias alone or a mask alone) from its warp's buffer in shared memory,
// which the warp fills by cp.async under the tile before, the logits then in the units that
// cost least (logit_scale) (docs/decisions/hopper-bias-and-mask.md). ALiBi's term is computed,
// two FP32 operations per element (alibi_terms.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/hopper_ptx.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/scalar.cuh"
#include "ffi/cuda/wgmma/alibi_terms.cuh"
#include "ffi/cuda/wgmma/staged_term.h"
#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::wgmma {

template <typename Traits>
struct BiasAndMask {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr int kNTiles = kBlockN / 8;  // 8-key column tiles of S

  const AttentionParams& p;
  const int row;       // this thread's first row of the block (the second is 8 below)
  const int quad_col;  // its first key of each 8-key column tile
  const int lane;
  const uint32_t stage;  // this warp's staging buffer (Traits::kTermStageBytes)
  const StagedTerm staged;  // kStagedTerm: the call's staged term (staged_term); else kNone

  // The offset of element (row, key) of tile t's (batch, head) in a tensor that broadcasts to
  // [batch, N, T, S] (a bias or mask) with unit stride along the keys, or a single key. Worked
  // out for each key tile: the head's offsets held through the tile loop spill. 32-bit batch
  // indices (indices_fit_32_bits).
  __device__ __forceinline__ int64_t offset_of(const BroadcastStrides& st, const ForwardTile& t,
                                               int64_t r, int64_t key) const {
    return st.head_offset32(t.b, p.batch_inner32(), t.n) + r * st.row + key;
  }

  // The lines of key tile j's bias and mask that this thread will read (its two rows; the
  // quad's four threads a quarter of the keys each), brought into L2. Clamped into [T, S],
  // where the tensors lie.
  __device__ __forceinline__ void prefetch(const ForwardTile& t, int j) const {
    const int64_t key =
        min(int64_t(t.tile_begin + j) * kBlockN + (lane % 4) * (kBlockN / 4), p.seqlen_k - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = min(int64_t(t.row0 + row + 8 * h), p.seqlen_q - 1);
      if (p.bias != nullptr)
        ptx::prefetch_l2(static_cast<const char*>(p.bias) +
                         offset_of(p.bias_strides, t, r, key) *
                             (p.bias_dtype == ElemType::kFloat32 ? 4 : 2));
      if (p.mask != nullptr) ptx::prefetch_l2(p.mask + offset_of(p.mask_strides, t, r, key));
    }
  }

  // The bounds of the tile whose first key is key0 where a length or window boundary crosses
  // it for the warp (not interior); none needed elsewhere.
  __device__ __forceinline__ cuda::TileVisibility bounds_of(const ForwardTile& t, int key0,
                                                            bool interior) const {
    cuda::TileVisibility tile_vis{};
    if (!interior) {
      const auto vis = variant::KeyWindow<int>::make(p, ptx::opaque(uint32_t(t.b)));
      tile_vis = cuda::TileVisibility::make(vis, t.row0, key0, kBlockM + kBlockN);
    }
    return tile_vis;
  }
  // This thread's visible elements of its row h of the tile, one bit each (all on an interior
  // tile).
  static constexpr int kBitWords = (2 * kNTiles + 31) / 32;
  __device__ __forceinline__ void visible_bits(const cuda::TileVisibility& tile_vis,
                                               bool interior, int h,
                                               uint32_t (&bits)[kBitWords]) const {
    if (interior) {
#pragma unroll
      for (uint32_t& word : bits) word = 0xffffffffu;
    } else {
      tile_vis.column_bits<kNTiles>(row + 8 * h, quad_col, bits);
    }
  }

  // A warp's 16 staged rows: kBlockN elements of kBytes each, in 16-byte chunks of
  // kKeysPerChunk keys, chunk c of row r at byte (16 c + r) 16. For one column of chunks the 16
  // rows lie side by side, so the eight rows that a quad's reads of an 8-key column tile span
  // are 128 consecutive bytes (no bank conflicts), and each of a thread's reads is a constant
  // offset from one address (thread_at).
  template <int kBytes>
  struct StageLayout {
    static constexpr int kKeysPerChunk = 16 / kBytes, kChunks = kBlockN / kKeysPerChunk;
    static_assert(16 * 16 * kChunks <= Traits::kTermStageBytes, "a warp's rows fit its buffer");
    static_assert(8 % kKeysPerChunk == 0 || kKeysPerChunk % 16 == 0,
                  "a quad's pair of keys lies in one chunk");
    // Chunk c of row r.
    __device__ static uint32_t chunk_at(int r, int c) { return uint32_t((16 * c + r) * 16); }
    // Row r's element quad_col of the tile, the first of a thread's pairs.
    __device__ static uint32_t thread_at(int r, int quad_col) {
      return uint32_t(16 * r + quad_col * kBytes);
    }
    // The offset from thread_at of the pair of 8-key column tile c (quad_col + 1 < 8 keeps the
    // pair inside the chunk).
    static constexpr uint32_t column_at(int c) {
      return uint32_t((8 * c / kKeysPerChunk) * 256 + (8 * c % kKeysPerChunk) * kBytes);
    }
  };

  // This lane's half row of the staged term at the block's first key tile (lane l copies half
  // l % 2 of row l / 2 of the warp's 16, clamped into T): worked out once per block, since an
  // offset's 32-bit division costs some 40 instructions.
  template <int kBytes>
  __device__ __forceinline__ const char* staged_row(const void* base, const BroadcastStrides& st,
                                                    const ForwardTile& t) const {
    const int64_t r = min(int64_t(t.row0 + (row - lane / 4) + lane / 2), p.seqlen_q - 1);
    const int64_t key = int64_t(t.tile_begin) * kBlockN + (lane % 2) * (kBlockN / 2);
    return static_cast<const char*>(base) + offset_of(st, t, r, key) * kBytes;
  }
  __device__ __forceinline__ const char* staged_row(const ForwardTile& t) const {
    if (staged == StagedTerm::kMask) return staged_row<1>(p.mask, p.mask_strides, t);
    return staged_row<2>(p.bias, p.bias_strides, t);
  }

  // Copies this warp's 16 rows of key tile j's staged term (kBytes an element) into its
  // buffer by cp.async, after the warp's reads of the tile before: lane l copies half of row
  // l / 2 (from src_row: staged_row), 16 bytes at a time, chunks past T or S zero-filled (read
  // by no visible element). With prefetch_next, the same half row of tile j + 1 (at most 128
  // bytes: one line) is brought into L2 for the copy a tile later.
  template <int kBytes>
  __device__ __forceinline__ void stage_term(const char* src_row, const ForwardTile& t, int j,
                                             bool prefetch_next) const {
    using Layout = StageLayout<kBytes>;
    constexpr int kPerLane = Layout::kChunks / 2, kKeysPerChunk = Layout::kKeysPerChunk;
    const int r = lane / 2, first_chunk = (lane % 2) * kPerLane;
    const bool row_valid = t.row0 + (row - lane / 4) + r < p.seqlen_q;
    const int64_t key = int64_t(t.tile_begin + j) * kBlockN + first_chunk * kKeysPerChunk;
    // The keys from the half row's first up to S (none past T), so that each chunk's test is
    // one 32-bit compare.
    const int64_t keys_left = row_valid ? p.seqlen_k - key : 0;
    const int chunk_keys = int(min(keys_left, int64_t(kBlockN + 1)));
    const char* src = src_row + int64_t(j) * (kBlockN * kBytes);
    const uint32_t dst = stage + Layout::chunk_at(r, first_chunk);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      ptx::cp_async_16(dst + Layout::chunk_at(0, i), src + 16 * i, i * kKeysPerChunk < chunk_keys);
    ptx::cp_async_commit();
    if (prefetch_next && chunk_keys > kBlockN) ptx::prefetch_l2(src + kBlockN * kBytes);
  }
  // Key tile j's staged term, for a call with one (staged), from this lane's src_row.
  __device__ __forceinline__ void stage_tile(const char* src_row, const ForwardTile& t, int j,
                                             bool prefetch_next) const {
    if (staged == StagedTerm::kMask) return stage_term<1>(src_row, t, j, prefetch_next);
    stage_term<2>(src_row, t, j, prefetch_next);
  }

  // The scale that makes the logits left in s base-2, which the softmax applies as it
  // exponentiates: a staged bias leaves natural-log logits (the scale's multiply and the
  // term's add one FFMA), a staged mask the scores themselves (no multiply); the global reads
  // (add) base-2 logits.
  __device__ static float logit_scale(const AttentionParams& p) {
    if constexpr (Traits::kStagedTerm)
      return staged_term(p) == StagedTerm::kMask ? p.scale * cuda::kLog2e : cuda::kLog2e;
    return 1.f;
  }

  // add for a staged term (Term: the bias's element type, or bool for the mask): the elements
  // from this warp's buffer, a pair of adjacent keys a read, the logits in logit_scale's units.
  // A tile that no bound crosses for the warp (interior) takes an instantiation of its own,
  // with no test of the elements' columns.
  template <typename Term>
  __device__ __forceinline__ void add_staged(float (&s)[1][kNTiles][4], const ForwardTile& t,
                                             int j, bool interior) const {
    const cuda::TileVisibility tile_vis = bounds_of(t, (t.tile_begin + j) * kBlockN, interior);
    ptx::cp_async_wait<0>();
    __syncwarp();
    if (interior) return add_staged_tile<Term, true>(s, tile_vis);
    add_staged_tile<Term, false>(s, tile_vis);
  }
  template <typename Term, bool kInterior>
  __device__ __forceinline__ void add_staged_tile(float (&s)[1][kNTiles][4],
                                                  const cuda::TileVisibility& tile_vis) const {
    using Layout = StageLayout<int(sizeof(Term))>;
    constexpr bool kMask = std::is_same_v<Term, bool>;
    const float scale = p.scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      [[maybe_unused]] uint32_t bits[kBitWords];
      if constexpr (!kInterior) tile_vis.column_bits<kNTiles>(row + 8 * h, quad_col, bits);
      const uint32_t thread_at = stage + Layout::thread_at(lane / 4 + 8 * h, quad_col);
#pragma unroll
      for (int c = 0; c < kNTiles; ++c) {
        const uint32_t at = thread_at + Layout::column_at(c);
        float term[2] = {0.f, 0.f};
        bool keep[2] = {true, true};
        if constexpr (kMask) {
          const uint16_t pair = ptx::ld_shared_b16(at);
          keep[0] = (pair & 0xff) != 0;
          keep[1] = (pair >> 8) != 0;
        } else {
          const float2 pair = cuda::pair_to_float2<Term>(ptx::ld_shared_b32(at));
          term[0] = pair.x;
          term[1] = pair.y;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          bool visible = keep[e];
          if constexpr (!kInterior)
            visible = visible && cuda::TileVisibility::column_visible(bits, 2 * c + e);
          float& score = s[0][c][2 * h + e];
          const float logit = kMask ? score : fmaf(score, scale, term[e]);
          score = visible ? logit : -INFINITY;
        }
      }
    }
  }

  // Key tile j's scores s (this thread's accumulator) as base-2 logits plus the bias, -inf
  // where the mask hides them or, on a tile a length or window boundary crosses for the warp
  // (not interior), the bounds do. The bias and mask are read only at visible elements, which
  // lie inside [T, S]. Bias of element type BiasElem; void: none.
  template <typename BiasElem>
  __device__ __forceinline__ void add(float (&s)[1][kNTiles][4], const ForwardTile& t, int j,
                                      bool interior) const {
    const int key0 = (t.tile_begin + j) * kBlockN;
    const cuda::TileVisibility tile_vis = bounds_of(t, key0, interior);
    const float scale_log2 = p.scale * cuda::kLog2e;
    const bool has_mask = p.mask != nullptr;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t bits[kBitWords];
      visible_bits(tile_vis, interior, h, bits);
      const int64_t r = t.row0 + row + 8 * h;
      const int64_t key = key0 + quad_col;
      [[maybe_unused]] const BiasElem* bias = nullptr;
      if constexpr (!std::is_void_v<BiasElem>)
        bias = static_cast<const BiasElem*>(p.bias) + offset_of(p.bias_strides, t, r, key);
      const bool* keep = p.mask + offset_of(p.mask_strides, t, r, key);
#pragma unroll
      for (int c = 0; c < kNTiles; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * c + e;
          bool visible = cuda::TileVisibility::column_visible(bits, 2 * c + e);
          if (has_mask && visible) visible = keep[col];
          float& score = s[0][c][2 * h + e];
          float logit = score * scale_log2;
          if constexpr (!std::is_void_v<BiasElem>)
            if (visible) logit = fmaf(cuda::kLog2e, cuda::to_float(bias[col]), logit);
          score = visible ? logit : -INFINITY;
        }
    }
  }

  // add for the call's bias type or (kStagedTerm) staged term, chosen once per tile.
  __device__ __forceinline__ void add_bias_and_mask(float (&s)[1][kNTiles][4],
                                                    const ForwardTile& t, int j,
                                                    bool interior) const {
    if constexpr (Traits::kStagedTerm) {
      switch (staged) {
        case StagedTerm::kBFloat16Bias: return add_staged<__nv_bfloat16>(s, t, j, interior);
        case StagedTerm::kFloat16Bias: return add_staged<__half>(s, t, j, interior);
        default: return add_staged<bool>(s, t, j, interior);
      }
    }
    if (p.bias == nullptr) return add<void>(s, t, j, interior);
    switch (p.bias_dtype) {
      case ElemType::kBFloat16: return add<__nv_bfloat16>(s, t, j, interior);
      case ElemType::kFloat16: return add<__half>(s, t, j, interior);
      default: return add<float>(s, t, j, interior);
    }
  }

  // Key tile j's scores s as the softmax takes them: base-2 logits with the call's terms, the
  // elements the mask or the bounds hide at -inf (add). Whether ALiBi is on is decided once per
  // tile: calls without it run add alone. With ALiBi alone on an interior tile nothing is read
  // and nothing hidden: add is skipped and the scale's multiply goes into the term's FFMA.
  // (add is inlined once: on two paths, its bodies for the four bias types, twice over, grew
  // the kernel by half and spilled.)
  __device__ __forceinline__ void apply(float (&s)[1][kNTiles][4], const ForwardTile& t, int j,
                                        bool interior) const {
    const bool alibi_alone =
        p.alibi_slopes != nullptr && p.bias == nullptr && p.mask == nullptr && interior;
    if (!alibi_alone) add_bias_and_mask(s, t, j, interior);
    if (p.alibi_slopes == nullptr) return;
    const cuda::AlibiLogits alibi = cuda::AlibiLogits::make(p, t.b, t.n);
    // The slope in the logits' units (logit_scale: base-2 but beside a staged term).
    const float slope = Traits::kStagedTerm ? alibi.slope2 / logit_scale(p) : alibi.slope2;
    const int64_t key = int64_t(t.tile_begin + j) * kBlockN + quad_col;
    // r_h = t + shift - the thread's first key of the tile, for its row t of h.
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) base[h] = slope * float(t.row0 + row + 8 * h + alibi.shift - key);
    const float factor = alibi_alone ? p.scale * cuda::kLog2e : 1.f;
    add_alibi_to_rows(s, factor, slope, base);
  }
};

}  // namespace jax_flashattn::wgmma
