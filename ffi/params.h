// The one contract between the FFI handlers and every kernel (CPU and CUDA).
//
// Handlers decode XLA buffers and attributes into an AttentionParams; kernels read nothing
// else. Strides are in elements and 64-bit so that offsets past 2^31 elements stay exact.
#pragma once

#include <cstdint>
#include <limits>

// The small helpers below run in host handlers and in CUDA kernels alike.
#ifdef __CUDACC__
#define JAX_FLASHATTN_HOST_DEVICE __host__ __device__
#else
#define JAX_FLASHATTN_HOST_DEVICE
#endif

namespace jax_flashattn {

// Element type of q, k, v, out and their gradients (and, separately, of the bias).
enum class ElemType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Strides of a tensor that broadcasts to [batch, heads, T, S] (bias, mask). A broadcast
// dimension has stride 0. The flattened batch index b splits into (b / batch_inner,
// b % batch_inner): the outer part runs over the dimensions vmap added in front, the inner
// part over the user's B, which the bias may broadcast on its own.
struct BroadcastStrides {
  int64_t batch_outer = 0;
  int64_t batch_inner = 0;
  int64_t head = 0;
  int64_t row = 0;  // query position
  int64_t col = 0;  // key position

  JAX_FLASHATTN_HOST_DEVICE int64_t offset(int64_t b, int64_t batch_inner_size, int64_t n, int64_t t, int64_t s) const {
    return (b / batch_inner_size) * batch_outer + (b % batch_inner_size) * batch_inner +
           n * head + t * row + s * col;
  }
  // offset(b, batch_inner_size, n, 0, 0) with the batch index and size in 32 bits (the Hopper
  // kernels' indices_fit_32_bits; AttentionParams::batch_inner32): a 32-bit division where
  // offset's is 64-bit.
  JAX_FLASHATTN_HOST_DEVICE int64_t head_offset32(uint32_t b, uint32_t batch_inner_size,
                                                  int64_t n) const {
    return int64_t(b / batch_inner_size) * batch_outer +
           int64_t(b % batch_inner_size) * batch_inner + n * head;
  }
};

// Marks an unbounded side of the local window. Every other value, negative ones included, is
// a real bound: ring attention's blocks see shifted windows such as s <= t - 1.
inline constexpr int64_t kUnboundedWindow = std::numeric_limits<int64_t>::min();

// Positions per entry of the segment-id spans (AttentionParams::q_key_spans): a multiple of
// every kernel's tile would do no better, and 16 divides them all. segments.py's GRANULE.
inline constexpr int64_t kSegmentGranule = 16;

// The fewest keys a page of a paged K/V holds (AttentionParams::page_table): the decode kernels
// look a page up once per kMinPageSize keys.
inline constexpr int kMinPageSize = 16;

// The ALiBi slopes' gradient comes out as partial sums, so that it is the same on every run
// without an ordered reduction in the kernels: dslopes holds, per (batch entry, head),
// dslopes_slots(S) float32 slots, and the caller sums them. A writer of a backward kernel
// (one thread, typically a warp's lane 0 after a shuffle sum) adds into slot
// (k / kDslopesGranule) kDslopesWriters + w, k the first key of the keys it sums over and
// w < kDslopesWriters its index among the writers whose first key lies in that granule: no
// slot has two writers, and one writer's adds land in program order.
inline constexpr int64_t kDslopesGranule = 16;
inline constexpr int64_t kDslopesWriters = 4;

JAX_FLASHATTN_HOST_DEVICE constexpr int64_t dslopes_slots(int64_t seqlen_k) {
  return (seqlen_k + kDslopesGranule - 1) / kDslopesGranule * kDslopesWriters;
}

struct AttentionParams {
  ElemType dtype = ElemType::kFloat32;

  // Sizes. `batch` is the product of every dimension before [T, N, H] (vmap dimensions times
  // the user's B); `batch_inner` is the user's B, the innermost of those dimensions.
  int64_t batch = 0;
  int64_t batch_inner = 1;
  int64_t seqlen_q = 0;      // T
  int64_t seqlen_k = 0;      // S
  int64_t num_heads = 0;     // N
  int64_t num_kv_heads = 0;  // K, N % K == 0; query head n reads kv head n / (N / K)
  int64_t head_dim = 0;      // H

  // q, out, d_out, dq: [batch, T, N, H]. k, v, dk, dv: [batch, S, K, H]. lse: [batch, N, T].
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t kv_batch_stride = 0, kv_row_stride = 0, kv_head_stride = 0;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  // Paged K/V (paged_attention), nullptr where k and v are [batch, S, K, H]: k and v are then
  // a pool of pages [num_pages, page_size, K, H], and key s of batch entry b lives in page
  // page_table[b max_pages + s / page_size] (int32 [batch, max_pages]), slot s % page_size.
  // S is max_pages page_size and kv_batch_stride 0; a forward on the kernels that read pages
  // (the CPU kernels and the split-KV decode kernels) only, always with kv_seqlens. A page id
  // outside [0, num_pages) reads page num_pages - 1 (the caller makes those rows NaN).
  const int32_t* page_table = nullptr;
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  int32_t page_size_log2 = 0;  // page_size a power of two, kMinPageSize or more
  int64_t kv_page_stride = 0;  // page_size K H
  void* out = nullptr;
  float* lse = nullptr;  // natural log; -inf for rows that see no key
  // Forward workspace: an int32 the Hopper kernel's blocks claim tiles from (zeroed on the
  // stream before each launch); nullptr when the call has none.
  int* tile_counter = nullptr;
  // Forward workspace past the counter (CallPlan::forward_workspace_ints): the Hopper kernel's
  // tile order for calls with segment ids, written on the stream before each launch (the
  // order of wgmma/tile_order.cuh); nullptr / 0 when the call has no room for it, which keeps
  // the tile scheduler's own order.
  int* tile_order = nullptr;
  int64_t tile_order_capacity = 0;
  // Forward workspace of the split-KV decode kernel (float32; layout in
  // ffi/decode_plan.h) and its size in floats; nullptr / 0 when the call has none.
  float* decode_workspace = nullptr;
  int64_t decode_workspace_floats = 0;

  // Optional inputs: nullptr when absent.
  const void* bias = nullptr;  // broadcastable to [batch, N, T, S], added after scaling
  ElemType bias_dtype = ElemType::kFloat32;
  BroadcastStrides bias_strides;
  const bool* mask = nullptr;  // broadcastable to [batch, N, T, S], true = keep
  BroadcastStrides mask_strides;
  const int32_t* q_seqlens = nullptr;   // [batch]; rows t >= q_seqlens[b] see no key
  const int32_t* kv_seqlens = nullptr;  // [batch]; keys s >= kv_seqlens[b] are hidden
  // Packed sequences, both or neither: [batch, T] and [batch, S] contiguous; query t of batch
  // entry b sees key s only where q_segment_ids[b T + t] == kv_segment_ids[b S + s].
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  // With segment ids or a mask, their spans (src/jax_flashattn/segments.py computes them),
  // pairs [lo, hi) of int32, lo >= hi where empty: for each granule of kSegmentGranule query
  // rows, the keys one of the granule's rows may see through the ids and the mask ([batch,
  // ceil(T / granule), 2]), and for each granule of keys the query rows likewise ([batch,
  // ceil(S / granule), 2]). A kernel narrows the tiles it visits to them; the element tests
  // still decide each pair.
  const int32_t* q_key_spans = nullptr;
  const int32_t* kv_query_spans = nullptr;

  // ALiBi (variant::Alibi): float32 [batch, N] slopes, contiguous; nullptr when absent. The
  // logit of query t and key s of entry b, head n gains -alibi_slopes[b N + n] |t + d - s|,
  // d = alibi_shift plus, with align_window_to_lengths, the entry's kv_len - q_len: the
  // diagonal the window is aligned to.
  const float* alibi_slopes = nullptr;
  int64_t alibi_shift = 0;

  float scale = 1.0f;  // logits = scale * q.k + bias
  // > 0: logits = cap * tanh(scale * q.k / cap) + bias (Gemma 2's soft-capping, before the
  // bias and every mask); 0: none (variant::SoftCap).
  float logits_soft_cap = 0.0f;
  // Query t sees key s iff t - window_left <= s <= t + window_right (each side unbounded when
  // kUnboundedWindow; moved per batch entry by align_window_to_lengths). Causal attention is
  // window_right == 0.
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  // Bottom-right alignment at each batch entry's lengths (cuDNN's BOTTOM_RIGHT with padding):
  // query t of entry b sits at t + d_b for the window, d_b = kv_len_b - q_len_b from the
  // lengths below clamped to [0, S] and [0, T] (S and T where absent), so entry b's sides are
  // window_left - d_b and window_right + d_b. Those are variant::KeyWindow::make(p, b)'s;
  // the two fields above alone say only which sides are bounded, which no shift changes.
  bool align_window_to_lengths = false;

  // Backward only.
  const void* d_out = nullptr;  // like q
  void* dq = nullptr;           // like q
  void* dk = nullptr;           // like k, summed over the N / K query heads of each kv head
  void* dv = nullptr;           // like v, likewise
  // float32, contiguous, broadcastable to [batch, N, T, S] like the bias (element (b, n, t, s)
  // at dbias_strides.offset): dS summed over its broadcast dims. nullptr without a bias, or
  // where its gradient is not needed (the kernels then skip what only dbias needs).
  float* dbias = nullptr;
  BroadcastStrides dbias_strides;
  int64_t dbias_elements = 0;
  // Whether dbias broadcasts over a dimension longer than 1, so that several elements of dS
  // sum into one of dbias: the CUDA kernels then zero it on their stream and add the visible
  // elements with float32 atomics. Otherwise every element has one writer, which stores it
  // (0 where hidden) and nothing is zeroed. The CPU kernels always zero it and add, in a
  // fixed order (ffi/cpu/backward.cc).
  bool dbias_accumulates = false;
  // float32 [batch, N, dslopes_slots(S)]: the slopes' gradient, -|t + d - s| dS summed over
  // the entry's pairs of the head, in partial sums the caller adds up (dslopes_slots says
  // why); nullptr without ALiBi or where its cotangent is not needed. Zeroed by the
  // dispatcher before the CUDA kernels add into it.
  float* dslopes = nullptr;
  // Workspaces (results of the call, so XLA owns them; the CPU kernels ignore them).
  float* dq_accum = nullptr;  // like q, float32: dQ summed over key blocks before rounding
  float* delta = nullptr;     // [batch, N, T] float32: D_t = dO_t . O_t
  // Gradients bit-identical across runs: on the Hopper kernel the key blocks add their dQ in a
  // fixed order (dq_semaphores), on the mma.sync family dQ comes from its own pass over the keys.
  bool deterministic = false;
  // Workspace of the Hopper kernel's deterministic mode: one int32 per (batch entry, query head,
  // query tile of the kernel's own size), counting the key blocks whose dQ of the tile has been
  // added, zeroed on the stream per call; dq_semaphores_needed() elements or more (the handlers
  // refuse fewer but some; with none the call keeps the mma.sync family's dQ pass).
  int32_t* dq_semaphores = nullptr;
  int64_t dq_semaphore_count = 0;
  // Backward workspace past the semaphores (past dq_semaphores_needed() of them in a
  // deterministic call; the same int32 result, CallPlan::backward_workspace_ints): the Hopper
  // kernel's block order for calls with segment ids (wgmma/tile_order.cuh); nullptr / 0 where
  // the call has no room for it, which keeps BackwardBlock's own order.
  int* block_order = nullptr;
  int64_t block_order_capacity = 0;

  // The kernel switches, read from the environment when the call was traced
  // (src/jax_flashattn/_ffi.py kernel_switches): part of the compiled program, so a call replayed
  // from XLA's command buffer keeps the choice it was traced with.
  bool disable_sm90 = false;   // JAX_FLASHATTN_DISABLE_SM90: Hopper calls on the mma.sync family
  bool sm80_cp_async = false;  // JAX_FLASHATTN_SM80_CP_ASYNC: mma.sync K/V by cp.async on Hopper

  // float8_e4m3fn k and v beside a q of another dtype (a quantised KV cache), nullptr
  // otherwise: the real key or value is the stored one times its kv head's descale, float32
  // [batch, K] each. A forward only, on the CPU kernels or the split-KV decode kernels
  // (decode_fp8_kv_fits: a bf16 or float16 q). Last, so that adding them moved no other field
  // of the kernels' parameter block.
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  // FP8 attention on the Hopper forward (wgmma::ForwardE4m3Config): q, k and v of
  // float8_e4m3fn, out and `dtype` bfloat16 or float16, k_descale the product of the query's
  // and the key's descales, v_descale the value's. v is given transposed, [batch, K, H,
  // vt_keys] (vt_keys: S rounded up to a multiple of 32), each 32 keys in the order the
  // P fragments of wgmma's e4m3 k-steps take them (src/jax_flashattn/fp8.py kernel_values),
  // zero past each entry's key length. False and 0 otherwise.
  bool e4m3_attention = false;
  int64_t vt_keys = 0;

  JAX_FLASHATTN_HOST_DEVICE int64_t group_size() const { return num_heads / num_kv_heads; }
  // Elements from k's (and v's) start to key s of batch entry b, kv head 0: through its page
  // where the call is paged (page_table). An unpaged kernel takes b kv_batch_stride + s
  // kv_row_stride itself.
  JAX_FLASHATTN_HOST_DEVICE int64_t kv_row_offset(int64_t b, int64_t s) const {
    if (page_table == nullptr) return b * kv_batch_stride + s * kv_row_stride;
    const uint32_t id = uint32_t(page_table[b * max_pages + (s >> page_size_log2)]);
    const uint32_t last = uint32_t(num_pages - 1);
    const int64_t page = id < last ? id : last;  // a negative id is a large unsigned one
    return page * kv_page_stride + (s & ((int64_t(1) << page_size_log2) - 1)) * kv_row_stride;
  }
  // batch_inner as a 32-bit divisor (BroadcastStrides::head_offset32), 1 where unset.
  JAX_FLASHATTN_HOST_DEVICE uint32_t batch_inner32() const {
    return uint32_t(batch_inner > 0 ? batch_inner : 1);
  }
  // The dQ semaphores a deterministic call on the Hopper kernel needs: one per (batch entry,
  // query head, kDqSemaphoreRows queries), the finest tile of any of its configurations.
  static constexpr int64_t kDqSemaphoreRows = 64;
  JAX_FLASHATTN_HOST_DEVICE int64_t dq_semaphores_needed() const {
    return batch * num_heads * ((seqlen_q + kDqSemaphoreRows - 1) / kDqSemaphoreRows);
  }
  // The work orders a call with segment ids has room for (wgmma/tile_order.cuh): one int32 per
  // kOrderPositions positions, the smallest block height and width of the Hopper kernels, so as
  // many as they have blocks in every configuration: the forward's tiles per (batch entry,
  // query head) and the backward's blocks per (batch entry, kv head).
  static constexpr int64_t kOrderPositions = 64;
  JAX_FLASHATTN_HOST_DEVICE int64_t tile_order_needed() const {
    return q_segment_ids == nullptr
               ? 0
               : batch * num_heads * ((seqlen_q + kOrderPositions - 1) / kOrderPositions);
  }
  JAX_FLASHATTN_HOST_DEVICE int64_t block_order_needed() const {
    return q_segment_ids == nullptr
               ? 0
               : batch * num_kv_heads * ((seqlen_k + kOrderPositions - 1) / kOrderPositions);
  }
  JAX_FLASHATTN_HOST_DEVICE bool soft_capped() const { return logits_soft_cap != 0.0f; }
  // Terms the tensor-core kernels add element by element, on every tile, in the
  // instantiations for them: a bias, a boolean mask, ALiBi.
  JAX_FLASHATTN_HOST_DEVICE bool has_elementwise_terms() const {
    return bias != nullptr || mask != nullptr || alibi_slopes != nullptr;
  }
  // No causal or window bound: every query sees every key up to the lengths (so too with
  // align_window_to_lengths, which moves bounded sides only).
  JAX_FLASHATTN_HOST_DEVICE bool unwindowed() const {
    return window_left == kUnboundedWindow && window_right == kUnboundedWindow;
  }
};

}  // namespace jax_flashattn
