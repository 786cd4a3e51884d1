// Weight-only quantized linears on CPU: y [M, N] = x [M, K] (fp32) times int8 or int4 weights
// [N, K], dequantized as they are read (quantized_weight.py holds the formats); and every fp32
// linear of a CPU model, over its weights in column panels (f32_panel_linear, model/cpu/panel_weight.py;
// its own comment below).
//
// Why not torch's kernels: `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` vectorise only
// bf16 inputs and still ran a [1536, 576] weight at one row in 0.6-1 ms on the Xeon of
// docs/benchmarks.md (1-1.5 GMAC/s: compute-bound on unpacking, far from the memory bandwidth a
// GEMV of 0.4-0.9 MB should reach), and 2-7x slower than the fp32 GEMM at prefill sizes.
//
// What the weight-only kernels compute, per output (m, n), in an order that depends on nothing but K (not on M, N,
// the thread count or which other rows share the call, so a row gives the same bits alone or in
// a batch):
// - int8: w[n, k] = q[n, k] * scale[n]; y = scale[n] * sum_k x[m, k] * q[n, k];
// - int4: codes in groups of 32 along K, w[n, k] = q[n, k] * scale[n, g] + minimum[n, g] (one
//   fused multiply-add, so the dequantized weight is rounded once); y = sum_k x[m, k] * w[n, k].
//   A group's 16 bytes hold code j in the low nibble of byte j and code j + 16 in the high
//   nibble: GGUF's Q4_0/Q4_1 block layout.
// The sums run in four W-lane fp32 accumulators (W = 16 with AVX-512, else 8; the column picks
// one), added pairwise at the end, then the lanes in a fixed order, then the scalar tail (int8,
// K mod 4W columns). The order depends on the machine's vector width, not on the call.
//
// Rows of x are taken up to kRowsPerTile at a time against each unpacked weight vector: the
// unpacking is shared and the rows' accumulators are independent chains. Work is split over output columns
// (at::parallel_for, torch's intra-op threads). AVX-512 or AVX2 + FMA; a scalar loop with the
// same arithmetic per lane without them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <utility>

namespace {

constexpr int64_t kGroup = 32;  // int4 group along K (GGUF's block)
#if defined(__AVX512F__)
constexpr int64_t kRowsPerTile = 4;  // 4 rows x 4 accumulators + the weights fit 32 vector registers
#else
constexpr int64_t kRowsPerTile = 2;  // ... and 2 rows fit 16
#endif
constexpr int64_t kBlockN = 32;  // weight rows per block: 18-36 KiB of int8 at K = 576-1,152

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int W = 16;  // fp32 lanes of a vector
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec v) {  // halves added in a fixed order down to one lane
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
// W int8 -> W floats
inline Vec vint8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// a group's 16 bytes -> its 32 codes as 32 / W vectors, in k order
inline void vint4(const uint8_t* p, Vec* out) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));                     // codes 0..15
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));  // 16..31
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(Vec v) {  // lanes added in a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline Vec vint8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vint4(const uint8_t* p, Vec* out) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);                     // codes 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);  // codes 16..31
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#else
constexpr int W = 8;
struct Vec {
  float v[W];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = p[i];
  return r;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline Vec vadd(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline Vec vset1(float x) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = x;
  return r;
}
inline void vstore(float* p, Vec v) {
  for (int i = 0; i < W; ++i) p[i] = v.v[i];
}
inline Vec vmul(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline float vsum(Vec v) {
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = v.v[i] + v.v[i + 4];
  const float a = s[0] + s[2], b = s[1] + s[3];
  return a + b;
}
inline Vec vint8(const int8_t* p) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void vint4(const uint8_t* p, Vec* out) {
  for (int i = 0; i < 16; ++i) {
    out[i / W].v[i % W] = static_cast<float>(p[i] & 0x0F);
    out[(16 + i) / W].v[i % W] = static_cast<float>(p[i] >> 4);
  }
}
#endif

constexpr int kAcc = 4;                 // independent accumulators per row
constexpr int64_t kStep = kAcc * W;     // int8: K columns per round, one vector per accumulator
constexpr int kGroupVecs = kGroup / W;  // int4: vectors per group (2 or 4)
static_assert(kAcc % kGroupVecs == 0, "a group's vectors map onto the accumulators");

inline float finish(Vec a[kAcc]) { return vsum(vadd(vadd(a[0], a[1]), vadd(a[2], a[3]))); }

// R rows of x (R <= kRowsPerTile) against int8 weight row q: out[r] = scale * x[r] . q
template <int R>
void int8_tile(const float* x, int64_t ldx, const int8_t* q, float scale, int64_t K, float* y, int64_t ldy) {
  Vec acc[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kAcc; ++i) acc[r][i] = vzero();
  const int64_t kv = K - K % kStep;
  for (int64_t k = 0; k < kv; k += kStep) {
    Vec w[kAcc];
    for (int i = 0; i < kAcc; ++i) w[i] = vint8(q + k + W * i);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kAcc; ++i) acc[r][i] = vfma(vload(x + r * ldx + k + W * i), w[i], acc[r][i]);
  }
  for (int r = 0; r < R; ++r) {
    float s = finish(acc[r]);
    for (int64_t k = kv; k < K; ++k) s += x[r * ldx + k] * static_cast<float>(q[k]);
    y[r * ldy] = scale * s;
  }
}

// R rows of x against one int4 weight row (K / 32 groups): out[r] = x[r] . (q * scale + minimum)
template <int R>
void int4_tile(const float* x, int64_t ldx, const uint8_t* codes, const float* scale, const float* minimum,
               int64_t K, float* y, int64_t ldy) {
  Vec acc[R][kAcc];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kAcc; ++i) acc[r][i] = vzero();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    Vec w[kGroupVecs];
    vint4(codes + g * (kGroup / 2), w);
    const Vec s = vset1(scale[g]), m = vset1(minimum[g]);
    for (int i = 0; i < kGroupVecs; ++i) w[i] = vfma(w[i], s, m);
    const int64_t k = g * kGroup;
    const int a0 = static_cast<int>(g % (kAcc / kGroupVecs)) * kGroupVecs;  // groups take turns
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kGroupVecs; ++i) acc[r][a0 + i] = vfma(vload(x + r * ldx + k + W * i), w[i], acc[r][a0 + i]);
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = finish(acc[r]);
}

at::Tensor check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, "x must be a CPU [M, K] tensor, K = ", K);
  return x.to(at::kFloat).contiguous();
}

// x [M, K] (any float dtype, computed in fp32); q int8 [N, K]; scale fp32 [N] -> [M, N] fp32
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "q must be int8 [N, K]");
  const int64_t N = q_in.size(0), K = q_in.size(1);
  const at::Tensor x = check_x(x_in, K), q = q_in.contiguous(), scale = scale_in.to(at::kFloat).contiguous();
  TORCH_CHECK(scale.numel() == N, "scale must be [N]");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += kBlockN)  // a block of weight rows stays in L1 over all of x
    for (int64_t m = 0; m < M; m += kRowsPerTile) {
      for (int64_t n = b; n < std::min(b + kBlockN, n1); ++n) {
        const float* xm = xp + m * K;
        float* ym = yp + m * N + n;
        switch (std::min<int64_t>(M - m, kRowsPerTile)) {
          case 4: int8_tile<4>(xm, K, qp + n * K, sp[n], K, ym, N); break;
          case 3: int8_tile<3>(xm, K, qp + n * K, sp[n], K, ym, N); break;
          case 2: int8_tile<2>(xm, K, qp + n * K, sp[n], K, ym, N); break;
          default: int8_tile<1>(xm, K, qp + n * K, sp[n], K, ym, N);
        }
      }
    }
  });
  return y;
}

// x [M, K]; codes uint8 [N, K / 2]; scale, minimum fp32 [N, K / 32] -> [M, N] fp32
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scale_in,
                       const at::Tensor& minimum_in) {
  TORCH_CHECK(codes_in.scalar_type() == at::kByte && codes_in.dim() == 2, "codes must be uint8 [N, K / 2]");
  const int64_t N = codes_in.size(0), K = codes_in.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  const at::Tensor x = check_x(x_in, K), codes = codes_in.contiguous();
  const at::Tensor scale = scale_in.to(at::kFloat).contiguous(), minimum = minimum_in.to(at::kFloat).contiguous();
  TORCH_CHECK(scale.numel() == N * (K / kGroup) && minimum.numel() == scale.numel(), "scale, minimum: [N, K / 32]");
  const int64_t M = x.size(0), G = K / kGroup;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += kBlockN)
    for (int64_t m = 0; m < M; m += kRowsPerTile) {
      for (int64_t n = b; n < std::min(b + kBlockN, n1); ++n) {
        const uint8_t* c = cp + n * (K / 2);
        const float* xm = xp + m * K;
        const float *s = sp + n * G, *mn = mp + n * G;
        float* ym = yp + m * N + n;
        switch (std::min<int64_t>(M - m, kRowsPerTile)) {
          case 4: int4_tile<4>(xm, K, c, s, mn, K, ym, N); break;
          case 3: int4_tile<3>(xm, K, c, s, mn, K, ym, N); break;
          case 2: int4_tile<2>(xm, K, c, s, mn, K, ym, N); break;
          default: int4_tile<1>(xm, K, c, s, mn, K, ym, N);
        }
      }
    }
  });
  return y;
}

// ---- fp32 and int8 weights as column panels (model/cpu/panel_weight.py, quantized_weight.py) ----
// Panel p holds output columns [p PW, (p + 1) PW) of W^T, k-major: panels[p, k, j] = w[p PW + j, k]
// (zeros past N); int8 panels hold the codes, and y = scale[n] * sum_k x[k] q[n, k] (the codes
// are exact in fp32; the scale is applied once, to the sum: the row kernel's arithmetic); int4
// panels hold two codes a byte (column j low, column j + PW / 2 high) and each (group, column)'s
// scale and minimum, and w = q * scale + minimum is formed with one FMA, as the row kernel does.
// A tile of R rows of x against one panel keeps R x kPanelVecs accumulators in registers; per k
// it loads one panel row (PW weights) and broadcasts x[r, k]:
// - one output is one chain, y = fma(x[k], w[k], y) for k = 0 .. K-1, whatever M, R, the thread
//   count or the ISA's vector width: a row gives the same bits alone, in a decode batch or in a
//   prefill (the prefill and a decode step of the same token agree bit for bit);
// - a batch-1 step reads the panels as one sequential stream (measured 33 GB/s on the EPYC's huge
//   pages, where oneDNN's packed product read the same weight at 14 GB/s at one row); from a few
//   rows up the tile is bound by the FMAs and keeps up with oneDNN's GEMM (docs/benchmarks.md).
constexpr int kPanelVecs = 4;
constexpr int64_t kPanelW = kPanelVecs * W;  // columns per panel: 64 with AVX-512, 32 otherwise
#if defined(__AVX512F__)
constexpr int kPanelRows = 6;  // 24 accumulators + 4 panel vectors + a broadcast of 32 registers
#else
constexpr int kPanelRows = 2;  // 8 + 4 + 1 of 16
#endif

inline Vec vpanel(const float* p) { return vload(p); }
inline Vec vpanel(const int8_t* p) { return vint8(p); }

static_assert(kPanelVecs == 4, "an int4 panel row is two vectors of low nibbles and two of high");
// one int4 panel row (PW / 2 bytes) -> its PW codes as kPanelVecs float vectors, in column order
inline void vpanel4(const uint8_t* p, Vec* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)));
  out[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
  out[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  for (int j = 0; j < kPanelW / 2; ++j) {
    out[j / W].v[j % W] = static_cast<float>(p[j] & 0x0F);
    out[(j + kPanelW / 2) / W].v[j % W] = static_cast<float>(p[j] >> 4);
  }
#endif
}

// int4: per k one panel row of codes, dequantized with its group's scale and minimum (one FMA),
// then R rows' FMAs; fewer rows than the other panels leave registers for the group's 8 vectors
#if defined(__AVX512F__)
constexpr int kPanelRows4 = 4;
#else
constexpr int kPanelRows4 = 1;
#endif

template <int R>
void panel_tile4(const float* x, int64_t ldx, const uint8_t* p, const float* scale, const float* minimum, int64_t K,
                 float* y, int64_t ldy, int64_t cols) {
  Vec acc[R][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVecs; ++c) acc[r][c] = vzero();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    Vec s[kPanelVecs], m[kPanelVecs];
    for (int c = 0; c < kPanelVecs; ++c) {
      s[c] = vload(scale + g * kPanelW + c * W);
      m[c] = vload(minimum + g * kPanelW + c * W);
    }
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      Vec w[kPanelVecs];
      vpanel4(p + k * (kPanelW / 2), w);
      for (int c = 0; c < kPanelVecs; ++c) w[c] = vfma(w[c], s[c], m[c]);
      for (int r = 0; r < R; ++r) {
        const Vec xv = vset1(x[r * ldx + k]);
        for (int c = 0; c < kPanelVecs; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float buf[kPanelW];
    for (int c = 0; c < kPanelVecs; ++c) vstore(buf + c * W, acc[r][c]);
    std::copy(buf, buf + cols, y + r * ldy);
  }
}

// scale: the panel's PW column scales (int8), or nullptr (fp32)
template <int R, typename T>
void panel_tile(const float* x, int64_t ldx, const T* p, int64_t K, const float* scale, float* y, int64_t ldy,
                int64_t cols) {
  Vec acc[R][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelVecs; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    Vec w[kPanelVecs];
    for (int c = 0; c < kPanelVecs; ++c) w[c] = vpanel(p + k * kPanelW + c * W);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vset1(x[r * ldx + k]);
      for (int c = 0; c < kPanelVecs; ++c) acc[r][c] = vfma(xv, w[c], acc[r][c]);
    }
  }
  if (scale != nullptr)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kPanelVecs; ++c) acc[r][c] = vmul(acc[r][c], vload(scale + c * W));
  for (int r = 0; r < R; ++r) {
    if (cols == kPanelW) {
      for (int c = 0; c < kPanelVecs; ++c) vstore(y + r * ldy + c * W, acc[r][c]);
    } else {  // the last panel of an N that is not a multiple of PW
      float buf[kPanelW];
      for (int c = 0; c < kPanelVecs; ++c) vstore(buf + c * W, acc[r][c]);
      std::copy(buf, buf + cols, y + r * ldy);
    }
  }
}

int64_t f32_panel_width() { return kPanelW; }

// A panel product's input x [M, K] as fp32 and its output [M, n] (n outputs in P panels)
std::pair<at::Tensor, at::Tensor> panel_io(const at::Tensor& x_in, int64_t K, int64_t P, int64_t n) {
  TORCH_CHECK(n > (P - 1) * kPanelW && n <= P * kPanelW, "n = ", n, " does not fill ", P, " panels of ", kPanelW);
  at::Tensor x = check_x(x_in, K);
  return {x, at::empty({x.size(0), n}, x.options())};
}

// x [M, K] (any float dtype, computed in fp32); panels [P, K, PW]; scale [P PW] or nullptr; n:
// the output features (P = ceil(n / PW)) -> [M, n] fp32. Work is split over panels (at::parallel_for).
template <typename T>
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, const float* scale, int64_t n) {
  const int64_t P = panels.size(0), K = panels.size(1);
  const auto [x, y] = panel_io(x_in, K, P, n);
  const int64_t M = x.size(0);
  const float* xp = x.data_ptr<float>();
  const T* pp = panels.data_ptr<T>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const T* panel = pp + p * K * kPanelW;
      const int64_t col = p * kPanelW, cols = std::min(kPanelW, n - col);
      const float* sc = scale == nullptr ? nullptr : scale + col;
      int64_t m = 0;
      for (; m + kPanelRows <= M; m += kPanelRows)
        panel_tile<kPanelRows>(xp + m * K, K, panel, K, sc, yp + m * n + col, n, cols);
      const float* xm = xp + m * K;
      float* ym = yp + m * n + col;
      switch (M - m) {  // the rows left over, fewer than kPanelRows
#if defined(__AVX512F__)
        case 5: panel_tile<5>(xm, K, panel, K, sc, ym, n, cols); break;
        case 4: panel_tile<4>(xm, K, panel, K, sc, ym, n, cols); break;
        case 3: panel_tile<3>(xm, K, panel, K, sc, ym, n, cols); break;
        case 2: panel_tile<2>(xm, K, panel, K, sc, ym, n, cols); break;
#endif
        case 1: panel_tile<1>(xm, K, panel, K, sc, ym, n, cols); break;
        default: break;
      }
    }
  });
  return y;
}

at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(2) == kPanelW &&
                  panels.is_contiguous(),
              "panels must be contiguous float32 [P, K, ", kPanelW, "]");
  return panel_linear<float>(x, panels, nullptr, n);
}

// codes uint8 [P, K, PW / 2]; scale, minimum fp32 [P, K / 32, PW]
at::Tensor int4_panel_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale,
                             const at::Tensor& minimum, int64_t n) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == kPanelW / 2 &&
                  codes.is_contiguous(),
              "codes must be contiguous uint8 [P, K, ", kPanelW / 2, "]");
  const int64_t P = codes.size(0), K = codes.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == P * G * kPanelW,
                "scale and minimum must be contiguous float32 [P, K / 32, ", kPanelW, "]");
  const auto [x, y] = panel_io(x_in, K, P, n);
  const int64_t M = x.size(0);
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *mp = minimum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = cp + p * K * (kPanelW / 2);
      const float *s = sp + p * G * kPanelW, *mn = mp + p * G * kPanelW;
      const int64_t col = p * kPanelW, cols = std::min(kPanelW, n - col);
      int64_t m = 0;
      for (; m + kPanelRows4 <= M; m += kPanelRows4)
        panel_tile4<kPanelRows4>(xp + m * K, K, panel, s, mn, K, yp + m * n + col, n, cols);
      for (; m < M; ++m) panel_tile4<1>(xp + m * K, K, panel, s, mn, K, yp + m * n + col, n, cols);
    }
  });
  return y;
}

// codes int8 [P, K, PW]; scale fp32 [P PW] (a row's scale, any value past n)
at::Tensor int8_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t n) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(2) == kPanelW && codes.is_contiguous(),
              "codes must be contiguous int8 [P, K, ", kPanelW, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == codes.size(0) * kPanelW,
              "scale must be contiguous float32 [P * ", kPanelW, "]");
  return panel_linear<int8_t>(x, codes, scale.data_ptr<float>(), n);
}

}  // namespace

// decode_layer.cpp compiles this file's kernels into its own extension: without a module of their own
#ifndef KVPIPE_KERNELS_NO_MODULE
// Every call releases the GIL while it runs (it touches no Python object). Holding it, a decode
// step left the server's other threads (the event loop streaming a first token, the transfer
// threads) only the gaps between kernel calls, each wait up to a switch interval (5 ms) long.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x [M, K] times int8 weights [N, K] with row scales -> [M, N]",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("q"),
        pybind11::arg("scale"));
  m.def("f32_panel_linear", &f32_panel_linear, "x [M, K] times fp32 panels [P, K, PW] -> [M, n], each output one chain over K",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("panels"),
        pybind11::arg("n"));
  m.def("int8_panel_linear", &int8_panel_linear, "x [M, K] times int8 panels [P, K, PW] with row scales -> [M, n]",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("codes"),
        pybind11::arg("scale"), pybind11::arg("n"));
  m.def("int4_panel_linear", &int4_panel_linear, "x [M, K] times int4 panels [P, K, PW / 2] with group scales -> [M, n]",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"), pybind11::arg("codes"),
        pybind11::arg("scale"), pybind11::arg("minimum"), pybind11::arg("n"));
  m.def("f32_panel_width", &f32_panel_width, "PW: the columns of a panel on this CPU");
  m.def("int4_linear", &int4_linear, "x [M, K] times int4 group weights [N, K] -> [M, N]",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scale"), pybind11::arg("minimum"));
}
#endif  // KVPIPE_KERNELS_NO_MODULE
