// Which keys a query sees, in the forms the CUDA kernels test: the key range a block of query
// rows must visit (so whole tiles outside it are never loaded) and the per-element predicate
// for the tiles that straddle a boundary. The Hopper forward and the decode kernels test
// variant::KeyWindow<int> (ffi/variant.h) through TileVisibility; Visibility below joins
// variant::KeyWindow<int64_t> and the mask for the CUDA-core, mma.sync and Hopper backward
// kernels.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/params.h"
#include "ffi/variant.h"

namespace jax_flashattn::cuda {

// Visibility for one (batch, head) in 64 bits: the KeyWindow's lengths and window (key_range,
// query_range), the ElementMask and the SegmentIds, with the two tests the kernels make on
// them, each in one function: built from smaller calls, ptxas branched and scheduled the
// mma.sync and CUDA-core kernels differently (their SASS changed; this form keeps it).
struct Visibility : variant::KeyWindow<int64_t> {
  variant::ElementMask mask;
  variant::SegmentIds segments;

  __device__ static Visibility make(const AttentionParams& p, int64_t b, int64_t n) {
    Visibility v;
    static_cast<variant::KeyWindow<int64_t>&>(v) = variant::KeyWindow<int64_t>::make(p, b);
    v.mask.keep = p.mask;
    v.mask.slice.offset = p.mask ? p.mask_strides.offset(b, p.batch_inner, n, 0, 0) : 0;
    v.mask.slice.row = p.mask_strides.row;
    v.mask.slice.col = p.mask_strides.col;
    return v;
  }

  // The same with the call's segment ids, for the kernels that take calls with them: the
  // CUDA-core kernels and the mma.sync instantiations for ids. make() leaves them out, and
  // with them their tests: in the other mma.sync kernels they cost calls without ids up to
  // 2.5%, and bias and mask calls 16-24% (docs/decisions/segment-ids.md).
  __device__ static Visibility make_with_segments(const AttentionParams& p, int64_t b,
                                                  int64_t n) {
    Visibility v = make(p, b, n);
    v.segments = variant::SegmentIds::make(p, b);
    return v;
  }

  // Whether every (row, key) of the rectangle is visible without looking at elements, so the
  // per-element predicate can be skipped (the common interior tile).
  __device__ bool all_visible(int64_t row_begin, int64_t row_end, int64_t key_begin,
                              int64_t key_end) const {
    if (mask.keep != nullptr || segments.q != nullptr || row_end > q_len || key_end > kv_len)
      return false;
    if (window_left != kUnboundedWindow && key_begin < row_end - 1 - window_left) return false;
    if (window_right != kUnboundedWindow && key_end - 1 > row_begin + window_right) return false;
    return true;
  }

  __device__ bool visible(int64_t t, int64_t s) const {
    if (t >= q_len || s >= kv_len) return false;
    if (window_left != kUnboundedWindow && s < t - window_left) return false;
    if (window_right != kUnboundedWindow && s > t + window_right) return false;
    if (segments.q != nullptr && segments.q[t] != segments.kv[s]) return false;
    return mask.keep == nullptr ||
           mask.keep[mask.slice.offset + t * mask.slice.row + s * mask.slice.col];
  }
};

// Visibility inside one (row block, key tile) in 32-bit tile-relative coordinates: row r and
// key c of the tile (0 <= r, c < span) are visible iff r < rows, c < keys and
// diff_lo <= c - r <= diff_hi. Clamping every bound to [-span, span] keeps each comparison's
// outcome and every sum small: visible() is four int32 compares, and column_bits (what the
// forward kernels' masked tiles use) one bit per element of a thread's accumulator row.
// Sequence lengths and windows only: an elementwise mask and segment ids are read separately.
struct TileVisibility {
  int rows, keys, diff_lo, diff_hi;

  __device__ static TileVisibility make(const Visibility& v, int64_t row0, int64_t key0, int span) {
    auto clamp = [span](int64_t x) { return int(x < -span ? -span : (x > span ? span : x)); };
    TileVisibility t;
    t.rows = clamp(v.q_len - row0);
    t.keys = clamp(v.kv_len - key0);
    // Key s = key0 + c sees query t = row0 + r iff t - left <= s <= t + right.
    t.diff_lo = v.window_left == kUnboundedWindow ? -span : clamp(row0 - key0 - v.window_left);
    t.diff_hi = v.window_right == kUnboundedWindow ? span : clamp(row0 - key0 + v.window_right);
    return t;
  }

  // The same from int32 bounds (no unbounded side there: see variant::KeyWindow).
  __device__ static TileVisibility make(const variant::KeyWindow<int>& v, int row0, int key0,
                                        int span) {
    const auto clamp = [span](int x) { return min(max(x, -span), span); };
    TileVisibility t;
    t.rows = clamp(v.q_len - row0);
    t.keys = clamp(v.kv_len - key0);
    t.diff_lo = clamp(row0 - key0 - v.left);
    t.diff_hi = clamp(row0 - key0 + v.right);
    return t;
  }

  __device__ bool visible(int r, int c) const {
    return r < rows && c < keys && c - r >= diff_lo && c - r <= diff_hi;
  }

  // The visible columns of row r as [lo, hi] (empty when lo > hi): two per-row bounds, which
  // column_bits turns into one bit per element of a thread's accumulator row.
  __device__ void columns(int r, int& lo, int& hi) const {
    lo = r + diff_lo > 0 ? r + diff_lo : 0;
    hi = r + diff_hi < keys - 1 ? r + diff_hi : keys - 1;
    if (r >= rows) hi = lo - 1;
  }

  // Row r's visible columns among one thread's share of an mma accumulator row: element
  // (t, e) of 8-column tile t is column 8 t + e + col0 (e = 0, 1), and bit 2 t + e of `bits`
  // (32 per word) says whether it is visible. Those columns rise with the bit index, so the
  // visible ones are one run of bits, built with one bmsk per word; a kernel then masks each
  // element with a predicate that ptxas takes seven at a time from a word (R2P), not with
  // compares against the bounds: two compares per element and their bounds cost about as much
  // as the masked tile's softmax (docs/decisions/int32-bounds-and-column-bits-masking.md).
  template <int kTiles>
  __device__ void column_bits(int r, int col0, uint32_t (&bits)[(2 * kTiles + 31) / 32]) const {
    int lo, hi;
    columns(r, lo, hi);
    lo = max(lo - col0, 0);
    hi -= col0;
    // The first bit whose column is >= lo and one past the last whose column is <= hi, in
    // arithmetic shifts (hi may be negative): column 8 t + e >= lo from 2 t + e on.
    const int first = 2 * (lo >> 3) + min(lo & 7, 2);
    const int end = 2 * (hi >> 3) + min(hi & 7, 1) + 1;
#pragma unroll
    for (int w = 0; w < (2 * kTiles + 31) / 32; ++w) {
      const int start = max(first - 32 * w, 0);
      bits[w] = ptx::bit_mask(uint32_t(start), uint32_t(max(end - 32 * w - start, 0)));
    }
  }

  // Whether bit i of column_bits is set.
  template <int kWords>
  __device__ static bool column_visible(const uint32_t (&bits)[kWords], int i) {
    return (bits[i / 32] >> (i % 32)) & 1u;
  }
};

// Segment ids: whether one id holds a warp's 16 positions of one side (lane l holds the id of
// position l % 16 in own_id) and kRun positions of the other, whose ids lie in shared memory
// from address `run` on: a warp vote, the same answer in every lane.
// Each lane tests kRun / 32 positions at immediate offsets: a loop from the lane's index would
// leave ptxas a trip count known only at run time (a remainder loop and its branches, about 20
// more instructions per tile in the Hopper forward).
template <int kRun>
__device__ __forceinline__ bool one_segment(int32_t own_id, uint32_t run, int lane) {
  static_assert(kRun % 32 == 0, "each lane tests kRun / 32 positions");
  const int32_t id = __shfl_sync(0xffffffff, own_id, 0);
  bool same = own_id == id;
  const uint32_t lane_run = run + uint32_t(lane) * 4;
#pragma unroll
  for (int i = 0; i < kRun / 32; ++i)
    same &= int32_t(ptx::ld_shared_b32(lane_run + uint32_t(i) * 128)) == id;
  return __all_sync(0xffffffff, same);
}

}  // namespace jax_flashattn::cuda
