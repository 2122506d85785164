// The order of the Hopper kernels' work for calls with segment ids: the forward's tiles (query
// block, head, batch entry) and the backward's blocks (key block, kv head, batch entry), written
// on the stream by one block before the kernel's launch.
//
// The forward's persistent blocks claim tiles in index order, the backward's grid starts its
// blocks in index order: a head's blocks together, longest first under a causal mask where the
// lengths follow the position in the row (the forward's highest query blocks, the backward's
// lowest key blocks), so that short ones fill the end. On packed rows a block's work follows its
// place in its document instead, so the last ones are long or short at random and the SMs that
// draw the long ones finish alone. This order keeps the long units (the kOrderLongClasses
// power-of-two classes from the longest unit's: at least an eighth of its tiles) first and in
// index order, so that the blocks running together are a few heads' and share
// their K/V (or Q/dO) in L2 as the index order's do, then the short ones sorted by tile count in
// classes of powers of two (all units of 2^k to 2^(k+1) - 1 tiles together), longest first,
// stable within a class. A model of the grids (132 SMs, each unit's cost its tiles plus a
// constant, the packed preset's documents) puts the index order at 1.03-1.09 of a perfect
// balance and this one at 1.001-1.005, as the sort of every unit by class, which measured slower
// where long units are many (one document per row: forward 1.5%, forward+backward 2.5-2.9%),
// its longest units from every head running at once (docs/decisions/segment-ids.md).
//
// One block of kOrderThreads threads: each unit's class from its batch entry's and position's
// tile count (Work::tiles: the ranges, from the ids, are the same for every head), the long
// classes merged into one, counted per warp over its contiguous share of the indices, offsets
// by class and warp, then each warp places its share in index order (the lanes of one class
// ranked by __match_any_sync).
#pragma once

#include <cstdint>

#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

inline constexpr int kOrderThreads = 1024;
inline constexpr int kOrderWarps = kOrderThreads / 32;
// Classes of tile counts: __clz(count) - 1, so 0 holds the longest units (2^30 or more tiles)
// and 31 those with none.
inline constexpr int kOrderClasses = 32;
// Per warp, its units of each class (and a column for lanes past its share): order_kernel's
// static shared memory.
inline constexpr int kOrderCountBytes = kOrderWarps * (kOrderClasses + 1) * 4;
// A class per (batch entry, position), one byte each in dynamic shared memory, beside the
// counts within the 48 KiB a launch takes without opting in. Calls with more keep the index
// order.
inline constexpr int64_t kOrderMaxEntries = 48 * 1024 - kOrderCountBytes;

// Classes from the longest unit's on that keep the index order: its own and the next two. With
// 2^k to 2^(k+1) - 1 tiles in the longest, the units of 2^(k-2) tiles or more (between an
// eighth and a quarter of its tiles).
inline constexpr int kOrderLongClasses = 3;

__device__ __forceinline__ int order_class(int tiles) { return __clz(tiles) - 1; }

// Work: index i of a kernel's units is position i % units of head (i / units) % heads of batch
// entry i / units / heads (Work::units(p), Work::heads(p)); Work::tiles(p, b, r) the tile
// count of position r of batch entry b.
template <typename Work>
__global__ void __launch_bounds__(kOrderThreads)
    order_kernel(const __grid_constant__ AttentionParams p, int* order) {
  extern __shared__ uint8_t entry_class[];  // [batch][position]
  // Per warp: its units of each class, then the place its first one of the class takes.
  // Column kOrderClasses counts the lanes past the warp's share.
  // Before the counts, counts[0][0] finds the longest unit's class.
  __shared__ int counts[kOrderWarps][kOrderClasses + 1];
  static_assert(sizeof(counts) == kOrderCountBytes, "kOrderMaxEntries leaves room for them");
  const int m = Work::units(p), heads = Work::heads(p);
  const int entries = int(p.batch) * m, units = entries * heads;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) counts[0][0] = kOrderClasses;
  __syncthreads();
  int top = kOrderClasses;
  for (int e = int(threadIdx.x); e < entries; e += kOrderThreads) {
    const int c = order_class(Work::tiles(p, e / m, e % m));
    entry_class[e] = uint8_t(c);
    top = min(top, c);
  }
  top = __reduce_min_sync(0xffffffff, top);
  if (lane == 0) atomicMin(&counts[0][0], top);
  __syncthreads();
  top = counts[0][0];
  __syncthreads();
  for (int c = lane; c <= kOrderClasses; c += 32) counts[warp][c] = 0;
  // The long classes as one, the first (each thread the entries it wrote).
  for (int e = int(threadIdx.x); e < entries; e += kOrderThreads)
    if (entry_class[e] < top + kOrderLongClasses) entry_class[e] = 0;
  __syncthreads();

  const int share = (units + kOrderWarps - 1) / kOrderWarps;
  const int first = warp * share;
  const int end = first + share < units ? first + share : units;
  const auto class_of = [&](int i) {
    return i < end ? int(entry_class[i / m / heads * m + i % m]) : kOrderClasses;
  };
  for (int i0 = first; i0 < end; i0 += 32) {
    const int c = class_of(i0 + lane);
    const unsigned peers = __match_any_sync(0xffffffff, c);
    if (lane == __ffs(peers) - 1) counts[warp][c] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Lane c of warp 0: class c's first place (a scan over the classes of their totals), then
  // each warp's first place in it.
  if (warp == 0) {
    int total = 0;
    for (int w = 0; w < kOrderWarps; ++w) total += counts[w][lane];
    int start = total;
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(0xffffffff, start, d);
      if (lane >= d) start += below;
    }
    start -= total;
    for (int w = 0; w < kOrderWarps; ++w) {
      const int n = counts[w][lane];
      counts[w][lane] = start;
      start += n;
    }
  }
  __syncthreads();
  for (int i0 = first; i0 < end; i0 += 32) {
    const int i = i0 + lane, c = class_of(i);
    const unsigned peers = __match_any_sync(0xffffffff, c);
    if (c < kOrderClasses) order[counts[warp][c] + __popc(peers & ((1u << lane) - 1))] = i;
    __syncwarp();
    if (lane == __ffs(peers) - 1) counts[warp][c] += __popc(peers);
    __syncwarp();
  }
}

// Writes the order of a call's units into `order` (room for `capacity`) before the kernel whose
// units Work describes, or sets `order` to nullptr where the call has no room for it or more
// (batch entry, position) pairs than kOrderMaxEntries: the kernel then takes its index order.
template <typename Work>
cudaError_t write_order(const AttentionParams& p, int*& order, int64_t capacity,
                        cudaStream_t stream) {
  const int64_t entries = p.batch * Work::units(p);
  if (order == nullptr || capacity < entries * Work::heads(p) || entries == 0 ||
      entries > kOrderMaxEntries) {
    order = nullptr;
    return cudaSuccess;
  }
  order_kernel<Work><<<1, kOrderThreads, size_t(entries), stream>>>(p, order);
  return cudaGetLastError();
}

// The forward's tiles: query blocks of kBlockM rows, their key tiles (TileScheduler's ranges).
template <int kBlockM, int kBlockN>
struct ForwardTileWork {
  __host__ __device__ static int units(const AttentionParams& p) {
    return int((p.seqlen_q + kBlockM - 1) / kBlockM);
  }
  __host__ __device__ static int heads(const AttentionParams& p) { return int(p.num_heads); }
  __device__ static int tiles(const AttentionParams& p, int b, int r) {
    const auto s = TileScheduler<kBlockM, kBlockN, true>::make(p);
    return s.tile(p, b * heads(p) * s.m_blocks + r).num_kv_tiles;
  }
};

}  // namespace jax_flashattn::wgmma
