// Paged decode attention on CPU: one query token per row over the row's KV pages, read in place.
//
// The torch path (attention.py::attend_pages) first gathers every row's pages into a
// [B, n, Hkv, P, D] copy and then runs batched matmuls of tiny [G, D] x [D, P] tiles; here each
// (row, KV head) task walks its pages straight from the pool and keeps an online (streaming)
// softmax in fp32, so nothing is copied and no per-tile BLAS call is made.
//
// Pool layout per layer: k [num_pages, Hkv, P, D], v [num_pages, Hkv, P, Dv]. Any strides of the
// first three dims are accepted (MLA passes v as the prefix view k[..., :Dv] of the latent pages);
// the last dim must be contiguous.
//
// KV dtypes (--kv-cache-dtype): the pool may store float32, bfloat16, float16, float8_e4m3fn or
// float8_e5m2 whatever the model computes in, converted to fp32 as it is read, never the pool:
// bf16 by a 16-bit shift, fp16 by F16C (or the branch-free bit conversion of the FP16 library
// without it), fp8 by moving its bits into an fp16 (e5m2 is the top byte of an fp16; e4m3 shifted
// into fp16's fields is its value times 2^-8, a factor folded into the scales). The fp8 scales
// (key = stored * k_scale, value = stored * v_scale) fold into the query and into the final
// normalisation, so they cost nothing per key.
//
// The loops (AVX2 + FMA; a scalar `omp simd` path without them) score 4 keys for up to 3 query
// heads at a time, one vector accumulator per (head, key) and one transpose-and-add per 4 keys
// instead of a horizontal reduction per key, and accumulate values 32 columns x 3 heads at a time
// in registers: each key or value vector is loaded, and converted, once for the heads that share
// it. With more than 3 query heads per KV head a page's rows are converted once into fp32 tiles
// in L1 instead (per-thread scratch), so that no row is converted once per block of heads.
// docs/benchmarks.md (KV cache dtypes) has the timings.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 (every exponent below is a score minus a running max), written so that GCC
// vectorises loops over it: Cephes' expf polynomial (about 1 ulp) with 2^n built in the exponent
// bits. glibc's scalar expf would cost about as much as the dot products themselves.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // 2^n stays a normal float; exp(-87) is 1.6e-38
  // round-to-nearest by the 1.5 * 2^23 trick (valid for |v| < 2^22; no -ffast-math, so kept)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, ln2 split in two
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

template <int N>
inline float dot(const float* a, const float* b, int64_t n) {
  if constexpr (N > 0) n = N;
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

enum class KV { F32, BF16, F16, E4M3, E5M2 };

template <KV T>
struct Stored {  // the bits one element is stored in
  using type = std::conditional_t<T == KV::F32, float, std::conditional_t<T == KV::BF16 || T == KV::F16, uint16_t, uint8_t>>;
};

// fp16 bits -> float without branches (Maratyszcza's FP16 library, fp16_ieee_to_fp32_value): GCC
// vectorises it, and no intermediate is a denormal float (which would cost microcode assists).
inline float half_bits_to_float(uint32_t h) {
  const uint32_t w = h << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = __builtin_bit_cast(float, (two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = __builtin_bit_cast(float, (two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? __builtin_bit_cast(uint32_t, denormalized)
                                           : __builtin_bit_cast(uint32_t, normalized);
  return __builtin_bit_cast(float, sign | bits);
}

// What the conversion below leaves out of a stored value, folded into the scales: e4m3's
// sign/exponent/mantissa moved into fp16's fields reads as 2^-8 of its value (biases 7 and 15),
// subnormals included; e5m2 is exactly the top byte of an fp16.
template <KV T>
constexpr float kv_factor() {
  return T == KV::E4M3 ? 256.0f : 1.0f;
}

template <KV T>
inline float to_float(typename Stored<T>::type x) {
  if constexpr (T == KV::F32) {
    return x;
  } else if constexpr (T == KV::BF16) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16);
  } else if constexpr (T == KV::F16) {
    return half_bits_to_float(x);
  } else if constexpr (T == KV::E4M3) {
    return half_bits_to_float(((x & 0x80u) << 8) | ((x & 0x7Fu) << 7));
  } else {
    return half_bits_to_float(static_cast<uint32_t>(x) << 8);
  }
}

#if defined(__F16C__) && defined(__AVX2__)
// 8 fp8 bytes (the low 8 of x) -> the fp16 bits that F16C converts (see kv_factor). e4m3:
// sign-extended to 16 bits and shifted left by 7, the sign lands in bits 15 and 14 and the
// exponent and mantissa in 13..7; clearing bit 14 leaves fp16's fields (3 operations, not 6).
template <KV T>
inline __m128i fp8_to_half_bits(__m128i x) {
  if constexpr (T == KV::E5M2) return _mm_slli_epi16(_mm_cvtepu8_epi16(x), 8);
  return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
}
#endif

// One stored row of n elements -> fp32 (divided by kv_factor) in out.
template <KV T>
inline void convert_row(const typename Stored<T>::type* src, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  if constexpr (T == KV::F16 || T == KV::E4M3 || T == KV::E5M2) {  // 8 at a time through F16C
    for (; i + 8 <= n; i += 8) {
      __m128i h;
      if constexpr (T == KV::F16) {
        h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      } else {
        h = fp8_to_half_bits<T>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      }
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
    }
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) out[j] = to_float<T>(src[j]);
}

#if defined(__AVX2__) && defined(__FMA__)
#define KVPIPE_AVX2 1
#else
#define KVPIPE_AVX2 0
#endif

#if KVPIPE_AVX2
// [sum of a0's 8 lanes, ..., sum of a3's]: one transpose-and-add for a block of 4 keys instead of
// a horizontal reduction per key.
inline __m128 lane_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // [a0..a3 low | high]
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

// Asks for one stored row (`cols` elements) ahead of its use, into L2. Pools other than fp32
// convert their pages row by row; each row converted asks for the same row of the task's next
// page, so DRAM streams that page during this one's arithmetic (the next page lies 3 x 16 KiB
// away at SmolLM2's shape: the hardware prefetchers do not cross to it in time). One or two
// lines per row, not a whole tile at once: a burst of hundreds of prefetches fills the line fill
// buffers and stalls the loads behind it. fp32 pools are read at DRAM bandwidth without it.
template <typename S>
inline void prefetch_row(const S* row, int64_t cols) {
  const char* r = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < cols * static_cast<int64_t>(sizeof(S)); o += 64) __builtin_prefetch(r + o, 0, 2);
}

// Query heads handled together by the loops below: NH x 4 vector accumulators, NH query (or
// weight) vectors and one key (or value) vector fill AVX2's 16 registers at NH = 3.
constexpr int kHeadBlock = 3;

#if KVPIPE_AVX2
// 8 stored elements -> 8 floats (divided by kv_factor) in a register: the conversion of
// convert_row, for loops that convert as they load.
template <KV T>
inline __m256 load8(const typename Stored<T>::type* p) {
  if constexpr (T == KV::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (T == KV::BF16) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else {
#if defined(__F16C__)
    __m128i h;
    if constexpr (T == KV::F16) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      h = fp8_to_half_bits<T>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    }
    return _mm256_cvtph_ps(h);
#else
    alignas(32) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = to_float<T>(p[i]);
    return _mm256_load_ps(t);
#endif
  }
}
#endif

// q . row for one stored row, converted element by element (the scalar path and the tails).
template <KV T, int N>
inline float dot_stored(const float* q, const typename Stored<T>::type* row, int64_t n) {
  if constexpr (T == KV::F32) {
    return dot<N>(q, row, n);
  } else {
    if constexpr (N > 0) n = N;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += q[i] * to_float<T>(row[i]);
    return acc;
  }
}

// s[h * s_stride + j] = q[h] . k[j] for NH query heads (rows q_stride apart) and the fp32 key rows
// j in [j0, j1), `stride` floats apart, of n (or DK) floats. With AVX2 + FMA, 4 keys at a time:
// each key vector is loaded once for the NH heads, one accumulator per (head, key) (independent
// FMA chains), then one lane_sums per head; the keys left over and the head dim's tail beyond
// whole vectors go through the scalar dot.
template <KV T, int DK, int NH>
inline void score_heads(const float* q, int64_t q_stride, const typename Stored<T>::type* k, int64_t stride,
                        int64_t j0, int64_t j1, int64_t n, float* s, int64_t s_stride,
                        const typename Stored<T>::type* next) {
  const int64_t D = DK > 0 ? DK : n;
  int64_t j = j0;
#if KVPIPE_AVX2
  const int64_t Dw = D & ~int64_t{7};
  if (Dw > 0) {
    for (; j + 4 <= j1; j += 4) {
      const typename Stored<T>::type* r = k + j * stride;
      if (next != nullptr)
        for (int64_t i = 0; i < 4; ++i) prefetch_row(next + (j + i) * stride, D);
      __m256 a[NH][4];
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[h][i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < Dw; d += 8) {
        __m256 qv[NH];
#pragma GCC unroll 16
        for (int h = 0; h < NH; ++h) qv[h] = _mm256_loadu_ps(q + h * q_stride + d);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256 kv = load8<T>(r + i * stride + d);
#pragma GCC unroll 16
          for (int h = 0; h < NH; ++h) a[h][i] = _mm256_fmadd_ps(qv[h], kv, a[h][i]);
        }
      }
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) {
        float* sh = s + h * s_stride + j;
        _mm_storeu_ps(sh, lane_sums(a[h][0], a[h][1], a[h][2], a[h][3]));
        const float* qh = q + h * q_stride;
        for (int64_t d = Dw; d < D; ++d)
          for (int64_t i = 0; i < 4; ++i) sh[i] += qh[d] * to_float<T>(r[i * stride + d]);
      }
    }
  }
#endif
  for (; j < j1; ++j) {
    if (next != nullptr) prefetch_row(next + j * stride, D);
    for (int h = 0; h < NH; ++h) s[h * s_stride + j] = dot_stored<T, DK>(q + h * q_stride, k + j * stride, D);
  }
}

// acc[h * acc_stride + c] += sum over j in [j0, j1) of p[h * p_stride + j] * v[j][c], c < n (or
// DV), for NH heads; fp32 value rows `stride` floats apart. With AVX2 + FMA, 32 columns at a time
// for the NH heads in NH x 4 accumulators held in registers over all the keys (each value vector
// loaded once for the NH heads), then 8 columns at a time; the columns left over row by row.
template <KV T, int DV, int NH>
inline void accumulate_heads(const float* p, int64_t p_stride, const typename Stored<T>::type* v, int64_t stride,
                             int64_t j0, int64_t j1, int64_t n, float* acc, int64_t acc_stride,
                             const typename Stored<T>::type* next) {
  const int64_t Dv = DV > 0 ? DV : n;
  const typename Stored<T>::type* pf = next;  // asked for row by row in the first pass over the keys
  int64_t d = 0;
#if KVPIPE_AVX2
  for (; d + 32 <= Dv; d += 32) {
    __m256 a[NH][4];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[h][i] = _mm256_loadu_ps(acc + h * acc_stride + d + 8 * i);
    for (int64_t j = j0; j < j1; ++j) {
      if (pf != nullptr) prefetch_row(pf + j * stride, Dv);
      __m256 pv[NH];
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) pv[h] = _mm256_broadcast_ss(p + h * p_stride + j);
      const typename Stored<T>::type* r = v + j * stride + d;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 vv = load8<T>(r + 8 * i);
#pragma GCC unroll 16
        for (int h = 0; h < NH; ++h) a[h][i] = _mm256_fmadd_ps(pv[h], vv, a[h][i]);
      }
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + h * acc_stride + d + 8 * i, a[h][i]);
    pf = nullptr;
  }
  for (; d + 8 <= Dv; d += 8) {
    __m256 a[NH];
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h) a[h] = _mm256_loadu_ps(acc + h * acc_stride + d);
    for (int64_t j = j0; j < j1; ++j) {
      if (pf != nullptr) prefetch_row(pf + j * stride, Dv);
      const __m256 vv = load8<T>(v + j * stride + d);
#pragma GCC unroll 16
      for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * p_stride + j), vv, a[h]);
    }
#pragma GCC unroll 16
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(acc + h * acc_stride + d, a[h]);
    pf = nullptr;
  }
#endif
  if (d < Dv) {
    for (int h = 0; h < NH; ++h) {
      float* ah = acc + h * acc_stride;
      for (int64_t j = j0; j < j1; ++j) {
        if (pf != nullptr) prefetch_row(pf + j * stride, Dv);
        const float pj = p[h * p_stride + j];
        const typename Stored<T>::type* r = v + j * stride;
#pragma omp simd
        for (int64_t c = d; c < Dv; ++c) ah[c] += pj * to_float<T>(r[c]);
      }
      pf = nullptr;
    }
  }
}

// One page's scores for the G query heads: kHeadBlock at a time, then the 1 or 2 left over.
// q [G, D] fp32; k: the page's key rows (stored type U), `stride` apart; s [G, P]; next: the
// next page's key rows to ask for, or nullptr.
template <KV U, int DK>
inline void page_scores(int64_t G, const float* q, int64_t D, const typename Stored<U>::type* k, int64_t stride,
                        int64_t j0, int64_t j1, float* s, int64_t P, const typename Stored<U>::type* next) {
  int64_t g = 0;
  for (; g + kHeadBlock <= G; g += kHeadBlock, next = nullptr)  // ask once, in the first head block
    score_heads<U, DK, kHeadBlock>(q + g * D, D, k, stride, j0, j1, D, s + g * P, P, next);
  if (G - g == 2) score_heads<U, DK, 2>(q + g * D, D, k, stride, j0, j1, D, s + g * P, P, next);
  if (G - g == 1) score_heads<U, DK, 1>(q + g * D, D, k, stride, j0, j1, D, s + g * P, P, next);
}

// acc[g] += sum over the page's keys j of p[g, j] * v[j], for the G heads; p [G, P]; acc [G, Dv].
template <KV U, int DV>
inline void page_values(int64_t G, const float* p, int64_t P, const typename Stored<U>::type* v, int64_t stride,
                        int64_t j0, int64_t j1, int64_t Dv, float* acc, const typename Stored<U>::type* next) {
  int64_t g = 0;
  for (; g + kHeadBlock <= G; g += kHeadBlock, next = nullptr)
    accumulate_heads<U, DV, kHeadBlock>(p + g * P, P, v, stride, j0, j1, Dv, acc + g * Dv, Dv, next);
  if (G - g == 2) accumulate_heads<U, DV, 2>(p + g * P, P, v, stride, j0, j1, Dv, acc + g * Dv, Dv, next);
  if (G - g == 1) accumulate_heads<U, DV, 1>(p + g * P, P, v, stride, j0, j1, Dv, acc + g * Dv, Dv, next);
}

struct Shapes {
  int64_t batch, q_heads, kv_heads, group, head_dim, v_dim, page_size, num_pages;
  int64_t k_page, k_head, k_tok;  // element strides of k
  int64_t v_page, v_head, v_tok;  // element strides of v
  bool v_in_k;                    // v is a prefix view of k (MLA's latent pages): same rows
  int64_t window;                 // <= 0: no window
  float scale;
  float k_scale, v_scale;  // the pool's scales times kv_factor
};

// Per-thread scratch, sized once per parallel chunk. kt, vt: one page's key and value rows
// converted to fp32 (pools other than fp32 with more than kHeadBlock query heads per KV head
// only), [P, D] and [P, Dv], 16 KiB each at P = D = 64.
struct Scratch {
  std::vector<float> q, acc, m, l, s, kt, vt;
  Scratch(const Shapes& sh, bool convert)
      : q(sh.group * sh.head_dim), acc(sh.group * sh.v_dim), m(sh.group), l(sh.group),
        s(sh.group * sh.page_size), kt(convert ? sh.page_size * sh.head_dim : 0),
        vt(convert && !sh.v_in_k ? sh.page_size * sh.v_dim : 0) {}
};

// One (row b, KV head h) task: its G query heads over the keys [lo, len) of row b, page by page.
// q [B, Hq, D] fp32 contiguous; pages [B, n]; out [B, Hq, Dv] fp32 contiguous; sinks [Hq] fp32 or null.
// A page's key rows are scored kHeadBlock query heads at a time (the page stays in L1 for the next
// block), then its values accumulated the same way.
template <KV T, int DK, int DV>
void decode_task(const Shapes& sh, int64_t b, int64_t h, const float* q, const typename Stored<T>::type* k,
                 const typename Stored<T>::type* v, const int64_t* pages, int64_t len, int64_t key_start,
                 const float* sinks, float* out, Scratch& w) {
  using S = typename Stored<T>::type;
  const int64_t G = sh.group, P = sh.page_size;
  // DK, DV > 0: head dims fixed at compile time, so the inner loops unroll into registers
  const int64_t D = DK > 0 ? DK : sh.head_dim, Dv = DV > 0 ? DV : sh.v_dim;
  const float qscale = sh.scale * sh.k_scale;  // scores = (q . stored key) * scale * k_scale
  for (int64_t g = 0; g < G; ++g) {
    const float* qrow = q + (b * sh.q_heads + h * G + g) * D;
    float* qf = w.q.data() + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) qf[d] = qrow[d] * qscale;
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);

  const int64_t lo = sh.window > 0 ? std::max(key_start, len - sh.window) : key_start;
  if (len > lo) {
    const int64_t first = (lo - key_start) / P;
    const int64_t last = std::min((len - 1 - key_start) / P, sh.num_pages - 1);
    for (int64_t pi = first; pi <= last; ++pi) {
      const int64_t page = pages[b * sh.num_pages + pi], base = key_start + pi * P;
      const int64_t j0 = std::max<int64_t>(lo - base, 0), j1 = std::min<int64_t>(len - base, P);
      const S* kp = k + page * sh.k_page + h * sh.k_head;
      const S* vp = v + page * sh.v_page + h * sh.v_head;
      // the same rows of the next page, asked for while this one is computed (nullptr on the
      // last page; a window's first page starts at j0 > 0 and leaves the next page's first rows
      // unasked: they are read on demand)
      const S *kn = nullptr, *vn = nullptr;
      if (pi < last) {
        const int64_t next = pages[b * sh.num_pages + pi + 1];
        kn = k + next * sh.k_page + h * sh.k_head;
        vn = sh.v_in_k ? nullptr : v + next * sh.v_page + h * sh.v_head;
      }
      // Up to kHeadBlock query heads (one head block) read each stored row once: the loops
      // convert in registers as they load. More heads would convert each row once per block:
      // then the page's rows are converted once into the fp32 tiles kt / vt and read from there.
      const bool tiles = T != KV::F32 && G > kHeadBlock;
      const float *kf = nullptr, *vf = nullptr;
      int64_t v_stride = Dv;
      if (tiles) {
        float* kt = w.kt.data();
        for (int64_t j = j0; j < j1; ++j) {
          if (kn != nullptr) prefetch_row(kn + j * sh.k_tok, D);
          convert_row<T>(kp + j * sh.k_tok, kt + j * D, D);
        }
        kf = kt;
        if (sh.v_in_k) {  // MLA: the values are the first Dv numbers of the rows just converted
          vf = kt, v_stride = D;
        } else {
          float* vt = w.vt.data();
          for (int64_t j = j0; j < j1; ++j) {
            if (vn != nullptr) prefetch_row(vn + j * sh.v_tok, Dv);
            convert_row<T>(vp + j * sh.v_tok, vt + j * Dv, Dv);
          }
          vf = vt;
        }
        page_scores<KV::F32, DK>(G, w.q.data(), D, kf, D, j0, j1, w.s.data(), P, nullptr);
      } else {
        page_scores<T, DK>(G, w.q.data(), D, kp, sh.k_tok, j0, j1, w.s.data(), P, kn);
      }
      // online softmax: rescale what was accumulated to the new running max
      for (int64_t g = 0; g < G; ++g) {
        float* sg = w.s.data() + g * P;
        float mx = w.m[g];
        // written as a comparison GCC vectorises (std::max's reduction stays scalar here)
#pragma omp simd reduction(max : mx)
        for (int64_t j = j0; j < j1; ++j) mx = sg[j] > mx ? sg[j] : mx;
        const float alpha = exp_nonpositive(w.m[g] - mx);  // 0 on the first page (m = -inf)
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j0; j < j1; ++j) {
          sg[j] = exp_nonpositive(sg[j] - mx);
          sum += sg[j];
        }
        w.l[g] = w.l[g] * alpha + sum;
        w.m[g] = mx;
        if (alpha != 1.0f) {
          float* ag = w.acc.data() + g * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) ag[d] *= alpha;
        }
      }
      // acc[g] += p[g, j] * v[j]
      if (tiles)
        page_values<KV::F32, DV>(G, w.s.data(), P, vf, v_stride, j0, j1, Dv, w.acc.data(), nullptr);
      else
        page_values<T, DV>(G, w.s.data(), P, vp, sh.v_tok, j0, j1, Dv, w.acc.data(), vn);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float l = w.l[g], alpha = 1.0f;
    if (sinks != nullptr) {  // the sink joins the max and the denominator, and adds no value
      const float sink = sinks[h * G + g], mx = std::max(w.m[g], sink);
      alpha = exp_nonpositive(w.m[g] - mx);
      l = l * alpha + exp_nonpositive(sink - mx);
    }
    const float f = l > 0.0f ? alpha / l * sh.v_scale : 0.0f;  // no key and no sink: zeros, not NaN
    const float* ag = w.acc.data() + g * Dv;
    float* orow = out + (b * sh.q_heads + h * G + g) * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) orow[d] = ag[d] * f;
  }
}

void check_pool(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.dim() == 4, name, " must be [num_pages, kv_heads, page_size, dim]");
  TORCH_CHECK(t.stride(3) == 1, name, "'s last dim must be contiguous");
}

template <KV T>
void run_tasks(const Shapes& sh, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const int64_t* pages_p, const int64_t* lens_p, const int64_t* start_p, const float* sinks_p,
               at::Tensor& out) {
  using S = typename Stored<T>::type;
  const float* q_p = q.data_ptr<float>();
  const S* k_p = static_cast<const S*>(k.data_ptr());
  const S* v_p = static_cast<const S*>(v.data_ptr());
  float* out_p = out.data_ptr<float>();
  // one task per (row, KV head); at::parallel_for honours torch's intra-op thread count
  at::parallel_for(0, sh.batch * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w(sh, T != KV::F32 && sh.group > kHeadBlock);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / sh.kv_heads, h = t % sh.kv_heads;
      if (sh.head_dim == 64 && sh.v_dim == 64)
        decode_task<T, 64, 64>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
      else if (sh.head_dim == 128 && sh.v_dim == 128)
        decode_task<T, 128, 128>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
      else
        decode_task<T, 0, 0>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
    }
  });
}

// q [B, Hq, D] (any float dtype); k [N, Hkv, P, D]; v [N, Hkv, P, Dv] (one of the five pool
// dtypes, the same for both); pages [B, n] int64; lens, key_start [B] int64; window <= 0 for none;
// sinks [Hq] or None; k_scale, v_scale: the pool's (1.0 unless fp8) -> [B, Hq, Dv] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& pages_in, const at::Tensor& lens_in,
                        const at::Tensor& key_start_in, int64_t window,
                        const c10::optional<at::Tensor>& sinks_in, double scale, double k_scale,
                        double v_scale) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.dim() == 3, "q must be a [B, Hq, D] CPU tensor");
  check_pool(k, "k");
  check_pool(v, "v");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(pages_in.dim() == 2 && pages_in.size(0) == q_in.size(0), "pages must be [B, n]");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2),
              "k and v must have the same pages, heads and page size");
  TORCH_CHECK(k.size(3) == q_in.size(2), "q and k head dims differ");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor pages = pages_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const at::Tensor key_start = key_start_in.to(at::kLong).contiguous();
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == q.size(1), "sinks must be [Hq]");
  }

  Shapes sh{};
  sh.batch = q.size(0);
  sh.q_heads = q.size(1);
  sh.kv_heads = k.size(1);
  TORCH_CHECK(sh.q_heads % sh.kv_heads == 0, "query heads must be a multiple of KV heads");
  sh.group = sh.q_heads / sh.kv_heads;
  sh.head_dim = q.size(2);
  sh.v_dim = v.size(3);
  sh.page_size = k.size(2);
  sh.num_pages = pages.size(1);
  sh.k_page = k.stride(0), sh.k_head = k.stride(1), sh.k_tok = k.stride(2);
  sh.v_page = v.stride(0), sh.v_head = v.stride(1), sh.v_tok = v.stride(2);
  sh.v_in_k = v.data_ptr() == k.data_ptr() && sh.v_page == sh.k_page && sh.v_head == sh.k_head &&
              sh.v_tok == sh.k_tok && sh.v_dim <= sh.head_dim;
  sh.window = window;
  sh.scale = static_cast<float>(scale);

  at::Tensor out = at::empty({sh.batch, sh.q_heads, sh.v_dim}, q.options());
  const int64_t* pages_p = pages.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* start_p = key_start.data_ptr<int64_t>();
  const float* sinks_p = sinks.defined() ? sinks.data_ptr<float>() : nullptr;

  auto run = [&](auto tag) {
    constexpr KV T = decltype(tag)::value;
    sh.k_scale = static_cast<float>(k_scale) * kv_factor<T>();
    sh.v_scale = static_cast<float>(v_scale) * kv_factor<T>();
    run_tasks<T>(sh, q, k, v, pages_p, lens_p, start_p, sinks_p, out);
  };
  switch (k.scalar_type()) {
    case at::ScalarType::Float: run(std::integral_constant<KV, KV::F32>{}); break;
    case at::ScalarType::BFloat16: run(std::integral_constant<KV, KV::BF16>{}); break;
    case at::ScalarType::Half: run(std::integral_constant<KV, KV::F16>{}); break;
    case at::ScalarType::Float8_e4m3fn: run(std::integral_constant<KV, KV::E4M3>{}); break;
    case at::ScalarType::Float8_e5m2: run(std::integral_constant<KV, KV::E5M2>{}); break;
    default: TORCH_CHECK(false, "unsupported KV pool dtype ", k.scalar_type());
  }
  return q_in.scalar_type() == at::kFloat ? out : out.to(q_in.scalar_type());
}

}  // namespace

// decode_layer.cpp compiles this file's kernels into its own extension: without a module of their own
#ifndef KVPIPE_KERNELS_NO_MODULE
// Every call releases the GIL while it runs (it touches no Python object). Holding it, a decode
// step left the server's other threads (the event loop streaming a first token, the transfer
// threads) only the gaps between kernel calls, each wait up to a switch interval (5 ms) long.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over KV pages read in place",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("pages"),
        pybind11::arg("lens"), pybind11::arg("key_start"), pybind11::arg("window"),
        pybind11::arg("sinks"), pybind11::arg("scale"), pybind11::arg("k_scale") = 1.0,
        pybind11::arg("v_scale") = 1.0);
}
#endif  // KVPIPE_KERNELS_NO_MODULE
