// CPU kernels: tiled C++ with float32 accumulation, parallel over (batch, head, tile of rows or
// keys).
#pragma once

#include "ffi/params.h"

namespace jax_flashattn::cpu {

// out, lse from q, k, v (+ bias, mask, seq lengths, window). Every element of out and lse is
// written. Rows that see no key get out = 0 and lse = -inf.
void forward(const AttentionParams& p);

// dq, dk, dv (and dbias when p.dbias != nullptr) from q, k, v, out, lse, d_out. P is recomputed
// from lse; rows with lse = -inf contribute nothing. Every element of every gradient is written.
void backward(const AttentionParams& p);

}  // namespace jax_flashattn::cpu
