// Fused elementwise steps of a decoder layer for Miles' local engine on CPU, with the rounding of the
// Hugging Face modules they replace (every intermediate rounded to the model's dtype where HF's is).

// No fused multiply-add contraction here: HF rounds each product before the sum (bit for bit in float32 too).
#pragma GCC optimize("fp-contract=off")

#include "common.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

using miles::load;
using miles::round_to;
using miles::store;

// x += delta (in place, rounded to x's dtype), then out = weight * T(x * rsqrt(mean(x^2) + eps)), the sum of
// squares in float32 (HF's LlamaRMSNorm and its Qwen / Mistral copies).
template <typename scalar_t>
void rms_norm_kernel(at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, float eps,
                     at::Tensor& out) {
  const int64_t H = x.size(-1), N = x.numel() / H;
  scalar_t* X = x.data_ptr<scalar_t>();
  const scalar_t* Dl = delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr;
  const scalar_t* W = weight.data_ptr<scalar_t>();
  scalar_t* O = out.data_ptr<scalar_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / H), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t* xr = X + n * H;
      if (Dl != nullptr) {
        const scalar_t* dr = Dl + n * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) store(xr, i, load(xr, i) + load(dr, i));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += load(xr, i) * load(xr, i);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      scalar_t* o = O + n * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) store(o, i, load(W, i) * round_to<scalar_t>(load(xr, i) * r));
    }
  });
}

// out = T(T(x * cos) + T(rotate_half(x) * sin)) for x [B, T, heads, D] (any strides, D contiguous) and
// cos / sin [B, T, D] (HF's apply_rotary_pos_emb); out is contiguous.
template <typename scalar_t>
void rotary_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), NH = x.size(2), D = x.size(3), half = D / 2;
  const scalar_t* X = x.data_ptr<scalar_t>();
  const scalar_t* C = cos.data_ptr<scalar_t>();
  const scalar_t* S = sin.data_ptr<scalar_t>();
  scalar_t* O = out.data_ptr<scalar_t>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1), ss0 = sin.stride(0), ss1 = sin.stride(1);
  at::parallel_for(0, B * T, std::max<int64_t>(1, 8192 / (NH * D)), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const scalar_t* c = C + b * cs0 + t * cs1;
      const scalar_t* s = S + b * ss0 + t * ss1;
      for (int64_t h = 0; h < NH; ++h) {
        const scalar_t* xr = X + b * xs0 + t * xs1 + h * xs2;
        scalar_t* o = O + (bt * NH + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {  // rotate_half: (-x2, x1)
          const float a = round_to<scalar_t>(load(xr, d) * load(c, d));
          const float r = round_to<scalar_t>(-load(xr, d + half) * load(s, d));
          store(o, d, a + r);
        }
#pragma omp simd
        for (int64_t d = half; d < D; ++d) {
          const float a = round_to<scalar_t>(load(xr, d) * load(c, d));
          const float r = round_to<scalar_t>(load(xr, d - half) * load(s, d));
          store(o, d, a + r);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [hidden] in x's dtype");
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() && delta->scalar_type() == x.scalar_type(),
                "rms_norm: delta must be contiguous and shaped like x");
  }
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x, delta, weight, static_cast<float>(eps), out);
  });
  return out;
}

at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rotary: x must be [B, T, heads, head_dim], head dim contiguous and even");
  for (const auto& t : {cos, sin}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == x.size(3) &&
                    t.stride(2) == 1 && t.scalar_type() == x.scalar_type(),
                "rotary: cos / sin must be [B, T, head_dim] in x's dtype");
  }
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_kernel<scalar_t>(x, cos, sin, out);
  });
  return out;
}
