// The Hopper backward's staged bias or mask (BackwardWithStagedTerm): each step's tile of it,
// [kBlockM queries][kBlockN keys], lands in the step's stage beside Q and dO, copied by one warp
// of the producer's warpgroup with cp.async, whose completion counts as 32 arrivals on the
// stage's full barrier. The consumers read it from there in place of 32 reads each from global
// memory: a bias as S^T lands (BackwardBiasAndMask::add_staged_bias), a mask's bits before
// (BackwardBiasAndMask::staged_mask_bits).
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/wgmma/staged_term.h"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// A tile of kBytes elements: rows of kBlockN keys in 16-byte chunks, chunk c of row r at chunk
// c ^ (r % 8) of the row (the 128-byte swizzle on chunks), or in rows of four chunks (a mask of
// 64 keys) c ^ (r / 2 % 4). The eight rows of an 8 x 8 block that ldmatrix reads (one chunk of
// each) then fall in distinct bank quadruples, and so do the four rows (every other one) of a
// warp's byte reads of a mask.
template <typename Traits, int kBytes>
struct BackwardTermTile {
  static constexpr int kRowBytes = Traits::kBlockN * kBytes;
  static constexpr int kRowChunks = kRowBytes / 16;
  static_assert(kRowChunks >= 4 && 32 % kRowChunks == 0,
                "the swizzle stays in a row, and each lane copies one column of chunks");
  static_assert(Traits::kBlockM * kRowBytes <= Traits::kTermStageBytes, "a tile fits a stage");

  __device__ static uint32_t chunk_at(int r, int c) {
    const int swizzle = kRowChunks >= 8 ? r % 8 : r / 2 % 4;
    return uint32_t(r * kRowBytes + ((c ^ swizzle) << 4));
  }

  // Query tile q0 of head n, keys key0.., of batch entry b into `dst` by cp.async from this
  // lane: chunks lane, lane + 32, ..., one column of chunks; chunks past T or S zero-filled
  // (read by no visible element: S is a whole number of chunks, staged_term), their source
  // the head's first element. One chunk an iteration: the producer's warpgroup has 24
  // registers.
  __device__ static void copy(const AttentionParams& p, const void* base,
                              const BroadcastStrides& st, int b, int n, int q0, int key0,
                              uint32_t dst, int lane) {
    constexpr int kRowsPerPass = 32 / kRowChunks;
    const char* head =
        static_cast<const char*>(base) + st.head_offset32(b, p.batch_inner32(), n) * kBytes;
    const int c = lane % kRowChunks;
    const int key = key0 + c * (16 / kBytes);
    int row = q0 + lane / kRowChunks;
    const char* src = head + (int64_t(row) * st.row + key) * kBytes;
    const int64_t src_step = kRowsPerPass * st.row * kBytes;
    const int rows_end = key < p.seqlen_k ? min(q0 + Traits::kBlockM, int(p.seqlen_q)) : 0;
#pragma unroll 1
    for (int r = lane / kRowChunks; r < Traits::kBlockM; r += kRowsPerPass) {
      const bool valid = row < rows_end;
      ptx::cp_async_16(dst + chunk_at(r, c), valid ? src : head, valid);
      row += kRowsPerPass;
      src += src_step;
    }
  }
};

}  // namespace jax_flashattn::wgmma
