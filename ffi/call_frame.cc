#include "ffi/call_frame.h"

#include <string>
#include <tuple>

#include "ffi/call_shape.h"
#include "ffi/variant.h"

namespace jax_flashattn {
namespace {

// Only error paths call this: a valid call builds no strings at all.
std::string ShapeString(const ffi::AnyBuffer& b) {
  std::string text = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax_flashattn: " + message);
}

bool ToElemType(ffi::DataType t, ElemType& out) {
  switch (t) {
    case ffi::DataType::F32: out = ElemType::kFloat32; return true;
    case ffi::DataType::BF16: out = ElemType::kBFloat16; return true;
    case ffi::DataType::F16: out = ElemType::kFloat16; return true;
    default: return false;
  }
}

// Product of the dimensions before the trailing `tail` ones.
int64_t LeadingProduct(const ffi::AnyBuffer& b, size_t tail) {
  int64_t n = 1;
  auto dims = b.dimensions();
  for (size_t i = 0; i + tail < dims.size(); ++i) n *= dims[i];
  return n;
}

// bias or mask: rank of q, the vmapped (outer) dimensions equal to q's, the last four each 1
// or the full (B, N, T, S). Contiguous row-major, so a broadcast dim simply gets stride 0.
ffi::Error BroadcastStridesOf(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q,
                              const AttentionParams& p, const char* name,
                              BroadcastStrides& strides) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  auto mismatch = [&] {
    return Invalid(std::string(name) + " must broadcast to [..., B, N, T, S] with query " +
                   ShapeString(q) + ", got " + ShapeString(x));
  };
  if (xd.size() != qd.size()) return mismatch();
  const size_t r = xd.size();
  for (size_t i = 0; i + 4 < r; ++i)
    if (xd[i] != qd[i]) return mismatch();
  const int64_t full[4] = {p.batch_inner, p.num_heads, p.seqlen_q, p.seqlen_k};
  int64_t stride[4];
  int64_t running = 1;
  for (int i = 3; i >= 0; --i) {
    const int64_t d = xd[r - 4 + i];
    if (d != 1 && d != full[i]) return mismatch();
    stride[i] = d == 1 ? 0 : running;
    running *= d;
  }
  strides.batch_outer = r > 4 ? running : 0;
  strides.batch_inner = stride[0];
  strides.head = stride[1];
  strides.row = stride[2];
  strides.col = stride[3];
  return ffi::Error::Success();
}

ffi::Error SeqLengths(const ffi::AnyBuffer& x, const AttentionParams& p, const char* name,
                      const int32_t*& out) {
  if (x.element_type() != ffi::DataType::S32 || x.element_count() != size_t(p.batch))
    return Invalid(std::string(name) + " must be int32 with one entry per batch element (" +
                   std::to_string(p.batch) + "), got " + ShapeString(x));
  out = static_cast<const int32_t*>(x.untyped_data());
  return ffi::Error::Success();
}

// Segment ids: int32 shaped like `like` (query or key) without its last two dims: [..., B, T]
// or [..., B, S].
ffi::Error SegmentIds(const ffi::AnyBuffer& x, const ffi::AnyBuffer& like, const char* name,
                      const int32_t*& out) {
  auto xd = x.dimensions();
  auto ld = like.dimensions();
  bool fits = x.element_type() == ffi::DataType::S32 && xd.size() + 2 == ld.size();
  for (size_t i = 0; fits && i < xd.size(); ++i) fits = xd[i] == ld[i];
  if (!fits)
    return Invalid(std::string(name) + " must be int32 with the dims of " + ShapeString(like) +
                   " but the last two, got " + ShapeString(x));
  out = static_cast<const int32_t*>(x.untyped_data());
  return ffi::Error::Success();
}

// Spans over positions of `like` (query or key: [..., B, L, heads, H]): int32
// [..., B, ceil(L / kSegmentGranule), 2].
ffi::Error Spans(const ffi::AnyBuffer& x, const ffi::AnyBuffer& like, const char* name,
                 const int32_t*& out) {
  auto xd = x.dimensions();
  auto ld = like.dimensions();
  const size_t lead = ld.size() - 3;
  bool fits = x.element_type() == ffi::DataType::S32 && xd.size() == lead + 2 &&
              xd[lead] == (ld[lead] + kSegmentGranule - 1) / kSegmentGranule && xd.back() == 2;
  for (size_t i = 0; fits && i < lead; ++i) fits = xd[i] == ld[i];
  if (!fits)
    return Invalid(std::string(name) + " must be int32 [..., B, ceil(L / " +
                   std::to_string(kSegmentGranule) + "), 2] for positions " + ShapeString(like) +
                   ", got " + ShapeString(x));
  out = static_cast<const int32_t*>(x.untyped_data());
  return ffi::Error::Success();
}

// Float32 values per (batch, head), [..., B, heads] with the batch dims of q (`label` names
// the heads: N, q's own, or K), and with `slots` >= 0 a last dimension of that many: the ALiBi
// slopes and their gradient's partial sums (dslopes_slots) per query head, the descales of e4m3
// keys and values per kv head.
ffi::Error CheckHeadValues(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q, const char* name,
                           int64_t slots = -1, int64_t heads = -1, const char* label = "N") {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  if (heads < 0) heads = qd[qd.size() - 2];
  const size_t extra = slots >= 0 ? 1 : 0;
  bool fits = x.element_type() == ffi::DataType::F32 && xd.size() + 2 == qd.size() + extra;
  for (size_t i = 0; fits && i + 1 + extra < xd.size(); ++i) fits = xd[i] == qd[i];
  if (fits) fits = xd[xd.size() - 1 - extra] == heads;
  if (fits && slots >= 0) fits = xd.back() == slots;
  if (!fits)
    return Invalid(std::string(name) + " must be float32 [..., B, " + label +
                   (slots >= 0 ? ", " + std::to_string(slots) : std::string()) + "] with " +
                   label + " = " + std::to_string(heads) + " for query " + ShapeString(q) +
                   ", got " + ShapeString(x));
  return ffi::Error::Success();
}

ffi::Error CheckLike(const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& like, const char* what) {
  auto a = buffer.dimensions();
  auto b = like.dimensions();
  bool same = a.size() == b.size() && buffer.element_type() == like.element_type();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == b[i];
  if (!same)
    return Invalid(std::string(what) + " must have shape " + ShapeString(like) +
                   " and the same dtype, got " + ShapeString(buffer));
  return ffi::Error::Success();
}

// A float32 statistic per (batch, head, query row): lse, or the backward's D.
ffi::Error CheckRowStats(const ffi::AnyBuffer& x, const AttentionParams& p, const char* name) {
  if (x.element_type() != ffi::DataType::F32 ||
      x.element_count() != size_t(p.batch * p.num_heads * p.seqlen_q))
    return Invalid(std::string(name) + " must be float32 [..., N, T], got " + ShapeString(x));
  return ffi::Error::Success();
}

ffi::Error DecodeInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::RemainingArgs& optional, const CallAttrs& attrs,
                        AttentionParams& p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  const bool paged = attrs.has_page_table != 0;
  if (paged) {
    if (qd.size() != 4 || kd.size() != 4)
      return Invalid("a paged call takes query [B, T, N, H] and key [P, page_size, K, H], got "
                     "query " + ShapeString(q) + ", key " + ShapeString(k));
  } else {
    if (qd.size() < 4 || kd.size() != qd.size())
      return Invalid("query must be [..., B, T, N, H] and key the same rank, got query " +
                     ShapeString(q) + ", key " + ShapeString(k));
    for (size_t i = 0; i + 3 < qd.size(); ++i)
      if (qd[i] != kd[i])
        return Invalid("query " + ShapeString(q) + " and key " + ShapeString(k) +
                       " disagree on the batch dimensions");
  }
  const size_t r = qd.size();
  const bool fp8_kv = attrs.has_kv_descale != 0;
  // FP8 attention: q e4m3 too, and v given as V^T (checked once the shape is known); out's
  // 2-byte type is the call's dtype (DecodeForward sets it).
  const bool e4m3_attention = fp8_kv && q.element_type() == ffi::DataType::F8E4M3FN;
  if (!e4m3_attention)
    if (ffi::Error e = CheckLike(v, k, "value"); e.failure()) return e;
  if (fp8_kv) {
    if (k.element_type() != ffi::DataType::F8E4M3FN ||
        (!e4m3_attention && !ToElemType(q.element_type(), p.dtype)))
      return Invalid("a call with key/value descales takes float8_e4m3fn key and value beside "
                     "a float32, bfloat16, float16 or float8_e4m3fn query, got query " +
                     ShapeString(q) + ", key " + ShapeString(k));
    if (e4m3_attention) p.dtype = ElemType::kBFloat16;
  } else if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
             !ToElemType(q.element_type(), p.dtype)) {
    return Invalid("query, key and value must share one dtype among float32, bfloat16, float16");
  }
  CallShape shape;
  shape.dtype = p.dtype;
  shape.batch = LeadingProduct(q, 3);
  shape.batch_inner = qd[r - 4];
  shape.seqlen_q = qd[r - 3];
  shape.num_heads = qd[r - 2];
  shape.head_dim = qd[r - 1];
  shape.seqlen_k = kd[r - 3];
  shape.num_kv_heads = kd[r - 2];
  if (kd[r - 1] != shape.head_dim || shape.num_kv_heads < 1 ||
      shape.num_heads % shape.num_kv_heads != 0)
    return Invalid("key " + ShapeString(k) + " does not fit query " + ShapeString(q) +
                   " (same head dim, N % K == 0)");
  shape.scale = attrs.scale;
  if (!variant::SoftCap::valid(attrs.logits_soft_cap))
    return Invalid("logits_soft_cap must be >= 0 (0: none) and finite times log2(e), got " +
                   std::to_string(attrs.logits_soft_cap));
  shape.logits_soft_cap = attrs.logits_soft_cap;
  shape.window_left = attrs.window_left;
  shape.window_right = attrs.window_right;
  shape.align_window_to_lengths = attrs.align_window_to_lengths != 0;
  shape.deterministic = attrs.deterministic != 0;
  shape.disable_sm90 = attrs.disable_sm90 != 0;
  shape.sm80_cp_async = attrs.sm80_cp_async != 0;
  shape.e4m3_attention = e4m3_attention;
  if (e4m3_attention) {
    auto vd = v.dimensions();
    bool fits = !paged && v.element_type() == ffi::DataType::F8E4M3FN && vd.size() == r &&
                vd[r - 3] == shape.num_kv_heads && vd[r - 2] == shape.head_dim &&
                vd[r - 1] == VtKeys(shape.seqlen_k);
    for (size_t i = 0; fits && i + 3 < r; ++i) fits = vd[i] == qd[i];
    if (!fits)
      return Invalid("FP8 attention takes value as float8_e4m3fn V^T [..., B, K, H, S'] (S' = S "
                     "rounded up to a multiple of 32: fp8.kernel_values) for key " +
                     ShapeString(k) + ", got " + ShapeString(v));
  }
  if (paged) {
    // page_size = kd[1], a power of two; S is the table's reach, max_pages page_size.
    const int64_t page_size = kd[1];
    if (kd[0] < 1 || page_size < kMinPageSize || (page_size & (page_size - 1)) != 0)
      return Invalid("a paged key must be [P, page_size, K, H] with P >= 1 and page_size a "
                     "power of two from " + std::to_string(kMinPageSize) + ", got " +
                     ShapeString(k));
    if (optional.size() < 1) return Invalid("a paged call needs its page_table operand");
    auto table = optional.get<ffi::AnyBuffer>(optional.size() - 1);
    if (!table.has_value()) return table.error();
    auto td = table->dimensions();
    if (table->element_type() != ffi::DataType::S32 || td.size() != 2 || td[0] != qd[0])
      return Invalid("page_table must be int32 [B, max_pages] with B = " +
                     std::to_string(qd[0]) + ", got " + ShapeString(*table));
    if (!attrs.has_kv_seqlens || attrs.has_segment_ids || attrs.has_spans)
      return Invalid("a paged call needs key_value_seq_lengths and takes no segment ids");
    shape.seqlen_k = td[1] * page_size;
    SetLayout(shape, p);
    p.kv_batch_stride = 0;
    p.page_table = static_cast<const int32_t*>(table->untyped_data());
    p.max_pages = td[1];
    p.num_pages = kd[0];
    while ((int64_t(1) << p.page_size_log2) < page_size) ++p.page_size_log2;
    p.kv_page_stride = page_size * p.kv_row_stride;
  } else {
    SetLayout(shape, p);
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();

  const size_t expected = size_t(attrs.has_bias != 0) + size_t(attrs.has_mask != 0) +
                          size_t(attrs.has_q_seqlens != 0) + size_t(attrs.has_kv_seqlens != 0) +
                          2 * size_t(attrs.has_segment_ids != 0) +
                          2 * size_t(attrs.has_spans != 0) +
                          size_t(attrs.has_alibi != 0) + 2 * size_t(fp8_kv) + size_t(paged);
  if (optional.size() != expected)
    return Invalid("expected " + std::to_string(expected) + " optional operands, got " +
                   std::to_string(optional.size()));
  size_t next = 0;
  if (attrs.has_bias) {
    auto bias = optional.get<ffi::AnyBuffer>(next++);
    if (!bias.has_value()) return bias.error();
    if (!ToElemType(bias->element_type(), p.bias_dtype))
      return Invalid("bias must be float32, bfloat16 or float16");
    if (ffi::Error e = BroadcastStridesOf(*bias, q, p, "bias", p.bias_strides); e.failure())
      return e;
    p.bias = bias->untyped_data();
  }
  if (attrs.has_mask) {
    auto mask = optional.get<ffi::AnyBuffer>(next++);
    if (!mask.has_value()) return mask.error();
    if (mask->element_type() != ffi::DataType::PRED) return Invalid("mask must be bool");
    if (ffi::Error e = BroadcastStridesOf(*mask, q, p, "mask", p.mask_strides); e.failure())
      return e;
    p.mask = static_cast<const bool*>(mask->untyped_data());
  }
  if (attrs.has_q_seqlens) {
    auto lens = optional.get<ffi::AnyBuffer>(next++);
    if (!lens.has_value()) return lens.error();
    if (ffi::Error e = SeqLengths(*lens, p, "query_seq_lengths", p.q_seqlens); e.failure())
      return e;
  }
  if (attrs.has_kv_seqlens) {
    auto lens = optional.get<ffi::AnyBuffer>(next++);
    if (!lens.has_value()) return lens.error();
    if (ffi::Error e = SeqLengths(*lens, p, "key_value_seq_lengths", p.kv_seqlens); e.failure())
      return e;
  }
  if (attrs.has_segment_ids) {
    auto q_ids = optional.get<ffi::AnyBuffer>(next++);
    if (!q_ids.has_value()) return q_ids.error();
    auto kv_ids = optional.get<ffi::AnyBuffer>(next++);
    if (!kv_ids.has_value()) return kv_ids.error();
    if (ffi::Error e = SegmentIds(*q_ids, q, "query_segment_ids", p.q_segment_ids); e.failure())
      return e;
    if (ffi::Error e = SegmentIds(*kv_ids, k, "key_value_segment_ids", p.kv_segment_ids);
        e.failure())
      return e;
  }
  if (attrs.has_spans) {
    auto q_spans = optional.get<ffi::AnyBuffer>(next++);
    if (!q_spans.has_value()) return q_spans.error();
    auto kv_spans = optional.get<ffi::AnyBuffer>(next++);
    if (!kv_spans.has_value()) return kv_spans.error();
    if (ffi::Error e = Spans(*q_spans, q, "query_key_spans", p.q_key_spans); e.failure())
      return e;
    if (ffi::Error e = Spans(*kv_spans, k, "key_query_spans", p.kv_query_spans); e.failure())
      return e;
  }
  if (attrs.has_alibi) {
    auto slopes = optional.get<ffi::AnyBuffer>(next++);
    if (!slopes.has_value()) return slopes.error();
    if (ffi::Error e = CheckHeadValues(*slopes, q, "alibi_slopes"); e.failure()) return e;
    p.alibi_slopes = static_cast<const float*>(slopes->untyped_data());
    p.alibi_shift = attrs.alibi_shift;
  }
  if (fp8_kv) {
    const float** descales[] = {&p.k_descale, &p.v_descale};
    const char* names[] = {"k_descale", "v_descale"};
    for (int i = 0; i < 2; ++i) {
      auto descale = optional.get<ffi::AnyBuffer>(next++);
      if (!descale.has_value()) return descale.error();
      if (ffi::Error e = CheckHeadValues(*descale, q, names[i], -1, p.num_kv_heads, "K");
          e.failure())
        return e;
      *descales[i] = static_cast<const float*>(descale->untyped_data());
    }
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DecodeForward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::RemainingArgs& optional,
                         ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& lse,
                         ffi::Result<ffi::AnyBuffer>& workspace,
                         ffi::Result<ffi::AnyBuffer>& decode_workspace, const CallAttrs& attrs,
                         AttentionParams& p) {
  if (ffi::Error e = DecodeInputs(q, k, v, optional, attrs, p); e.failure()) return e;
  if (p.e4m3_attention) {
    auto od = out->dimensions();
    auto qd = q.dimensions();
    bool fits = od.size() == qd.size() && ToElemType(out->element_type(), p.dtype) &&
                p.dtype != ElemType::kFloat32;
    for (size_t i = 0; fits && i < qd.size(); ++i) fits = od[i] == qd[i];
    if (!fits)
      return Invalid("FP8 attention writes out of bfloat16 or float16 with query's shape " +
                     ShapeString(q) + ", got " + ShapeString(*out));
  } else if (ffi::Error e = CheckLike(*out, q, "out"); e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRowStats(*lse, p, "lse"); e.failure()) return e;
  if (workspace->element_type() != ffi::DataType::S32 || workspace->element_count() < 1)
    return Invalid("the forward workspace must hold at least one int32, got " +
                   ShapeString(*workspace));
  p.out = out->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());
  p.tile_counter = static_cast<int*>(workspace->untyped_data());
  // Past the counter, room for the tile order (PlanningParams asks tile_order_needed of it).
  p.tile_order_capacity = int64_t(workspace->element_count()) - 1;
  p.tile_order = p.tile_order_capacity > 0 ? p.tile_counter + 1 : nullptr;
  // Any size: the dispatcher runs only as many splits as it holds (none: the normal kernels).
  if (decode_workspace->element_type() != ffi::DataType::F32)
    return Invalid("the forward's decode workspace must be float32, got " +
                   ShapeString(*decode_workspace));
  p.decode_workspace_floats = int64_t(decode_workspace->element_count());
  p.decode_workspace = p.decode_workspace_floats > 0
                           ? static_cast<float*>(decode_workspace->untyped_data())
                           : nullptr;
  return ffi::Error::Success();
}

ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                          const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                          const ffi::AnyBuffer& lse, const ffi::AnyBuffer& d_out,
                          const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& dq,
                          ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                          ffi::Result<ffi::AnyBuffer>& dq_accum,
                          ffi::Result<ffi::AnyBuffer>& delta,
                          ffi::Result<ffi::AnyBuffer>& dq_semaphores,
                          const ffi::RemainingRets& dbias,
                          const CallAttrs& attrs, AttentionParams& p) {
  if (attrs.has_page_table) return Invalid("a paged call has no backward");
  if (attrs.has_kv_descale)
    return Invalid("a call on float8_e4m3fn keys and values has no backward");
  if (ffi::Error e = DecodeInputs(q, k, v, optional, attrs, p); e.failure()) return e;
  for (auto [buffer, like, what] : {std::tuple{&out, &q, "out"}, {&d_out, &q, "d_out"},
                                    {&*dq, &q, "dq"}, {&*dk, &k, "dk"}, {&*dv, &k, "dv"}}) {
    if (ffi::Error e = CheckLike(*buffer, *like, what); e.failure()) return e;
  }
  if (ffi::Error e = CheckRowStats(lse, p, "lse"); e.failure()) return e;
  p.out = const_cast<void*>(out.untyped_data());
  p.lse = static_cast<float*>(lse.untyped_data());
  p.d_out = d_out.untyped_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  if (dq_accum->element_type() != ffi::DataType::F32 ||
      dq_accum->element_count() != q.element_count())
    return Invalid("dq_accum must be float32 shaped like query " + ShapeString(q) + ", got " +
                   ShapeString(*dq_accum));
  if (ffi::Error e = CheckRowStats(*delta, p, "delta"); e.failure()) return e;
  p.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  p.delta = static_cast<float*>(delta->untyped_data());
  if (dq_semaphores->element_type() != ffi::DataType::S32)
    return Invalid("dq_semaphores must be int32, got " + ShapeString(*dq_semaphores));
  p.dq_semaphore_count = int64_t(dq_semaphores->element_count());
  // None is a call without them (the Hopper kernel's deterministic mode then leaves dQ to the
  // mma.sync family's pass); some but too few is a planning error, not a slower call.
  if (p.deterministic && p.dq_semaphore_count > 0 &&
      p.dq_semaphore_count < p.dq_semaphores_needed())
    return Invalid("dq_semaphores must hold at least " +
                   std::to_string(p.dq_semaphores_needed()) + " int32 for this call, got " +
                   ShapeString(*dq_semaphores));
  p.dq_semaphores = p.dq_semaphore_count > 0
                        ? static_cast<int32_t*>(dq_semaphores->untyped_data())
                        : nullptr;
  // Past the semaphores, room for the block order (PlanningParams asks block_order_needed of
  // it).
  const int64_t semaphores = p.deterministic ? p.dq_semaphores_needed() : 0;
  p.block_order_capacity = p.dq_semaphore_count - semaphores;
  p.block_order = p.block_order_capacity > 0 ? p.dq_semaphores + semaphores : nullptr;
  // The bias's and the slopes' gradients are results only where the caller needs them (never
  // without a bias, or without the slopes): dbias first, then dslopes.
  const bool want_dslopes = attrs.want_dslopes != 0;
  if (want_dslopes && p.alibi_slopes == nullptr)
    return Invalid("expected a dslopes result only where ALiBi slopes are given");
  const size_t dbias_results = dbias.size() - size_t(want_dslopes);
  if (dbias.size() < size_t(want_dslopes) || dbias_results > size_t(p.bias != nullptr))
    return Invalid("expected a dbias result only where a bias is given");
  if (want_dslopes) {
    auto result = dbias.get<ffi::AnyBuffer>(dbias_results);
    if (!result.has_value()) return result.error();
    if (ffi::Error e = CheckHeadValues(**result, q, "dslopes", dslopes_slots(p.seqlen_k));
        e.failure())
      return e;
    p.dslopes = static_cast<float*>((**result).untyped_data());
  }
  if (dbias_results == 1) {
    auto result = dbias.get<ffi::AnyBuffer>(0);
    if (!result.has_value()) return result.error();
    ffi::AnyBuffer grad = **result;
    if (grad.element_type() != ffi::DataType::F32)
      return Invalid("dbias must be float32, got another type of shape " + ShapeString(grad));
    if (ffi::Error e = BroadcastStridesOf(grad, q, p, "dbias", p.dbias_strides); e.failure())
      return e;
    p.dbias = static_cast<float*>(grad.untyped_data());
    p.dbias_elements = int64_t(grad.element_count());
    // Fewer elements than [batch, N, T, S], or more where that is empty (its zeros are the sum).
    p.dbias_accumulates = p.dbias_elements != p.batch * p.num_heads * p.seqlen_q * p.seqlen_k;
  }
  return ffi::Error::Success();
}

}  // namespace jax_flashattn
