// GEMMs through cuBLASLt: linear's y = x · w^T (+ bias), and the strided-batched products the
// attention and convolution paths build on. bf16 (or f32) operands, f32 accumulation, the bias added
// in the epilogue; int8 operands (the int8 tier, tier_linear.cu) summed exactly in int32, e4m3
// operands (the fp8 tier) in fp32, their row scales applied after or in the epilogue. Row-major
// [M, K] x and [N, K] w are column-major K x M and K x N, so the product is computed as
// y^T = w · x^T with w transposed. cuBLASLt (half a gigabyte) is opened at the first GEMM, not
// linked: a CPU run of the same binary never maps it.
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/scaled_codes.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/loaded_library.h"

namespace apus::cuda {

namespace {

void check_lt(cublasStatus_t s, const char* what) {
  APUS_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", what, " failed (status ", int(s), ")");
}

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    case DType::f32:
      return CUDA_R_32F;
    case DType::i8:
      return CUDA_R_8I;
    case DType::i32:
      return CUDA_R_32I;
    case DType::fp8_e4m3:
      return CUDA_R_8F_E4M3;
    default:
      fail("linear: dtype ", dtype_name(dt), " is not supported on cuda");
  }
}

struct Lt {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;
  Lt() {
    LoadedLibrary lib("cuBLASLt", {"libcublasLt.so.13", "libcublasLt.so"});
    lib.function(create, "cublasLtCreate");
    lib.function(desc_create, "cublasLtMatmulDescCreate");
    lib.function(desc_set, "cublasLtMatmulDescSetAttribute");
    lib.function(desc_destroy, "cublasLtMatmulDescDestroy");
    lib.function(layout_create, "cublasLtMatrixLayoutCreate");
    lib.function(layout_destroy, "cublasLtMatrixLayoutDestroy");
    lib.function(layout_set, "cublasLtMatrixLayoutSetAttribute");
    lib.function(matmul, "cublasLtMatmul");
    lib.function(pref_create, "cublasLtMatmulPreferenceCreate");
    lib.function(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    lib.function(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    lib.function(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    APUS_CHECK(lib.missing().empty(), "cuda: ", lib.missing());
    check_lt(create(&handle), "create");
    check(cudaMalloc(&workspace, workspace_bytes), "cuBLASLt workspace");
  }
};

// One handle and workspace, made on the first GEMM's device: enough for one GPU (issue 11's
// scope); several devices need one each.
Lt& lt() {
  static Lt instance;
  return instance;
}

// The algorithm for one product's shape, chosen by cuBLASLt's heuristic once and kept. Split-K
// reductions are held to the compute type (fp32): cuBLASLt's default also allows summing the
// partial products in the output's buffer and dtype, which on the H200 rounded a bf16 product's
// partial sums to bf16 (a long causal attention's P·V came out 6965 ulp from the reference).
// A shape cuBLASLt has no algorithm for is kept as such (null): the caller refuses it, or, for
// a variant with another route (the fp8 tier's scales in the epilogue), takes that route.
using AlgoKey = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, bool, bool>;

const cublasLtMatmulAlgo_t* algorithm(Lt& l, const AlgoKey& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                      cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld) {
  static std::mutex mutex;
  static std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>> chosen;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = chosen.find(key);
  if (found != chosen.end()) return found->second ? &*found->second : nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(l.pref_create(&pref), "preference");
  const uint64_t workspace = l.workspace_bytes;
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  check_lt(l.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace), "workspace");
  check_lt(l.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes), "reductions");
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t status = l.heuristic(l.handle, op, la, lb, ld, ld, pref, 1, &result, &count);
  l.pref_destroy(pref);
  std::optional<cublasLtMatmulAlgo_t>& kept = chosen[key];
  if (status == CUBLAS_STATUS_SUCCESS && count > 0) kept = result.algo;
  return kept ? &*kept : nullptr;
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && dtype_bytes(t.dtype, t.row_stride()) % 16 == 0;
}

// t [rows, cols] in the context's memory as [rows, width] rows, zeros past its columns.
Tensor padded(Context& c, const Tensor& t, int64_t width) {
  Tensor out = Tensor::in(*c.arena, {t.shape[0], width}, t.dtype);
  check(cudaMemsetAsync(out.data, 0, out.nbytes(), stream()), "clear padded rows");
  Tensor inner = out.cols(0, t.shape[1]);
  copy(c, t, inner);
  return out;
}

}  // namespace

namespace {

bool try_gemm(const Operand& a, const Operand& b, bool b_transposed, const Operand& c, int64_t m, int64_t n, int64_t k,
              int64_t batch, float alpha, const void* bias, const OuterScales* scales) {
  // Row-major C [M, N] is column-major C^T [N, M] = op(B) · A^T: cuBLASLt multiplies b by a.
  const cudaDataType_t ta = cuda_type(a.dt), tb = cuda_type(b.dt), tc = cuda_type(c.dt);
  // Integer products (the int8 tier): exact int32 sums on the integer tensor cores, which take
  // only this form (A transposed, in cuBLASLt's column-major terms) with int32 scalars.
  const bool integer = a.dt == DType::i8;
  APUS_CHECK(!integer || (b.dt == DType::i8 && c.dt == DType::i32 && b_transposed && !bias && alpha == 1.0f),
             "gemm: an int8 product is i8 x i8^T -> i32, without a bias or a scale");
  // float8 products (the fp8 tier): cuBLASLt's fp8 kernels take only this form too, here into fp32.
  const bool fp8 = a.dt == DType::fp8_e4m3;
  APUS_CHECK((b.dt == DType::fp8_e4m3) == fp8 && (!fp8 || (b_transposed && batch == 1)) && (!scales || fp8) &&
                 (!fp8 || scales || (c.dt == DType::f32 && !bias)),
             "gemm: an fp8 product is e4m3 x e4m3^T, one matrix: into f32 without a bias, or scaled by rows");
  Lt& l = lt();
  cublasLtMatmulDesc_t op = nullptr;
  check_lt(l.desc_create(&op, integer ? CUBLAS_COMPUTE_32I : CUBLAS_COMPUTE_32F, integer ? CUDA_R_32I : CUDA_R_32F),
           "matmul descriptor");
  const cublasOperation_t transa = b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, transb = CUBLAS_OP_N;
  check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa), "transa");
  check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb), "transb");
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue), "epilogue");
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), "bias");
  }
  if (scales) {
    // cuBLASLt's A is b here (its M the rows of b), its B is a: each output (i, j) times a's row
    // scale i and b's row scale j.
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    for (const auto mode : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
      check_lt(l.desc_set(op, mode, &outer, sizeof outer), "scale mode");
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales->b_rows, sizeof scales->b_rows), "b scales");
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales->a_rows, sizeof scales->a_rows), "a scales");
  }
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  // B stored [N, K] row-major is column-major K x N (transposed by the op); [K, N] is N x K.
  if (b_transposed) check_lt(l.layout_create(&la, tb, uint64_t(k), uint64_t(n), b.ld), "layout b");
  else check_lt(l.layout_create(&la, tb, uint64_t(n), uint64_t(k), b.ld), "layout b");
  check_lt(l.layout_create(&lb, ta, uint64_t(k), uint64_t(m), a.ld), "layout a");
  check_lt(l.layout_create(&ld, tc, uint64_t(n), uint64_t(m), c.ld), "layout c");
  if (batch > 1) {
    const int32_t count = int32_t(batch);
    for (auto [layout, stride] :
         {std::pair{la, b.batch_stride}, std::pair{lb, a.batch_stride}, std::pair{ld, c.batch_stride}}) {
      check_lt(l.layout_set(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count), "batch count");
      check_lt(l.layout_set(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
               "batch stride");
    }
  }
  const AlgoKey key{int(a.dt),
                    int(b.dt),
                    int(c.dt),
                    b_transposed,
                    m,
                    n,
                    k,
                    a.ld,
                    b.ld,
                    c.ld,
                    batch,
                    a.batch_stride,
                    b.batch_stride,
                    c.batch_stride,
                    bias != nullptr,
                    scales != nullptr};
  const cublasLtMatmulAlgo_t* algo = algorithm(l, key, op, la, lb, ld);
  const float zero = 0.0f;
  const int32_t integer_one = 1, integer_zero = 0;
  if (algo)
    check_lt(l.matmul(l.handle, op, integer ? static_cast<const void*>(&integer_one) : &alpha, b.p, la, a.p, lb,
                      integer ? static_cast<const void*>(&integer_zero) : &zero, c.p, ld, const_cast<void*>(c.p), ld,
                      algo, l.workspace, l.workspace_bytes, stream()),
             "matmul");
  l.layout_destroy(la);
  l.layout_destroy(lb);
  l.layout_destroy(ld);
  l.desc_destroy(op);
  return algo != nullptr;
}

}  // namespace

void gemm(const Operand& a, const Operand& b, bool b_transposed, const Operand& c, int64_t m, int64_t n, int64_t k,
          int64_t batch, float alpha, const void* bias) {
  APUS_CHECK(try_gemm(a, b, b_transposed, c, m, n, k, batch, alpha, bias, nullptr), "cuBLASLt: no algorithm for a ", m,
             "x", n, "x", k, " product of ", dtype_name(a.dt), " into ", dtype_name(c.dt));
}

bool scaled_fp8_gemm(const Operand& a, const Operand& b, const OuterScales& scales, const Operand& c, int64_t m,
                     int64_t n, int64_t k, const void* bias) {
  return try_gemm(a, b, true, c, m, n, k, 1, 1.0f, bias, &scales);
}

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = x.shape[1], n = w.shape[0];
  APUS_CHECK(x.rank() == 2 && w.rank() == 2 && w.shape[1] == k && y.shape == Shape({m, n}) && w.contiguous() &&
                 x.dtype == y.dtype && (!bias || bias->numel() == n),
             "linear: x ", shape_str(x.shape), ", w ", shape_str(w.shape), ", y ", shape_str(y.shape));
  if (w.encoding.products == Products::int8) return linear_int8(c, x, w, bias, y);
  if (w.encoding.products == Products::fp8) return linear_fp8(c, x, w, bias, y);
  if (m == 0) return;
  // Weights (and bias) in the activation dtype, as torch_dtype converts them; a weight stored
  // quantized decoded whole for this call (the model holds it as stored).
  ArenaScope scope(*c.arena);
  auto in_act = [&](const Tensor& t) {
    if (t.dtype == x.dtype) return t;
    Tensor to = Tensor::in(*c.arena, t.shape, x.dtype);
    if (is_stored_quantized(t.dtype)) decode_stored(t, nullptr, to);
    else copy(c, t, to);
    return to;
  };
  const Tensor wx = in_act(w);
  const Tensor bx = bias ? in_act(*bias) : Tensor{};
  if (bias && y.dtype != DType::f32 && !(aligned(x) && aligned(wx) && aligned(y))) {
    // cuBLASLt adds the bias of a product whose rows are off 16-byte alignment in a second pass
    // over the already rounded output (seen on the H200: a 37x45x70 bf16 linear with its bias 185
    // ulp from the reference, 25% of outputs off by a rounding): such operands are copied into
    // aligned rows, K and N padded with zeros, so the bias is added before the one rounding.
    const int64_t kp = (k + 7) / 8 * 8, np = (n + 7) / 8 * 8;
    const Tensor xp = padded(c, x, kp), wp = padded(c, wx, kp);
    Tensor yp = Tensor::in(*c.arena, {m, np}, y.dtype);
    const Tensor bp = padded(c, bx.reshape({1, n}), np);
    gemm({xp.data, xp.dtype, kp}, {wp.data, wp.dtype, kp}, true, {yp.data, yp.dtype, np}, m, np, k, 1, 1.0f, bp.data);
    copy(c, yp.cols(0, n), y);
    return;
  }
  gemm({x.data, x.dtype, x.row_stride()}, {wx.data, wx.dtype, k}, true, {y.data, y.dtype, y.row_stride()}, m, n, k, 1,
       1.0f, bias ? bx.data : nullptr);
}

}  // namespace apus::cuda
