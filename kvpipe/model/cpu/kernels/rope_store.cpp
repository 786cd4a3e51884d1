// RoPE of an attention layer's q and k and the store of its new k and v into the paged pool, in
// one call (fp32 model and pool, or bf16 model and pool): what gqa_attention.py does with apply_rope and
// KVPool.write in about fifteen torch calls per layer (views, a negation, a concatenation, three
// elementwise ops per rotation, two advanced-index writes). At batch 1 a decode step is bound by
// such per-call costs (docs/benchmarks.md, issue 31).
//
// Same bits as the torch path: rotate_half RoPE is out = x * cos + rotate_half(x) * sin with
// rotate_half(x) = cat(-x[half:], x[:half]); each product and the sum are rounded once, as torch's
// separate elementwise kernels round them (contraction into fused multiply-adds is switched off
// below), and the stores are plain copies.
//
// qkv [T, (Hq + 2 Hkv) D] (q heads, then k heads, then v heads); cos, sin [T, D]; k_pool, v_pool
// [num_pages, Hkv, P, D] (any strides of the first three dims, the last contiguous); pages,
// offsets [T] int64: the page and the slot in it of each token's K/V.
// Returns [T, Hq + Hkv, D]: the rotated q heads, then the rotated k heads.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

void check_pool(const at::Tensor& pool, at::ScalarType dtype, const char* name, int64_t hkv, int64_t d) {
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == dtype && pool.dim() == 4, name,
              " must be a CPU [num_pages, Hkv, P, D] tensor of qkv's dtype");
  TORCH_CHECK(pool.size(1) == hkv && pool.size(3) == d && pool.stride(3) == 1, name,
              ": Hkv and D must match, the last dim contiguous");
}

// T's rounding of an fp32 result: none for fp32; bf16 rounds to nearest even, as each of torch's
// bf16 elementwise kernels does (it computes in fp32 and rounds its output)
inline float round_to(float v, float*) { return v; }
inline float round_to(float v, at::BFloat16*) { return static_cast<float>(at::BFloat16(v)); }

// one head: o[i] = x[i] * c[i] + r[i] * s[i], r = rotate_half(x); each product and the sum
// rounded to T (cos and sin are in T already)
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* o, int64_t d) {
  T* tag = nullptr;
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = round_to(static_cast<float>(x[i]) * static_cast<float>(c[i]), tag);
    const float b = round_to(-static_cast<float>(x[i + half]) * static_cast<float>(s[i]), tag);
    o[i] = static_cast<T>(round_to(a + b, tag));
  }
  for (int64_t i = half; i < d; ++i) {
    const float a = round_to(static_cast<float>(x[i]) * static_cast<float>(c[i]), tag);
    const float b = round_to(static_cast<float>(x[i - half]) * static_cast<float>(s[i]), tag);
    o[i] = static_cast<T>(round_to(a + b, tag));
  }
}

template <typename T>
void rope_store_as(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                   at::Tensor& v_pool, const at::Tensor& pages, const at::Tensor& offsets, int64_t hq, int64_t hkv,
                   at::Tensor& out) {
  const int64_t d = k_pool.size(3), t_n = qkv.size(0), width = (hq + 2 * hkv) * d;
  const int64_t num_pages = k_pool.size(0), page = k_pool.size(2);
  const T* x = qkv.data_ptr<T>();
  const T *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
  const int64_t *pg = pages.data_ptr<int64_t>(), *off = offsets.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  T *kp = k_pool.data_ptr<T>(), *vp = v_pool.data_ptr<T>();
  for (int64_t t = 0; t < t_n; ++t) {
    TORCH_CHECK(pg[t] >= 0 && pg[t] < num_pages && off[t] >= 0 && off[t] < page, "slot outside the pool");
    const T* xt = x + t * width;
    T* ot = o + t * (hq + hkv) * d;
    for (int64_t h = 0; h < hq + hkv; ++h) rotate(xt + h * d, c + t * d, s + t * d, ot + h * d, d);
    for (int64_t h = 0; h < hkv; ++h) {
      T* kd = kp + pg[t] * k_pool.stride(0) + h * k_pool.stride(1) + off[t] * k_pool.stride(2);
      T* vd = vp + pg[t] * v_pool.stride(0) + h * v_pool.stride(1) + off[t] * v_pool.stride(2);
      std::memcpy(kd, ot + (hq + h) * d, d * sizeof(T));
      std::memcpy(vd, xt + (hq + hkv + h) * d, d * sizeof(T));
    }
  }
}

// qkv, cos, sin and both pools all float32, or all bfloat16 (a --dtype bfloat16 model with its
// bf16 pool: the bits of torch's bf16 elementwise ops)
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                      at::Tensor v_pool, const at::Tensor& pages, const at::Tensor& offsets, int64_t hq,
                      int64_t hkv) {
  const at::ScalarType dtype = qkv.scalar_type();
  const int64_t d = k_pool.size(3), t_n = qkv.size(0), width = (hq + 2 * hkv) * d;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "qkv must be float32 or bfloat16");
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == width,
              "qkv must be a contiguous [T, (Hq + 2 Hkv) D] tensor");
  TORCH_CHECK(d % 2 == 0, "the head dim must be even");
  check_pool(k_pool, dtype, "k_pool", hkv, d);
  check_pool(v_pool, dtype, "v_pool", hkv, d);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->dim() == 2 && t->size(0) == t_n &&
                    t->size(1) == d,
                "cos and sin must be contiguous [T, D] in qkv's dtype");
  for (const at::Tensor* t : {&pages, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == t_n,
                "pages and offsets must be contiguous int64 [T]");
  at::Tensor out = at::empty({t_n, hq + hkv, d}, qkv.options());
  if (dtype == at::kFloat)
    rope_store_as<float>(qkv, cos, sin, k_pool, v_pool, pages, offsets, hq, hkv, out);
  else
    rope_store_as<at::BFloat16>(qkv, cos, sin, k_pool, v_pool, pages, offsets, hq, hkv, out);
  return out;
}

}  // namespace

#pragma GCC pop_options

// decode_layer.cpp compiles this file's kernels into its own extension: without a module of their own
#ifndef KVPIPE_KERNELS_NO_MODULE
// Every call releases the GIL while it runs (it touches no Python object). Holding it, a decode
// step left the server's other threads (the event loop streaming a first token, the transfer
// threads) only the gaps between kernel calls, each wait up to a switch interval (5 ms) long.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_store", &rope_store, "RoPE of q and k, and k and v stored into the paged pool",
        pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("qkv"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_pool"), pybind11::arg("v_pool"),
        pybind11::arg("pages"), pybind11::arg("offsets"), pybind11::arg("hq"), pybind11::arg("hkv"));
}
#endif  // KVPIPE_KERNELS_NO_MODULE
