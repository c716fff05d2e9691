// Compiled CPU kernels of lightning_ext.nn.SyncBatchNorm for eager CPU input.
//
// On the small layers of CPU training, SyncBatchNorm's cost is not arithmetic but passes over the
// data and host-side operations: ATen offers no fused CPU kernel for the synchronized backward
// (torch's own SyncBatchNorm is CUDA-only), so the pure-torch path (the `reference` backend) needs
// four passes over the activations per backward and about 45 host operations per layer and step.
// Here the training forward is ONE call from Python, sync_batch_norm(), a torch::autograd::Function
// whose backward is C++ too; the all_reduce in each direction is a Python callback (set_reducer:
// lightning_ext.shm_collectives / torch.distributed), and each step makes ONE pass over the data:
//
// Forward:  pack_moments: one pass, [n, sum(x - c), sum((x - c)^2)] per channel, float64 (2C+1,),
//             c = the running mean (the shifted-data algorithm: Chan, Golub & LeVeque 1983; the
//             pass itself sums about a value of the channel, moved to c exactly in float64);
//           [all_reduce SUM of the payload]
//           forward_finish: global mean/invstd, running statistics, and one pass
//             y = x * scale + offset (scale = invstd * weight).
// Backward: backward_local: one pass, [sum(dy), sum(dy * (x - mean))] per channel of this shard;
//             grad_weight / grad_bias from these LOCAL sums (DDP averages them);
//           [all_reduce SUM of the sums, skipped by every rank alike when x needs no gradient]
//           backward_finish: one pass dx = (dy - G1 / n - (x - mean) invstd^2 G2 / n) invstd w
//             (G = the group's sums, n = the global count).
//
// Arithmetic: float32 (float64 for float64 input) per element, accumulated per channel in blocks of
// at most BLOCK elements and summed across blocks in float64; float16/bfloat16 values are read and
// written with round-to-nearest-even, as ATen. The pure-torch path computes the same quantities with
// ATen ops (different summation order: results agree to rounding, see
// tests/kernels/test_cpu_extension.py, and both against float64 one-process BatchNorm in
// tests/nn/test_sync_batch_norm.py). Work is split over channels (channels-first) or row blocks
// (channels-last) with at::parallel_for.

// The three headers this file needs instead of <torch/extension.h> (all of libtorch's C++ API):
// the first build compiles in ~26 s instead of ~39 s on 2 cores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

namespace py = pybind11;
using at::Tensor;

constexpr int64_t BLOCK = 2048;  // elements per float32 partial sum before it joins the float64 total
constexpr int64_t ROW_BLOCK = 64;  // channels-last rows per parallel task / per partial sum

// Guards every entry point: no autograd recording (buffers are updated in place; the autograd
// Function around the forward records the graph) and no autocast (the kernels see the input's own
// dtype, as in the Python path, which disables autocast around them).
struct Guards {
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

// ------------------------------------------------------------------------------ element access

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }

inline void store(c10::BFloat16* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  // Round to nearest even (c10::BFloat16's rule); NaN stays a quiet NaN.
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[i] = std::isnan(v) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}
inline void store(c10::Half* p, int64_t i, float v) { p[i] = static_cast<c10::Half>(v); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(double* p, int64_t i, double v) { p[i] = v; }

template <typename F>
void dispatch_input(const Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      f(static_cast<c10::BFloat16*>(nullptr));
      break;
    case at::kHalf:
      f(static_cast<c10::Half*>(nullptr));
      break;
    case at::kFloat:
      f(static_cast<float*>(nullptr));
      break;
    case at::kDouble:
      f(static_cast<double*>(nullptr));
      break;
    default:
      TORCH_CHECK(false, "SyncBatchNorm CPU kernels: unsupported dtype ", x.scalar_type());
  }
}

// ------------------------------------------------------------------------------ layout

// A 2d-5d input seen as (N, C, S) channels-first or (R, C) rows of channels (channels_last(_3d),
// and 2d input, whose rows are its samples). `dense(x, x)` gives the dense tensor the kernels read.
struct Layout {
  bool channels_last;
  int64_t n, c, s;  // channels-first: n samples, c channels, s spatial elements
  int64_t rows;     // channels-last: rows of c channels
};

at::MemoryFormat memory_format(const Tensor& x) {
  if (x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return at::MemoryFormat::ChannelsLast;
  }
  if (x.dim() == 5 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    return at::MemoryFormat::ChannelsLast3d;
  }
  return at::MemoryFormat::Contiguous;
}

Layout layout_of(const Tensor& x) {
  Layout l;
  l.n = x.size(0);
  l.c = x.size(1);
  l.s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) l.s *= x.size(d);
  l.channels_last = x.dim() == 2 || memory_format(x) != at::MemoryFormat::Contiguous;
  l.rows = l.n * l.s;
  return l;
}

// A (C,) parameter as float64 values (float32/float64 read directly, other dtypes converted).
std::vector<double> values(const std::optional<Tensor>& t, int64_t c, double fill) {
  std::vector<double> out(c, fill);
  if (!t.has_value()) return out;
  Tensor u = (t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble) ? t->contiguous()
                                                                                  : t->to(at::kDouble).contiguous();
  if (u.scalar_type() == at::kFloat) {
    const float* p = u.data_ptr<float>();
    for (int64_t k = 0; k < c; ++k) out[k] = p[k];
  } else {
    const double* p = u.data_ptr<double>();
    for (int64_t k = 0; k < c; ++k) out[k] = p[k];
  }
  return out;
}

Tensor dense(const Tensor& t, const Tensor& like) { return t.contiguous(memory_format(like)); }

at::ScalarType stat_type(const Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ------------------------------------------------------------------------------ row kernels
// The loops over the data, compiled twice where GCC can (AVX2 and the baseline, picked at load
// time by the CPU's features: function multi-versioning), so the build runs on any x86-64 CPU.
// `omp simd` (-fopenmp-simd: the pragma only, no OpenMP runtime) lets the reductions vectorize.

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LE_CLONES
#endif

// The two per-channel sums of a pass, one element at a time (inlined into the loops below):
// moments about a shift c, (x - c, (x - c)^2) with u = v = x; the backward's sums, (dy, dy (x - c))
// with u = dy, v = x and c = the mean.
struct MomentTerms {
  template <typename T, typename Acc>
  static inline void add(const T* u, const T*, int64_t i, Acc c, Acc& a1, Acc& a2) {
    const Acc d = load(u, i) - c;
    a1 += d;
    a2 += d * d;
  }
};

struct GradTerms {
  template <typename T, typename Acc>
  static inline void add(const T* u, const T* v, int64_t i, Acc c, Acc& a1, Acc& a2) {
    const Acc g = load(u, i);
    a1 += g;
    a2 += g * (load(v, i) - c);
  }
};

// Channels-first: the `runs` contiguous runs of `len` elements of one channel (one per sample,
// `stride` elements apart), summed in float32 (float64 for float64 input) over at most BLOCK
// elements and in float64 across blocks.
template <typename Terms, typename T, typename Acc>
LE_CLONES void channel_terms(
    const T* u, const T* v, int64_t runs, int64_t stride, int64_t len, Acc c, double* s1, double* s2) {
  double t1 = 0.0, t2 = 0.0;
  for (int64_t r = 0; r < runs; ++r) {
    const T* u_run = u + r * stride;
    const T* v_run = v + r * stride;
    for (int64_t b0 = 0; b0 < len; b0 += BLOCK) {
      const int64_t end = std::min(len, b0 + BLOCK);
      Acc a1 = 0, a2 = 0;
#pragma omp simd reduction(+ : a1, a2)
      for (int64_t i = b0; i < end; ++i) Terms::add(u_run, v_run, i, c, a1, a2);
      t1 += a1;
      t2 += a2;
    }
  }
  *s1 = t1;
  *s2 = t2;
}

template <typename T, typename Acc>
LE_CLONES void channel_affine(
    const T* u, const T* v, T* out, int64_t runs, int64_t stride, int64_t len, Acc a, Acc b, Acc d) {
  for (int64_t r = 0; r < runs; ++r) {
    const T* u_run = u + r * stride;
    T* o_run = out + r * stride;
    if (v == nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) store(o_run, i, a * load(u_run, i) + d);
    } else {
      const T* v_run = v + r * stride;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) store(o_run, i, a * load(u_run, i) + b * load(v_run, i) + d);
    }
  }
}

// Channels-last: `rows` consecutive rows of `nc` channels, accumulated per channel into a1/a2
// (c: the per-channel shift or mean).
template <typename Terms, typename T, typename Acc>
LE_CLONES void rows_terms(const T* u, const T* v, int64_t rows, int64_t nc, const Acc* c, Acc* a1, Acc* a2) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * nc;
#pragma omp simd
    for (int64_t k = 0; k < nc; ++k) Terms::add(u + base, v + base, k, c[k], a1[k], a2[k]);
  }
}

template <typename T, typename Acc>
LE_CLONES void rows_affine(
    const T* u, const T* v, T* out, int64_t rows, int64_t c, const Acc* a, const Acc* b, const Acc* d) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * c;
    if (v == nullptr) {
#pragma omp simd
      for (int64_t k = 0; k < c; ++k) store(out + base, k, a[k] * load(u + base, k) + d[k]);
    } else {
#pragma omp simd
      for (int64_t k = 0; k < c; ++k) {
        store(out + base, k, a[k] * load(u + base, k) + b[k] * load(v + base, k) + d[k]);
      }
    }
  }
}

// ------------------------------------------------------------------------------ passes

// Per-channel sums (out1[k], out2[k]) of one pass over the data: float64 totals of float32
// (float64 for float64 input) partial sums over at most BLOCK elements (channels-first) or ROW_BLOCK
// rows (channels-last, per-thread totals combined at the end). `channel(k, &s1, &s2)` sums channel k
// of channels-first data; `rows(offset, nrows, a1, a2)` adds channels-last rows into a1/a2.
template <typename Acc, typename Channel, typename Rows>
void channel_sums(const Layout& l, double* out1, double* out2, Channel channel, Rows rows) {
  if (!l.channels_last) {
    at::parallel_for(0, l.c, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t k = c0; k < c1; ++k) channel(k, out1 + k, out2 + k);
    });
    return;
  }
  const int64_t c = l.c;
  const int threads = at::get_num_threads();
  std::vector<double> totals(static_cast<size_t>(2 * c * threads), 0.0);
  at::parallel_for(0, l.rows, ROW_BLOCK, [&](int64_t r0, int64_t r1) {
    double* tot = totals.data() + 2 * c * at::get_thread_num();
    std::vector<Acc> a1(c), a2(c);
    for (int64_t b0 = r0; b0 < r1; b0 += ROW_BLOCK) {
      std::fill(a1.begin(), a1.end(), Acc(0));
      std::fill(a2.begin(), a2.end(), Acc(0));
      rows(b0 * c, std::min(ROW_BLOCK, r1 - b0), a1.data(), a2.data());
      for (int64_t k = 0; k < c; ++k) {
        tot[k] += a1[k];
        tot[c + k] += a2[k];
      }
    }
  });
  for (int64_t k = 0; k < c; ++k) {
    double t1 = 0.0, t2 = 0.0;
    for (int t = 0; t < threads; ++t) {
      t1 += totals[2 * c * t + k];
      t2 += totals[2 * c * t + c + k];
    }
    out1[k] = t1;
    out2[k] = t2;
  }
}

// out = a[k] * u + b[k] * v + d[k] elementwise (channel k; v may be null: out = a[k] * u + d[k]).
template <typename T, typename Acc>
void affine_pass(const Layout& l, const T* u, const T* v, T* out, const Acc* a, const Acc* b, const Acc* d) {
  if (!l.channels_last) {
    at::parallel_for(0, l.c, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t k = c0; k < c1; ++k) {
        const int64_t base = k * l.s;
        channel_affine<T, Acc>(
            u + base, v == nullptr ? nullptr : v + base, out + base, l.n, l.c * l.s, l.s, a[k], b[k], d[k]);
      }
    });
    return;
  }
  at::parallel_for(0, l.rows, ROW_BLOCK, [&](int64_t r0, int64_t r1) {
    const int64_t base = r0 * l.c;
    rows_affine<T, Acc>(u + base, v == nullptr ? nullptr : v + base, out + base, r1 - r0, l.c, a, b, d);
  });
}

// ------------------------------------------------------------------------------ forward

// [n, sum(x - shift), sum((x - shift)^2)] of this rank, float64 (2C+1,), and the float64 shift it
// used: a copy of the running mean read BEFORE the update (zeros without one). Also counts the
// batch in num_batches_tracked (as the module's forward does before the synchronized path).
std::tuple<Tensor, Tensor> pack_moments(
    const Tensor& x, const std::optional<Tensor>& running_mean,
    const std::optional<Tensor>& num_batches_tracked, bool count_batch) {
  Guards guards;
  const int64_t c = x.size(1);
  if (count_batch && num_batches_tracked.has_value()) num_batches_tracked->add_(1);
  Tensor shift = running_mean.has_value()
                     ? running_mean->to(at::kDouble, /*non_blocking=*/false, /*copy=*/true).contiguous()
                     : at::zeros({c}, at::TensorOptions().dtype(at::kDouble));
  Tensor payload = at::empty({2 * c + 1}, at::TensorOptions().dtype(at::kDouble));
  double* p = payload.data_ptr<double>();
  const int64_t n = c > 0 ? x.numel() / c : 0;
  p[0] = static_cast<double>(n);
  if (n == 0) {
    std::fill(p + 1, p + 2 * c + 1, 0.0);
    return {payload, shift};
  }
  const Tensor xd = dense(x, x);
  const Layout l = layout_of(xd);
  const double* s = shift.data_ptr<double>();
  dispatch_input(xd, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = typename AccOf<T>::type;
    const T* xp = xd.data_ptr<T>();
    // The pass sums about a LOCAL shift f, a value of the channel itself (its first element if finite),
    // so that the float32 partial sums see deviations of the data's own spread even when the
    // common shift (the running mean) is far from the data (at the first step, after a data
    // shift); the float64 totals are then moved to the common shift c exactly as algebra allows:
    // sum(x - c) = t1 + n d, sum((x - c)^2) = t2 + 2 d t1 + n d^2 with d = f - c.
    std::vector<Acc> local(c);
    for (int64_t k = 0; k < c; ++k) {
      const Acc first = load(xp, l.channels_last ? k : k * l.s);
      local[k] = std::isfinite(first) ? first : static_cast<Acc>(s[k]);  // inf/NaN: as torch, no inf - inf
    }
    const Acc* fp = local.data();
    channel_sums<Acc>(
        l, p + 1, p + 1 + c,
        [xp, fp, &l](int64_t k, double* s1, double* s2) {
          channel_terms<MomentTerms, T, Acc>(xp + k * l.s, xp + k * l.s, l.n, l.c * l.s, l.s, fp[k], s1, s2);
        },
        [xp, fp, c](int64_t off, int64_t rows, Acc* a1, Acc* a2) {
          rows_terms<MomentTerms, T, Acc>(xp + off, xp + off, rows, c, fp, a1, a2);
        });
    const double count = static_cast<double>(n);
    for (int64_t k = 0; k < c; ++k) {
      const double d = static_cast<double>(local[k]) - s[k];
      const double t1 = p[1 + k];
      p[1 + k] = t1 + count * d;
      p[1 + c + k] = p[1 + c + k] + 2.0 * d * t1 + count * d * d;
    }
  });
  return {payload, shift};
}

// running = running * (1 - factor) + value * factor, in place (float64 arithmetic).
template <typename T>
void update_running(T* running, const double* value, int64_t c, double factor) {
  const double keep = 1.0 - factor;
  for (int64_t k = 0; k < c; ++k) {
    running[k] = static_cast<T>(static_cast<double>(running[k]) * keep + value[k] * factor);
  }
}

void update_buffer(Tensor& buffer, const double* value, int64_t c, double factor) {
  Tensor work = buffer.is_contiguous() ? buffer : buffer.contiguous();  // a strided buffer: via a copy
  if (work.scalar_type() == at::kFloat) {
    update_running(work.data_ptr<float>(), value, c, factor);
  } else {
    TORCH_CHECK(work.scalar_type() == at::kDouble, "running statistics: float32 or float64 buffers");
    update_running(work.data_ptr<double>(), value, c, factor);
  }
  if (!buffer.is_same(work)) buffer.copy_(work);
}

// Unpacks the summed payload (global mean, biased variance), updates the running statistics (when
// `update_stats` and the group's batch is not empty; unbiased variance of the GLOBAL count) and
// normalizes x in one pass. Returns (y, mean, invstd, count): mean/invstd float32 (C,), count
// the global number of values per channel.
std::tuple<Tensor, Tensor, Tensor, double> forward_finish(
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
    const double factor = momentum.has_value()
                              ? *momentum
                              : 1.0 / static_cast<double>(num_batches_tracked->item<int64_t>());
    std::vector<double> unbiased(c);
    for (int64_t k = 0; k < c; ++k) unbiased[k] = m2[k] / (n - 1.0);
    update_buffer(*running_mean, mean.data(), c, factor);
    update_buffer(*running_var, unbiased.data(), c, factor);
  }
  Tensor mean32 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
  Tensor invstd32 = at::empty({c}, at::TensorOptions().dtype(at::kFloat));
  float* mp = mean32.data_ptr<float>();
  float* ip = invstd32.data_ptr<float>();
  std::vector<double> invstd(c);
  for (int64_t k = 0; k < c; ++k) {
    invstd[k] = 1.0 / std::sqrt(m2[k] / n + eps);
    mp[k] = static_cast<float>(mean[k]);
    ip[k] = static_cast<float>(invstd[k]);
  }
  if (x.numel() == 0) return {at::empty_like(x), mean32, invstd32, n};
  const Tensor xd = dense(x, x);
  Tensor y = at::empty_like(xd);
  const Layout l = layout_of(xd);
  const std::vector<double> w = values(weight, c, 1.0);
  const std::vector<double> b = values(bias, c, 0.0);
  dispatch_input(xd, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = typename AccOf<T>::type;
    // y = (x - mean) * invstd * w + b = x * scale + (b - mean * scale), coefficients in float64.
    std::vector<Acc> scale(c), offset(c);
    for (int64_t k = 0; k < c; ++k) {
      const double sc = invstd[k] * w[k];
      scale[k] = static_cast<Acc>(sc);
      offset[k] = static_cast<Acc>(b[k] - mean[k] * sc);
    }
    affine_pass<T, Acc>(l, xd.data_ptr<T>(), nullptr, y.data_ptr<T>(), scale.data(), scale.data(), offset.data());
  });
  return {y, mean32, invstd32, n};
}

// ------------------------------------------------------------------------------ backward

// Local half of the backward: this shard's [sum(dy), sum(dy * (x - mean))] per channel, packed
// (2C,) in the statistics' dtype (float32; float64 for float64 input) for the all_reduce.
Tensor backward_local(const Tensor& dy, const Tensor& x, const Tensor& mean) {
  Guards guards;
  const int64_t c = x.size(1);
  const at::ScalarType st = stat_type(x);
  std::vector<double> s1(c, 0.0), s2(c, 0.0);
  if (x.numel() > 0) {
    const Tensor xd = dense(x, x);
    const Tensor dyd = dense(dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type()), xd);
    const Layout l = layout_of(xd);
    const float* mp = mean.data_ptr<float>();
    dispatch_input(xd, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      using Acc = typename AccOf<T>::type;
      const T* xp = xd.data_ptr<T>();
      const T* gp = dyd.data_ptr<T>();
      std::vector<Acc> mu(c);
      for (int64_t k = 0; k < c; ++k) mu[k] = static_cast<Acc>(mp[k]);
      const Acc* mup = mu.data();
      channel_sums<Acc>(
          l, s1.data(), s2.data(),
          [xp, gp, mup, &l](int64_t k, double* s1, double* s2) {
            channel_terms<GradTerms, T, Acc>(gp + k * l.s, xp + k * l.s, l.n, l.c * l.s, l.s, mup[k], s1, s2);
          },
          [xp, gp, mup, c](int64_t off, int64_t rows, Acc* a1, Acc* a2) {
            rows_terms<GradTerms, T, Acc>(gp + off, xp + off, rows, c, mup, a1, a2);
          });
    });
  }
  Tensor packed = at::empty({2 * c}, at::TensorOptions().dtype(st));
  if (st == at::kFloat) {
    float* q = packed.data_ptr<float>();
    for (int64_t k = 0; k < c; ++k) {
      q[k] = static_cast<float>(s1[k]);
      q[c + k] = static_cast<float>(s2[k]);
    }
  } else {
    double* q = packed.data_ptr<double>();
    for (int64_t k = 0; k < c; ++k) {
      q[k] = s1[k];
      q[c + k] = s2[k];
    }
  }
  return packed;
}

// A (C,) tensor of `dtype` holding `v` (float32/float64 filled directly).
Tensor vector_tensor(const std::vector<double>& v, at::ScalarType dtype) {
  const int64_t c = static_cast<int64_t>(v.size());
  const at::ScalarType fill = dtype == at::kFloat ? at::kFloat : at::kDouble;
  Tensor t = at::empty({c}, at::TensorOptions().dtype(fill));
  if (fill == at::kFloat) {
    float* p = t.data_ptr<float>();
    for (int64_t k = 0; k < c; ++k) p[k] = static_cast<float>(v[k]);
  } else {
    double* p = t.data_ptr<double>();
    for (int64_t k = 0; k < c; ++k) p[k] = v[k];
  }
  return fill == dtype ? t : t.to(dtype);
}

// The local sums of `packed` as float64 values (they are float32 or float64).
std::vector<double> packed_values(const Tensor& packed) {
  const Tensor p = packed.to(at::kDouble).contiguous();
  const double* q = p.data_ptr<double>();
  return std::vector<double>(q, q + p.numel());
}

// grad_weight = sum_dy_xmu * invstd and grad_bias = sum_dy from the LOCAL sums `packed` (DDP
// averages them, as for torch's SyncBatchNorm), rounded to the statistics' dtype and then to the
// parameters' dtype; undefined where not needed.
std::tuple<Tensor, Tensor> parameter_grads(
    const Tensor& packed, const Tensor& invstd, const std::optional<Tensor>& weight, bool need_weight,
    bool need_bias) {
  Tensor grad_weight, grad_bias;
  if (!need_weight && !need_bias) return {grad_weight, grad_bias};
  const int64_t c = invstd.numel();
  const std::vector<double> sums = packed_values(packed);
  const bool float_stats = packed.scalar_type() == at::kFloat;
  const at::ScalarType param_type = weight.has_value() ? weight->scalar_type() : at::kFloat;
  if (need_weight) {
    const float* is = invstd.data_ptr<float>();
    std::vector<double> g(c);
    for (int64_t k = 0; k < c; ++k) {
      const double product = sums[c + k] * static_cast<double>(is[k]);
      g[k] = float_stats ? static_cast<double>(static_cast<float>(product)) : product;  // float32 maths
    }
    grad_weight = vector_tensor(g, param_type);
  }
  if (need_bias) grad_bias = vector_tensor(std::vector<double>(sums.begin(), sums.begin() + c), param_type);
  return {grad_weight, grad_bias};
}

// Global half: dx from the group sums `total` ((2C,) in the statistics' dtype, or the local sums
// themselves without a group) in one pass.
Tensor backward_finish(
    const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
    const std::optional<Tensor>& weight, double n, const Tensor& total) {
  Guards guards;
  const int64_t c = x.size(1);
  Tensor dx;
  if (x.numel() == 0) {
    dx = at::empty_like(x);
  } else {
    const Tensor xd = dense(x, x);
    const Tensor dyd = dense(dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type()), xd);
    dx = at::empty_like(xd);
    const Layout l = layout_of(xd);
    const std::vector<double> group_sums = packed_values(total);
    const double* gp = group_sums.data();
    const std::vector<double> w = values(weight, c, 1.0);
    const float* mp = mean.data_ptr<float>();
    const float* ip = invstd.data_ptr<float>();
    dispatch_input(xd, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      using Acc = typename AccOf<T>::type;
      // dx = dy * A + x * B + D with A = invstd w, B = -A invstd^2 G2 / n,
      // D = -A G1 / n - B mean (float64 coefficients, rounded once to the element precision).
      std::vector<Acc> a(c), b(c), d(c);
      for (int64_t k = 0; k < c; ++k) {
        const double is = ip[k];
        const double ak = is * w[k];
        const double bk = -ak * is * is * gp[c + k] / n;
        a[k] = static_cast<Acc>(ak);
        b[k] = static_cast<Acc>(bk);
        d[k] = static_cast<Acc>(-ak * gp[k] / n - bk * static_cast<double>(mp[k]));
      }
      affine_pass<T, Acc>(l, dyd.data_ptr<T>(), xd.data_ptr<T>(), dx.data_ptr<T>(), a.data(), b.data(), d.data());
    });
  }
  return dx;
}

// ------------------------------------------------------------------------------ autograd Function

// The group's SUM all_reduce, done by Python (lightning_ext.nn.sync_batch_norm registers it with
// set_reducer): reducer(tensor, group_key) -> summed tensor. Called with the GIL held (the forward
// runs from Python; the backward runs on an autograd thread without it and acquires it here).
py::object& reducer() {
  static auto* r = new py::object();  // never destroyed: no Python call at interpreter exit
  return *r;
}

void set_reducer(py::object fn) { reducer() = std::move(fn); }

Tensor reduce(const Tensor& t, int64_t group_key) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(!reducer().is_none(), "SyncBatchNorm CPU kernels: no reducer registered");
  return reducer()(t, group_key).cast<Tensor>();
}

std::string shape_string(const Tensor& x) {
  std::string out = "(";
  for (int64_t d = 0; d < x.dim(); ++d) out += (d ? ", " : "") + std::to_string(x.size(d));
  return out + ")";
}

// SyncBatchNorm's training forward and backward, each ONE call from Python: the moments pass, the
// all_reduce (Python, through the reducer), the normalization; in the backward the local sums, the
// all_reduce (skipped with every rank alike when the input needs no gradient), dx.
struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static Tensor forward(
      torch::autograd::AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& weight,
      const std::optional<Tensor>& bias, const std::optional<Tensor>& running_mean,
      const std::optional<Tensor>& running_var, const std::optional<Tensor>& num_batches_tracked,
      std::optional<double> momentum, double eps, bool update_stats, bool sync, int64_t group_key) {
    auto [payload, shift] = pack_moments(x, running_mean, num_batches_tracked, update_stats);
    if (sync) payload = reduce(payload, group_key);
    if (x.numel() <= x.size(1) && payload.data_ptr<double>()[0] == 1.0) {  // same count on every rank
      throw py::value_error(
          "Expected more than 1 value per channel when training, got input size " + shape_string(x) +
          " on this rank and 1 value per channel over the process group");
    }
    auto [y, mean, invstd, count] = forward_finish(
        x, payload, shift, running_mean, running_var, num_batches_tracked, weight, bias, momentum, eps,
        update_stats);
    ctx->save_for_backward({x, weight.has_value() ? *weight : Tensor(), mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["sync"] = sync;
    ctx->saved_data["group_key"] = group_key;
    return y;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_outputs) {
    // create_graph=True would get gradients without a graph (the passes record none): refuse, loudly.
    TORCH_CHECK(
        !at::GradMode::is_enabled(),
        "SyncBatchNorm's compiled CPU backward is not differentiable (double backward / create_graph=True); "
        "set LIGHTNING_EXT_CPU_EXTENSION=0 for the pure-torch path");
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const std::optional<Tensor> weight = saved[1].defined() ? std::optional<Tensor>(saved[1]) : std::nullopt;
    const Tensor& mean = saved[2];
    const Tensor& invstd = saved[3];
    const Tensor& dy = grad_outputs[0];
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);
    const bool need_bias = ctx->needs_input_grad(2);
    const Tensor packed = backward_local(dy, x, mean);
    Tensor dx, grad_weight, grad_bias;
    {
      Guards guards;  // from the LOCAL sums, before the all_reduce sums them in place
      std::tie(grad_weight, grad_bias) = parameter_grads(packed, invstd, weight, need_weight, need_bias);
    }
    if (need_x) {  // else no collective: the group only needs the sums for dx, which nobody asked for
      const Tensor total =
          ctx->saved_data["sync"].toBool() ? reduce(packed, ctx->saved_data["group_key"].toInt()) : packed;
      dx = backward_finish(dy, x, mean, invstd, weight, ctx->saved_data["count"].toDouble(), total);
    }
    // One gradient per forward argument: x, weight, bias, then none for the other eight.
    return {dx, grad_weight, grad_bias, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor sync_batch_norm(
    const Tensor& x, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& running_mean, const std::optional<Tensor>& running_var,
    const std::optional<Tensor>& num_batches_tracked, std::optional<double> momentum, double eps,
    bool update_stats, bool sync, int64_t group_key) {
  return SyncBatchNormFunction::apply(
      x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, update_stats, sync,
      group_key);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled CPU kernels of lightning_ext.nn.SyncBatchNorm for eager CPU input.";
  m.def("sync_batch_norm", &sync_batch_norm,
        "SyncBatchNorm's training forward (autograd-recorded; the backward is compiled too).");
  m.def("set_reducer", &set_reducer, "Register reducer(tensor, group_key) -> the group's SUM all_reduce.");
}
