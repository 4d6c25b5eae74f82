// Python bindings of Miles' CPU kernels (miles/engine/cpu_kernels.py builds this module).

#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_scores", &decode_scores, "write new K/V at pos; fp32 scores [B, kv_heads, group, span]");
  m.def("decode_values", &decode_values, "probs . V as [B, heads, head_dim]");
  m.def("rms_norm", &rms_norm, "x += delta in place; HF RMSNorm of x");
  m.def("rotary", &rotary, "HF rotary embedding of [B, T, heads, head_dim]");
  m.def("linear_rows", &linear_rows, "bfloat16 x [M <= 8, K] @ w [N, K]^T (+ bias), AVX-512 BF16");
  m.def("linear_rows_available", &linear_rows_available, "whether linear_rows was built (AVX-512 BF16)");
  m.def("decode_block", &decode_block, "one plain decoder layer of a decode step on the kernels above; its MLP output");
  m.def("decode_blocks", &decode_blocks, "decode_block over every layer (9 weights, 2 eps each); the last MLP output");
}
