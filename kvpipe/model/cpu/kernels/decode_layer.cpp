// One call per decoder layer for a decode step (issue 31): a Llama-style pre-norm layer
//   h = x + o_proj(attention(rope(qkv(rms_norm(x)))));  out = h + down(silu(gate) * up)(rms_norm(h))
// run in C++ instead of ~20 Python-level calls (module calls, views, checks, dispatch). At batch 1
// a small model's decode step is bound by such per-call costs once the weights are int8/int4
// (docs/benchmarks.md, issue 31).
//
// Exact by construction: every step is the call the Python path makes, on the same inputs.
// - RMSNorm, the residual adds, silu and the SwiGLU product: the same ATen ops (at::rms_norm is
//   what F.rms_norm calls, at::add / at::silu / at::mul what `+`, F.silu and `*` call);
// - the projections: weight_only.cpp's fp32 panel kernel (panel_weight.py) or its int8 / int4
//   kernels, oneDNN's packed product through the same registered op (mkldnn::_linear_pointwise,
//   packed_linear.py) where the panels are not built, at::linear for a dense weight (F.linear),
//   bf16_panel.cpp's kernel for a bf16 model's pair panels (Bf16PanelWeight);
// - RoPE + K/V store and the paged decode attention: rope_store.cpp's and paged_decode.cpp's
//   functions, compiled into this extension from their own source files (included below, with
//   the same flags), so the same code computes the same bits.
// A bf16 layer (--dtype bfloat16) runs the same ops on bf16 tensors, each rounding its output to
// bf16 as in the module path; its RMSNorm is norms.py's bf16 form (fp32 statistics, rounded, then
// the weight). tests/unit/test_decode_layer.py (fp32) and test_decode_layer_bf16.py check the
// outputs and the pool bit for bit against the module path.
//
// What a layer must be to take this path is decided in Python (model/cpu/fused_decode.py): fp32
// (or bf16) weights and activations, a pool of that dtype, q/k/v and gate/up fused, no biases,
// no q/k norms, no window or sinks, full rotary dims, TP 1.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// The kernels, each in a namespace of its own (their helpers share names); every header they
// include is included above, so their #includes are no-ops here.
#define KVPIPE_KERNELS_NO_MODULE 1
namespace weight_only {
#include "weight_only.cpp"
}
namespace rope_store {
#include "rope_store.cpp"
}
namespace paged_decode {
#include "paged_decode.cpp"
}
namespace bf16_panel {
#include "bf16_panel.cpp"
}

namespace {

// How a projection's weight is held (model/layers/linear.py): dense fp32, oneDNN-packed fp32, int8
// with row scales, int4 groups (model/quant/weights.py), fp32 column panels (panel_weight.py),
// int8 and int4 codes in column panels with their scales, bf16 pair panels (a bf16 model)
enum class Kind : int64_t {
  Dense = 0,
  Packed = 1,
  Int8 = 2,
  Int4 = 3,
  Panel = 4,
  Int8Panel = 5,
  Int4Panel = 6,
  Bf16Panel = 7
};

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  // the op packed_linear.py calls, through the dispatcher as Python's torch.ops does
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(c10::IValue());  // no bias
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));  // no algorithm, as packed_linear.py passes it
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

struct Proj {
  Kind kind;
  // Dense/Packed: w; Int8: w = q, a = scale; Int4: w = codes, a = scale, b = minimum; Panel and
  // Bf16Panel: w = panels, n = the output features; Int8Panel: w = codes, a = scale, n; Int4Panel:
  // w = codes, a = scale, b = minimum, n
  at::Tensor w, a, b;
  int64_t n;

  at::Tensor operator()(const at::Tensor& x) const {  // x [T, in] fp32 (bf16) -> [T, out] fp32 (bf16)
    switch (kind) {
      case Kind::Dense: return at::linear(x, w);
      case Kind::Packed: return packed_linear(x, w);
      case Kind::Int8: return weight_only::int8_linear(x, w, a);
      case Kind::Int4: return weight_only::int4_linear(x, w, a, b);
      case Kind::Panel: return weight_only::f32_panel_linear(x, w, n);
      case Kind::Int8Panel: return weight_only::int8_panel_linear(x, w, a, n);
      case Kind::Int4Panel: return weight_only::int4_panel_linear(x, w, a, b, n);
      case Kind::Bf16Panel: return bf16_panel::bf16_panel_linear(x, w, n);
    }
    TORCH_CHECK(false, "unknown projection kind");
  }
};

// (kind, w, a, b, n): n the output features of a Panel projection, 0 for the others
using ProjSpec = std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t>;

Proj make_proj(const ProjSpec& s) {
  const int64_t kind = std::get<0>(s);
  TORCH_CHECK(kind >= 0 && kind <= 7, "projection kind must be 0..7, got ", kind);
  return Proj{static_cast<Kind>(kind), std::get<1>(s), std::get<2>(s), std::get<3>(s), std::get<4>(s)};
}

// norms.py's RMSNorm of x [T, hidden] with weight w [hidden]: fp32 in one call, the weight inside
// (F.rms_norm); bf16 with fp32 statistics rounded back to bf16, the weight applied after (HF's order)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const std::vector<int64_t> shape{w.size(0)};
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, shape, w, eps);
  return at::mul(w, at::rms_norm(x.to(at::kFloat), shape, std::nullopt, eps).to(x.scalar_type()));
}

class DecodeLayer {
 public:
  DecodeLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, const ProjSpec& qkv, const ProjSpec& o,
              const ProjSpec& gate_up, const ProjSpec& down, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
              int64_t intermediate, double scale)
      : input_norm_(std::move(input_norm)),
        post_norm_(std::move(post_norm)),
        eps_(eps),
        qkv_(make_proj(qkv)),
        o_(make_proj(o)),
        gate_up_(make_proj(gate_up)),
        down_(make_proj(down)),
        hq_(q_heads),
        hkv_(kv_heads),
        d_(head_dim),
        inter_(intermediate),
        scale_(scale) {
    TORCH_CHECK(input_norm_.dim() == 1 && post_norm_.sizes() == input_norm_.sizes(), "norm weights must be [hidden]");
    const at::ScalarType dtype = input_norm_.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && post_norm_.scalar_type() == dtype,
                "norm weights must be float32 or bfloat16, both alike");
  }

  // x [B, hidden] in the norms' dtype, fp32 or bf16 (one new token per row); cos, sin [B, D]; k_pool, v_pool this layer's
  // [num_pages, Hkv, P, D]; slot_pages, slot_offsets [B] where each row's K/V goes; page_table
  // [B, n], lens, key_start [B] (model/forward_batch.py DecodeIndex) -> [B, hidden]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                     const at::Tensor& v_pool, const at::Tensor& slot_pages, const at::Tensor& slot_offsets,
                     const at::Tensor& page_table, const at::Tensor& lens, const at::Tensor& key_start,
                     double k_scale, double v_scale) const {
    TORCH_CHECK(x.scalar_type() == input_norm_.scalar_type(), "x must have the layer's dtype");
    const int64_t t = x.size(0);
    // attention block (decoder_layer.py, gqa_attention.py _forward_fused)
    const at::Tensor qkv = qkv_(rms_norm(x, input_norm_, eps_));
    const at::Tensor qk =
        rope_store::rope_store(qkv, cos, sin, k_pool, v_pool, slot_pages, slot_offsets, hq_, hkv_);  // [B, Hq + Hkv, D]
    const at::Tensor attn = paged_decode::paged_decode(qk.narrow(1, 0, hq_), k_pool, v_pool, page_table, lens,
                                                       key_start, 0, std::nullopt, scale_, k_scale, v_scale);
    const at::Tensor h = at::add(x, o_(attn.reshape({t, hq_ * d_})));
    // MLP block (mlp.py)
    const at::Tensor gu = gate_up_(rms_norm(h, post_norm_, eps_));  // [B, 2 I]
    const at::Tensor act = at::mul(at::silu(gu.narrow(-1, 0, inter_)), gu.narrow(-1, inter_, inter_));
    return at::add(h, down_(act));
  }

 private:
  at::Tensor input_norm_, post_norm_;
  double eps_;
  Proj qkv_, o_, gate_up_, down_;
  int64_t hq_, hkv_, d_, inter_;
  double scale_;
};

}  // namespace

// Every call releases the GIL while it runs (it touches no Python object). Holding it, a decode
// step left the server's other threads (the event loop streaming a first token, the transfer
// threads) only the gaps between kernel calls, each wait up to a switch interval (5 ms) long.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, double, const ProjSpec&, const ProjSpec&, const ProjSpec&,
                          const ProjSpec&, int64_t, int64_t, int64_t, int64_t, double>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("eps"), pybind11::arg("qkv"),
           pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("q_heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("intermediate"),
           pybind11::arg("scale"))
      .def("forward", &DecodeLayer::forward, "one decoder layer's decode step",
           pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_pool"), pybind11::arg("v_pool"),
           pybind11::arg("slot_pages"), pybind11::arg("slot_offsets"), pybind11::arg("page_table"),
           pybind11::arg("lens"), pybind11::arg("key_start"), pybind11::arg("k_scale"), pybind11::arg("v_scale"));
}
