// Python bindings of Miles' CPU kernels (miles/engine/cpu_kernels.py builds this module).

#include <torch/extension.h>

at::Tensor decode_scores(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_new, at::Tensor v_new,
                         at::Tensor pos, int64_t span, double scale);
at::Tensor decode_values(at::Tensor probs, at::Tensor v_cache, at::Tensor pos);
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor linear_rows(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
bool linear_rows_available();
at::Tensor decode_block(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor norm1, double eps1, at::Tensor qkv_w,
                        c10::optional<at::Tensor> qkv_b, at::Tensor cos, at::Tensor sin, int64_t heads,
                        int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache, int64_t layer, int64_t first_slot,
                        at::Tensor pos, int64_t span, double scale, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                        at::Tensor norm2, double eps2, at::Tensor gate_up_w, at::Tensor down_w,
                        c10::optional<at::Tensor> down_b);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_scores", &decode_scores, "write new K/V at pos; fp32 scores [B, kv_heads, group, span]");
  m.def("decode_values", &decode_values, "probs . V as [B, heads, head_dim]");
  m.def("rms_norm", &rms_norm, "x += delta in place; HF RMSNorm of x");
  m.def("rotary", &rotary, "HF rotary embedding of [B, T, heads, head_dim]");
  m.def("linear_rows", &linear_rows, "bfloat16 x [M <= 8, K] @ w [N, K]^T (+ bias), AVX-512 BF16");
  m.def("linear_rows_available", &linear_rows_available, "whether linear_rows was built (AVX-512 BF16)");
  m.def("decode_block", &decode_block, "one plain decoder layer of a decode step on the kernels above; its MLP output");
}
