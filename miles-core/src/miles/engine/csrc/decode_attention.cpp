// Decode attention for Miles' local engine on CPU (see miles/engine/cpu_kernels.py; bound in bindings.cpp).
//
// One decode step of B requests: request b's query heads q[b] (H heads of D dims) attend over positions
// 0..pos[b] of its slot in the layer's KV cache ([slots, KVH, capacity, D], the head dim contiguous).
// decode_scores writes the step's new key and value at pos[b] and returns fp32 scores
// [B, KVH, G, span] (G = H / KVH query heads per KV head; -inf past pos[b]); the caller applies
// torch.softmax; decode_values returns probs . V as [B, H, D] in the cache's dtype.
// Work items are (request, KV head) pairs, each computed alone in a fixed order: batch-invariant.
//
// With AVX-512 and a head dim of 64 or 128: bfloat16 scores as AVX-512 BF16 dot products of q and each key
// (VDPBF16PS, products summed in float32, times the scale after), 16 positions at a time reduced together
// (miles::sum16); the values with each value row converted once for up to four query heads, whose float32
// sums stay in registers. On an AMD EPYC at 8 requests (SmolLM2: 9 heads over 3 KV heads of 64) a layer's
// scores and values took 48 + 21 us at 151 positions with a horizontal sum per dot product and the values' sums in
// memory, 17 + 13 us so; 278 + 137 against 76 + 67 at 1,024.

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

using miles::load;
using miles::store;

constexpr int64_t kMaxGroup = 16;
constexpr int kMaxDim = 256;

// Whether scores_bf16 computes the scores of a head dim kD in scalar_t here.
template <typename scalar_t, int kD>
constexpr bool kDotScores =
#if defined(__AVX512BF16__)
    kD > 0 && kD % 32 == 0 && std::is_same_v<scalar_t, c10::BFloat16>;
#else
    false;
#endif

#if defined(__AVX512F__)
// 16 elements from p as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[g * L + l] = (q[g] . k[l]) * scale for l in [0, n), g < G: q rows qs1 apart, keys ks2 apart (bfloat16).
#if defined(__AVX512BF16__)
template <int kD>
void scores_bf16(const c10::BFloat16* q, int64_t qs1, int64_t G, const c10::BFloat16* k, int64_t ks2, int64_t n,
                 float scale, float* out, int64_t L) {
  constexpr int C = kD / 32;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[C];
    for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * qs1 + 32 * c);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - l0));
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i < count) {
          const c10::BFloat16* kr = k + (l0 + i) * ks2;
          for (int c = 0; c < C; ++c)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(kr + 32 * c), qv[c]);
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      _mm512_mask_storeu_ps(out + g * L + l0, mask, _mm512_mul_ps(miles::sum16(acc), vscale));
    }
  }
}
#endif

// o[g * D + d] = sum over l < n of w[g * L + l] * v[l][d] for g < G (values ls apart), summed in float32 in
// position order, rounded to scalar_t once; up to four query heads per pass over the values.
template <typename scalar_t, int kD>
void values_avx512(const float* w, int64_t L, int64_t G, const scalar_t* v, int64_t vs2, int64_t n, scalar_t* o) {
  constexpr int C = kD / 16;
  alignas(64) float sums[kD];
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m512 acc[4][C];
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
    const float* wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = w + (g0 + std::min<int64_t>(j, gn - 1)) * L;  // (a repeated head: unused)
    for (int64_t l = 0; l < n; ++l) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(v + l * vs2 + 16 * c);
      for (int j = 0; j < 4; ++j) {
        const __m512 wl = _mm512_set1_ps(wr[j][l]);
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(wl, vv[c], acc[j][c]);
      }
    }
    for (int64_t j = 0; j < gn; ++j) {
      for (int c = 0; c < C; ++c) _mm512_store_ps(sums + 16 * c, acc[j][c]);
      scalar_t* out = o + (g0 + j) * kD;
      for (int d = 0; d < kD; ++d) store(out, d, sums[d]);
    }
  }
}
#endif

// kD > 0: the head dim known at compile time (vectorised, unrolled); kD == 0: any head dim <= kMaxDim.
template <typename scalar_t, int kD>
void scores_kernel(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new,
                   const at::Tensor& v_new, const at::Tensor& pos, at::Tensor& scores, float scale) {
  const int64_t B = q.size(0), H = q.size(1), KVH = k_cache.size(1), G = H / KVH, L = scores.size(3);
  const int64_t D = kD > 0 ? kD : q.size(2);
  const int64_t* P = pos.data_ptr<int64_t>();
  const scalar_t* Q = q.data_ptr<scalar_t>();
  scalar_t* K = k_cache.data_ptr<scalar_t>();
  scalar_t* V = v_cache.data_ptr<scalar_t>();
  const scalar_t* KN = k_new.data_ptr<scalar_t>();
  const scalar_t* VN = v_new.data_ptr<scalar_t>();
  float* S = scores.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t kns0 = k_new.stride(0), kns1 = k_new.stride(1), vns0 = v_new.stride(0), vns1 = v_new.stride(1);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    float qf[kMaxGroup][kD > 0 ? kD : kMaxDim];
    float kf[kD > 0 ? kD : kMaxDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH, p = P[b];
      scalar_t* kb = K + b * ks0 + h * ks1;
      scalar_t* vb = V + b * vs0 + h * vs1;
      std::memcpy(kb + p * ks2, KN + b * kns0 + h * kns1, D * sizeof(scalar_t));
      std::memcpy(vb + p * vs2, VN + b * vns0 + h * vns1, D * sizeof(scalar_t));
      float* out = S + (b * KVH + h) * G * L;
      if constexpr (kDotScores<scalar_t, kD>) {
#if defined(__AVX512BF16__)
        scores_bf16<kD>(Q + b * qs0 + h * G * qs1, qs1, G, kb, ks2, p + 1, scale, out, L);
#endif
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* qr = Q + b * qs0 + (h * G + g) * qs1;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) qf[g][d] = load(qr, d) * scale;
        }
        for (int64_t l = 0; l <= p; ++l) {
          const scalar_t* kr = kb + l * ks2;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) kf[d] = load(kr, d);
          for (int64_t g = 0; g < G; ++g) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qf[g][d] * kf[d];
            out[g * L + l] = s;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t l = p + 1; l < L; ++l) out[g * L + l] = -std::numeric_limits<float>::infinity();
    }
  });
}

template <typename scalar_t, int kD>
void values_kernel(const at::Tensor& probs, const at::Tensor& v_cache, const at::Tensor& pos, at::Tensor& out) {
  const int64_t B = probs.size(0), KVH = probs.size(1), G = probs.size(2), L = probs.size(3);
  const int64_t D = kD > 0 ? kD : v_cache.size(3);
  const int64_t* P = pos.data_ptr<int64_t>();
  const float* PR = probs.data_ptr<float>();
  const scalar_t* V = v_cache.data_ptr<scalar_t>();
  scalar_t* O = out.data_ptr<scalar_t>();
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    float acc[kD > 0 ? kD : kMaxDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH, p = P[b];
      const scalar_t* vb = V + b * vs0 + h * vs1;
#if defined(__AVX512F__)
      if constexpr (kD > 0 && kD % 16 == 0 && !std::is_same_v<scalar_t, double>) {
        values_avx512<scalar_t, kD>(PR + (b * KVH + h) * G * L, L, G, vb, vs2, p + 1, O + (b * KVH + h) * G * D);
        continue;
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        const float* w = PR + ((b * KVH + h) * G + g) * L;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
        for (int64_t l = 0; l <= p; ++l) {
          const float wl = w[l];
          const scalar_t* vr = vb + l * vs2;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += wl * load(vr, d);
        }
        scalar_t* o = O + ((b * KVH + h) * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(o, d, acc[d]);
      }
    }
  });
}

#define MILES_DISPATCH_HEAD_DIM(DIM, ...)       \
  switch (DIM) {                                \
    case 64: {                                  \
      constexpr int kHeadDim = 64;              \
      __VA_ARGS__;                              \
      break;                                    \
    }                                           \
    case 128: {                                 \
      constexpr int kHeadDim = 128;             \
      __VA_ARGS__;                              \
      break;                                    \
    }                                           \
    default: {                                  \
      constexpr int kHeadDim = 0;               \
      __VA_ARGS__;                              \
    }                                           \
  }

void check_cache(const at::Tensor& cache, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cache.dim() == 4, "decode attention: ", name, " must be [slots, kv_heads, capacity, head_dim]");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "decode attention: ", name, " and q differ in dtype");
  TORCH_CHECK(cache.stride(3) == 1, "decode attention: ", name, "'s head dim must be contiguous");
  TORCH_CHECK(cache.size(3) == q.size(2), "decode attention: ", name, " and q differ in head_dim");
  TORCH_CHECK(cache.device().is_cpu(), "decode attention: ", name, " must be on the CPU");
}

// pos: contiguous int64 [B], every position in [0, span) and inside the cache's capacity.
void check_positions(const at::Tensor& pos, int64_t B, int64_t span, int64_t capacity) {
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == B && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              "decode attention: pos must be a contiguous int64 [B]");
  TORCH_CHECK(span <= capacity, "decode attention: span ", span, " > capacity ", capacity);
  const int64_t* P = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(P[b] >= 0 && P[b] < span, "decode attention: position ", P[b], " of request ", b,
                " outside the span ", span);
  }
}

}  // namespace

at::Tensor decode_scores(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_new, at::Tensor v_new,
                         at::Tensor pos, int64_t span, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "decode attention: q must be [B, heads, head_dim], head dim contiguous");
  check_cache(k_cache, "k_cache", q);
  check_cache(v_cache, "v_cache", q);
  const int64_t B = q.size(0), KVH = k_cache.size(1);
  TORCH_CHECK(q.size(1) % KVH == 0 && q.size(1) / KVH <= kMaxGroup, "decode attention: ", q.size(1),
              " query heads over ", KVH, " kv heads is not supported");
  TORCH_CHECK(q.size(2) <= kMaxDim, "decode attention: head_dim ", q.size(2), " > ", kMaxDim);
  TORCH_CHECK(k_cache.size(0) >= B && v_cache.size(0) >= B, "decode attention: fewer cache slots than requests");
  for (const auto& t : {k_new, v_new}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == KVH && t.size(2) == q.size(2) && t.stride(2) == 1 &&
                    t.scalar_type() == q.scalar_type(),
                "decode attention: new keys / values must be [B, kv_heads, head_dim] like q");
  }
  check_positions(pos, B, span, std::min(k_cache.size(2), v_cache.size(2)));
  auto scores = at::empty({B, KVH, q.size(1) / KVH, span}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_scores", [&] {
    MILES_DISPATCH_HEAD_DIM(q.size(2), scores_kernel<scalar_t, kHeadDim>(q, k_cache, v_cache, k_new, v_new, pos,
                                                                           scores, static_cast<float>(scale)));
  });
  return scores;
}

at::Tensor decode_values(at::Tensor probs, at::Tensor v_cache, at::Tensor pos) {
  TORCH_CHECK(probs.dim() == 4 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "decode attention: probs must be a contiguous float32 [B, kv_heads, group, span]");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.stride(3) == 1 && v_cache.size(1) == probs.size(1) &&
                  v_cache.size(0) >= probs.size(0),
              "decode attention: v_cache does not match probs");
  check_positions(pos, probs.size(0), probs.size(3), v_cache.size(2));
  const int64_t D = v_cache.size(3);
  TORCH_CHECK(D <= kMaxDim, "decode attention: head_dim ", D, " > ", kMaxDim);
  auto out = at::empty({probs.size(0), probs.size(1) * probs.size(2), D}, v_cache.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v_cache.scalar_type(), "decode_values", [&] {
    MILES_DISPATCH_HEAD_DIM(D, values_kernel<scalar_t, kHeadDim>(probs, v_cache, pos, out));
  });
  return out;
}
