// bf16 linear weights in column panels of K pairs: y [M, n] = x [M, K] (bf16) times w^T, w [n, K]
// bf16, summed in fp32 and rounded to bf16 once (what oneDNN's and HF's bf16 matmul compute),
// for every projection of a --dtype bfloat16 CPU model (model/cpu/panel_weight.py, Bf16PanelWeight).
//
// Why: torch's bf16 F.linear at one row ran 1.9x slower than the fp32 panel kernel (issue 51), so a
// bf16 batch-1 decode step lost to fp32 although it reads half the bytes. Here a batch-1 step
// streams the panels sequentially at half the fp32 bytes, and from a few rows up each K pair is
// one VDPBF16PS per 16 outputs (AVX-512-BF16: twice the fp32 FMA's multiply-adds per instruction).
//
// Layout: panels [P, Kh, 2 PW] bf16, Kh = ceil(K / 2), panels[p, h, 2 j + t] = w[p PW + j, 2 h + t]
// (zeros past n and past K); PW = 64 (four vectors of 16 fp32 lanes, each lane one output
// column's pair). With PW = 64 and K a multiple of 16 this is oneDNN's AB16b64a2b blocking.
//
// Arithmetic per output (m, j), whatever M, the thread count or which rows share the call (a row
// gives the same bits alone, in a decode batch or in a prefill): one fp32 chain over the K pairs,
// acc += x[2h + 1] w[2h + 1]; acc += x[2h] w[2h] (VDPBF16PS's order; a product of two bf16 is
// exact in fp32, so each step is one rounding), then the sum rounded to bf16 (nearest even).
// VDPBF16PS flushes denormal inputs and outputs to zero; the portable loop below (CPUs without
// AVX-512-BF16) does not, the only way its bits can differ.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPW = 64;  // output columns per panel
constexpr int kLanes = 16;   // fp32 lanes of one accumulator (one column each)
constexpr int kVecs = kPW / kLanes;
#if defined(__AVX512BF16__)
constexpr int kRows = 6;  // 24 accumulators + 4 weight vectors + a broadcast of 32 registers
#else
constexpr int kRows = 4;
#endif

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__AVX512BF16__)
// R rows of x (bf16, row stride ldx elements, K even) against one panel -> acc [R][kPW] fp32
template <int R>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t Kh, float* out) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t h = 0; h < Kh; ++h) {
    __m512bh w[kVecs];
    for (int c = 0; c < kVecs; ++c) w[c] = (__m512bh)_mm512_loadu_si512(p + h * 2 * kPW + c * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * h, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(out + r * kPW + c * kLanes, acc[r][c]);
}
#else
template <int R>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t Kh, float* out) {
  float acc[R][kPW] = {};
  for (int64_t h = 0; h < Kh; ++h) {
    const uint16_t* ph = p + h * 2 * kPW;
    for (int r = 0; r < R; ++r) {
      const float x0 = bf16_to_f32(x[r * ldx + 2 * h]), x1 = bf16_to_f32(x[r * ldx + 2 * h + 1]);
      for (int j = 0; j < kPW; ++j) {  // the odd element first, as VDPBF16PS adds them
        acc[r][j] = __builtin_fmaf(x1, bf16_to_f32(ph[2 * j + 1]), acc[r][j]);
        acc[r][j] = __builtin_fmaf(x0, bf16_to_f32(ph[2 * j]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + kPW, out + r * kPW);
}
#endif

// fp32 sums [R][kPW] -> bf16 outputs y[r, 0 .. cols)
template <int R>
void store(const float* acc, at::BFloat16* y, int64_t ldy, int64_t cols) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = at::BFloat16(acc[r * kPW + j]);  // nearest even
}

template <int R>
void rows(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t Kh, at::BFloat16* y, int64_t ldy, int64_t cols) {
  alignas(64) float acc[R * kPW];
  tile<R>(x, ldx, p, Kh, acc);
  store<R>(acc, y, ldy, cols);
}

int64_t bf16_panel_width() { return kPW; }

// x [M, K] (any float dtype, rounded to bf16); panels bf16 [P, ceil(K / 2), 2 PW]; n: the output
// features (P = ceil(n / PW)) -> [M, n] bf16. Work is split over panels (at::parallel_for).
at::Tensor bf16_panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 3 && panels.size(2) == 2 * kPW &&
                  panels.is_contiguous(),
              "panels must be contiguous bfloat16 [P, Kh, ", 2 * kPW, "]");
  const int64_t P = panels.size(0), Kh = panels.size(1);
  TORCH_CHECK(n > (P - 1) * kPW && n <= P * kPW, "n = ", n, " does not fill ", P, " panels of ", kPW);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "x must be a CPU [M, K] tensor");
  const int64_t K = x_in.size(1), M = x_in.size(0);
  TORCH_CHECK(K == 2 * Kh || K == 2 * Kh - 1, "x has ", K, " columns, the panels ", 2 * Kh, " (pairs)");
  at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  if (K % 2 == 1) {  // a zero column pairs the last one (the panels hold zeros there)
    at::Tensor even = at::zeros({M, K + 1}, x.options());
    even.narrow(1, 0, K).copy_(x);
    x = even;
  }
  const int64_t ldx = 2 * Kh;
  at::Tensor y = at::empty({M, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = pp + p * Kh * 2 * kPW;
      const int64_t col = p * kPW, cols = std::min(kPW, n - col);
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) rows<kRows>(xp + m * ldx, ldx, panel, Kh, yp + m * n + col, n, cols);
      const uint16_t* xm = xp + m * ldx;
      at::BFloat16* ym = yp + m * n + col;
      switch (M - m) {  // the rows left over, fewer than kRows
#if defined(__AVX512BF16__)
        case 5: rows<5>(xm, ldx, panel, Kh, ym, n, cols); break;
        case 4: rows<4>(xm, ldx, panel, Kh, ym, n, cols); break;
#endif
        case 3: rows<3>(xm, ldx, panel, Kh, ym, n, cols); break;
        case 2: rows<2>(xm, ldx, panel, Kh, ym, n, cols); break;
        case 1: rows<1>(xm, ldx, panel, Kh, ym, n, cols); break;
        default: break;
      }
    }
  });
  return y;
}

bool bf16_panel_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

// decode_layer.cpp compiles this file's kernel into its own extension: without a module of its own
#ifndef KVPIPE_KERNELS_NO_MODULE
// Every call releases the GIL while it runs (it touches no Python object), as weight_only.cpp's do.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_panel_linear", &bf16_panel_linear,
        "x [M, K] times bf16 pair panels [P, ceil(K / 2), 2 PW] -> [M, n] bf16, fp32 sums",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("panels"),
        pybind11::arg("n"));
  m.def("bf16_panel_width", &bf16_panel_width, "PW: the columns of a panel");
  m.def("bf16_panel_native", &bf16_panel_native, "whether the kernel was built with AVX-512-BF16 (VDPBF16PS)");
}
#endif  // KVPIPE_KERNELS_NO_MODULE
