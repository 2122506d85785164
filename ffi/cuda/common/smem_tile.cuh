// Shared-memory tiles of the mma.sync kernels: the XOR swizzle, ldmatrix addressing, and the
// copies between global row tiles and swizzled shared tiles (cp.async in, 16-byte stores out).
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

// Rows of 2-byte elements padded to a whole number of 128-byte swizzle spans.
constexpr int smem_dim_for(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile: XOR with row % 8
// spreads the 8 rows an ldmatrix phase reads over all 32 banks.
template <int kSmemDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kSmemDim + ((chunk ^ (row & 7)) << 3);
}

// The layouts load_tile writes, each an element offset of 16-byte chunk `chunk` of row `row`,
// with the geometry LdmatrixAddress (below) reads them by: rows of kRowBytes bytes, made of
// spans of kSpanSteps 32-byte column steps within which the chunks are XOR-swizzled by row % 8,
// a span's rows kSpanBytes after the previous span's (kSpanBytes 0: one span, the row). Rows of
// kSmemDim elements with the XOR swizzle above (the mma.sync kernels), ...
template <int kSmemDim>
struct SwizzledRows {
  static constexpr int kRowBytes = kSmemDim * 2, kSpanBytes = 0;
  __device__ static int offset(int row, int chunk) { return swizzled<kSmemDim>(row, chunk); }
};

// ... or the layout TMA writes with the 128-byte swizzle (and the wgmma descriptors of wgmma/
// read): each 64-element span of the kRows rows a [kRows][64] array of its own, spans one after
// another, chunk c of a row at c ^ row % 8 within its span's row.
template <int kRows>
struct SwizzledSpans {
  static constexpr int kRowBytes = 128, kSpanSteps = 4, kSpanBytes = kRows * kRowBytes;
  __device__ static int offset(int row, int chunk) {
    return (chunk >> 3) * kRows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  }
};

// ... or rows of kSmemDim elements one after another, unswizzled: for tiles that only whole
// 16-byte loads read, consecutive threads consecutive chunks (the wgmma decode kernel's e4m3
// ring, which its widening reads).
template <int kSmemDim>
struct DenseRows {
  static constexpr int kRowBytes = kSmemDim * 2, kSpanBytes = 0;
  __device__ static int offset(int row, int chunk) { return row * kSmemDim + chunk * 8; }
};

// ldmatrix addresses into a tile laid out as Layout, whose start is aligned to its swizzle's
// period (a whole row of SwizzledRows, a power of two; 1024 bytes for SwizzledSpans). Lane l
// addresses row `lane_row` (== l % 8 mod 8) and 16-byte chunk `lane_chunk` (0 or 1) of each
// 16 x 16 operand. Chunk 2 i + c of a row sits at ((c ^ row % 8) * 16) ^ (32 (i % kSpanSteps))
// bytes into the row of span i / kSpanSteps, so one per-lane base address covers every
// operand: XOR in the column step within its span, add whole spans and rows. That keeps one
// register per operand instead of one per (step, operand) for ptxas to hoist.
template <typename Layout>
struct LdmatrixAddress {
  uint32_t base;

  __device__ LdmatrixAddress(const void* tile, int lane_row, int lane_chunk)
      : base(ptx::smem_address(tile) + lane_row * Layout::kRowBytes +
             ((lane_chunk ^ (lane_row & 7)) << 4)) {}

  // 16 x 16 operand at rows [16 row_step, +16), columns [16 col_step, +16). With one span per
  // row (SwizzledRows) every column step is an XOR, as the row is aligned to its power-of-two
  // size: no division where the step is known only at run time.
  __device__ uint32_t operator()(int row_step, int col_step) const {
    const uint32_t rows = row_step * 16 * Layout::kRowBytes;
    if constexpr (Layout::kSpanBytes == 0)
      return (base ^ (col_step << 5)) + rows;
    else
      return (base ^ ((col_step % Layout::kSpanSteps) << 5)) +
             (col_step / Layout::kSpanSteps) * Layout::kSpanBytes + rows;
  }
};

// Copies rows [0, kRows) x chunks [0, kChunks) of a [rows, head_dim] global tile into shared
// memory laid out as Layout, zero-filling rows >= valid_rows and chunks past head_dim.
//
// Copy j of thread tid is chunk tid + j kThreads of the tile in row-major order, over a loop of
// compile-time length: bounded by the runtime tid instead, ptxas keeps the loop and spends tens
// of integer instructions of 64-bit address and predicate arithmetic on every 16-byte copy
// (docs/decisions/cp-async-tile-copies.md). Where whole rows fit the block (kThreads a
// multiple of kChunks) every copy of a thread is the same chunk column, kRowStep rows further
// on: one 64-bit add per copy.
template <typename Traits, int kRows, typename Layout = SwizzledRows<Traits::kSmemDim>,
          typename Elem>
__device__ __forceinline__ void load_tile(Elem* smem, const Elem* global, int64_t row_stride,
                                          int64_t valid_rows, int64_t head_dim, int tid) {
  constexpr int kChunks = Traits::kChunks, kThreads = Traits::kThreads;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kCopies = (kTotal + kThreads - 1) / kThreads;
  const int rows = valid_rows < 0 ? 0 : valid_rows < kRows ? int(valid_rows) : kRows;
  const int head_chunks = int((head_dim < kChunks * 8 ? head_dim : kChunks * 8) + 7) / 8;
  if constexpr (kThreads % kChunks == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    const int row0 = tid / kChunks, chunk = tid % kChunks;
    const bool chunk_valid = chunk < head_chunks;
    const Elem* src = global + row0 * row_stride + chunk * 8;
    const int64_t src_step = kRowStep * row_stride;
    // A whole tile (every K/V tile but the last, at an unpadded head dim) needs no predicates
    // and no selects: one 64-bit add per copy instead of ~9 instructions. It pays where a
    // thread has many copies (8 per tile in the H = 128 forward); at 4 (H = 64) the second
    // copy loop costs more than it saves, so it is compiled only from 8 on
    // (docs/decisions/cp-async-tile-copies.md).
    constexpr bool kWholeTilePath = kCopies >= 8;
    if (kWholeTilePath && rows == kRows && head_chunks == kChunks) {
#pragma unroll
      for (int j = 0; j < kCopies; ++j) {
        const int row = row0 + j * kRowStep;
        if (kTotal % kThreads != 0 && row >= kRows) break;
        ptx::cp_async_16(ptx::smem_address(smem + Layout::offset(row, chunk)),
                         src + j * src_step);
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int row = row0 + j * kRowStep;
      if (kTotal % kThreads != 0 && row >= kRows) break;
      const bool valid = chunk_valid && row < rows;
      ptx::cp_async_16(ptx::smem_address(smem + Layout::offset(row, chunk)),
                       valid ? src + j * src_step : global, valid);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const unsigned i = unsigned(tid) + j * kThreads;
      if (kTotal % kThreads != 0 && i >= unsigned(kTotal)) break;
      const int row = int(i / kChunks), chunk = int(i % kChunks);
      const bool valid = row < rows && chunk < head_chunks;
      const Elem* src = valid ? global + row * row_stride + chunk * 8 : global;
      ptx::cp_async_16(ptx::smem_address(smem + Layout::offset(row, chunk)), src,
                       valid);
    }
  }
}

// Copies keys [key0, key0 + kBlockN) of K and V (whose rows start at `k` and `v`) into one
// pipeline stage, zero-filling keys past kv_len, the batch entry's key length: a padded cache
// may hold NaN or Inf there, and a masked probability of 0 times NaN is NaN.
template <typename Traits, typename Elem>
__device__ __forceinline__ void load_kv_tile(Elem* sK, Elem* sV, const Elem* k, const Elem* v,
                                             int64_t key0, int64_t kv_len,
                                             const AttentionParams& p, int tid) {
  load_tile<Traits, Traits::kBlockN>(sK, k + key0 * p.kv_row_stride, p.kv_row_stride,
                                     kv_len - key0, p.head_dim, tid);
  load_tile<Traits, Traits::kBlockN>(sV, v + key0 * p.kv_row_stride, p.kv_row_stride,
                                     kv_len - key0, p.head_dim, tid);
}

// Zeroes rows [first_row, kRows) of a shared tile laid out as Layout with kChunks 16-byte chunks
// per row, `threads` threads from `tid` on: the rows of a TMA-loaded key tile past the batch
// entry's key length, which the tensor map (spanning all of S) loaded from the cache.
template <typename Layout, int kRows, int kChunks, typename Elem>
__device__ __forceinline__ void zero_tile_rows(Elem* smem, int first_row, int tid, int threads) {
  const int rows = kRows - (first_row < 0 ? 0 : first_row);
  for (int i = tid; i < rows * kChunks; i += threads) {
    const int row = kRows - rows + i / kChunks, chunk = i % kChunks;
    *reinterpret_cast<uint4*>(smem + Layout::offset(row, chunk)) = uint4{};
  }
}

// Writes rows [0, valid_rows) x the head_dim columns of a swizzled shared tile of kRows rows to
// a [rows, head_dim] global tile with 16-byte stores.
template <typename Traits, int kRows, typename Elem>
__device__ __forceinline__ void store_tile(Elem* global, int64_t row_stride, const Elem* smem,
                                           int64_t valid_rows, int64_t head_dim, int tid) {
  constexpr int kChunks = Traits::kChunks;
  for (int i = tid; i < kRows * kChunks; i += Traits::kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (row < valid_rows && chunk * 8 < head_dim)
      *reinterpret_cast<uint4*>(global + row * row_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(smem + swizzled<Traits::kSmemDim>(row, chunk));
  }
}

// Writes zeros to rows [0, valid_rows) x the head_dim columns of a global tile, 16 bytes at a
// time (the output of rows that see no key).
template <typename Traits, typename Elem>
__device__ __forceinline__ void zero_rows(Elem* global, int64_t row_stride, int64_t valid_rows,
                                          int64_t head_dim, int tid) {
  constexpr int kChunks = Traits::kChunks;
  for (int i = tid; i < valid_rows * kChunks; i += Traits::kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (chunk * 8 < head_dim)
      *reinterpret_cast<uint4*>(global + row * row_stride + chunk * 8) = uint4{};
  }
}

}  // namespace jax_flashattn::mma_sync
