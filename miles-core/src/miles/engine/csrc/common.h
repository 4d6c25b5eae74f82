// Shared helpers of Miles' CPU kernels.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

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

}  // namespace miles
