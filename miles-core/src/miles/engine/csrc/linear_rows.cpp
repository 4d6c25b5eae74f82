// bfloat16 linear layers of a few rows (a decode step at small batch) for Miles' local engine on CPU.
//
// At one to a few rows a linear layer reads its whole weight for little arithmetic: the step is bound by memory.
// Each thread streams its own block of weight rows once, 32 bfloat16 at a time, and multiplies them with every
// input row by AVX-512 BF16 dot products (VDPBF16PS: products of bfloat16 pairs summed in float32), so the
// weight is read once whatever the number of rows; 16 / rows weight rows go together, so that 16 float32 sums are
// reduced at once (sum16). Each sum (plus the bias) is rounded to bfloat16 once, and every sum is taken in the
// same order whatever the number of rows. At one or two rows the weight rows are read one after the other (one
// stream, a line 4 KB ahead prefetched); from three, side by side with a later group's rows prefetched. Built
// where the compiler targets AVX-512 BF16 (-march=native on such a CPU); elsewhere linear_rows_available() is
// false and the engine keeps oneDNN. On the development machine (Xeon, AMX) it read weights at 18-21 GB/s at one
// row, where oneDNN's prepacked GEMM reaches 12-16; on an AMD EPYC (no AMX) 24 GB/s at two rows against oneDNN's
// 13 (without the prefetch, two streams of rows at 8 rows read 9-10 GB/s), and at one row SmolLM2's weights at
// 24.7 GB/s read one row after the other against 21.6 side by side (30-31 GB/s over one 276 MB matrix).
// The engine calls it at one row, and up to the rows where it measured it as fast (cpu_kernels.measure_rows).
//
// From three rows a later group's lines are prefetched into L1 only where they and the input rows fit in half of
// it (kL1Bytes): R streams of R weight rows ahead, (R * R + M) * K bfloat16s; else into L2, where the lines the
// kernel is about to read do not evict the input rows. On an AMD EPYC (32 KB L1D) SmolLM2's decode layers (30
// decode_block calls) at 3 / 4 / 6 / 8 rows took 9.5 / 9.8 / 12.0 / 10.6 ms against 11.2 / 11.5 / 13.2 / 11.5 with
// every prefetch into L1; the down projection (K = 1536) at 8 rows 56 against 97 us a layer.
//
// The lines prefetched are those of the group after next (kAheadGroups): a group of R rows at K = 576 takes the
// kernel a few hundred cycles, about one memory latency, so lines asked for one group ahead often came late.
// SmolLM2's 30 layers of projections and its LM head, cold in turn, on the same AMD EPYC, three runs alternating:
// 1.03-1.06x at 8 rows, 1.05-1.08x at 4, 1.01-1.03x at 3 against one group ahead (four and eight groups ahead: no
// better than one); with the weights in L3 (no memory stalls to hide) no difference.

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its reads a row stream asks for a line
constexpr int64_t kL1Bytes = 16384;       // what the lines prefetched into L1 and the input rows may take of it
constexpr int64_t kAheadGroups = 2;       // from three rows: how many groups of R rows ahead lines are prefetched

#if defined(__AVX512BF16__)
// R = 16 / M weight rows at a time, each multiplied with every input row: 16 float32 accumulators (R x M, the
// rest zero), summed horizontally together by sum16. kL1: from three rows, a later group's lines prefetched into
// L1 (else L2).
template <int M, bool kL1>
void rows_kernel(const uint16_t* x, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* out, int64_t K,
                 int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = 16 / M;
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  alignas(64) float sums[16];
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    if constexpr (M <= 2) {
      // one weight row after the other: a single stream through memory, which the hardware prefetchers follow
      // best, with the line 4 KB ahead asked for too (at one row on an AMD EPYC 25-31 GB/s, where R rows read side
      // by side, 16 streams, read 22-24; at 4 and 8 rows reading each input row once per weight row costs more)
      for (int r = 0; r < rows; ++r) {
        const uint16_t* wr = w + (n + r) * K;
        __m512 a[M];
        for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
          const __mmask32 mask = k < full ? static_cast<__mmask32>(0xFFFFFFFFu) : tail;
          _mm_prefetch(reinterpret_cast<const char*>(wr + k) + kPrefetchBytes, _MM_HINT_T0);
          const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
          for (int m = 0; m < M; ++m)
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), wv);
        }
        for (int m = 0; m < M; ++m) acc[r * M + m] = a[m];
      }
    } else {
      // the R rows side by side, each input row loaded once for all of them; the group after next prefetched
      for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = k < full ? static_cast<__mmask32>(0xFFFFFFFFu) : tail;
        __m512bh xv[M];
        for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
        if (n + kAheadGroups * R < N) {
          const char* next = reinterpret_cast<const char*>(w + (n + kAheadGroups * R) * K) + (k / 32) * R * 64;
          for (int r = 0; r < R; ++r) _mm_prefetch(next + r * 64, kL1 ? _MM_HINT_T0 : _MM_HINT_T1);
        }
        for (int r = 0; r < R; ++r) {  // (R, known when compiled: the accumulators stay in registers)
          if (r < rows) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n + r) * K + k);
            for (int m = 0; m < M; ++m) acc[r * M + m] = _mm512_dpbf16_ps(acc[r * M + m], xv[m], wv);
          }
        }
      }
    }
    _mm512_store_ps(sums, miles::sum16(acc));
    for (int r = 0; r < rows; ++r) {
      const float b = bias != nullptr ? static_cast<float>(bias[n + r]) : 0.f;
      for (int m = 0; m < M; ++m) miles::store(out + m * N, n + r, sums[r * M + m] + b);
    }
  }
}

template <int M>
void run(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  constexpr int64_t R = 16 / M;
  const int64_t K = x.size(1), N = w.size(0);
  const auto* X = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* W = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  const c10::BFloat16* B = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* O = out.data_ptr<c10::BFloat16>();
  const int64_t groups = (N + R - 1) / R;
  const bool l1 = (R * R + M) * K * 2 <= kL1Bytes;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    if (l1) {
      rows_kernel<M, true>(X, W, B, O, K, N, g0 * R, std::min(N, g1 * R));
    } else {
      rows_kernel<M, false>(X, W, B, O, K, N, g0 * R, std::min(N, g1 * R));
    }
  });
}
#endif

}  // namespace

bool linear_rows_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M <= 8, K] and w [N, K] bfloat16, contiguous; bias [N] bfloat16 or none. Returns [M, N] bfloat16.
at::Tensor linear_rows(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_rows: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_rows: bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_rows: contiguous x and w");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "linear_rows: 1 to 8 rows");
  if (bias.has_value()) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "linear_rows: bias");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
#if defined(__AVX512BF16__)
  switch (x.size(0)) {
    case 1: run<1>(x, w, bias, out); break;
    case 2: run<2>(x, w, bias, out); break;
    case 3: run<3>(x, w, bias, out); break;
    case 4: run<4>(x, w, bias, out); break;
    case 5: run<5>(x, w, bias, out); break;
    case 6: run<6>(x, w, bias, out); break;
    case 7: run<7>(x, w, bias, out); break;
    default: run<8>(x, w, bias, out); break;
  }
  return out;
#else
  TORCH_CHECK(false, "linear_rows: built without AVX-512 BF16");
#endif
}
