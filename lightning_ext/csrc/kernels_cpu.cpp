// The `cpu` kernel backend of lightning_ext (lightning_ext/kernels/cpu.py): one vectorized pass over
// the data per op, for CPU tensors.
//
// Batch norm (the ops of lightning_ext.kernels.KernelBackend, composed by nn.SyncBatchNorm):
//   batch_norm_moments          one pass: [n, sum(x - c), sum((x - c)^2)] per channel, float64 (2C+1,)
//                               (shifted-data algorithm, Chan, Golub & LeVeque 1983);
//   batch_norm_elemt            one pass: y = x * scale + offset (scale = invstd * weight);
//   batch_norm_backward_reduce  one pass: [sum(dy), sum(dy * (x - mean))] per channel, (2C,);
//   batch_norm_backward_elemt   one pass: dx = (dy - G1 / n - (x - mean) invstd^2 G2 / n) invstd w.
// ATen has no fused CPU kernel for the synchronized backward and its float32 NCHW statistics walk
// each channel with a scalar loop; these loops are vectorized per channel.
// Loss scaling: check_finite reads the gradients once without writing them.
// Statistics: accumulate_moments_ adds count, shifted sums (float64 totals) and extremes of any real
// tensor; moments_payload_ and moments_finish_ are the arithmetic of a Collector's flush over its names;
// accumulate_histogram_ counts any real tensor into a signed histogram of given float64 edges (a
// cheap logarithm guesses each bucket, float64 comparisons with the edges settle it).
//
// Arithmetic: float32 per element (float64 for float64 and integer input), accumulated in blocks
// (BLOCK elements per channel; 32 per lane for the moments) and summed across blocks in float64;
// float16/bfloat16 values are read and written with round-to-nearest-even, as ATen. Work is split
// over channels (channels-first) or row blocks (channels-last, and over elements elsewhere) with
// at::parallel_for (compiled with -fopenmp, it runs on torch's OpenMP threads).

// The headers this file needs instead of <torch/extension.h> (all of libtorch's C++ API): a shorter
// first build.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <utility>
#include <tuple>
#include <vector>

namespace {

namespace py = pybind11;
using at::Tensor;

constexpr int64_t BLOCK = 2048;  // elements per float32 partial sum before it joins the float64 total
constexpr int64_t ROW_BLOCK = 64;  // channels-last rows per parallel task / per partial sum
constexpr int64_t AFFINE_GRAIN = 1 << 15;  // elements per parallel task of an elementwise pass, at least
constexpr int64_t MAX_PERIOD = 64;  // float16 channels-last sums: the longest period of repeated shifts

// Guards every entry point: no autograd recording and no autocast (the kernels see the input's own
// dtype).
struct Guards {
  c10::NoGradGuard no_grad;
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
// float16 <-> float32 from the bits, exactly and branch-free (F. Giesen's "half_to_float" and
// "float_to_half_fast3_rtne", https://gist.github.com/rygorous/2156668), so that the loops vectorize:
// GCC 12 keeps _Float16's and c10::Half's conversions scalar (one F16C instruction per element), which
// made the float16 reductions 4x slower. IEEE conversions both ways (round to nearest even; zeros,
// subnormals and inf included; NaN to the quiet NaN 0x7E00 with its sign), as c10::Half's. A few
// integer operations per element: the normalize loops and channel sums take F16C instead where the
// CPU has it (half_affine, half_terms), and these serve their tails, the baseline CPU and the rest.
inline float load(const c10::Half* p, int64_t i) {
  const uint32_t h = reinterpret_cast<const uint16_t*>(p)[i];
  const uint32_t bits = (h & 0x7FFFu) << 13;  // exponent and mantissa at float32's positions
  const uint32_t exp = bits & 0x0F800000u;
  const uint32_t o = bits + ((127u - 15u) << 23) + (exp == 0x0F800000u ? (128u - 16u) << 23 : 0u);
  // Zero or subnormal: 2^-14 (1 + mantissa / 2^10) - 2^-14, exact in float32.
  const float sub = __builtin_bit_cast(float, o + (1u << 23)) - __builtin_bit_cast(float, 113u << 23);
  const uint32_t zero_or_subnormal = 0u - static_cast<uint32_t>(exp == 0);  // a mask: no branch on `sub`
  const uint32_t magnitude =
      (__builtin_bit_cast(uint32_t, sub) & zero_or_subnormal) | (o & ~zero_or_subnormal);
  return __builtin_bit_cast(float, magnitude | ((h & 0x8000u) << 16));
}
inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }

inline void store(c10::BFloat16* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  // Round to nearest even (c10::BFloat16's rule); NaN stays a quiet NaN.
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[i] = std::isnan(v) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}
inline void store(c10::Half* p, int64_t i, float v) {
  const int32_t bits = __builtin_bit_cast(int32_t, v);
  const int32_t a = bits & 0x7FFFFFFF;  // the magnitude's bits (signed compares: they vectorize)
  // NaN -> a quiet NaN, inf and what rounds past 65504 -> inf (the normal path's rounding carries there)
  const int32_t special = a > (255 << 23) ? 0x7E00 : 0x7C00;
  // Subnormal or zero: adding 2^-1 aligns the 10 mantissa bits at the bottom, rounded to nearest even.
  const int32_t subnormal = __builtin_bit_cast(int32_t, __builtin_bit_cast(float, a) + 0.5f) - (126 << 23);
  // Normal: rebias the exponent and round to nearest even on the 13 dropped bits.
  const int32_t normal = (a - ((127 - 15) << 23) + 0xFFF + ((a >> 13) & 1)) >> 13;
  const int32_t h = a >= ((127 + 16) << 23) ? special : (a < (113 << 23) ? subnormal : normal);
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(h | ((bits >> 16) & 0x8000));
}
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
      TORCH_CHECK(false, "lightning_ext cpu kernels: unsupported dtype ", x.scalar_type());
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
// The loops over the data, compiled twice where GCC can (x86-64-v3, i.e. AVX2 and FMA, and the
// baseline, picked at load time by the CPU's features: function multi-versioning), so the build runs
// on any x86-64 CPU. `omp simd` lets the reductions vectorize.

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define LE_F16C 1
#include <immintrin.h>
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

// The channel sums of len float16 elements into float32 a1, a2: with p = 0 their totals (one shift
// c[0]), with p > 0 element i's terms added to a1[k], a2[k] with shift c[k], k = i mod p (p a multiple
// of 8 for the vector loop); the moments' terms (u - c, (u - c)^2), or with grad the backward's (u,
// u (v - c)). Converted as half_affine's.
inline void half_terms_loop(bool grad, const c10::Half* u, const c10::Half* v, int64_t i0, int64_t len,
                            const float* c, float* a1, float* a2, int64_t p) {
  if (p == 0) {
    float t1 = 0.0f, t2 = 0.0f;
    if (grad) {
#pragma omp simd reduction(+ : t1, t2)
      for (int64_t i = i0; i < len; ++i) GradTerms::add(u, v, i, c[0], t1, t2);
    } else {
#pragma omp simd reduction(+ : t1, t2)
      for (int64_t i = i0; i < len; ++i) MomentTerms::add(u, v, i, c[0], t1, t2);
    }
    a1[0] += t1;
    a2[0] += t2;
    return;
  }
  for (int64_t i = i0, k = i0 % p; i < len; ++i, k = k + 1 == p ? 0 : k + 1) {
    if (grad) {
      GradTerms::add(u, v, i, c[k], a1[k], a2[k]);
    } else {
      MomentTerms::add(u, v, i, c[k], a1[k], a2[k]);
    }
  }
}
#if defined(LE_F16C)
__attribute__((target("default"))) void half_terms(bool grad, const c10::Half* u, const c10::Half* v, int64_t len,
                                                   const float* c, float* a1, float* a2, int64_t p) {
  half_terms_loop(grad, u, v, 0, len, c, a1, a2, p);
}
__attribute__((target("arch=x86-64-v3"))) void half_terms(bool grad, const c10::Half* u, const c10::Half* v,
                                                          int64_t len, const float* c, float* a1, float* a2,
                                                          int64_t p) {
  __m256 t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps();
  int64_t i = 0;
  for (int64_t k = 0; i + 8 <= len; i += 8, k = k + 8 == p ? 0 : k + 8) {  // k = i mod p
    const __m256 vc = p ? _mm256_loadu_ps(c + k) : _mm256_set1_ps(c[0]);
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + i)));
    __m256 e1 = _mm256_sub_ps(x, vc), e2 = _mm256_mul_ps(e1, e1);
    if (grad) {
      const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)));
      e1 = x;
      e2 = _mm256_mul_ps(x, _mm256_sub_ps(y, vc));
    }
    if (p) {
      _mm256_storeu_ps(a1 + k, _mm256_add_ps(_mm256_loadu_ps(a1 + k), e1));
      _mm256_storeu_ps(a2 + k, _mm256_add_ps(_mm256_loadu_ps(a2 + k), e2));
    } else {
      t1 = _mm256_add_ps(t1, e1);
      t2 = _mm256_add_ps(t2, e2);
    }
  }
  if (p == 0) {  // the 8 lanes' totals
    alignas(32) float l1[8], l2[8];
    _mm256_store_ps(l1, t1);
    _mm256_store_ps(l2, t2);
    for (int j = 0; j < 8; ++j) {
      a1[0] += l1[j];
      a2[0] += l2[j];
    }
  }
  half_terms_loop(grad, u, v, i, len, c, a1, a2, p);
}
#else
void half_terms(bool grad, const c10::Half* u, const c10::Half* v, int64_t len, const float* c, float* a1,
                float* a2, int64_t p) {
  half_terms_loop(grad, u, v, 0, len, c, a1, a2, p);
}
#endif

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
      if constexpr (std::is_same_v<T, c10::Half> && std::is_same_v<Acc, float>) {
        half_terms(std::is_same_v<Terms, GradTerms>, u_run + b0, v_run + b0, end - b0, &c, &a1, &a2, 0);
      } else {
#pragma omp simd reduction(+ : a1, a2)
        for (int64_t i = b0; i < end; ++i) Terms::add(u_run, v_run, i, c, a1, a2);
      }
      t1 += a1;
      t2 += a2;
    }
  }
  *s1 = t1;
  *s2 = t2;
}

// out[i] = a[k] u[i] + b[k] v[i] + d[k] over len float16 elements, k = i mod p (p = 0: k = 0, the same
// coefficients for all; v may be null: no b term). The baseline's loop converts by bit operations
// (load, store); the x86-64-v3 version with F16C, 8 elements an instruction, as ATen's loops (a
// function per target, picked at load time: GCC's multi-versioning), p a multiple of 8.
inline void half_affine_loop(const c10::Half* u, const c10::Half* v, c10::Half* out, int64_t i0, int64_t len,
                             const float* a, const float* b, const float* d, int64_t p) {
  const int64_t period = p ? p : 1;  // (p = 0: k stays 0)
  for (int64_t i = i0, k = i0 % period; i < len; ++i, k = k + 1 == period ? 0 : k + 1) {
    store(out, i, a[k] * load(u, i) + (v == nullptr ? 0.0f : b[k] * load(v, i)) + d[k]);
  }
}
#if defined(LE_F16C)
__attribute__((target("default"))) void half_affine(const c10::Half* u, const c10::Half* v, c10::Half* out,
                                                    int64_t len, const float* a, const float* b, const float* d,
                                                    int64_t p) {
  half_affine_loop(u, v, out, 0, len, a, b, d, p);
}
__attribute__((target("arch=x86-64-v3"))) void half_affine(const c10::Half* u, const c10::Half* v, c10::Half* out,
                                                           int64_t len, const float* a, const float* b,
                                                           const float* d, int64_t p) {
  int64_t i = 0;
  if (p == 0) {  // one channel's coefficients for every element
    const __m256 va = _mm256_set1_ps(*a), vb = _mm256_set1_ps(v == nullptr ? 0.0f : *b), vd = _mm256_set1_ps(*d);
    for (; i + 8 <= len; i += 8) {
      __m256 r = _mm256_fmadd_ps(va, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + i))), vd);
      if (v != nullptr) {
        r = _mm256_fmadd_ps(vb, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))), r);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  for (int64_t k = 0; p && i + 8 <= len; i += 8, k = k + 8 == p ? 0 : k + 8) {  // k = i mod p; a u + b v + d
    const __m256 va = _mm256_loadu_ps(a + k), vd = _mm256_loadu_ps(d + k);
    __m256 r = _mm256_mul_ps(va, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + i))));
    if (v != nullptr) {
      const __m256 vb = _mm256_loadu_ps(b + k);
      r = _mm256_fmadd_ps(vb, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i))), r);
    }
    const __m128i h = _mm256_cvtps_ph(_mm256_add_ps(r, vd), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  half_affine_loop(u, v, out, i, len, a, b, d, p);
}
#else
void half_affine(const c10::Half* u, const c10::Half* v, c10::Half* out, int64_t len, const float* a,
                 const float* b, const float* d, int64_t p) {
  half_affine_loop(u, v, out, 0, len, a, b, d, p);
}
#endif

// The NCHW planes p0 .. p1 - 1 of len elements each, in memory order (plane p: channel k = p mod c):
// out = a[k] u + b[k] v + d[k] (v may be null: no b term).
template <typename T, typename Acc>
LE_CLONES void planes_affine(const T* u, const T* v, T* out, int64_t p0, int64_t p1, int64_t len, int64_t c,
                             const Acc* a, const Acc* b, const Acc* d) {
  for (int64_t p = p0, k = p0 % c; p < p1; ++p, k = k + 1 == c ? 0 : k + 1) {
    const T *__restrict__ u_p = u + p * len, *__restrict__ v_p = v == nullptr ? nullptr : v + p * len;
    T* __restrict__ o_p = out + p * len;
    const Acc ak = a[k], bk = b[k], dk = d[k];
    if constexpr (std::is_same_v<T, c10::Half>) {
      half_affine(u_p, v_p, o_p, len, &ak, &bk, &dk, 0);
    } else if (v_p == nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) store(o_p, i, ak * load(u_p, i) + dk);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) store(o_p, i, ak * load(u_p, i) + bk * load(v_p, i) + dk);
    }
  }
}

// Channels-last: `rows` consecutive rows of `nc` channels, accumulated per channel into a1/a2
// (c: the per-channel shift or mean).
template <typename Terms, typename T, typename Acc>
LE_CLONES void rows_terms(const T* u, const T* v, int64_t rows, int64_t nc, const Acc* c, Acc* a1, Acc* a2) {
  if constexpr (std::is_same_v<T, c10::Half> && std::is_same_v<Acc, float>) {
    const bool grad = std::is_same_v<Terms, GradTerms>;
    const int64_t p = std::lcm(nc, int64_t{8});
    if (nc % 8 == 0) {  // the rows as one run: element i is channel i mod nc's
      half_terms(grad, u, v, rows * nc, c, a1, a2, nc);
    } else if (p <= MAX_PERIOD) {  // few channels (a row shorter than a vector, or hardly longer): the
      // rows as one run, the shifts and sums repeated over lcm(nc, 8) elements, folded back per channel
      float rep[3 * MAX_PERIOD] = {};
      for (int64_t k = 0, j = 0; k < p; ++k, j = j + 1 == nc ? 0 : j + 1) rep[k] = c[j];
      half_terms(grad, u, v, rows * nc, rep, rep + p, rep + 2 * p, p);
      for (int64_t k = 0, j = 0; k < p; ++k, j = j + 1 == nc ? 0 : j + 1) {
        a1[j] += rep[p + k];
        a2[j] += rep[2 * p + k];
      }
    } else {  // a row at a time: the vector loop over its first channels, the rest element by element
      for (int64_t r = 0; r < rows; ++r) half_terms(grad, u + r * nc, v + r * nc, nc, c, a1, a2, nc);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * nc;
#pragma omp simd
    for (int64_t k = 0; k < nc; ++k) Terms::add(u + base, v + base, k, c[k], a1[k], a2[k]);
  }
}

template <typename T, typename Acc>
LE_CLONES void rows_affine(
    const T* u, const T* v, T* out, int64_t rows, int64_t c, const Acc* a, const Acc* b, const Acc* d) {
  if constexpr (std::is_same_v<T, c10::Half>) {  // the rows as one run, the coefficients over lcm(c, 8)
    if (c % 8 == 0) {  // the caller's coefficients as they are
      half_affine(u, v, out, rows * c, a, b, d, c);
      return;
    }
    const int64_t p = std::lcm(c, int64_t{8});
    std::vector<float> rep(3 * p);
    for (int64_t k = 0, j = 0; k < p; ++k, j = j + 1 == c ? 0 : j + 1) {
      rep[k] = a[j];
      rep[p + k] = b[j];
      rep[2 * p + k] = d[j];
    }
    half_affine(u, v, out, rows * c, rep.data(), rep.data() + p, rep.data() + 2 * p, p);
    return;
  }
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
  if (!l.channels_last) {  // the (sample, channel) planes in memory order: each thread streams one range
    at::parallel_for(0, l.n * l.c, std::max<int64_t>(1, AFFINE_GRAIN / l.s), [&](int64_t p0, int64_t p1) {
      planes_affine<T, Acc>(u, v, out, p0, p1, l.s, l.c, a, b, d);
    });
    return;
  }
  at::parallel_for(0, l.rows, ROW_BLOCK, [&](int64_t r0, int64_t r1) {
    const int64_t base = r0 * l.c;
    rows_affine<T, Acc>(u + base, v == nullptr ? nullptr : v + base, out + base, r1 - r0, l.c, a, b, d);
  });
}

// ------------------------------------------------------------------------------ batch norm

// Channel k's local center: the median of up to CENTER_SAMPLES finite elements spread evenly over it
// (positions j (rows - 1) / (m - 1)), the shift where none is finite (no inf - inf): a value of the
// data's bulk, whatever one element is.
constexpr int64_t CENTER_SAMPLES = 33;
template <typename T, typename Acc>
Acc local_center(const T* xp, const Layout& l, int64_t k, double shift) {
  const int64_t m = std::min(CENTER_SAMPLES, l.rows);
  std::vector<Acc> seen;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t r = m > 1 ? j * (l.rows - 1) / (m - 1) : 0;
    const Acc v = load(xp, l.channels_last ? r * l.c + k : (r / l.s) * l.c * l.s + k * l.s + r % l.s);
    if (std::isfinite(v)) seen.push_back(v);
  }
  if (seen.empty()) return static_cast<Acc>(shift);
  const auto mid = seen.begin() + (seen.size() - 1) / 2;  // the lower median, as torch.nanmedian
  std::nth_element(seen.begin(), mid, seen.end());
  return *mid;
}

// p[1..2C] = [sum(x - shift), sum((x - shift)^2)] per channel of xd, elements in Acc. The pass sums
// about a LOCAL shift f, a value of the channel's bulk (local_center), so that float32 partial sums see
// deviations of the data's own spread even when the common shift (the running mean) is far from the
// data, or one element is; the float64 totals are then moved to the common shift c:
// sum(x - c) = t1 + n d, sum((x - c)^2) = t2 + 2 d t1 + n d^2, d = f - c.
template <typename T, typename Acc>
void moment_sums(const T* xp, const Layout& l, const std::vector<double>& s, double* p) {
  const int64_t c = l.c;
  std::vector<Acc> local(c);
  for (int64_t k = 0; k < c; ++k) local[k] = local_center<T, Acc>(xp, l, k, s[k]);
  const Acc* fp = local.data();
  channel_sums<Acc>(
      l, p + 1, p + 1 + c,
      [xp, fp, &l](int64_t k, double* s1, double* s2) {
        channel_terms<MomentTerms, T, Acc>(xp + k * l.s, xp + k * l.s, l.n, l.c * l.s, l.s, fp[k], s1, s2);
      },
      [xp, fp, c](int64_t off, int64_t rows, Acc* a1, Acc* a2) {
        rows_terms<MomentTerms, T, Acc>(xp + off, xp + off, rows, c, fp, a1, a2);
      });
  const double count = static_cast<double>(l.rows);
  for (int64_t k = 0; k < c; ++k) {
    const double d = static_cast<double>(local[k]) - s[k];
    const double t1 = p[1 + k];
    p[1 + k] = t1 + count * d;
    p[1 + c + k] = p[1 + c + k] + 2.0 * d * t1 + count * d * d;
  }
}

// [n, sum(x - shift), sum((x - shift)^2)] per channel, float64 (2C+1,). A float32 pass whose sums
// overflow (a channel spread beyond ~1e19) is redone in float64.
Tensor batch_norm_moments(const Tensor& x, const Tensor& shift) {
  Guards guards;
  const int64_t c = x.size(1);
  const std::vector<double> s = values(shift, c, 0.0);
  Tensor payload = at::zeros({2 * c + 1}, at::TensorOptions().dtype(at::kDouble));
  double* p = payload.data_ptr<double>();
  const int64_t n = c > 0 ? x.numel() / c : 0;
  p[0] = static_cast<double>(n);
  if (n == 0) return payload;
  const Tensor xd = dense(x, x);
  const Layout l = layout_of(xd);
  dispatch_input(xd, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = typename AccOf<T>::type;
    moment_sums<T, Acc>(xd.data_ptr<T>(), l, s, p);
    if (!std::is_same_v<Acc, double> && !std::all_of(p + 1, p + 1 + 2 * c, [](double v) { return std::isfinite(v); })) {
      moment_sums<T, double>(xd.data_ptr<T>(), l, s, p);
    }
  });
  return payload;
}

// running = running * (1 - factor) + value * factor, in place (float64 arithmetic; a strided or other-
// dtype buffer through a float64 copy).
void update_running(Tensor& buffer, const std::vector<double>& value, double factor) {
  const bool direct = buffer.is_contiguous() && buffer.scalar_type() == at::kDouble;
  Tensor work = direct ? buffer : buffer.to(at::kDouble).contiguous();
  double* r = work.data_ptr<double>();
  for (size_t k = 0; k < value.size(); ++k) r[k] = r[k] * (1.0 - factor) + value[k] * factor;
  if (!direct) buffer.copy_(work);
}

// Mean and invstd (float64 (C,)) of the group from its summed moments; the running statistics
// updated in place from the unbiased variance when given. An empty group: mean = shift.
std::tuple<Tensor, Tensor> batch_norm_gather_stats(
    const Tensor& payload, const Tensor& shift, std::optional<Tensor> running_mean,
    std::optional<Tensor> running_var, const Tensor& momentum, double eps) {
  Guards guards;
  const int64_t c = shift.size(0);
  const std::vector<double> p = values(payload, 2 * c + 1, 0.0), s = values(shift, c, 0.0);
  const double n = p[0], div = n > 0.0 ? n : 1.0;
  std::vector<double> mean(c), var(c);
  Tensor mean_t = at::empty({c}, at::TensorOptions().dtype(at::kDouble));
  Tensor invstd_t = at::empty({c}, at::TensorOptions().dtype(at::kDouble));
  double* mp = mean_t.data_ptr<double>();
  double* ip = invstd_t.data_ptr<double>();
  for (int64_t k = 0; k < c; ++k) {
    const double dev = p[1 + k] / div, v = p[1 + c + k] / div - dev * dev;
    var[k] = v < 0.0 ? 0.0 : v;  // clip at 0: NaN (non-finite input) stays NaN
    mean[k] = mp[k] = s[k] + dev;
    ip[k] = 1.0 / std::sqrt(var[k] + eps);
  }
  if (running_mean.has_value() && running_var.has_value()) {
    const double factor = momentum.item<double>();
    for (double& v : var) v *= n / (n - 1.0);
    update_running(*running_mean, mean, factor);
    update_running(*running_var, var, factor);
  }
  return {mean_t, invstd_t};
}

// y = (x - mean) * invstd * w + b = x * scale + (b - mean * scale), coefficients in float64.
Tensor batch_norm_elemt(
    const Tensor& x, const Tensor& mean, const Tensor& invstd, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias) {
  Guards guards;
  if (x.numel() == 0) return at::empty_like(x);
  const int64_t c = x.size(1);
  const std::vector<double> m = values(mean, c, 0.0), is = values(invstd, c, 1.0);
  const std::vector<double> w = values(weight, c, 1.0), b = values(bias, c, 0.0);
  const Tensor xd = dense(x, x);
  const Layout l = layout_of(xd);
  Tensor y = at::empty_like(xd);
  dispatch_input(xd, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = typename AccOf<T>::type;
    std::vector<Acc> scale(c), offset(c);
    for (int64_t k = 0; k < c; ++k) {
      const double sc = is[k] * w[k];
      scale[k] = static_cast<Acc>(sc);
      offset[k] = static_cast<Acc>(b[k] - m[k] * sc);
    }
    affine_pass<T, Acc>(l, xd.data_ptr<T>(), nullptr, y.data_ptr<T>(), scale.data(), scale.data(), offset.data());
  });
  return y;
}

// This shard's [sum(dy), sum(dy * (x - mean))] per channel, (2C,) in the statistics' dtype.
Tensor batch_norm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean) {
  Guards guards;
  const int64_t c = x.size(1);
  std::vector<double> s1(c, 0.0), s2(c, 0.0);
  if (x.numel() > 0) {
    const Tensor xd = dense(x, x);
    const Tensor dyd = dense(dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type()), xd);
    const Layout l = layout_of(xd);
    const std::vector<double> m = values(mean, c, 0.0);
    dispatch_input(xd, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      using Acc = typename AccOf<T>::type;
      const T* xp = xd.data_ptr<T>();
      const T* gp = dyd.data_ptr<T>();
      std::vector<Acc> mu(m.begin(), m.end());
      const Acc* mup = mu.data();
      channel_sums<Acc>(
          l, s1.data(), s2.data(),
          [xp, gp, mup, &l](int64_t k, double* t1, double* t2) {
            channel_terms<GradTerms, T, Acc>(gp + k * l.s, xp + k * l.s, l.n, l.c * l.s, l.s, mup[k], t1, t2);
          },
          [xp, gp, mup, c](int64_t off, int64_t rows, Acc* a1, Acc* a2) {
            rows_terms<GradTerms, T, Acc>(gp + off, xp + off, rows, c, mup, a1, a2);
          });
    });
  }
  s1.insert(s1.end(), s2.begin(), s2.end());
  return at::tensor(s1, at::TensorOptions().dtype(at::kDouble)).to(stat_type(x));
}

// dx = dy * A + x * B + D with A = invstd w, B = -A invstd^2 G2 / n, D = -A G1 / n - B mean
// (float64 coefficients, rounded once to the element precision).
Tensor batch_norm_backward_elemt(
    const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
    const std::optional<Tensor>& weight, const Tensor& sums, const Tensor& count) {
  Guards guards;
  if (x.numel() == 0) return at::empty_like(x);
  const int64_t c = x.size(1);
  const Tensor xd = dense(x, x);
  const Tensor dyd = dense(dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type()), xd);
  Tensor dx = at::empty_like(xd);
  const Layout l = layout_of(xd);
  const std::vector<double> g = values(sums, 2 * c, 0.0);
  const std::vector<double> m = values(mean, c, 0.0), is = values(invstd, c, 1.0), w = values(weight, c, 1.0);
  const double n = count.item<double>();
  dispatch_input(xd, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using Acc = typename AccOf<T>::type;
    std::vector<Acc> a(c), b(c), d(c);
    for (int64_t k = 0; k < c; ++k) {
      const double ak = is[k] * w[k];
      const double bk = -ak * is[k] * is[k] * g[c + k] / n;
      a[k] = static_cast<Acc>(ak);
      b[k] = static_cast<Acc>(bk);
      d[k] = static_cast<Acc>(-ak * g[k] / n - bk * m[k]);
    }
    affine_pass<T, Acc>(l, dyd.data_ptr<T>(), xd.data_ptr<T>(), dx.data_ptr<T>(), a.data(), b.data(), d.data());
  });
  return dx;
}

// ------------------------------------------------------------------------------ loss scaling

// Whether any of n elements is inf/NaN: its exponent bits are all ones (bit patterns, so it
// vectorizes; `mask` is the exponent mask of the type, U its unsigned integer of the same width).
template <typename U>
LE_CLONES bool any_nonfinite(const U* p, int64_t n, U mask) {
  U bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<U>((p[i] & mask) == mask);
  return bad != 0;
}

template <typename U>
bool tensor_nonfinite(const Tensor& t, U mask) {
  const Tensor d = t.contiguous();
  const U* p = static_cast<const U*>(d.const_data_ptr());
  bool found = false;
  at::parallel_for(0, d.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    if (any_nonfinite<U>(p + i0, i1 - i0, mask)) found = true;  // a benign race: only ever set
  });
  return found;
}

// float32 0-dim: 1.0 iff any element of any tensor is inf or NaN. Reads each element once (the
// tensors are on the CPU, `device`).
Tensor check_finite(const std::vector<Tensor>& tensors, const at::Device& /*device*/) {
  Guards guards;
  bool found = false;
  for (const Tensor& t : tensors) {
    if (found) break;
    switch (t.scalar_type()) {
      case at::kFloat: found = tensor_nonfinite<uint32_t>(t, 0x7F800000u); break;
      case at::kDouble: found = tensor_nonfinite<uint64_t>(t, 0x7FF0000000000000ull); break;
      case at::kHalf: found = tensor_nonfinite<uint16_t>(t, 0x7C00u); break;
      case at::kBFloat16: found = tensor_nonfinite<uint16_t>(t, 0x7F80u); break;
      default: found = !t.isfinite().all().item<bool>();  // other floating types: ATen
    }
  }
  return at::scalar_tensor(found ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat));
}

// ------------------------------------------------------------------------------ statistics

// Per-element arithmetic of the moments: float32 for float16/bfloat16/float32 input (16 lanes, two
// AVX2 registers; each lane sums at most 32 terms before the float64 total takes them), float64
// otherwise (8 lanes, one float64 sum per lane).
template <typename T>
using MomentAcc = std::conditional_t<
    std::is_same_v<T, float> || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, double>;

struct Moments {
  double s1 = 0.0, s2 = 0.0, nonfinite = 0.0;
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
};

template <typename Acc, typename T>
inline Acc value(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    return load(p, i);
  } else {
    return static_cast<Acc>(p[i]);
  }
}

// Shifted sums and extremes of p[0..n): per-lane partial sums in Acc, flushed into float64 totals.
// Careful: of its finite values only, and the count of the others (`v - v == 0` is false exactly for NaN
// and +-inf), every value selected after its arithmetic (with -fno-trapping-math the loop vectorizes).
// Otherwise every value counts: any NaN or +-inf makes s1 non-finite, and the careful pass follows.
template <bool Careful, typename T, typename Acc = MomentAcc<T>>
LE_CLONES Moments moments_range(const T* p, int64_t n, Acc shift) {
  constexpr int kLanes = std::is_same_v<Acc, float> ? 16 : 8;
  constexpr int64_t kBlock = std::is_same_v<Acc, float> ? 32 * kLanes : std::numeric_limits<int64_t>::max();
  constexpr Acc kInf = std::numeric_limits<Acc>::infinity();
  Acc lo[kLanes], hi[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    lo[j] = kInf;
    hi[j] = -kInf;
  }
  double t1[kLanes] = {}, t2[kLanes] = {}, tb[kLanes] = {};  // float64 totals per lane
  auto add = [&](Acc v, Acc* s1, Acc* s2, Acc* bad, int j) {
    const bool finite = !Careful || v - v == Acc(0);
    const Acc d0 = v - shift, d = finite ? d0 : Acc(0);
    const Acc vlo = finite ? v : kInf, vhi = finite ? v : -kInf;
    s1[j] += d;
    s2[j] += d * d;
    lo[j] = vlo < lo[j] ? vlo : lo[j];
    hi[j] = vhi > hi[j] ? vhi : hi[j];
    bad[j] += finite ? Acc(0) : Acc(1);
  };
  for (int64_t b0 = 0; b0 < n; b0 = (kBlock >= n - b0) ? n : b0 + kBlock) {
    const int64_t end = (kBlock >= n - b0) ? n : b0 + kBlock;
    const int64_t body = end - (end - b0) % kLanes;
    Acc s1[kLanes] = {}, s2[kLanes] = {}, bad[kLanes] = {};
    for (int64_t i = b0; i < body; i += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) add(value<Acc>(p, i + j), s1, s2, bad, j);
    }
    for (int64_t i = body; i < end; ++i) add(value<Acc>(p, i), s1, s2, bad, 0);
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      t1[j] += s1[j];
      t2[j] += s2[j];
      tb[j] += bad[j];
    }
  }
  Moments m;
  for (int j = 0; j < kLanes; ++j) {
    m.s1 += t1[j];
    m.s2 += t2[j];
    m.nonfinite += tb[j];
    m.lo = std::min(m.lo, static_cast<double>(lo[j]));
    m.hi = std::max(m.hi, static_cast<double>(hi[j]));
  }
  return m;
}

inline void merge(Moments& total, const Moments& m) {
  total.s1 += m.s1;
  total.s2 += m.s2;
  total.nonfinite += m.nonfinite;
  total.lo = std::min(total.lo, m.lo);
  total.hi = std::max(total.hi, m.hi);
}

// Shifted sums and extremes of p[0..n) in fixed-order thread chunks, summed about `shift` in Acc.
template <bool Careful, typename T, typename Acc>
Moments moments_of(const T* p, int64_t n, Acc shift) {
  const int chunks = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n >> 15, 1)));
  std::vector<Moments> parts(chunks);
  const int64_t per = (n + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t i0 = k * per, i1 = std::min(n, i0 + per);
      if (i0 < i1) parts[k] = moments_range<Careful, T, Acc>(p + i0, i1 - i0, shift);
    }
  });
  Moments total;
  for (const Moments& m : parts) merge(total, m);  // fixed order: the same result for the same thread count
  return total;
}

// The careful pass where the plain one met a non-finite value (or a square beyond Acc's range).
template <typename T, typename Acc>
Moments finite_moments_of(const T* p, int64_t n, Acc shift) {
  const Moments plain = moments_of<false, T, Acc>(p, n, shift);
  return std::isfinite(plain.s1) && std::isfinite(plain.s2) ? plain : moments_of<true, T, Acc>(p, n, shift);
}

// Whether float32 partial sums about `shift` (a float32 value) are as accurate as documented for the
// finite data in [m.lo, m.hi]: with d = max |x - shift|, no square overflows (32 terms per lane, each
// below 2^120) and no large one underflows (d >= 2^-40: squares above 2^-46 d^2 are normal). No finite
// value (lo = +inf): nothing was summed.
bool float32_sums_hold(const Moments& m, double shift) {
  if (!std::isfinite(m.lo) || !std::isfinite(m.hi)) return true;
  const double d = std::max(m.hi - shift, shift - m.lo);
  return d == 0.0 || (d >= 0x1p-40 && d <= 0x1p60);
}

// acc (float64 (6,)) += [n, sum(x - shift), sum((x - shift)^2)] over the n finite values of x, acc[3] =
// min, acc[4] = max of them, acc[5] += the count of the others (NaN, +-inf). Float input sums about the
// shift rounded to float32, moved to the float64 shift in float64: sum(x - c) = t1 + n d, sum((x - c)^2)
// = t2 + 2 d t1 + n d^2, d = c32 - c; values too far from the shift (or too close to it) for float32
// squares take a float64 pass instead. A NaN shift (a row without values yet) becomes the first finite
// value of x (NaN without one).
void accumulate_moments_(Tensor& acc, const Tensor& x, Tensor& shift) {
  TORCH_CHECK(acc.numel() == 6 && acc.scalar_type() == at::kDouble && acc.is_contiguous() && shift.numel() == 1 &&
                  shift.scalar_type() == at::kDouble,
              "accumulate_moments_: `acc` must be a contiguous float64 row of 6 and `shift` one float64, got ",
              acc.scalar_type(), " ", acc.sizes(), " and ", shift.scalar_type(), " ", shift.sizes());
  if (x.numel() == 0) return;
  Guards guards;
  const Tensor xd = x.contiguous();
  double* const shift_at = shift.data_ptr<double>();
  double c = *shift_at;
  Moments total;
  double used_shift = c;
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, xd.scalar_type(), "accumulate_moments_", [&] {
    using Acc = MomentAcc<scalar_t>;
    const scalar_t* p = xd.const_data_ptr<scalar_t>();
    if (std::isnan(c)) {  // the first finite element (the row's shift stays NaN without one)
      int64_t i = 0;
      while (i < xd.numel() && !std::isfinite(static_cast<double>(p[i]))) ++i;
      c = i < xd.numel() ? (*shift_at = static_cast<double>(p[i])) : 0.0;
    }
    used_shift = static_cast<double>(static_cast<Acc>(c));
    total = finite_moments_of<scalar_t, Acc>(p, xd.numel(), static_cast<Acc>(c));
    if (!std::is_same_v<Acc, double> && !float32_sums_hold(total, used_shift)) {
      used_shift = c;
      total = finite_moments_of<scalar_t, double>(p, xd.numel(), c);
    }
  });
  const double count = static_cast<double>(xd.numel()) - total.nonfinite, d = used_shift - c;
  double* a = acc.data_ptr<double>();
  a[0] += count;
  if (d == 0.0) {  // the usual case (the shift is a value of the data): no correction, no 0 * inf
    a[1] += total.s1;
    a[2] += total.s2;
  } else {
    a[1] += total.s1 + count * d;
    a[2] += total.s2 + (2.0 * d * total.s1 + count * d * d);
  }
  a[3] = std::min(a[3], total.lo);
  a[4] = std::max(a[4], total.hi);
  a[5] += total.nonfinite;
}

// accumulate_histogram_ (contract: KernelBackend.accumulate_histogram_; layout and reference:
// lightning_ext/kernels/histogram.py): hist[(m + 1) +- j] += 1 per finite value v, j = the number of
// the m + 1 edges below |v| (torch.bucketize), the sign of v choosing +-; NaN and +-inf are not counted.
//
// Geometric edges e_j = e_0 gamma^j (DDSketch's, Masson, Rim & Lee, VLDB 2019) put |v| in bucket
// ceil(log_gamma(|v| / e_0)). A vectorized pass over HIST_BLOCK values guesses j from a float32
// logarithm (exponent bits and a cubic in the mantissa, within 0.0014 of log2: 0.05 bucket at
// gamma = 1.0202), clamped to [0, m + 1], and checks it against its two edges, gathered; a scalar
// pass counts, and moves the rare wrong guesses (values next to an edge, or edges far from geometric)
// by HIST_STEPS neighbour steps, else by a binary search over all edges: exact for any increasing
// edges.
//
// The comparisons are those of |v| in float64 with the float64 edges, made in the type C of the
// value: float32 for float16/bfloat16/float32 and 8/16-bit integer input (their values are float32
// values), with each edge rounded DOWN to float32, ed = RD(e): for a float32 a, e < a <=> ed < a and
// a <= e <=> a <= ed (no float32 lies strictly between ed and e); float64 for float64, int32 and int64
// input (converted as ATen's .to(float64), to nearest). Each thread chunk of the input counts into its
// own int64 histogram (NaN and +-inf into a trash slot); the chunks' counts are summed in a fixed order and added
// once per bucket, as the reference's bincount, so the float64 counts equal the reference's. At most
// HIST_SMALL values (report() of a scalar) skip the tables: float64 comparisons value by value.

constexpr int64_t HIST_BLOCK = 512;      // values per guess-then-count round (positions stay in L1)
constexpr int HIST_STEPS = 3;            // neighbour steps before a binary search over all edges
constexpr int64_t HIST_GRAIN = 1 << 14;  // values per thread chunk at least
constexpr int64_t HIST_SMALL = 64;       // at most this many values: no tables, no threads

template <typename T>
using HistCompare = std::conditional_t<
    std::is_same_v<T, double> || std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>, double, float>;

// What the guess needs: log2(e_0) and 1 / log2(gamma) for gamma = e_1 / e_0, and the largest j; where
// the edges give no usable ratio (one edge, non-positive or non-finite ones, 2^24 or more edges: j no
// longer exact in float32) every guess is 0.
struct HistGuess {
  float log2_e0 = 0.0f, inv_log2_gamma = 0.0f, top = 0.0f;
};

HistGuess hist_guess(const double* edges, int64_t m) {
  HistGuess g;
  const bool ratio = m >= 1 && edges[0] > 0.0 && edges[1] > edges[0] && std::isfinite(edges[1]);
  if (ratio && m + 1 < (int64_t{1} << 24)) {
    const double l2e0 = std::log2(edges[0]), inv = 1.0 / std::log2(edges[1] / edges[0]);
    if (std::isfinite(l2e0) && std::isfinite(inv) && inv > 0.0) {
      g.log2_e0 = static_cast<float>(l2e0);
      g.inv_log2_gamma = static_cast<float>(inv);
      g.top = static_cast<float>(m + 1);
    }
  }
  return g;
}

// The guessed j of a magnitude f >= 0 (or NaN): ceil(log_gamma(f / e_0)) clamped to [0, m + 1].
// Branch-free (bit casts as __builtin_bit_cast: memcpy in an `omp simd` loop draws false
// -Wstringop-overflow warnings).
inline int32_t hist_guess_of(float f, const HistGuess& g) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  const float mant = __builtin_bit_cast(float, (bits & 0x7FFFFFu) | 0x3F800000u);  // in [1, 2)
  const float u = mant - 1.0f;
  const float log2_mant = ((0.153914771f * u - 0.567755742f) * u + 1.41348792f) * u + 0.00133410354f;
  const float log2_f = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127) + log2_mant;
  float t = (log2_f - g.log2_e0) * g.inv_log2_gamma;
  t = t > 0.0f ? t : 0.0f;  // NaN (0 * inf) too
  t = t < g.top ? t : g.top;
  const int32_t j = static_cast<int32_t>(t);
  return j + (static_cast<float>(j) < t);  // ceil(t)
}

// The edges between sentinels in the compare type: ext = [-inf, RD(e_0) .. RD(e_m), +inf] (bucket j:
// ext[j] < |v| <= ext[j + 1]), no bounds checks in the loops.
template <typename C>
std::vector<C> hist_edges(const double* edges, int64_t m) {
  std::vector<C> ext(m + 3);
  ext[0] = -std::numeric_limits<C>::infinity();
  for (int64_t k = 0; k <= m; ++k) {
    C e = static_cast<C>(edges[k]);  // to nearest: one step down where that rounded up
    if (static_cast<double>(e) > edges[k]) e = std::nextafter(e, -std::numeric_limits<C>::infinity());
    ext[k + 1] = e;
  }
  ext[m + 2] = std::numeric_limits<C>::infinity();
  return ext;
}

inline int32_t sign_bit(float v) { return static_cast<int32_t>(__builtin_bit_cast(uint32_t, v) >> 31); }
inline int32_t sign_bit(double v) { return static_cast<int32_t>(__builtin_bit_cast(uint64_t, v) >> 63); }

// pos[i] for p[0..len): the position m + 1 +- j of a value whose guess j is right, 2m + 3 (the trash
// slot) for NaN and +-inf, and -1 - j for a wrong guess j. Branch-free (signs from bits, a quiet
// comparison for the non-finite) so that it vectorizes, the edges gathered.
template <typename C, typename T>
LE_CLONES __attribute__((noinline)) void hist_positions(const T* __restrict p, int64_t len,
                                                       const C* __restrict ext, int32_t m, HistGuess g,
                                                       int32_t* __restrict pos) {
  const int32_t trash = 2 * m + 3;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const C c = value<C>(p, i);
    const C a = std::fabs(c);
    const float f = static_cast<float>(a);  // inf above float32's range, 0 below: clamped
    const int32_t j = hist_guess_of(f, g);
    const C lo = ext[j], hi = ext[j + 1];
    // Quiet comparisons: `<` may trap on NaN, which keeps GCC from if-converting (vectorizing) the loop.
    const bool right = std::isless(lo, a) & std::islessequal(a, hi);
    const bool nonfinite = !std::islessequal(a, std::numeric_limits<C>::max());
    const int32_t neg = -sign_bit(c);
    const int32_t q = m + 1 + ((j ^ neg) - neg);
    pos[i] = nonfinite ? trash : (right ? q : -1 - j);
  }
}

// The j of a magnitude a (not NaN) from a guess j in [0, m + 1]; ext as hist_edges gives it.
template <typename C>
inline int64_t hist_locate(const C* ext, int64_t m, C a, int64_t j) {
  for (int s = 0; s < HIST_STEPS; ++s) {
    if (ext[j + 1] < a) {
      ++j;
    } else if (ext[j] >= a) {
      --j;
    } else {
      return j;
    }
  }
  if (ext[j] < a && a <= ext[j + 1]) return j;
  return std::lower_bound(ext + 1, ext + m + 2, a) - (ext + 1);  // the number of edges below a
}

// counts (2m + 4,) int64 += the counts of p[0..n) (the last slot: NaN and +-inf).
template <typename C, typename T>
void histogram_range(const T* p, int64_t n, const C* ext, int64_t m, HistGuess g, int64_t* counts) {
  int32_t pos[HIST_BLOCK];
  for (int64_t b0 = 0; b0 < n; b0 += HIST_BLOCK) {
    const int64_t len = std::min(HIST_BLOCK, n - b0);
    hist_positions<C>(p + b0, len, ext, static_cast<int32_t>(m), g, pos);
    for (int64_t i = 0; i < len; ++i) {
      int64_t q = pos[i];
      if (q < 0) {
        const C c = value<C>(p, b0 + i);
        const int64_t j = hist_locate<C>(ext, m, std::fabs(c), -1 - q);
        q = m + 1 + (sign_bit(c) ? -j : j);
      }
      ++counts[q];
    }
  }
}

// The number of the edges e[0..m] below a >= 0 (torch.bucketize): the guess, settled by neighbour
// steps, else by a binary search.
inline int64_t edge_index(const double* e, int64_t m, const HistGuess& g, double a) {
  int64_t j = hist_guess_of(static_cast<float>(a), g);
  for (int s = 0; s < HIST_STEPS && j <= m && e[j] < a; ++s) ++j;
  for (int s = 0; s < HIST_STEPS && j > 0 && e[j - 1] >= a; ++s) --j;
  if ((j <= m && e[j] < a) || (j > 0 && e[j - 1] >= a)) j = std::lower_bound(e, e + m + 1, a) - e;
  return j;
}

// hist += the counts of p[0..n), n <= HIST_SMALL, from float64 comparisons with the edges e themselves.
template <typename T>
void histogram_small(const T* p, int64_t n, const double* e, int64_t m, HistGuess g, double* hist) {
  int64_t pos[HIST_SMALL];
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = value<double>(p, i);
    if (!std::isfinite(v)) continue;
    const int64_t j = edge_index(e, m, g, std::fabs(v));
    pos[k++] = m + 1 + (v < 0.0 ? -j : j);
  }
  std::sort(pos, pos + k);  // one float64 add per bucket, as the large path
  for (int64_t i = 0; i < k;) {
    int64_t r = i;
    while (r < k && pos[r] == pos[i]) ++r;
    hist[pos[i]] += static_cast<double>(r - i);
    i = r;
  }
}

// The dtypes the kernels read; other real ones (uint16/32/64, float8) are converted to float64 first.
bool hist_reads(at::ScalarType t) {
  switch (t) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kHalf: case at::kBFloat16: case at::kFloat: case at::kDouble:
      return true;
    default:
      return false;
  }
}

void accumulate_histogram_(Tensor& hist, const Tensor& x, const Tensor& edges) {
  Guards guards;
  const Tensor xd = hist_reads(x.scalar_type()) ? x.contiguous() : x.to(at::kDouble).contiguous();
  const Tensor ed = edges.contiguous();
  const int64_t n = xd.numel(), m = ed.numel() - 1, buckets = 2 * m + 3;
  TORCH_CHECK(m >= 0 && m < (int64_t{1} << 29), "accumulate_histogram_: 1 to 2^29 edges, got ", m + 1);
  TORCH_CHECK(hist.numel() == buckets && hist.scalar_type() == at::kDouble && hist.is_contiguous(),
              "accumulate_histogram_: `hist` must be a contiguous float64 tensor of 2m + 3 = ", buckets,
              " counts");
  const double* e = ed.const_data_ptr<double>();
  double* h = hist.data_ptr<double>();
  const HistGuess g = hist_guess(e, m);
  if (n <= HIST_SMALL) {
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, xd.scalar_type(), "accumulate_histogram_", [&] {
      histogram_small(xd.const_data_ptr<scalar_t>(), n, e, m, g, h);
    });
    return;
  }
  const int chunks =
      static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n / HIST_GRAIN, 1)));
  std::vector<int64_t> counts(static_cast<size_t>(chunks) * (buckets + 1), 0);
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, xd.scalar_type(), "accumulate_histogram_", [&] {
    using C = HistCompare<scalar_t>;
    const std::vector<C> ext = hist_edges<C>(e, m);
    const scalar_t* p = xd.const_data_ptr<scalar_t>();
    const int64_t per = (n + chunks - 1) / chunks;
    at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t i0 = k * per, i1 = std::min(n, i0 + per);
        if (i0 < i1) histogram_range<C>(p + i0, i1 - i0, ext.data(), m, g, counts.data() + k * (buckets + 1));
      }
    });
  });
  for (int64_t b = 0; b < buckets; ++b) {  // fixed order; exact int64 sums, one float64 add per bucket
    int64_t total = 0;
    for (int k = 0; k < chunks; ++k) total += counts[static_cast<size_t>(k) * (buckets + 1) + b];
    if (total != 0) h[b] += static_cast<double>(total);  // (+0.0 would change nothing but a -0.0)
  }
}


// ------------------------------------------------------------------------------ statistics flush
// moments_payload_ and moments_finish_ (contracts: KernelBackend): one loop over the R names each, the
// float64 operations of the reference (lightning_ext/kernels/moments.py) in the same order.

double finite_or_zero(double v) { return std::isfinite(v) ? v : 0.0; }

double max_nan(double a, double b) {  // torch.maximum: NaN if either is NaN
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

double clamp_min_zero(double v) { return v < 0.0 ? 0.0 : v; }  // clamp_min(0): NaN stays NaN

// The flush ops read and write their tensors through raw pointers: each must be contiguous and of its
// dtype (a strided view would be read as the wrong elements, silently).
void check_flat(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> args,
                at::ScalarType dtype = at::kDouble) {
  for (const auto& [name, t] : args) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == dtype && t->device().is_cpu(), op, ": `", name,
                "` must be a contiguous ", dtype, " CPU tensor, got ", t->scalar_type(), " on ", t->device(),
                " with strides ", t->strides());
  }
}

// max_payload (H + 5R,) = [head | bound | max | -min | mean | -mean | mean with the rank in its low bits];
// sum_payload (R, 5) = [n, m2, n d, n d^2, nonfinite]; rows (R, 6) = [n, S1, S2, min, max, nonfinite].
void moments_payload_(Tensor& max_payload, Tensor& sum_payload, const Tensor& rows, const Tensor& shifts,
                      const Tensor& center, const std::vector<double>& head, const Tensor& counted,
                      int64_t rank, int64_t rank_bits) {
  check_flat("moments_payload_", {{"max_payload", &max_payload}, {"sum_payload", &sum_payload},
                                  {"rows", &rows}, {"shifts", &shifts}, {"center", &center}});
  check_flat("moments_payload_", {{"counted", &counted}}, at::kLong);
  const int64_t r = rows.size(0), h = static_cast<int64_t>(head.size()) + 1;
  const double* s = rows.const_data_ptr<double>();
  const double* a = shifts.const_data_ptr<double>();
  const double* c = center.const_data_ptr<double>();
  const int64_t* at = counted.const_data_ptr<int64_t>();
  double* mx = max_payload.data_ptr<double>();
  double* out = sum_payload.data_ptr<double>();
  const double ninf = -std::numeric_limits<double>::infinity();
  std::copy(head.begin(), head.end(), mx);
  mx[h - 1] = 1.0;  // the largest count of the counted rows, at least 1
  for (int64_t j = 0; j < counted.numel(); ++j) mx[h - 1] = std::max(mx[h - 1], s[6 * at[j]]);
  double *hi = mx + h, *neg_lo = hi + r, *mean_max = neg_lo + r, *neg_mean_min = mean_max + r;
  double* packed = neg_mean_min + r;
  const uint64_t mask = (uint64_t{1} << rank_bits) - 1;
  for (int64_t i = 0; i < r; ++i) {
    const double* row = s + 6 * i;
    const double n = row[0];
    const bool has = n > 0;
    const double safe_n = has ? n : 1.0;
    const double mean = has ? finite_or_zero(a[i]) + row[1] / safe_n : 0.0;
    const double m2 = has ? clamp_min_zero(row[2] - row[1] * row[1] / safe_n) : 0.0;
    const double d = has ? mean - finite_or_zero(c[i]) : 0.0;
    double* o = out + 5 * i;
    o[0] = n;
    o[1] = m2;
    o[2] = n * d;
    o[3] = n * d * d;
    o[4] = row[5];
    hi[i] = row[4];
    neg_lo[i] = -row[3];
    mean_max[i] = has ? mean : ninf;
    neg_mean_min[i] = has ? -mean : ninf;
    const uint64_t bits = (__builtin_bit_cast(uint64_t, mean) & ~mask) | static_cast<uint64_t>(rank);
    packed[i] = has ? __builtin_bit_cast(double, bits) : ninf;
  }
}

// published (R, 6) = [n, mean, std, min, max, nonfinite], next_shift (R,) and idle (R,) from the reduced
// payloads; flags (2,) = [whether a row needs another reduction around max(mean), rows idle >= forget_after];
// the accumulator rows (any R', 6) and their shifts emptied unless another reduction is needed.
void moments_finish_(Tensor& published, Tensor& next_shift, Tensor& idle, Tensor& flags, Tensor& rows,
                     Tensor& shifts, const Tensor& extremes, const Tensor& sum_payload, const Tensor& center,
                     bool keep_previous, int64_t forget_after) {
  check_flat("moments_finish_", {{"published", &published}, {"next_shift", &next_shift}, {"idle", &idle},
                                 {"flags", &flags}, {"rows", &rows}, {"shifts", &shifts},
                                 {"extremes", &extremes}, {"sum_payload", &sum_payload}, {"center", &center}});
  TORCH_CHECK(flags.numel() == 2, "moments_finish_: `flags` must hold 2 elements, got ", flags.numel());
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 6 && shifts.numel() == rows.size(0),
              "moments_finish_: `rows` must be (R', 6) and `shifts` (R',), got ", rows.sizes(), " and ",
              shifts.sizes());
  const int64_t r = sum_payload.size(0);
  const double* mx = extremes.const_data_ptr<double>();
  const double *hi = mx, *neg_lo = hi + r, *mean_max = neg_lo + r, *neg_mean_min = mean_max + r;
  const double* sp = sum_payload.const_data_ptr<double>();
  const double* c0 = center.const_data_ptr<double>();
  double* pub = published.data_ptr<double>();
  double* shift = next_shift.data_ptr<double>();
  double* quiet = idle.data_ptr<double>();
  const double eps = std::numeric_limits<double>::epsilon(), nan = std::numeric_limits<double>::quiet_NaN();
  bool again = false;
  double forgettable = 0.0;
  for (int64_t i = 0; i < r; ++i) {
    const double *o = sp + 5 * i, n = o[0], c = finite_or_zero(c0[i]);
    const bool has = n > 0;
    const double safe_n = has ? n : 1.0, spread = mean_max[i] + neg_mean_min[i];
    const double between = spread > 0 ? clamp_min_zero(o[3] - o[2] * o[2] / safe_n) : 0.0;
    const double m2 = has ? o[1] + between : 0.0;
    const double distance = max_nan(mean_max[i] - c, neg_mean_min[i] + c);
    again = again || (has && spread > 0 && 8 * eps * n * distance * distance > 1e-10 * m2);
    double* p = pub + 6 * i;
    if (has) {
      const double mean = spread == 0 ? mean_max[i] : c + o[2] / safe_n;
      p[0] = n;
      p[1] = mean;
      p[2] = std::sqrt(m2 / safe_n);
      p[3] = -neg_lo[i];
      p[4] = hi[i];
      p[5] = o[4];
      shift[i] = mean;
    } else if (o[4] > 0 || !keep_previous) {
      p[0] = 0.0;
      p[1] = p[2] = p[3] = p[4] = nan;
      p[5] = o[4];
    }
    quiet[i] = has || o[4] > 0 ? 0.0 : quiet[i] + 1.0;
    forgettable += forget_after > 0 && quiet[i] >= static_cast<double>(forget_after) ? 1.0 : 0.0;
  }
  double* out = flags.data_ptr<double>();
  out[0] = again ? 1.0 : 0.0;
  out[1] = forgettable;
  if (again) return;
  const double inf = std::numeric_limits<double>::infinity();
  double* row = rows.data_ptr<double>();
  double* s = shifts.data_ptr<double>();
  for (int64_t i = 0; i < rows.size(0); ++i, row += 6) {
    row[0] = row[1] = row[2] = row[5] = 0.0;
    row[3] = inf;
    row[4] = -inf;
    s[i] = nan;
  }
}

// pack_windows_ (contract and reference: lightning_ext/kernels/histogram.py): each sketch row's window of
// buckets between its reduced min and max at the smallest collapse level that fits, its counts packed
// `bits` bits a field, 53 / bits fields a float64 word; a hist row's buckets are read once and zeroed.

// The position of magnitude index j (edges below |v|, m + 1 for the overflow) of sign s at level c.
int64_t window_position(int64_t s, int64_t j, int64_t m, int64_t c) {
  const int64_t step = int64_t{1} << c, groups = (m + step - 1) >> c;
  return groups + 1 + s * (j > m ? groups + 1 : (j + step - 1) >> c);
}

// The sign and magnitude index of v (the edges below |v|): its position is window_position(s, j, m, c).
struct Place {
  int64_t s, j;
};

Place place_of(const double* e, int64_t m, const HistGuess& g, double v) {
  return {v > 0 ? 1 : v < 0 ? -1 : 0, edge_index(e, m, g, std::abs(v))};
}

int64_t position(Place p, int64_t m, int64_t c) { return window_position(p.s, p.j, m, c); }

void pack_windows_(Tensor& words, Tensor& hist, Tensor& layout, const Tensor& rows, const Tensor& shifts,
                   const Tensor& extremes, const Tensor& at, const Tensor& edges, int64_t bits,
                   int64_t max_words) {
  const int64_t q = hist.size(0), size = hist.size(1), n = at.numel(), r = rows.size(0);
  const int64_t m = edges.numel() - 1, k = 53 / bits, slots = max_words * k;
  TORCH_CHECK(bits >= 1 && bits <= 53 && slots >= 5, "pack_windows_: 1 to 53 bits and 5 fields at least");
  check_flat("pack_windows_", {{"words", &words}, {"hist", &hist}, {"rows", &rows}, {"shifts", &shifts},
                              {"extremes", &extremes}, {"edges", &edges}});
  check_flat("pack_windows_", {{"at", &at}, {"layout", &layout}}, at::kLong);
  TORCH_CHECK(layout.numel() == 3 * n + 2, "pack_windows_: `layout` must hold 3 N + 2 elements");
  const double *e = edges.const_data_ptr<double>(), *x = extremes.const_data_ptr<double>();
  const double *s = rows.const_data_ptr<double>(), *a = shifts.const_data_ptr<double>();
  const int64_t* name = at.const_data_ptr<int64_t>();
  int64_t *level = layout.data_ptr<int64_t>(), *start = level + n, *fields = start + n, widest = 0;
  std::fill(level, level + 3 * n + 2, int64_t{0});
  std::vector<int64_t> width(n, 0);
  const HistGuess g = hist_guess(e, m);
  for (int64_t i = 0; i < n; ++i) {  // values: [max | -min] of the name; rank means: [mean | -mean]
    const int64_t base = i < q ? 0 : 2 * r;
    const double hi = x[base + name[i]], lo = -x[base + r + name[i]];
    if (!(lo <= hi)) continue;
    const Place first = place_of(e, m, g, lo), last = place_of(e, m, g, hi);
    int64_t c = 0;
    while (position(last, m, c) - position(first, m, c) >= slots) ++c;
    level[i] = c, start[i] = position(first, m, c);
    width[i] = position(last, m, c) - start[i] + 1, widest = std::max(widest, width[i]);
    fields[i] = bits, ++level[3 * n + 1];
  }
  int64_t w = 1;
  while (w < max_words && w * k < widest) w <<= 1;
  w = level[3 * n] = std::min(w, max_words);  // words per row: a power of two, or max_words
  std::vector<uint64_t> packed(n * w, 0);
  auto put = [&](int64_t i, int64_t slot, uint64_t count) {
    slot = std::clamp<int64_t>(slot, 0, w * k - 1);
    packed[i * w + slot / k] += count << (bits * (slot % k));
  };
  for (int64_t i = 0; i < q; ++i) {  // the buckets between this rank's own min and max: its counts
    double* row = hist.data_ptr<double>() + i * size;
    const double* v = s + 6 * name[i];
    if (!width[i] || !(v[3] <= v[4])) continue;
    const int64_t last = position(place_of(e, m, g, v[4]), m, 0);
    for (int64_t b = position(place_of(e, m, g, v[3]), m, 0); b <= last; ++b) {
      if (row[b] == 0.0) continue;
      const int64_t d = b - (m + 1);
      put(i, window_position(d > 0 ? 1 : d < 0 ? -1 : 0, std::abs(d), m, level[i]) - start[i],
          static_cast<uint64_t>(row[b]));
      row[b] = 0.0;
    }
  }
  for (int64_t i = q; i < n; ++i) {  // this rank's mean of the name, if it had values
    const double* v = s + 6 * name[i];
    const double mean = v[0] > 0 ? finite_or_zero(a[name[i]]) + v[1] / v[0] : 0.0;
    if (width[i] && v[0] > 0) put(i, position(place_of(e, m, g, mean), m, level[i]) - start[i], 1);
  }
  double* wd = words.data_ptr<double>();
  for (int64_t j = 0; j < n * w; ++j) wd[j] = static_cast<double>(packed[j]);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The cpu kernel backend of lightning_ext (see lightning_ext/kernels/cpu.py).";
  m.def("batch_norm_moments", &batch_norm_moments);
  m.def("batch_norm_gather_stats", &batch_norm_gather_stats);
  m.def("batch_norm_elemt", &batch_norm_elemt);
  m.def("batch_norm_backward_reduce", &batch_norm_backward_reduce);
  m.def("batch_norm_backward_elemt", &batch_norm_backward_elemt);
  m.def("check_finite", &check_finite);
  m.def("accumulate_moments_", &accumulate_moments_);
  m.def("moments_payload_", &moments_payload_);
  m.def("moments_finish_", &moments_finish_);
  m.def("accumulate_histogram_", &accumulate_histogram_);
  m.def("pack_windows_", &pack_windows_);
}
