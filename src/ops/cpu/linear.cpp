#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/tier_rows.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/dnnl_util.h"
#include "ops/cpu/rows.h"

namespace apus::cpu {

dnnl::engine& dnnl_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream s(dnnl_engine());
  return s;
}

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::f32:
      return dnnl::memory::data_type::f32;
    case DType::bf16:
      return dnnl::memory::data_type::bf16;
    case DType::f16:
      return dnnl::memory::data_type::f16;
    default:
      fail("oneDNN: unsupported dtype ", dtype_name(t));
  }
}

Knob native_bf16_knob("cpu.native_bf16",
                      "bf16 GEMMs and convs on the CPU's bf16 instructions (AVX512-BF16, AMX), or widened to f32 "
                      "as on an AVX2-only CPU",
                      {"on", "off"});

bool native_bf16() {
  static const bool supported = [] {
    try {
      using namespace dnnl;
      const memory::desc md(memory::dims{16, 16}, memory::data_type::bf16, memory::format_tag::ab);
      matmul::primitive_desc(matmul::desc(md, md, md), dnnl_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  const bool native = supported && native_bf16_knob.value() == 0;
  native_bf16_knob.took(native ? 0 : 1);
  return native;
}

void widen_row(const void* p, DType dt, float* out, int64_t n) {
  if (dt == DType::bf16) return bf16_to_f32_row(static_cast<const uint16_t*>(p), out, n);
  if (dt == DType::f16) return f16_to_f32_row(static_cast<const uint16_t*>(p), out, n);
  APUS_CHECK(dt == DType::f32, "linear: widening ", dtype_name(dt), " is not supported");
  std::memcpy(out, p, size_t(n) * sizeof(float));
}

Knob widened_gemm_knob("cpu.widened_gemm",
                       "the widened (f32) GEMM: auto (apus's AVX2 kernel unless the CPU has AVX-512), apus's AVX2 "
                       "kernel over weights packed once per call, or oneDNN's sgemm on single-threaded 64-row tiles",
                       {"auto", "avx2", "onednn"});

namespace {

enum WidenedGemm { kAuto, kOwnAvx2, kOneDnnTiles };

// The AVX2 kernel where the knob asks for it, or by default on CPUs without AVX-512 (where
// oneDNN's tiles ran at 0.5-0.65x OpenBLAS; with AVX-512 oneDNN's wider kernel is the better one).
bool widened_by_sgemm_avx2() {
  if (!sgemm_avx2_supported()) return false;
  switch (widened_gemm_knob.value()) {
    case kOwnAvx2:
      return true;
    case kOneDnnTiles:
      return false;
    default: {
      static const bool avx512 = __builtin_cpu_supports("avx512f");
      return !avx512;
    }
  }
}

// A [rows, cols] view as contiguous f32 in `buf` (strides in elements).
Tensor widened(const void* data, DType dt, int64_t rows, int64_t cols, int64_t stride_r, int64_t stride_c,
               std::vector<float>& buf) {
  buf.resize(size_t(rows * cols));
  const size_t es = dtype_size(dt);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < cols; ++q) {
      const void* p = static_cast<const char*>(data) + size_t(r * stride_r + q * stride_c) * es;
      buf[size_t(r * cols + q)] = dt == DType::bf16  ? bf16_to_f32(*static_cast<const uint16_t*>(p))
                                  : dt == DType::f16 ? f16_to_f32(*static_cast<const uint16_t*>(p))
                                                     : *static_cast<const float*>(p);
    }
  Tensor t;
  t.dtype = DType::f32;
  t.shape = {rows, cols};
  t.data = buf.data();
  return t;
}

}  // namespace

namespace {
// Set on a thread while it runs one tile of the widened GEMM below, whose own product must not be
// tiled again: omp_in_parallel() cannot tell (a team of one thread, OMP_NUM_THREADS=1 as MPI ranks
// run, is not an active parallel region, and the tile recursed until the stack ran out).
thread_local bool in_widened_tile = false;
struct WidenedTile {
  WidenedTile() { in_widened_tile = true; }
  ~WidenedTile() { in_widened_tile = false; }
};
}  // namespace

void gemm(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n, const Tensor* bias,
          Tensor& c, int64_t k, int64_t n) {
  using namespace dnnl;
  using dims = memory::dims;
  const int64_t m = a.shape[0];
  const bool tiled = !native_bf16() && !in_widened_tile && !omp_in_parallel() && m > 0 && n > 0;
  if (tiled && widened_by_sgemm_avx2()) {
    widened_gemm_knob.took(kOwnAvx2);
    return sgemm_avx2(a, b, b_type, b_stride_k, b_stride_n, bias, c, k, n);
  }
  if (tiled) {
    widened_gemm_knob.took(kOneDnnTiles);
    // Without AVX512-BF16 oneDNN runs its sgemm, whose summation order depends on the call's shape
    // and thread split: a row's bits would depend on how many rows came with it, and a batch of
    // two would not equal two requests. Every call here is single-threaded on exactly kTile rows
    // (the last tile padded with zero rows), so a row's result depends on its own values only.
    constexpr int64_t kTile = 64;
    const size_t a_es = dtype_size(a.dtype), c_es = dtype_size(c.dtype);
    // The weight and bias widened to f32 once for all tiles, in their own layout: each tile
    // widened the whole weight again before (16 times for 1024 rows, a fifth of sgemm's rate).
    std::vector<float> wide_b, wide_bias;
    Tensor wide_bias_t;
    if (b_type != DType::f32) {
      const bool rows_of_k = b_stride_k == 1;  // [n][k], a linear's weight
      const int64_t outer = rows_of_k ? n : k, inner = rows_of_k ? k : n;
      const int64_t outer_stride = rows_of_k ? b_stride_n : b_stride_k;
      wide_b.resize(size_t(outer * inner));
      parallel_for(outer, [&](int64_t r) {
        widen_row(static_cast<const char*>(b) + dtype_bytes(b_type, r * outer_stride), b_type,
                  wide_b.data() + r * inner, inner);
      });
      b = wide_b.data();
      b_stride_k = rows_of_k ? 1 : n;
      b_stride_n = rows_of_k ? k : 1;
      b_type = DType::f32;
    }
    if (bias && bias->dtype != DType::f32) {
      wide_bias.resize(size_t(n));
      widen_row(bias->data, bias->dtype, wide_bias.data(), n);
      wide_bias_t.dtype = DType::f32;
      wide_bias_t.shape = {n};
      wide_bias_t.data = wide_bias.data();
      bias = &wide_bias_t;
    }
#pragma omp parallel for schedule(static)
    for (int64_t lo = 0; lo < m; lo += kTile) {
      const int64_t rows = std::min(kTile, m - lo);
      const WidenedTile tile;
      if (rows == kTile) {
        Tensor cp = c.rows(lo, lo + kTile);
        gemm(a.rows(lo, lo + kTile), b, b_type, b_stride_k, b_stride_n, bias, cp, k, n);
        continue;
      }
      thread_local std::vector<char> a_pad, c_pad;
      a_pad.resize(size_t(kTile * k) * a_es);
      c_pad.resize(size_t(kTile * n) * c_es);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(a_pad.data() + size_t(r * k) * a_es, a.row(lo + r), size_t(k) * a_es);
      std::memset(a_pad.data() + size_t(rows * k) * a_es, 0, size_t((kTile - rows) * k) * a_es);
      Tensor ap = a, cp = c;
      ap.shape = {kTile, k};
      ap.stride0 = 0;
      ap.data = a_pad.data();
      cp.shape = {kTile, n};
      cp.stride0 = 0;
      cp.data = c_pad.data();
      gemm(ap, b, b_type, b_stride_k, b_stride_n, bias, cp, k, n);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(c.row(lo + r), c_pad.data() + size_t(r * n) * c_es, size_t(n) * c_es);
    }
    return;
  }
  const bool any_bf16 =
      a.dtype == DType::bf16 || b_type == DType::bf16 || c.dtype == DType::bf16 || (bias && bias->dtype == DType::bf16);
  if (any_bf16 && !native_bf16()) {
    thread_local std::vector<float> wa, wb, wc, wbias;
    const Tensor af = widened(a.data, a.dtype, m, k, a.row_stride(), 1, wa);
    // An f32 weight (widened once by the tiling above) is used where it lies.
    const bool wide_b = b_type == DType::f32;
    const Tensor bf = wide_b ? Tensor{} : widened(b, b_type, k, n, b_stride_k, b_stride_n, wb);
    const bool wide_bias = !bias || bias->dtype == DType::f32;
    const Tensor biasf = wide_bias ? Tensor{} : widened(bias->data, bias->dtype, 1, n, n, 1, wbias);
    wc.resize(size_t(m * n));
    Tensor cf = af;
    cf.shape = {m, n};
    cf.data = wc.data();
    gemm(af, wide_b ? b : bf.data, DType::f32, wide_b ? b_stride_k : n, wide_b ? b_stride_n : 1,
         wide_bias ? bias : &biasf, cf, k, n);
    for (int64_t r = 0; r < m; ++r) store_row(c, r, wc.data() + r * n, n);
    return;
  }
  const KernelKey key("matmul", {m, k, n, int64_t(a.dtype), int64_t(b_type), int64_t(c.dtype), a.row_stride(),
                                 c.row_stride(), b_stride_k, b_stride_n, bias ? int64_t(bias->dtype) : -1});
  const memory::desc a_md(dims{m, k}, dnnl_type(a.dtype), dims{a.row_stride(), 1});
  const memory::desc b_md(dims{k, n}, dnnl_type(b_type), dims{b_stride_k, b_stride_n});
  const memory::desc c_md(dims{m, n}, dnnl_type(c.dtype), dims{c.row_stride(), 1});
  memory::desc bias_md;
  if (bias) bias_md = memory::desc(dims{1, n}, dnnl_type(bias->dtype), dims{n, 1});
  auto& prim = cached_primitive<matmul>(key, [&] {
    auto d = bias ? matmul::desc(a_md, b_md, bias_md, c_md) : matmul::desc(a_md, b_md, c_md);
    return matmul(matmul::primitive_desc(d, dnnl_engine()));
  });
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(a_md, dnnl_engine(), a.data)},
                                       {DNNL_ARG_WEIGHTS, memory(b_md, dnnl_engine(), const_cast<void*>(b))},
                                       {DNNL_ARG_DST, memory(c_md, dnnl_engine(), c.data)}};
  if (bias) args.emplace(DNNL_ARG_BIAS, memory(bias_md, dnnl_engine(), bias->data));
  run_primitive(key, [&] { prim.execute(dnnl_stream(), args); });
}

Tensor as_dtype(Arena& arena, const Tensor& t, DType dt) {
  if (t.dtype == dt) return t;
  const Tensor src = t.reshape({t.numel() / t.shape.back(), t.shape.back()});
  Tensor out = Tensor::in(arena, src.shape, dt);
  const int64_t cols = src.shape[1];
  parallel_for(src.shape[0], [&](int64_t r) {
    float* buf = thread_scratch(0, cols);
    load_row(src, r, buf, cols);
    store_row(out, r, buf, cols);
  });
  return out.reshape(t.shape);
}

}  // namespace apus::cpu

namespace apus::cpu {

// Stored formats run their GEMM a panel of output features at a time; "panels" runs weights in
// the activation dtype the same way, which tells the split's cost from the decode's (an A/B).
Knob linear_panels_knob("cpu.linear_panels",
                        "weights already in the activation dtype in one GEMM, or a panel of output features at a "
                        "time as stored formats run",
                        {"whole", "panels"});

// 32 MiB: the GEMM of a panel that small (2 MiB: ~340 features at k = 3072) ran at two thirds of
// the rate (docs/SPEED.md, session 15).
constexpr int64_t kPanelMiB[] = {32, 8, 2};
Knob linear_panel_mb_knob("cpu.linear_panel_mb", "MiB of expanded weights a stored format's panel holds",
                          {"32", "8", "2"});

namespace {

// VNNI (AVX512-VNNI, or AVX-VNNI: CPUID leaf 7, subleaf 1, EAX bit 4, read directly: clang 14's
// __builtin_cpu_supports does not know the name "avxvnni"; the fuzz build is clang's).
bool vnni() {
  static const bool present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool avx_vnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1u);
    return __builtin_cpu_supports("avx512vnni") || avx_vnni;
  }();
  return present;
}

}  // namespace

bool exact_int8_products() { return vnni() || sgemm_avx2_supported(); }

Knob int8_gemm_knob("cpu.int8_gemm",
                    "the int8 tier's integer GEMM: auto (oneDNN's where the CPU has VNNI, else apus's AVX2 kernel), "
                    "or apus's AVX2 kernel (vpmaddwd on int16-widened codes: exact without VNNI)",
                    {"auto", "avx2"});

namespace {

// A quantised tier's weight scale of each output feature: code_scale times its row's factor.
Tensor weight_row_scales(Context& c, const Tensor& w) {
  const int64_t n = w.shape[0];
  Tensor s = Tensor::in(*c.arena, {n}, DType::f32);
  for (int64_t j = 0; j < n; ++j)
    s.ptr<float>()[j] = w.encoding.block_scales
                            ? w.encoding.code_scale * w.encoding.block_scales->at(w.encoding.block_row0 + j, 0)
                            : w.encoding.code_scale;
  return s;
}

// A tier's bias in fp32, rounded to the activation dtype as torch_dtype converts it (none: empty).
Tensor tier_bias(Context& c, const Tensor* bias, DType act, int64_t n) {
  if (!bias) return {};
  Tensor b = Tensor::in(*c.arena, {n}, DType::f32);
  load_row(vector_row(*bias), 0, b.ptr<float>(), n);
  round_to(act, b.ptr<float>(), n);
  return b;
}

// y = a · w^T (+ bias) with a stored weight (or one split by the panels knob) expanded into a's
// dtype one panel of output features at a time, into scratch the GEMM reads while it is in cache:
// the model is never held in a's dtype.
void gemm_by_panels(Context& c, const Tensor& a, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t k = w.shape[1], n = w.shape[0];
  const int choice = linear_panel_mb_knob.value();
  linear_panel_mb_knob.took(choice);
  const int64_t bytes = kPanelMiB[choice] << 20;
  const int64_t panel = std::max<int64_t>(16, std::min<int64_t>(n, bytes / (2 * k)) / 16 * 16);
  ArenaScope scope(*c.arena);
  const Tensor bx = bias ? cpu::as_dtype(*c.arena, *bias, a.dtype) : Tensor{};
  for (int64_t n0 = 0; n0 < n; n0 += panel) {
    ArenaScope panel_scope(*c.arena);
    const int64_t n1 = std::min(n, n0 + panel);
    const Tensor wp = cpu::as_dtype(*c.arena, w.rows(n0, n1), a.dtype);
    const Tensor bp = bias ? bx.reshape({n}).rows(n0, n1) : Tensor{};
    Tensor yp = y.cols(n0, n1);
    cpu::gemm(a, wp.data, wp.dtype, 1, k, bias ? &bp : nullptr, yp, k, n1 - n0);
  }
}

// y's rows from a quantised tier's sums: NaN for a row whose scale is NaN (a NaN or an infinity in
// it), else scaled(r, its scale, the weight's scales a row, the bias in fp32 or null, y's row in
// fp32), the contract's fp32 steps on row r's sums.
template <typename Scaled> void tier_outputs(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias,
                                             const Tensor& x_scale, Tensor& y, Scaled scaled) {
  const int64_t m = x.shape[0], n = w.shape[0];
  const Tensor w_scale = weight_row_scales(c, w);
  const Tensor b = tier_bias(c, bias, x.dtype, n);
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, n);
    const float s = x_scale.ptr<float>()[r];
    if (std::isnan(s)) {
      std::fill(row, row + n, std::numeric_limits<float>::quiet_NaN());
    } else {
      scaled(r, s, w_scale.ptr<float>(), bias ? b.ptr<float>() : nullptr, row);
    }
    store_row(y, r, row, n);
  });
}

// The int8 tier's linear (ops/op_list.h): x's rows as codes, one s8 x s8 -> s32 GEMM over the
// whole weight (oneDNN's on VNNI, apus's AVX2 kernel otherwise: the same integers), the scales and
// bias applied row by row.
void linear_int8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  using namespace dnnl;
  using dims = memory::dims;
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(w.dtype == DType::i8 && w.contiguous() && k <= kInt8MaxDot,
             "linear: an int8 tier weight must be contiguous i8 with rows of at most ", kInt8MaxDot, ", got ",
             dtype_name(w.dtype), " ", shape_str(w.shape));
  APUS_CHECK(exact_int8_products(), "the int8 tier needs a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX) or AVX2, ",
             "where its int8 products are exact; this one has neither");
  ArenaScope scope(*c.arena);
  Tensor codes = Tensor::in(*c.arena, {m, k}, DType::i8);
  Tensor x_scale = Tensor::in(*c.arena, {m}, DType::f32);
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, k);
    load_row(x, r, row, k);
    x_scale.ptr<float>()[r] = quantize_int8_row(row, k, static_cast<int8_t*>(codes.row(r)));
  });
  Tensor acc = Tensor::in(*c.arena, {m, n}, DType::i32);
  const bool own = int8_gemm_knob.value() == 1 || !vnni();
  int8_gemm_knob.took(own && vnni() ? 1 : 0);
  if (own) {
    int8_gemm_avx2(static_cast<const int8_t*>(codes.data), m, k, static_cast<const int8_t*>(w.data), n,
                   acc.ptr<int32_t>());
  } else {
    const KernelKey key("matmul_s8", {m, k, n});
    const memory::desc a_md(dims{m, k}, memory::data_type::s8, dims{k, 1});
    const memory::desc b_md(dims{k, n}, memory::data_type::s8, dims{1, k});
    const memory::desc c_md(dims{m, n}, memory::data_type::s32, dims{n, 1});
    auto& prim = cached_primitive<matmul>(
        key, [&] { return matmul(matmul::primitive_desc(matmul::desc(a_md, b_md, c_md), dnnl_engine())); });
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(a_md, dnnl_engine(), codes.data)},
                                         {DNNL_ARG_WEIGHTS, memory(b_md, dnnl_engine(), w.data)},
                                         {DNNL_ARG_DST, memory(c_md, dnnl_engine(), acc.data)}};
    run_primitive(key, [&] { prim.execute(dnnl_stream(), args); });
  }
  tier_outputs(c, x, w, bias, x_scale, y, [&](int64_t r, float s, const float* w_scale, const float* b, float* row) {
    int8_products_row(acc.ptr<int32_t>() + r * n, s, w_scale, b, row, n);
  });
}

// The fp8 tier's linear (ops/op_list.h): x's rows as float8_e4m3fn values and the weight's codes
// without their scales, both exact in bf16, in one bf16 GEMM into fp32 sums (a product of two
// 4-bit significands is exact in fp32; the sums round), then the scales and bias by the contract's
// fp32 steps. The weight is decoded a panel at a time, as stored formats are.
void linear_fp8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(w.dtype == DType::fp8_e4m3 && w.contiguous(), "linear: an fp8 tier weight must be contiguous ",
             "float8_e4m3fn, got ", dtype_name(w.dtype), " ", shape_str(w.shape));
  ArenaScope scope(*c.arena);
  Tensor codes = Tensor::in(*c.arena, {m, k}, DType::bf16);
  Tensor x_scale = Tensor::in(*c.arena, {m}, DType::f32);
  parallel_for(m, [&](int64_t r) {
    float* row = thread_scratch(0, k);
    load_row(x, r, row, k);
    const float s = quantize_fp8_row(row, k, row);
    if (std::isnan(s)) std::fill(row, row + k, 0.0f);  // its outputs are NaN; the GEMM reads zeros
    x_scale.ptr<float>()[r] = s;
    store_row(codes, r, row, k);
  });
  Tensor codes_of_w = w;
  codes_of_w.encoding = {};  // the codes' own values: their scales multiply the sums
  Tensor sums = Tensor::in(*c.arena, {m, n}, DType::f32);
  gemm_by_panels(c, codes, codes_of_w, nullptr, sums);
  tier_outputs(c, x, w, bias, x_scale, y, [&](int64_t r, float s, const float* w_scale, const float* b, float* row) {
    fp8_products_row(sums.ptr<float>() + r * n, s, w_scale, b, row, n);
  });
}

}  // namespace

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  APUS_CHECK(x.rank() == 2 && w.rank() == 2 && y.rank() == 2 && x.shape[1] == w.shape[1] && y.shape[0] == x.shape[0] &&
                 y.shape[1] == w.shape[0],
             "linear: x ", shape_str(x.shape), " · w ", shape_str(w.shape), "^T -> y ", shape_str(y.shape),
             " do not agree");
  if (w.encoding.products == Products::int8) {
    linear_int8(c, x, w, bias, y);
    return;
  }
  if (w.encoding.products == Products::fp8) {
    linear_fp8(c, x, w, bias, y);
    return;
  }
  const int64_t k = w.shape[1], n = w.shape[0];
  const bool split = linear_panels_knob.value() == 1 && w.dtype == x.dtype;
  if (w.dtype == x.dtype) linear_panels_knob.took(split ? 1 : 0);
  if (is_stored_quantized(w.dtype) || split) {
    gemm_by_panels(c, x, w, bias, y);
    return;
  }
  if (x.dtype == w.dtype && (!bias || bias->dtype == w.dtype)) {
    cpu::gemm(x, w.data, w.dtype, 1, k, bias, y, k, n);
    return;
  }
  ArenaScope scope(*c.arena);
  const Tensor wx = cpu::as_dtype(*c.arena, w, x.dtype);
  const Tensor bx = bias ? cpu::as_dtype(*c.arena, *bias, x.dtype) : Tensor{};
  cpu::gemm(x, wx.data, wx.dtype, 1, k, bias ? &bx : nullptr, y, k, n);
}

}  // namespace apus::cpu
