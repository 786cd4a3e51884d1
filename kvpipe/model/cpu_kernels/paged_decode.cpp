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

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

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

// Rows [j0, j1) of a page (row stride `stride` elements) as fp32: the pool itself when it already
// is (then rows keep `stride`), else converted into buf with stride n.
template <typename scalar_t>
inline const float* page_as_float(const scalar_t* page, int64_t stride, int64_t j0, int64_t j1, int64_t n,
                                  float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return page;
  } else {
    for (int64_t j = j0; j < j1; ++j) {
      const scalar_t* row = page + j * stride;
      float* out = buf + j * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(row[i]);
    }
    return buf;
  }
}

struct Shapes {
  int64_t batch, q_heads, kv_heads, group, head_dim, v_dim, page_size, num_pages;
  int64_t k_page, k_head, k_tok;  // element strides of k
  int64_t v_page, v_head, v_tok;  // element strides of v
  int64_t window;                 // <= 0: no window
  float scale;
};

// Per-thread scratch, sized once per parallel chunk.
struct Scratch {
  std::vector<float> q, acc, m, l, s, page;
  explicit Scratch(const Shapes& sh)
      : q(sh.group * sh.head_dim), acc(sh.group * sh.v_dim), m(sh.group), l(sh.group),
        s(sh.group * sh.page_size), page(sh.page_size * std::max(sh.head_dim, sh.v_dim)) {}
};

// One (row b, KV head h) task: its G query heads over the keys [lo, len) of row b.
// q [B, Hq, D] contiguous; pages [B, n]; out [B, Hq, Dv] contiguous; sinks [Hq] fp32 or null.
template <typename scalar_t, int DK, int DV>
void decode_task(const Shapes& sh, int64_t b, int64_t h, const scalar_t* q, const scalar_t* k,
                 const scalar_t* v, const int64_t* pages, int64_t len, int64_t key_start,
                 const float* sinks, scalar_t* out, Scratch& w) {
  const int64_t G = sh.group, P = sh.page_size;
  // DK, DV > 0: head dims fixed at compile time, so the inner loops unroll into registers
  const int64_t D = DK > 0 ? DK : sh.head_dim, Dv = DV > 0 ? DV : sh.v_dim;
  for (int64_t g = 0; g < G; ++g) {
    const scalar_t* qrow = q + (b * sh.q_heads + h * G + g) * D;
    float* qf = w.q.data() + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qrow[d]) * sh.scale;
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
      const scalar_t* kp = k + page * sh.k_page + h * sh.k_head;
      const scalar_t* vp = v + page * sh.v_page + h * sh.v_head;
      // scores s[g, j] for the page's keys in range; each key row is read once for G heads
      const float* kf = page_as_float(kp, sh.k_tok, j0, j1, D, w.page.data());  // rows j0..j1, kst apart
      const int64_t kst = std::is_same_v<scalar_t, float> ? sh.k_tok : D;
      for (int64_t g = 0; g < G; ++g) {  // one query head at a time: it stays in registers, the page in L1
        const float* qg = w.q.data() + g * D;
        float* sg = w.s.data() + g * P;
        for (int64_t j = j0; j < j1; ++j) sg[j] = dot<DK>(qg, kf + j * kst, D);
      }
      // online softmax: rescale what was accumulated to the new running max
      for (int64_t g = 0; g < G; ++g) {
        float* sg = w.s.data() + g * P;
        float mx = w.m[g];
        for (int64_t j = j0; j < j1; ++j) mx = std::max(mx, sg[j]);
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
      const float* vf = page_as_float(vp, sh.v_tok, j0, j1, Dv, w.page.data());
      const int64_t vst = std::is_same_v<scalar_t, float> ? sh.v_tok : Dv;
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = w.s.data() + g * P;
        float* ag = w.acc.data() + g * Dv;
        float a[DV > 0 ? DV : 1];  // the accumulator in registers when Dv is fixed
        if constexpr (DV > 0) {
#pragma omp simd
          for (int64_t d = 0; d < DV; ++d) a[d] = ag[d];
          for (int64_t j = j0; j < j1; ++j) {
            const float p = pg[j];
            const float* vr = vf + j * vst;
#pragma omp simd
            for (int64_t d = 0; d < DV; ++d) a[d] += p * vr[d];
          }
#pragma omp simd
          for (int64_t d = 0; d < DV; ++d) ag[d] = a[d];
        } else {
          for (int64_t j = j0; j < j1; ++j) {
            const float p = pg[j];
            const float* vr = vf + j * vst;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) ag[d] += p * vr[d];
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float l = w.l[g], alpha = 1.0f;
    if (sinks != nullptr) {  // the sink joins the max and the denominator, and adds no value
      const float sink = sinks[h * G + g], mx = std::max(w.m[g], sink);
      alpha = exp_nonpositive(w.m[g] - mx);
      l = l * alpha + exp_nonpositive(sink - mx);
    }
    const float f = l > 0.0f ? alpha / l : 0.0f;  // no key and no sink: zeros, not NaN
    const float* ag = w.acc.data() + g * Dv;
    scalar_t* orow = out + (b * sh.q_heads + h * G + g) * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) orow[d] = static_cast<scalar_t>(ag[d] * f);
  }
}

void check_pool(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.dim() == 4, name, " must be [num_pages, kv_heads, page_size, dim]");
  TORCH_CHECK(t.stride(3) == 1, name, "'s last dim must be contiguous");
}

// q [B, Hq, D]; k [N, Hkv, P, D]; v [N, Hkv, P, Dv]; pages [B, n] int64; lens, key_start [B] int64;
// window <= 0 for none; sinks [Hq] or None -> [B, Hq, Dv] in q's dtype.
at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& pages_in, const at::Tensor& lens_in,
                        const at::Tensor& key_start_in, int64_t window,
                        const c10::optional<at::Tensor>& sinks_in, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.dim() == 3, "q must be a [B, Hq, D] CPU tensor");
  check_pool(k, "k");
  check_pool(v, "v");
  TORCH_CHECK(k.scalar_type() == q_in.scalar_type() && v.scalar_type() == q_in.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(pages_in.dim() == 2 && pages_in.size(0) == q_in.size(0), "pages must be [B, n]");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2),
              "k and v must have the same pages, heads and page size");
  TORCH_CHECK(k.size(3) == q_in.size(2), "q and k head dims differ");
  const at::Tensor q = q_in.contiguous();
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
  sh.window = window;
  sh.scale = static_cast<float>(scale);

  at::Tensor out = at::empty({sh.batch, sh.q_heads, sh.v_dim}, q.options());
  const int64_t* pages_p = pages.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  const int64_t* start_p = key_start.data_ptr<int64_t>();
  const float* sinks_p = sinks.defined() ? sinks.data_ptr<float>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = k.data_ptr<scalar_t>();
    const scalar_t* v_p = v.data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    // one task per (row, KV head); at::parallel_for honours torch's intra-op thread count
    at::parallel_for(0, sh.batch * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch w(sh);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / sh.kv_heads, h = t % sh.kv_heads;
        if (sh.head_dim == 64 && sh.v_dim == 64)
          decode_task<scalar_t, 64, 64>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
        else if (sh.head_dim == 128 && sh.v_dim == 128)
          decode_task<scalar_t, 128, 128>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
        else
          decode_task<scalar_t, 0, 0>(sh, b, h, q_p, k_p, v_p, pages_p, lens_p[b], start_p[b], sinks_p, out_p, w);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over KV pages read in place",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("pages"),
        pybind11::arg("lens"), pybind11::arg("key_start"), pybind11::arg("window"),
        pybind11::arg("sinks"), pybind11::arg("scale"));
}
