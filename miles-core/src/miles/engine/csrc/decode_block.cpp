// One decoder layer of a decode step at a few rows, in one call from Python, for Miles' local engine on CPU.
//
// At batch 1-8 a bfloat16 decode step of a small model (SmolLM2-135M: 30 layers) spent 3-5 ms of its ~17 ms in
// Python: some 40 tensor operations per layer (views, slices, checks, the calls of the kernels), each a few
// microseconds of the interpreter and the dispatcher. This runs a plain layer's steps -- the same kernels and ATen
// operations in the same order as ModelRunner._layers, so the same bits -- from C++:
//
//   x += delta; h = RMSNorm(x)                           rms_norm (elementwise.cpp)
//   qkv = h @ Wqkv^T (+ b)                               linear_rows (linear_rows.cpp)
//   q, k = rotary(qkv[q, k]); v = qkv[v]                 rotary (elementwise.cpp)
//   att = softmax(q . K) . V, k and v written first     decode_scores / softmax / decode_values
//   x += att @ Wo^T (+ b); h = RMSNorm(x)
//   g, u = h @ Wgate_up^T; return (silu(g) * u) @ Wdown^T (+ b)
//
// The returned MLP output is the next layer's delta (added to x by its first norm), as in _layers.

#include "common.h"

namespace {

// linear_rows over the rows of x [B, T, K]: [B, T, N] (ModelRunner._linear's reshape and view).
at::Tensor rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const at::Tensor out = linear_rows(x.reshape({-1, x.size(-1)}).contiguous(), w, bias);
  return out.view({x.size(0), x.size(1), -1});
}

}  // namespace

// x [B, 1, H] the residual stream (updated in place), delta [B, 1, H] the last block's output (none before the
// first layer); k_cache / v_cache [layers, slots, kv_heads, capacity, head_dim], request b in slot first_slot + b;
// pos [B] int64 positions, span = max(pos) + 1; cos / sin [B, 1, head_dim]. Returns the MLP's output [B, 1, H].
at::Tensor decode_block(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor norm1, double eps1, at::Tensor qkv_w,
                        c10::optional<at::Tensor> qkv_b, at::Tensor cos, at::Tensor sin, int64_t heads,
                        int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache, int64_t layer, int64_t first_slot,
                        at::Tensor pos, int64_t span, double scale, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                        at::Tensor norm2, double eps2, at::Tensor gate_up_w, at::Tensor down_w,
                        c10::optional<at::Tensor> down_b) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.is_contiguous(), "decode_block: x [B, 1, hidden], contiguous");
  const int64_t B = x.size(0), head_dim = k_cache.size(-1);
  if (delta.has_value() && !delta->is_contiguous()) delta = delta->contiguous();
  const at::Tensor h = rms_norm(x, delta, norm1, eps1);
  const at::Tensor qkv = rows(h, qkv_w, qkv_b).view({B, 1, -1, head_dim});
  const at::Tensor qk = rotary(qkv.slice(2, 0, heads + kv_heads), cos, sin);
  const at::Tensor q = qk.slice(2, 0, heads), k = qk.slice(2, heads), v = qkv.slice(2, heads + kv_heads);
  const at::Tensor keys = k_cache.select(0, layer).slice(0, first_slot, first_slot + B);
  const at::Tensor values = v_cache.select(0, layer).slice(0, first_slot, first_slot + B);
  const at::Tensor scores = decode_scores(q.select(1, 0), keys, values, k.select(1, 0), v.select(1, 0), pos, span, scale);
  const at::Tensor att = decode_values(at::softmax(scores, -1), values, pos);  // [B, heads, head_dim]
  const at::Tensor o = rows(att.unsqueeze(2).transpose(1, 2).reshape({B, 1, -1}), o_w, o_b);
  const at::Tensor h2 = rms_norm(x, o, norm2, eps2);
  const std::vector<at::Tensor> gu = rows(h2, gate_up_w, c10::nullopt).chunk(2, -1);
  return rows(at::silu(gu[0]) * gu[1], down_w, down_b);
}

// Every layer of a decode step, decode_block after decode_block, in one call from Python: the per-layer call
// from Python (its ~27 arguments converted by pybind11, and the interpreter's loop) cost about as much as the
// layer's view operations. weights holds kBlockWeights per layer, in decode_block's order (norm1, qkv_w, qkv_b,
// o_w, o_b, norm2, gate_up_w, down_w, down_b; the biases may be None), eps two per layer (norm1's, norm2's).
// Returns the last layer's MLP output (x, updated in place, has not had it added yet).
at::Tensor decode_blocks(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t kv_heads,
                         at::Tensor k_cache, at::Tensor v_cache, int64_t first_slot, at::Tensor pos, int64_t span,
                         double scale, const std::vector<c10::optional<at::Tensor>>& weights,
                         const std::vector<double>& eps) {
  constexpr size_t kBlockWeights = 9;
  const size_t layers = eps.size() / 2;
  TORCH_CHECK(layers > 0 && eps.size() == 2 * layers && weights.size() == kBlockWeights * layers,
              "decode_blocks: ", kBlockWeights, " weights and 2 eps per layer (", weights.size(), " weights, ",
              eps.size(), " eps)");
  for (size_t i = 0; i < layers; ++i) {
    for (size_t j : {0, 1, 3, 5, 6, 7}) {
      TORCH_CHECK(weights[kBlockWeights * i + j].has_value(), "decode_blocks: layer ", i, " lacks weight ", j);
    }
  }
  c10::optional<at::Tensor> delta;
  for (size_t i = 0; i < layers; ++i) {
    const auto* w = &weights[kBlockWeights * i];
    delta = decode_block(x, delta, *w[0], eps[2 * i], *w[1], w[2], cos, sin, heads, kv_heads, k_cache, v_cache,
                         static_cast<int64_t>(i), first_slot, pos, span, scale, *w[3], w[4], *w[5], eps[2 * i + 1],
                         *w[6], *w[7], w[8]);
  }
  return *delta;
}
