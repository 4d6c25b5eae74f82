// Shared helpers of Miles' CPU kernels.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace miles {

// An element as float32 (bfloat16 -> float32 is a shift, which vectorises).
template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <>
inline float load<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Store float32 as T, rounded to nearest even as torch rounds every elementwise result.
template <typename T>
inline void store(T* p, int64_t i, float x) {
  p[i] = static_cast<T>(x);
}

// bfloat16: c10's rounding, written branch-free so that loops vectorise (NaN stays a quiet NaN).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (x != x) ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <>
inline void store<c10::BFloat16>(c10::BFloat16* p, int64_t i, float x) {
  reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(x);
}

// float32 rounded to T and back.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <>
inline float round_to<float>(float x) {
  return x;
}

template <>
inline float round_to<c10::BFloat16>(float x) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if defined(__AVX512F__)
// The 16 horizontal sums of a[0..15], as one vector: out[i] = sum of a[i]'s 16 floats (a transpose-and-add tree).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)
    c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}
#endif

}  // namespace miles

// The kernels' entry points, each defined in its own source: bindings.cpp exposes them to Python, decode_block.cpp
// runs a decoder layer on them.
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
at::Tensor decode_blocks(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t kv_heads,
                         at::Tensor k_cache, at::Tensor v_cache, int64_t first_slot, at::Tensor pos, int64_t span,
                         double scale, const std::vector<c10::optional<at::Tensor>>& weights,
                         const std::vector<double>& eps);
