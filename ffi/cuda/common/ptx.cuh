// One small wrapper per PTX instruction the kernels use, so kernel bodies read like the
// algorithm. Everything here is sm_80+ (cp.async, ldmatrix, mma.sync m16n8k16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_flashattn::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t address) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(address) : "memory");
  return v;
}

__device__ __forceinline__ uint16_t ld_shared_b16(uint32_t address) {
  uint16_t v;
  asm volatile("ld.shared.b16 %0, [%1];\n" : "=h"(v) : "r"(address) : "memory");
  return v;
}

// One byte, zero-extended.
__device__ __forceinline__ uint32_t ld_shared_u8(uint32_t address) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(address) : "memory");
  return v;
}

// cp.async.cg: 16 bytes global -> shared, bypassing L1. With valid == false it reads nothing
// and zero-fills the destination, which is how tile edges (rows past T or S, head dims past H)
// become zeros in shared memory without branches around the copy.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

// The same copy where the whole source is known to be inside the tensor: no source-size operand
// (and no register to hold it).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// cp.async.ca: 4 bytes global -> shared (the L1-cached form, the only one that copies fewer than
// 16 bytes), zero-filling the destination where valid == false, for arrays whose rows are not
// whole 16-byte pieces.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

// A hint that the 128-byte line holding `address` will be read soon: brought into L2, with no
// register written and nothing to wait for. The address must lie inside an allocation.
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(address));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// An arrival on the mbarrier at `bar` once every cp.async this thread issued before it has
// landed. .noinc: the arrival is one of the barrier's expected arrivals (counted at its init).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Programmatic dependent launch (sm_90+; nothing on older targets, where the launch attribute
// that lets a dependent grid start early is not set either). launch_dependents: this block has
// no more reason to hold back a grid launched after it with that attribute. grid_dependency_wait:
// waits until the grids this one depends on have completed and their memory is visible.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// %nsmid: how many SM identifiers the device has, at least its number of SMs (the identifiers
// need not be contiguous).
__device__ __forceinline__ uint32_t sm_id_count() {
  uint32_t count;
  asm("mov.u32 %0, %%nsmid;" : "=r"(count));
  return count;
}

// Synchronises the `threads` threads (a multiple of 32) that use named barrier `id`.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` without waiting: with named_barrier_sync on the other side, one
// group of warps signals another.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Thread block clusters and distributed shared memory (sm_90+). The kernels that use them are
// launched only from an image built for 9.0+ (cuda::runs_sm90_image), so the empty bodies of
// older targets never run.
//
// cluster_arrive: this thread is done with its writes to shared memory (release), which the
// cluster's other blocks may read once cluster_wait returns; cluster_wait: every thread of the
// cluster has arrived (acquire). Every thread of every block of the cluster executes an
// arrival (this or cluster_arrive_relaxed) and then cluster_wait.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}

// The same arrival without ordering this thread's memory accesses: for a barrier that only
// keeps blocks alive (no block leaves while another reads its shared memory), where the caller
// knows its loads from other blocks' shared memory are complete (their values were used before
// the arrival); a release arrival waits for them.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The shared::cluster address of shared-memory address `address` (this block's) in the block
// of cluster rank `rank`.
__device__ __forceinline__ uint32_t map_shared_rank(uint32_t address, uint32_t rank) {
  uint32_t mapped = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
#endif
  return mapped;
}

__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t address) {
  float x = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(address) : "memory");
#endif
  return x;
}

__device__ __forceinline__ float4 ld_shared_cluster_v4_f32(uint32_t address) {
  float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
               : "r"(address)
               : "memory");
#endif
  return x;
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8. Register i
// of lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same, transposed: register i of lane l receives rows 2 (l % 4) and 2 (l % 4) + 1 of
// column l / 4, i.e. the B operand layout when the matrix is stored row-major as [k][n].
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Two 8x8 b16 matrices: ldmatrix_x4's first two (lanes 0-15 give the row addresses).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

// D = A (16x16, row) * B (16x8, col) + D with float32 accumulators.
template <typename Elem>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                     const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 2^x on the special-function unit; -inf gives 0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x and log2(x) on the special-function unit (1 ulp; absolute error about 2^-22): one
// instruction each where `1.f / x` is a Newton step with a slow-path call and `log2f` a
// 9-term polynomial (CUDA 13.0), on the path from a tile's last product to its output store.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) on the special-function unit (sm_75+): relative error at most about 1.1e-5 (16.5
// bits), one instruction where tanhf is about twenty.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// max(a, b), NaN when either is (fmaxf drops a NaN): where a NaN logit or partial lse decides a
// row's result, the row must come out NaN, as in jax.nn.
__device__ __forceinline__ float max_propagating_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// `width` set bits from bit `start` up (bmsk.clamp: both clamped to [0, 32], bits past 31
// dropped), in one instruction.
__device__ __forceinline__ uint32_t bit_mask(uint32_t start, uint32_t width) {
  uint32_t mask;
  asm("bmsk.clamp.b32 %0, %1, %2;\n" : "=r"(mask) : "r"(start), "r"(width));
  return mask;
}

// Two floats rounded to the element type and packed into one register (low half first), the
// layout of an mma operand pair.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// prmt.b32 in its default mode: byte n of the result from selector nibble n, whose bits 2:0
// pick one of the 8 bytes of {b, a} (a's first) and whose bit 3, where set, replicates that
// byte's sign bit over the whole byte (which CUDA's __byte_perm does not offer).
template <uint32_t kSelector>
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "n"(kSelector));
  return d;
}

// cvt.rn.f16x2.e4m3x2 (sm_89 and newer): the two float8_e4m3fn bytes of `pair` as a float16
// pair, the low byte's in the low half; exact (every e4m3 value is a float16), an e4m3 NaN a
// float16 NaN. One instruction; 0 where the target lacks it (its callers test kE4m3Convert).
__device__ __forceinline__ uint32_t cvt_f16x2_e4m3x2(uint16_t pair) {
  uint32_t d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"(pair));
#endif
  return d;
}

// cvt.rn.satfinite.e4m3x2.f32 (sm_89 and newer): two floats as float8_e4m3fn bytes, `lo` in
// the low byte, rounded to nearest and saturated to +-448 (a NaN stays NaN). 0 where the
// target lacks it (its callers compile for sm_90a only).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
#endif
  return d;
}

// a * b per 16-bit half of two float16 pairs, rounded to nearest, subnormals kept (no .ftz).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// a * b + c per 16-bit half of two bfloat16 pairs, rounded to nearest (sm_80 has no bf16x2
// mul: a product is this with c = -0).
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Float32 add to global memory without a return value (the reduction form of atom.add): how
// the blocks that share a dQ row sum their partial products into the float32 accumulator.
__device__ __forceinline__ void red_add_f32(float* address, float value) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(address), "f"(value) : "memory");
}

}  // namespace jax_flashattn::ptx
