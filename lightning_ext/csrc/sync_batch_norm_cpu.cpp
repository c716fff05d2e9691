// Compiled host glue of lightning_ext.nn.SyncBatchNorm for eager CPU input (the `reference` kernel
// backend's maths, with the per-channel arithmetic in C++ loops instead of NumPy/torch calls).
//
// The Python layer (lightning_ext/nn/sync_batch_norm.py) runs the same computation op for op; this
// file exists because on small CPU layers that computation is dispatch-bound: about 25 host-side
// operations per forward and 20 per backward, each a Python call. Here each direction is two calls
// around the one all_reduce, which stays in Python (lightning_ext.shm_collectives / torch.distributed).
//
// Forward:  pack_moments(x, shift) -> float64 (2C+1,) payload; [all_reduce SUM];
//           forward_finish(...) -> (y, mean, invstd, count): unpack, running statistics, normalize.
// Backward: backward_local(dy, x, mean, invstd, weight) -> (dx_local, sum_dy, sum_dy_xmu, packed);
//           [all_reduce SUM of packed]; backward_finish(...) -> (dx, grad_weight, grad_bias).
//
// Every ATen call is the one the Python path makes, with the same arguments; the per-channel loops
// follow the Python expressions' evaluation order and precision (float64 where NumPy promotes to
// float64, float32 where it stays float32), so both paths give bit-identical results
// (tests/kernels/test_cpu_extension.py checks it).

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// Guards every entry point: no autograd recording (buffers are updated in place; the autograd
// Function around the forward records the graph) and no autocast (the kernels see the input's own
// dtype, as in the Python path, which disables autocast around them).
struct Guards {
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

at::ScalarType stat_type(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::MemoryFormat memory_format(const Tensor& x) {
  if (x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return at::MemoryFormat::ChannelsLast;
  }
  if (x.dim() == 5 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    return at::MemoryFormat::ChannelsLast3d;
  }
  return at::MemoryFormat::Contiguous;
}

Tensor as(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

Tensor ones(int64_t c, at::ScalarType dtype) {
  return at::ones({c}, at::TensorOptions().dtype(dtype));
}

// Local float32 (float64 for float64 input) (mean, m2) of a non-empty x: batch_norm_stats_reference.
std::tuple<Tensor, Tensor> local_moments(const Tensor& x) {
  const int64_t c = x.size(1);
  const int64_t n = x.numel() / c;
  int64_t spatial = 1;
  for (int64_t d = 2; d < x.dim(); ++d) spatial *= x.size(d);
  if (x.scalar_type() == at::kFloat && x.dim() > 2 && x.is_contiguous() && spatial >= 32 &&
      x.numel() >= (int64_t{1} << 16)) {
    // _stats_channels_first: row sums over the contiguous spatial dims, then a second pass.
    Tensor rows = x.view({x.size(0), c, -1});
    const int64_t count = rows.size(0) * rows.size(2);
    Tensor mean = rows.sum(at::IntArrayRef{2}).sum(at::IntArrayRef{0}, false, at::kDouble).div_(count).to(at::kFloat);
    Tensor dev = rows - mean.view({1, c, 1});
    Tensor m2 = at::linalg_vecdot(dev, dev, 2).sum(at::IntArrayRef{0}, false, at::kDouble).to(at::kFloat);
    return {mean, m2};
  }
  Tensor mean, var;
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) {
    std::tie(mean, var) = at::batch_norm_update_stats(x, std::nullopt, std::nullopt, 0.0);
  } else {
    // float32 scratch running buffers: ATen's mixed-dtype path, float32 accumulation, no copy of x.
    Tensor scratch = at::empty({2, c}, at::TensorOptions().dtype(at::kFloat));
    std::tie(mean, var) = at::batch_norm_update_stats(x, scratch[0], scratch[1], 0.0);
  }
  // m2 = var * n in the statistics' dtype (as `var * n` on the tensor).
  if (var.scalar_type() == at::kFloat) {
    float* v = var.data_ptr<float>();
    const float nf = static_cast<float>(n);
    for (int64_t k = 0; k < c; ++k) v[k] = v[k] * nf;
  } else {
    double* v = var.data_ptr<double>();
    for (int64_t k = 0; k < c; ++k) v[k] = v[k] * static_cast<double>(n);
  }
  return {mean, var};
}

template <typename T>
void pack(double* p, const T* mean, const T* m2, const double* shift, int64_t c, int64_t n) {
  const double count = static_cast<double>(n);
  for (int64_t k = 0; k < c; ++k) {
    const double dev = static_cast<double>(mean[k]) - shift[k];
    const double s1 = dev * count;
    p[1 + k] = s1;
    p[1 + c + k] = static_cast<double>(m2[k]) + s1 * dev;
  }
}

// [n, n (mean - c), M2 + n (mean - c)^2] of this rank, float64 (2C+1,): _pack_moments.
Tensor pack_moments(const Tensor& x, const Tensor& shift) {
  Guards guards;
  TORCH_CHECK(shift.scalar_type() == at::kDouble && shift.is_contiguous(), "shift: contiguous float64");
  const int64_t c = x.size(1);
  const int64_t n = x.numel() / c;
  Tensor payload = at::empty({2 * c + 1}, at::TensorOptions().dtype(at::kDouble));
  double* p = payload.data_ptr<double>();
  p[0] = static_cast<double>(n);
  if (n == 0) {
    std::fill(p + 1, p + 2 * c + 1, 0.0);
    return payload;
  }
  auto [mean, m2] = local_moments(x);
  const double* s = shift.data_ptr<double>();
  if (mean.scalar_type() == at::kFloat) {
    pack(p, mean.data_ptr<float>(), m2.data_ptr<float>(), s, c, n);
  } else {
    pack(p, mean.data_ptr<double>(), m2.data_ptr<double>(), s, c, n);
  }
  return payload;
}

// running = running * (1 - factor) + value * factor, in place, with NumPy's precision: the product
// by (1 - factor) in the buffer's dtype when `factor` is a Python float (momentum), in float64 when
// it is a NumPy float64 (cumulative average); the sum always in float64.
template <typename T>
void update_running(T* running, const double* value, int64_t c, double factor, bool weak_factor) {
  const double keep = 1.0 - factor;
  for (int64_t k = 0; k < c; ++k) {
    T r = weak_factor ? static_cast<T>(running[k] * static_cast<T>(keep))
                      : static_cast<T>(static_cast<double>(running[k]) * keep);
    running[k] = static_cast<T>(static_cast<double>(r) + value[k] * factor);
  }
}

void update_buffer(Tensor& buffer, const double* value, int64_t c, double factor, bool weak_factor) {
  Tensor work = buffer.is_contiguous() ? buffer : buffer.contiguous();  // a strided buffer: via a copy
  if (work.scalar_type() == at::kFloat) {
    update_running(work.data_ptr<float>(), value, c, factor, weak_factor);
  } else {
    update_running(work.data_ptr<double>(), value, c, factor, weak_factor);
  }
  if (!buffer.is_same(work)) buffer.copy_(work);
}

// Unpacks the summed payload, updates the running statistics (when `update_stats` and the group's
// batch is not empty) and normalizes x: _unpack_moments, _update_running_stats, batch_norm_elemt.
// Returns (y, mean, invstd, count): mean/invstd float32 (C,), count (C,) in the statistics' dtype.
std::tuple<Tensor, Tensor, Tensor, Tensor> forward_finish(
    const Tensor& x, const Tensor& payload, const Tensor& shift, std::optional<Tensor> running_mean,
    std::optional<Tensor> running_var, const std::optional<Tensor>& num_batches_tracked,
    const std::optional<Tensor>& weight, const std::optional<Tensor>& bias, std::optional<double> momentum,
    double eps, bool update_stats) {
  Guards guards;
  const int64_t c = x.size(1);
  const double* p = payload.data_ptr<double>();
  const double* s = shift.data_ptr<double>();
  const double n = p[0];
  std::vector<double> mean(c), m2(c);
  for (int64_t k = 0; k < c; ++k) {
    const double s1 = p[1 + k];
    const double dev = s1 / n;
    mean[k] = s[k] + dev;
    const double v = p[1 + c + k] - s1 * dev;
    m2[k] = v < 0.0 ? 0.0 : v;  // clip(min=0): NaN (empty group) stays NaN
  }
  if (update_stats && n > 0 && running_mean.has_value()) {
    double factor;
    const bool weak = momentum.has_value();
    if (weak) {
      factor = *momentum;
    } else {
      factor = 1.0 / static_cast<double>(num_batches_tracked->item<int64_t>());
    }
    std::vector<double> unbiased(c);
    for (int64_t k = 0; k < c; ++k) unbiased[k] = m2[k] / (n - 1.0);
    update_buffer(*running_mean, mean.data(), c, factor, weak);
    update_buffer(*running_var, unbiased.data(), c, factor, weak);
  }
  const at::ScalarType st = stat_type(x);
  Tensor mean32 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
  Tensor invstd32 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
  float* mp = mean32.data_ptr<float>();
  float* ip = invstd32.data_ptr<float>();
  for (int64_t k = 0; k < c; ++k) {
    mp[k] = static_cast<float>(mean[k]);
    ip[k] = static_cast<float>(std::pow(m2[k] / n + eps, -0.5));
  }
  Tensor count = at::full({c}, n, at::TensorOptions().dtype(st));
  Tensor y;
  if (x.numel() == 0) {
    y = at::empty_like(x);
  } else {
    Tensor scale = as(invstd32, st);
    if (weight.has_value()) scale = scale * as(*weight, st);
    std::optional<Tensor> shift_out;
    if (bias.has_value()) shift_out = as(*bias, st);
    y = at::batch_norm(x, scale, shift_out, as(mean32, st), ones(c, st), false, 0.0, 0.0, false);
  }
  return {y, mean32, invstd32, count};
}

bool fused_backward(const Tensor& x) {
  return (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && x.numel() > 0;
}

// Local half of the backward: the sums (sum_dy, sum_dy_xmu) of this shard, packed as float32 (2C,)
// for the all_reduce. For float16/bfloat16 input also ATen's fused local dx (batch_norm_backward_cpu);
// float32/float64 input takes reduce + elemt (batch_norm_backward_reduce_reference), dx_local undefined.
std::tuple<Tensor, Tensor, Tensor, Tensor> backward_local(
    const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
    const std::optional<Tensor>& weight) {
  Guards guards;
  const int64_t c = x.size(1);
  const at::ScalarType st = stat_type(x);
  const at::MemoryFormat fmt = memory_format(x);
  Tensor packed = at::empty({2 * c}, at::TensorOptions().dtype(st));
  if (x.numel() == 0) {
    packed.zero_();
    return {Tensor(), packed.narrow(0, 0, c).clone(), packed.narrow(0, c, c).clone(), packed};
  }
  Tensor xd = x.contiguous(fmt);
  Tensor dyd = dy.contiguous(fmt);
  if (fused_backward(x)) {
    Tensor w = weight.has_value() ? as(*weight, st).contiguous() : ones(c, st);
    auto [dx, grad_weight, sum_dy] = at::native_batch_norm_backward(
        dyd, xd, w, std::nullopt, std::nullopt, as(mean, st), as(invstd, st), true, 0.0, {true, true, true});
    // s2 = grad_weight / invstd (grad_weight = S2 * invstd), float32.
    Tensor s2 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
    const float* gw = grad_weight.data_ptr<float>();
    const float* i = invstd.data_ptr<float>();
    float* s2p = s2.data_ptr<float>();
    const float* s1p = sum_dy.data_ptr<float>();
    float* pk = packed.data_ptr<float>();
    for (int64_t k = 0; k < c; ++k) {
      s2p[k] = gw[k] / i[k];
      pk[k] = s1p[k];
      pk[c + k] = s2p[k];
    }
    return {dx, sum_dy, s2, packed};
  }
  Tensor unit = ones(c, st);
  auto grads = at::native_batch_norm_backward(
      dyd, xd, unit, std::nullopt, std::nullopt, as(mean, st), unit, true, 0.0, {false, true, true});
  Tensor sum_dy_xmu = as(std::get<1>(grads), st);
  Tensor sum_dy = as(std::get<2>(grads), st);
  packed.narrow(0, 0, c).copy_(sum_dy);
  packed.narrow(0, c, c).copy_(sum_dy_xmu);
  return {Tensor(), sum_dy, sum_dy_xmu, packed};
}

// Global half: dx from the group sums `total` (float32 (2C,), or `packed` itself without a group),
// and grad_weight = sum_dy_xmu * invstd / grad_bias = sum_dy from the LOCAL sums (DDP averages them).
std::tuple<Tensor, Tensor, Tensor> backward_finish(
    const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
    const std::optional<Tensor>& weight, const Tensor& count, const std::optional<Tensor>& dx_local, const Tensor& sum_dy,
    const Tensor& sum_dy_xmu, const Tensor& total, bool need_weight, bool need_bias) {
  Guards guards;
  const int64_t c = x.size(1);
  const at::ScalarType st = stat_type(x);
  Tensor dx;
  if (x.numel() == 0) {
    dx = at::empty_like(x);
  } else if (fused_backward(x)) {
    // dx = dx_local + k1 (x - mean) + k0 (batch_norm_backward_cpu), float32 coefficients.
    Tensor xd = x.contiguous(memory_format(x));
    Tensor w = weight.has_value() ? as(*weight, st).contiguous() : ones(c, st);
    Tensor k0 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
    Tensor k1 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
    const float* i = invstd.data_ptr<float>();
    const float* wn = w.data_ptr<float>();
    const float* ng = count.data_ptr<float>();
    const float* s1 = sum_dy.data_ptr<float>();
    const float* s2 = sum_dy_xmu.data_ptr<float>();
    const float* g = total.data_ptr<float>();
    const float nl = static_cast<float>(x.numel() / c);
    float* k0p = k0.data_ptr<float>();
    float* k1p = k1.data_ptr<float>();
    for (int64_t k = 0; k < c; ++k) {
      const float wi = wn[k] * i[k];
      k0p[k] = wi * (s1[k] / nl - g[k] / ng[k]);
      k1p[k] = wi * i[k] * i[k] * (s2[k] / nl - g[c + k] / ng[k]);
    }
    dx = *dx_local;
    dx.add_(at::batch_norm(xd, k1, k0, as(mean, st), ones(c, st), false, 0.0, 0.0, false));
  } else {
    // batch_norm_backward_elemt_reference: u = (x - mean) (-b c) - a c, then u += dy * c.
    Tensor is = as(invstd, st);
    Tensor cc = weight.has_value() ? is * as(*weight, st) : is;
    Tensor cnt = as(count, st);
    Tensor a = total.narrow(0, 0, c) / cnt;
    Tensor b = is * is * total.narrow(0, c, c) / cnt;
    Tensor u = at::batch_norm(x, -b * cc, -a * cc, as(mean, st), ones(c, st), false, 0.0, 0.0, false);
    std::vector<int64_t> shape(x.dim(), 1);
    shape[1] = c;
    u.addcmul_(dy.contiguous(memory_format(x)), cc.view(shape));
    dx = u.scalar_type() == x.scalar_type() ? u : u.to(x.scalar_type());
  }
  Tensor grad_weight, grad_bias;
  if (need_weight) {
    grad_weight = sum_dy_xmu * invstd;
    if (weight.has_value() && grad_weight.scalar_type() != weight->scalar_type()) {
      grad_weight = grad_weight.to(weight->scalar_type());
    }
  }
  if (need_bias) {
    const at::ScalarType bias_type = weight.has_value() ? weight->scalar_type() : at::kFloat;
    grad_bias = sum_dy.scalar_type() == bias_type ? sum_dy : sum_dy.to(bias_type);
  }
  return {dx, grad_weight, grad_bias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled host glue of lightning_ext.nn.SyncBatchNorm for eager CPU input.";
  m.def("pack_moments", &pack_moments);
  m.def("forward_finish", &forward_finish);
  m.def("backward_local", &backward_local);
  m.def("backward_finish", &backward_finish);
}
