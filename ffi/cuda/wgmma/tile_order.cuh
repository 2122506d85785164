// The Hopper forward's tile order for calls with segment ids, written on the stream by one block
// before the forward's launch.
//
// The persistent kernel's blocks claim tiles in index order (tile_scheduler.cuh): a head's
// query blocks together, highest first. Without ids that is longest first under a causal mask,
// and the short tiles fill the end. On packed rows a block's key tiles follow its place in its
// document, not in the row, so the last tiles claimed are long or short at random and the
// blocks that draw the long ones finish alone. This order sorts the tiles by their key tile
// count, longest first, in classes of powers of two (all tiles of 2^k to 2^(k+1) - 1 key tiles
// together), and keeps the scheduler's order within a class (a stable sort), so the query
// blocks of one head that run together still share their documents' K/V in L2. A model of
// the grid (132 SMs, each tile's cost its key tiles plus 0.6, the packed preset's documents)
// puts the makespan at 1.03-1.09 of a perfect balance in index order, at 1.003-1.005 in this
// one (docs/decisions/segment-ids.md).
//
// One block of kOrderThreads threads: each tile's class from its batch entry's and query
// block's key range (TileScheduler::tile of the call's first head: the ids, and so the
// ranges, are the same for every head), counted per warp over its contiguous share of the tile
// indices, offsets by class and warp, then each warp places its share in index order (the
// lanes of one class ranked by __match_any_sync).
#pragma once

#include <cstdint>

#include "ffi/cuda/wgmma/tile_scheduler.cuh"
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

inline constexpr int kOrderThreads = 1024;
inline constexpr int kOrderWarps = kOrderThreads / 32;
// Classes of key tile counts: __clz(count) - 1, so 0 holds the longest tiles (2^30 or more key
// tiles) and 31 the tiles that see no key.
inline constexpr int kOrderClasses = 32;
// A class per (batch entry, query block), one byte each in shared memory: at most the 48 KiB
// a launch takes without opting in. Calls with more keep the scheduler's own order.
inline constexpr int64_t kOrderMaxEntries = 48 * 1024;

__device__ __forceinline__ int order_class(int key_tiles) { return __clz(key_tiles) - 1; }

template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kOrderThreads)
    order_tiles_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ uint8_t entry_class[];  // [batch][query block]
  // Per warp: its tiles of each class, then the position its first one of the class takes.
  // Column kOrderClasses counts the lanes past the warp's share.
  __shared__ int counts[kOrderWarps][kOrderClasses + 1];
  const auto s = TileScheduler<kBlockM, kBlockN, true>::make(p);
  const int m = s.m_blocks, heads = int(p.num_heads);
  const int entries = int(p.batch) * m;
  for (int e = int(threadIdx.x); e < entries; e += kOrderThreads)
    entry_class[e] = uint8_t(order_class(s.tile(p, e / m * heads * m + e % m).num_kv_tiles));
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (int c = lane; c <= kOrderClasses; c += 32) counts[warp][c] = 0;
  __syncthreads();

  const int share = (s.num_tiles + kOrderWarps - 1) / kOrderWarps;
  const int first = warp * share;
  const int end = first + share < s.num_tiles ? first + share : s.num_tiles;
  // Tile i is query block i % m of head (i / m) % heads of batch entry i / m / heads.
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
  // Lane c of warp 0: class c's first position (a scan over the classes of their totals),
  // then each warp's first position in it.
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
    if (c < kOrderClasses) p.tile_order[counts[warp][c] + __popc(peers & ((1u << lane) - 1))] = i;
    __syncwarp();
    if (lane == __ffs(peers) - 1) counts[warp][c] += __popc(peers);
    __syncwarp();
  }
}

// Writes the tile order of a call with segment ids into p.tile_order before the forward of
// configuration Traits; `ordered` says whether it did (false where the call has no room for
// it or more (batch entry, query block) pairs than kOrderMaxEntries: the forward then takes
// the scheduler's own order).
template <typename Traits>
cudaError_t order_tiles(const AttentionParams& p, int64_t m_blocks, int64_t tiles, bool& ordered,
                        cudaStream_t stream) {
  const int64_t entries = p.batch * m_blocks;
  ordered = p.tile_order != nullptr && p.tile_order_capacity >= tiles && entries > 0 &&
            entries <= kOrderMaxEntries;
  if (!ordered) return cudaSuccess;
  order_tiles_kernel<Traits::kBlockM, Traits::kBlockN>
      <<<1, kOrderThreads, size_t(entries), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flashattn::wgmma
