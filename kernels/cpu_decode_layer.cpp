// One decoder layer of a CPU decode step as one operator call: the model's eager layer (runtime/models/
// llama.py, `DecoderLayer.forward` on its fused CPU path: bf16 / fp16, or a quantized fp32 model) op for
// op, called from C++.
//
// Why: at batch 1 a layer is ~16 small operator calls, and each one made from Python costs a few
// microseconds of argument parsing and dispatch; over 30 layers that was about a third of the bundled
// model's decode step once the weight reads got fast (measured: 6.1 -> 4.3 ms, median of three). Here
// the same operators run through the dispatcher (handles looked up once) in the same order on the same
// tensors, so the values are the eager layer's, bit for bit (tests/kernels/test_cpu_decode_layer.py
// compares every layer's outputs and the pool).
//
//   decode_layer(x [T, H], residual? [T, H], in_norm [H], post_norm [H], eps,
//                qkv, qkv_bias?, o, gate_up, down, dense_min_rows, nq, nkv, head_dim,
//                positions [T], cos, sin_signed, rows, key_rows, lens, k_offset, v_offset, scale, new_rows)
//       -> (mlp_out [T, H], residual [T, H])
// Each projection is [weight] (a plain linear: at::linear) or [dense, packed] (w4a16: pdserve's
// int4_linear (int4_linear_a8 where act8: w4a8) below dense_min_rows rows, else at::linear on the dense copy, or where the dense tensor is
// empty (no copy kept) the weights dequantized into a scratch and multiplied, as Int4WeightOnlyLinear does).
// The attention is paged_decode_attention_store: this layer's new K and V stored, then attended.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cpu_rows.h"

#include <c10/util/Optional.h>

#include <tuple>

namespace {

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

using Opt = c10::optional<at::Tensor>;

at::Tensor project(const at::Tensor& x, at::TensorList w, const Opt& bias, int64_t dense_min_rows, bool act8) {
  static const auto int4_w = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Opt&)>(
      "pdserve_cpu::int4_linear");
  static const auto int4_a8 = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Opt&)>(
      "pdserve_cpu::int4_linear_a8");
  const auto& int4 = act8 ? int4_a8 : int4_w;
  static const auto unpack = op<void(const at::Tensor&, at::Tensor&)>("pdserve_cpu::int4_unpack_t_");
  PDSERVE_CHECK(w.size() == 1 || w.size() == 2, "decode_layer: a projection is [weight] or [dense, packed]");
  if (w.size() == 1) return at::linear(x, w[0], bias);
  const int64_t n = w[1].size(0) * 16, k = w[1].size(1) * 32;  // packed [N/16, K/32, 320]
  if (x.size(0) < dense_min_rows) return int4.call(x, w[1], n, bias);
  if (w[0].numel() > 0) return at::linear(x, w[0], bias);
  at::Tensor w_t = at::empty({k, n}, x.options().dtype(at::kFloat));
  unpack.call(w[1], w_t);
  at::Tensor y = at::matmul(x.to(at::kFloat), w_t).to(x.scalar_type());
  return bias.has_value() && bias->defined() ? y.add_(*bias) : y;
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const Opt& residual_in, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
    at::TensorList qkv_w, const Opt& qkv_bias, at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
    int64_t dense_min_rows, int64_t nq, int64_t nkv, int64_t hd, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin_signed, at::Tensor& rows, const at::Tensor& key_rows, const at::Tensor& lens,
    int64_t k_offset, int64_t v_offset, double scale, const at::Tensor& new_rows, bool act8) {
  static const auto rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("pdserve_cpu::rms_norm");
  static const auto add_rms_norm =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "pdserve_cpu::add_rms_norm");
  static const auto rotary =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("pdserve_cpu::rotary_");
  static const auto attend =
      op<at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&)>("pdserve_cpu::paged_decode_attention_store");
  static const auto silu_and_mul = op<at::Tensor(const at::Tensor&)>("pdserve_cpu::silu_and_mul");
  PDSERVE_CHECK(x.dim() == 2, "decode_layer: x must be [T, hidden]");
  const int64_t T = x.size(0);

  at::Tensor h, residual;
  if (residual_in.has_value() && residual_in->defined()) {
    std::tie(h, residual) = add_rms_norm.call(x, *residual_in, in_norm, eps);
  } else {  // the first layer: its input is the stream
    residual = x;
    h = rms_norm.call(x, in_norm, eps);
  }
  const at::Tensor qkv = project(h, qkv_w, qkv_bias, dense_min_rows, act8);  // [T, (nq + 2 nkv) hd]
  auto parts = qkv.split({nq * hd, nkv * hd, nkv * hd}, -1);
  const at::Tensor q = parts[0].view({T, nq, hd}), k = parts[1].view({T, nkv, hd}), v = parts[2].view({T, nkv, hd});
  // q and k lie side by side in qkv, a fresh tensor: one rotation in place covers both
  rotary.call(qkv.slice(1, 0, (nq + nkv) * hd).view({T, -1, hd}), positions, cos, sin_signed);
  const at::Tensor attn = attend.call(q, rows, key_rows, lens, k_offset, v_offset, scale, new_rows, k, v);
  const at::Tensor y = project(attn.reshape({T, nq * hd}), o_w, c10::nullopt, dense_min_rows, act8);
  std::tie(h, residual) = add_rms_norm.call(y, residual, post_norm, eps);
  const at::Tensor gate_up = project(h, gate_up_w, c10::nullopt, dense_min_rows, act8);
  return {project(silu_and_mul.call(gate_up), down_w, c10::nullopt, dense_min_rows, act8), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? residual, Tensor in_norm, Tensor post_norm, float eps, Tensor[] qkv, "
      "Tensor? qkv_bias, Tensor[] o, Tensor[] gate_up, Tensor[] down, int dense_min_rows, int nq, int nkv, "
      "int head_dim, Tensor positions, Tensor cos, Tensor sin_signed, Tensor(a!) rows, Tensor key_rows, "
      "Tensor lens, int k_offset, int v_offset, float scale, Tensor new_rows, bool act8=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
