// mma.sync m16n8k16 operand fragments from XOR-swizzled shared-memory tiles, named by how the
// tile is stored, so a kernel states each product as "A from [m][k]", "B from [k][n]".
//
// ldmatrix lane l addresses row l % 8 of 8x8 matrix l / 8; the matrix order below is the
// operand's register order: A = {rows 0-7 k 0-7, rows 8-15 k 0-7, rows 0-7 k 8-15,
// rows 8-15 k 8-15}; B pair = {n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15}.
// A storage with the reduction dim along rows ([k][m], [k][n]) loads with .trans.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/common/smem_tile.cuh"

namespace jax_flashattn::mma_sync {

// A (16 x 16) of a tile stored [m][k]: rows m0..m0+15, columns 16 ks..16 ks+15.
template <int kSmemDim, typename Elem>
__device__ __forceinline__ void load_a_mk(uint32_t (&a)[4], const Elem* tile, int m0, int ks,
                                          int lane) {
  const int matrix = lane / 8;
  const int row = m0 + (matrix & 1) * 8 + lane % 8;
  ptx::ldmatrix_x4(a, ptx::smem_address(tile + swizzled<kSmemDim>(row, 2 * ks + (matrix >> 1))));
}

// A (16 x 16) of a tile stored [k][m]: columns m0..m0+15 (m0 a multiple of 8), rows k0..k0+15.
template <int kSmemDim, typename Elem>
__device__ __forceinline__ void load_a_km(uint32_t (&a)[4], const Elem* tile, int m0, int k0,
                                          int lane) {
  const int matrix = lane / 8;
  const int row = k0 + (matrix >> 1) * 8 + lane % 8;
  ptx::ldmatrix_x4_trans(a, ptx::smem_address(tile + swizzled<kSmemDim>(row, m0 / 8 + (matrix & 1))));
}

// B of the two 8-column tiles n0..n0+15 of a tile stored [n][k], k-step ks: b[0..1] is the
// operand of columns n0..n0+7, b[2..3] of n0+8..n0+15.
template <int kSmemDim, typename Elem>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const Elem* tile, int n0, int ks,
                                          int lane) {
  const int matrix = lane / 8;
  const int row = n0 + (matrix >> 1) * 8 + lane % 8;
  ptx::ldmatrix_x4(b, ptx::smem_address(tile + swizzled<kSmemDim>(row, 2 * ks + (matrix & 1))));
}

// The same from a tile stored [k][n]: rows k0..k0+15, columns n0..n0+15 (n0 a multiple of 8).
template <int kSmemDim, typename Elem>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const Elem* tile, int k0, int n0,
                                          int lane) {
  const int matrix = lane / 8;
  const int row = k0 + (matrix & 1) * 8 + lane % 8;
  ptx::ldmatrix_x4_trans(b, ptx::smem_address(tile + swizzled<kSmemDim>(row, n0 / 8 + (matrix >> 1))));
}

// The accumulators of 8-column tiles 2 kk and 2 kk + 1, rounded to Elem, are exactly the A
// operand of k-step kk: a product's result feeds the next product with no shuffle.
template <typename Elem, int kTiles>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&acc)[kTiles][4], int kk) {
  a[0] = ptx::pack2<Elem>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = ptx::pack2<Elem>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = ptx::pack2<Elem>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = ptx::pack2<Elem>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// acc[2 np] += a * b[0..1] and acc[2 np + 1] += a * b[2..3]: one A against a B pair.
template <typename Elem, int kTiles>
__device__ __forceinline__ void mma_pair(float (&acc)[kTiles][4], int np, const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  ptx::mma_m16n8k16<Elem>(acc[2 * np], a, b0);
  ptx::mma_m16n8k16<Elem>(acc[2 * np + 1], a, b1);
}

}  // namespace jax_flashattn::mma_sync
