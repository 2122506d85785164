// One wrapper per Hopper (sm_90a) PTX instruction the wgmma kernels use: mbarriers, TMA
// (cp.async.bulk.tensor), wgmma and setmaxnreg. Callers compile them only for sm_90a (inside
// JAX_FLASHATTN_SM90_BODY, below); the wgmma operand lists are spelled out because inline asm
// takes no arrays.
#pragma once

// The Hopper kernels' bodies exist only in the sm_90a compilation (wgmma, setmaxnreg); the
// other targets of a multi-architecture build get empty kernels. The dispatchers launch them only
// on compute capability 9.0 from a build whose only 9.0 image is sm_90a (cmake/cuda.cmake).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FLASHATTN_SM90_BODY 1
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "ffi/cuda/common/ptx.cuh"  // smem_address

namespace jax_flashattn::ptx {

// ---- mbarrier: a shared-memory barrier that completes a phase when `count` threads have
// arrived and the transaction bytes announced with expect_tx have landed.

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrives and announces `bytes` more to land (a TMA load's size) in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t phase) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  } while (!done);
}

// ---- TMA: tiles of a 4-D tensor map (coordinates innermost first) to and from shared memory,
// and boxes of a 1-D one.

__device__ __forceinline__ void tma_load_1d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3}], [%2];\n" ::"r"(dst),
      "l"(tensor_map), "r"(bar), "r"(c0)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_store_4d(const void* tensor_map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(tensor_map), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Adds a box of shared memory into a 4-D tensor map's tensor in global memory, element-wise
// (the map's type; the adds are performed in L2, atomically per element), clipped at the
// tensor's bounds. Completes with the bulk group it is committed in.
__device__ __forceinline__ void tma_reduce_add_4d(const void* tensor_map, uint32_t src, int c0,
                                                  int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group "
      "[%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(tensor_map),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of the most recent committed bulk groups are still reading
// shared memory (every older one has finished reading).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until the committed bulk stores and reductions have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_group_read_all() { bulk_wait_group_read<0>(); }

// Waits until the committed bulk stores and reductions are complete: their writes to global
// memory performed, not only their reads of shared memory.
__device__ __forceinline__ void bulk_wait_group_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Orders this thread's async-proxy global-memory accesses (TMA stores and reductions) with its
// generic-proxy ones, both ways: a completed reduction before a release that publishes it, an
// acquire before a reduction that must follow the ones it observed.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones:
// its writes before a TMA store's reads of them, and (with the reads of other threads made
// visible to it first) reads before a TMA load that overwrites them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Stores 4 bytes at a shared-memory address: a 32-bit shared-window offset, where a store
// through a generic pointer takes a 64-bit address register.
__device__ __forceinline__ void st_shared_b32(uint32_t address, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(value) : "memory");
}

// Two floats, 8-byte aligned, at a shared-memory address.
__device__ __forceinline__ void st_shared_v2_f32(uint32_t address, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(x), "f"(y) : "memory");
}

// 16 bytes, 16-byte aligned, at a shared-memory address.
__device__ __forceinline__ void st_shared_v4_b32(uint32_t address, uint32_t x, uint32_t y,
                                                 uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(x), "r"(y),
               "r"(z), "r"(w)
               : "memory");
}

// Four 8x8 b16 matrices to shared memory (sm_90): lane l gives the address of row l % 8 of
// matrix l / 8, and register i of lane l holds matrix i's elements (l / 4, 2 (l % 4) + {0, 1}),
// the layout of an m16n8 accumulator packed in pairs. One instruction stores what takes four
// st.shared.b32.
__device__ __forceinline__ void stmatrix_x4(uint32_t address, uint32_t r0, uint32_t r1,
                                            uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(address), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void ld_shared_v4_b32(uint32_t address, uint32_t (&v)[4]) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(address)
               : "memory");
}

// ---- Register reallocation between warpgroups (every warp of the warpgroup executes it).

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- wgmma: warpgroup matrix multiply, m64 x N x k16, float32 accumulators.
//
// The accumulator fragment of each warp (16 of the 64 rows) is laid out like N / 8 mma.sync
// m16n8 accumulators side by side: d[j][0..1] at row lane / 4, columns 8 j + 2 (lane % 4) + 0..1,
// d[j][2..3] eight rows lower; the register A operand is the mma.sync m16n8k16 A fragment.

// Orders register accesses before the wgmma that follow (required before the first wgmma
// and whenever its accumulator or A registers were touched by other instructions).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warp are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins a register between asynchronous wgmma and the code around them: the compiler may not
// move reads or writes of `x` across this point (a compiler fence, no instruction).
__device__ __forceinline__ void fence_register(float& x) { asm volatile("" : "+f"(x)::"memory"); }

__device__ __forceinline__ void fence_register(uint32_t& x) {
  asm volatile("" : "+r"(x)::"memory");
}

// fence_register on every accumulator of a wgmma fragment.
template <int kTiles>
__device__ __forceinline__ void fence_registers(float (&d)[kTiles][4]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_register(d[t][e]);
}

// The same value, opaque to the compiler (no instruction): what is computed from it cannot be
// hoisted out of the loop it sits in, where keeping the results would cost registers.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Shared-memory matrix descriptor of a tile written by TMA with the 128-byte swizzle: rows of
// 128 bytes, 8-row groups `group_stride` bytes apart (SBO), swizzle spans `span_stride` bytes
// apart along the other dimension (LBO; used by MN-major operands only).
__device__ __forceinline__ uint64_t smem_descriptor_sw128(uint32_t address, uint32_t span_stride,
                                                          uint32_t group_stride) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((span_stride >> 4) & 0x3FFF) << 16) |
         (uint64_t((group_stride >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// The same for a tile written by TMA with the 64-byte swizzle: rows of 64 bytes, 8-row groups
// `group_stride` bytes apart (FP8 attention's V^T with 64-key tiles).
__device__ __forceinline__ uint64_t smem_descriptor_sw64(uint32_t address, uint32_t span_stride,
                                                         uint32_t group_stride) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((span_stride >> 4) & 0x3FFF) << 16) |
         (uint64_t((group_stride >> 4) & 0x3FFF) << 32) | (uint64_t(2) << 62);
}

// The descriptor of the address `bytes` past the one `desc` describes: the start address
// (address >> 4) sits in the low 14 bits, and an offset inside one shared-memory tile never
// carries out of them. One add on the low word, where a descriptor built from the address
// takes four or five instructions (each wgmma of a k-loop needs two).
__device__ __forceinline__ uint64_t smem_descriptor_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t low = uint32_t(desc) + (bytes >> 4), high = uint32_t(desc >> 32);
  return (uint64_t(high) << 32) | low;
}

// D (+)= A B, A and B from shared memory, both K-major (the reduction dim contiguous).
template <int N, typename Elem>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc,
                                         bool accumulate);

// D (+)= A B, A and B from shared memory, both MN-major (M resp. N contiguous: the transposed
// forms; wgmma transposes only 16-bit operands, which these are). The backward's dQ = dS K reads
// dS^T, stored [key][query] as its accumulator lies, and K [key][head dim] this way.
template <int N, typename Elem>
__device__ __forceinline__ void wgmma_ss_mn_major(float (&d)[N / 8][4], uint64_t a_desc,
                                                  uint64_t b_desc, bool accumulate);

// D (+)= A B, A from registers, B from shared memory MN-major (N contiguous: the transposed
// form).
template <int N, typename Elem>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                         uint64_t b_desc, bool accumulate = true);

// D (+)= A B, A from registers, B from shared memory K-major (the reduction dim contiguous): the
// decode kernel's S = Q K^T, whose few query rows stay in registers.
template <int N, typename Elem>
__device__ __forceinline__ void wgmma_rs_k_major(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                                 uint64_t b_desc, bool accumulate);

// Accumulator operand lists: the register template and the "+f" bindings of d[N / 8][4], each
// size's the one before it and its next 8-column tiles.
#define JAX_FLASHATTN_WGMMA_D32_LIST \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define JAX_FLASHATTN_WGMMA_D64_LIST \
  JAX_FLASHATTN_WGMMA_D32_LIST ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JAX_FLASHATTN_WGMMA_D96_LIST \
  JAX_FLASHATTN_WGMMA_D64_LIST ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define JAX_FLASHATTN_WGMMA_D128_LIST \
  JAX_FLASHATTN_WGMMA_D96_LIST ", " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JAX_FLASHATTN_WGMMA_D160_LIST \
  JAX_FLASHATTN_WGMMA_D128_LIST ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define JAX_FLASHATTN_WGMMA_D192_LIST \
  JAX_FLASHATTN_WGMMA_D160_LIST ", " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define JAX_FLASHATTN_WGMMA_D256_LIST \
  JAX_FLASHATTN_WGMMA_D192_LIST ", " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define JAX_FLASHATTN_WGMMA_D32_REGS "{" JAX_FLASHATTN_WGMMA_D32_LIST "}"
#define JAX_FLASHATTN_WGMMA_D64_REGS "{" JAX_FLASHATTN_WGMMA_D64_LIST "}"
#define JAX_FLASHATTN_WGMMA_D96_REGS "{" JAX_FLASHATTN_WGMMA_D96_LIST "}"
#define JAX_FLASHATTN_WGMMA_D128_REGS "{" JAX_FLASHATTN_WGMMA_D128_LIST "}"
#define JAX_FLASHATTN_WGMMA_D160_REGS "{" JAX_FLASHATTN_WGMMA_D160_LIST "}"
#define JAX_FLASHATTN_WGMMA_D192_REGS "{" JAX_FLASHATTN_WGMMA_D192_LIST "}"
#define JAX_FLASHATTN_WGMMA_D256_REGS "{" JAX_FLASHATTN_WGMMA_D256_LIST "}"
#define JAX_FLASHATTN_WGMMA_D32_OPERANDS(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
#define JAX_FLASHATTN_WGMMA_D64_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D32_OPERANDS(d), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define JAX_FLASHATTN_WGMMA_D96_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D64_OPERANDS(d), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
  "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])
#define JAX_FLASHATTN_WGMMA_D128_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D96_OPERANDS(d), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define JAX_FLASHATTN_WGMMA_D160_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D128_OPERANDS(d), \
  "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), \
  "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
  "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), \
  "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3])
#define JAX_FLASHATTN_WGMMA_D192_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D160_OPERANDS(d), \
  "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), \
  "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
  "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), \
  "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3])
#define JAX_FLASHATTN_WGMMA_D256_OPERANDS(d) \
  JAX_FLASHATTN_WGMMA_D192_OPERANDS(d), \
  "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), \
  "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), \
  "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), \
  "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), \
  "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), \
  "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
  "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), \
  "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])

// One specialisation of each wrapper per (N, element type). A and B descriptors, the scale-d
// flag and the register A operand follow the N / 2 accumulators, hence their operand numbers.
// The shared-memory forms, one function per major-ness of both operands (TRANS: imm-trans-a and
// imm-trans-b, 1 for MN-major), for both element types at once.
#define JAX_FLASHATTN_WGMMA_SS_ONE(NAME, TRANS, N, ELEM, TYPE, REGS, OPERANDS, A, B, SCALE_D)   \
  template <>                                                                                \
  __device__ __forceinline__ void NAME<N, ELEM>(float(&d)[N / 8][4], uint64_t a_desc,         \
                                                uint64_t b_desc, bool accumulate) {           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE_D ", 0;\n"                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS    \
                 ", %" #A ", %" #B ", p, 1, 1, " #TRANS ", " #TRANS ";\n}\n"                 \
                 : OPERANDS(d)                                                               \
                 : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)));                          \
  }
#define JAX_FLASHATTN_WGMMA_SS(NAME, TRANS, N, REGS, OPERANDS, A, B, SCALE_D)                   \
  JAX_FLASHATTN_WGMMA_SS_ONE(NAME, TRANS, N, __nv_bfloat16, "bf16", REGS, OPERANDS, A, B,      \
                             SCALE_D)                                                        \
  JAX_FLASHATTN_WGMMA_SS_ONE(NAME, TRANS, N, __half, "f16", REGS, OPERANDS, A, B, SCALE_D)

// The register-A forms, one function per B major-ness (TRANS_B: imm-trans-b, 1 for MN-major),
// for both element types at once.
#define JAX_FLASHATTN_WGMMA_RS_ONE(NAME, TRANS_B, N, ELEM, TYPE, REGS, OPERANDS, A0, A1, A2, A3, \
                                   B, SCALE_D)                                               \
  template <>                                                                                \
  __device__ __forceinline__ void NAME<N, ELEM>(float(&d)[N / 8][4], const uint32_t(&a)[4],    \
                                                uint64_t b_desc, bool accumulate) {           \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE_D ", 0;\n"                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS    \
                 ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, " #TRANS_B    \
                 ";\n}\n"                                                                    \
                 : OPERANDS(d)                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),                  \
                   "r"(int(accumulate)));                                                    \
  }
#define JAX_FLASHATTN_WGMMA_RS(NAME, TRANS_B, N, REGS, OPERANDS, A0, A1, A2, A3, B, SCALE_D)    \
  JAX_FLASHATTN_WGMMA_RS_ONE(NAME, TRANS_B, N, __nv_bfloat16, "bf16", REGS, OPERANDS, A0, A1,  \
                             A2, A3, B, SCALE_D)                                             \
  JAX_FLASHATTN_WGMMA_RS_ONE(NAME, TRANS_B, N, __half, "f16", REGS, OPERANDS, A0, A1, A2, A3,  \
                             B, SCALE_D)

JAX_FLASHATTN_WGMMA_SS(wgmma_ss, 0, 64, JAX_FLASHATTN_WGMMA_D64_REGS,
                       JAX_FLASHATTN_WGMMA_D64_OPERANDS, 32, 33, 34)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss, 0, 96, JAX_FLASHATTN_WGMMA_D96_REGS,
                       JAX_FLASHATTN_WGMMA_D96_OPERANDS, 48, 49, 50)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss, 0, 128, JAX_FLASHATTN_WGMMA_D128_REGS,
                       JAX_FLASHATTN_WGMMA_D128_OPERANDS, 64, 65, 66)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss, 0, 160, JAX_FLASHATTN_WGMMA_D160_REGS,
                       JAX_FLASHATTN_WGMMA_D160_OPERANDS, 80, 81, 82)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss_mn_major, 1, 32, JAX_FLASHATTN_WGMMA_D32_REGS,
                       JAX_FLASHATTN_WGMMA_D32_OPERANDS, 16, 17, 18)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss_mn_major, 1, 64, JAX_FLASHATTN_WGMMA_D64_REGS,
                       JAX_FLASHATTN_WGMMA_D64_OPERANDS, 32, 33, 34)
JAX_FLASHATTN_WGMMA_SS(wgmma_ss_mn_major, 1, 128, JAX_FLASHATTN_WGMMA_D128_REGS,
                       JAX_FLASHATTN_WGMMA_D128_OPERANDS, 64, 65, 66)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs, 1, 64, JAX_FLASHATTN_WGMMA_D64_REGS,
                       JAX_FLASHATTN_WGMMA_D64_OPERANDS, 32, 33, 34, 35, 36, 37)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs, 1, 96, JAX_FLASHATTN_WGMMA_D96_REGS,
                       JAX_FLASHATTN_WGMMA_D96_OPERANDS, 48, 49, 50, 51, 52, 53)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs, 1, 128, JAX_FLASHATTN_WGMMA_D128_REGS,
                       JAX_FLASHATTN_WGMMA_D128_OPERANDS, 64, 65, 66, 67, 68, 69)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs_k_major, 0, 64, JAX_FLASHATTN_WGMMA_D64_REGS,
                       JAX_FLASHATTN_WGMMA_D64_OPERANDS, 32, 33, 34, 35, 36, 37)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs_k_major, 0, 128, JAX_FLASHATTN_WGMMA_D128_REGS,
                       JAX_FLASHATTN_WGMMA_D128_OPERANDS, 64, 65, 66, 67, 68, 69)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs, 1, 192, JAX_FLASHATTN_WGMMA_D192_REGS,
                       JAX_FLASHATTN_WGMMA_D192_OPERANDS, 96, 97, 98, 99, 100, 101)
JAX_FLASHATTN_WGMMA_RS(wgmma_rs, 1, 256, JAX_FLASHATTN_WGMMA_D256_REGS,
                       JAX_FLASHATTN_WGMMA_D256_OPERANDS, 128, 129, 130, 131, 132, 133)

// float8_e4m3fn operands (k32 steps: 32 one-byte elements, the 32 bytes of a 16-bit k16 step),
// both K-major (wgmma transposes no 8-bit operand): S = Q K^T of FP8 attention from shared
// memory, and O += P V with P from registers and V^T in shared memory. The register A
// fragment of a k32 step is the mma.sync m16n8k32 one: register r holds 4 bytes of row
// lane / 4 + 8 (r % 2), columns 16 (r / 2) + 4 (lane % 4) + 0..3.
#define JAX_FLASHATTN_WGMMA_E4M3_SS(N, REGS, OPERANDS, A, B, SCALE_D)                          \
  template <>                                                                                \
  __device__ __forceinline__ void wgmma_ss<N, __nv_fp8_e4m3>(                                 \
      float(&d)[N / 8][4], uint64_t a_desc, uint64_t b_desc, bool accumulate) {              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE_D ", 0;\n"                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", %" #A     \
                 ", %" #B ", p, 1, 1;\n}\n"                                                   \
                 : OPERANDS(d)                                                               \
                 : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)));                          \
  }
#define JAX_FLASHATTN_WGMMA_E4M3_RS(N, REGS, OPERANDS, A0, A1, A2, A3, B, SCALE_D)             \
  template <>                                                                                \
  __device__ __forceinline__ void wgmma_rs_k_major<N, __nv_fp8_e4m3>(                         \
      float(&d)[N / 8][4], const uint32_t(&a)[4], uint64_t b_desc, bool accumulate) {        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE_D ", 0;\n"                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", {%" #A0   \
                 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1;\n}\n"                     \
                 : OPERANDS(d)                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc),                  \
                   "r"(int(accumulate)));                                                    \
  }
JAX_FLASHATTN_WGMMA_E4M3_SS(64, JAX_FLASHATTN_WGMMA_D64_REGS, JAX_FLASHATTN_WGMMA_D64_OPERANDS,
                            32, 33, 34)
JAX_FLASHATTN_WGMMA_E4M3_SS(128, JAX_FLASHATTN_WGMMA_D128_REGS, JAX_FLASHATTN_WGMMA_D128_OPERANDS,
                            64, 65, 66)
JAX_FLASHATTN_WGMMA_E4M3_RS(128, JAX_FLASHATTN_WGMMA_D128_REGS, JAX_FLASHATTN_WGMMA_D128_OPERANDS,
                            64, 65, 66, 67, 68, 69)
JAX_FLASHATTN_WGMMA_E4M3_RS(256, JAX_FLASHATTN_WGMMA_D256_REGS, JAX_FLASHATTN_WGMMA_D256_OPERANDS,
                            128, 129, 130, 131, 132, 133)
#undef JAX_FLASHATTN_WGMMA_E4M3_SS
#undef JAX_FLASHATTN_WGMMA_E4M3_RS
#undef JAX_FLASHATTN_WGMMA_SS
#undef JAX_FLASHATTN_WGMMA_SS_ONE
#undef JAX_FLASHATTN_WGMMA_RS
#undef JAX_FLASHATTN_WGMMA_RS_ONE
#undef JAX_FLASHATTN_WGMMA_D32_REGS
#undef JAX_FLASHATTN_WGMMA_D64_REGS
#undef JAX_FLASHATTN_WGMMA_D128_REGS
#undef JAX_FLASHATTN_WGMMA_D160_REGS
#undef JAX_FLASHATTN_WGMMA_D256_REGS
#undef JAX_FLASHATTN_WGMMA_D32_OPERANDS
#undef JAX_FLASHATTN_WGMMA_D64_OPERANDS
#undef JAX_FLASHATTN_WGMMA_D128_OPERANDS
#undef JAX_FLASHATTN_WGMMA_D160_OPERANDS
#undef JAX_FLASHATTN_WGMMA_D256_OPERANDS

// ---- Vector reductions.

// Adds two consecutive floats (8-byte aligned) to global memory without a return value: the
// vector form of red.add (sm_90+), half as many reductions as two scalar ones.
__device__ __forceinline__ void red_add_v2_f32(float* address, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(x), "f"(y)
               : "memory");
}

// ---- Flags between blocks.

// Loads an int32 from global memory with acquire semantics at GPU scope: what the thread that
// released the value wrote before it is visible after this load.
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* address) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Adds to an int32 in global memory with release semantics at GPU scope: every write ordered
// before it (this thread's, and other threads' through a barrier with it) is visible to a
// thread whose acquire load reads the sum.
__device__ __forceinline__ void red_release_gpu_add(int32_t* address, int32_t value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(address), "r"(value)
               : "memory");
}

// An mbarrier's 32-bit shared address, the form the mbarrier wrappers take.
__device__ __forceinline__ uint32_t barrier_address(uint64_t& barrier) {
  return smem_address(&barrier);
}

}  // namespace jax_flashattn::ptx
