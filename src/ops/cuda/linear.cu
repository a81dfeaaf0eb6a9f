// y = x · w^T (+ bias) through cuBLASLt: bf16 (or f32) operands, f32 accumulation, the bias added
// in the epilogue. Row-major [M, K] x and [N, K] w are column-major K x M and K x N, so the
// product is computed as y^T = w · x^T with w transposed. cuBLASLt (half a gigabyte) is opened at
// the first GEMM, not linked: a CPU run of the same binary never maps it.
#include <cublasLt.h>
#include <dlfcn.h>

#include "core/scaled_codes.h"
#include "ops/cuda/cuda_ops.h"

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
  decltype(&cublasLtMatmul) matmul;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;
  Lt() {
    void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
    APUS_CHECK(lib, "cuda: cannot open cuBLASLt (libcublasLt.so.13): ", dlerror());
    auto sym = [lib](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, name));
      APUS_CHECK(f, "cuda: cuBLASLt has no ", name);
    };
    sym(create, "cublasLtCreate");
    sym(desc_create, "cublasLtMatmulDescCreate");
    sym(desc_set, "cublasLtMatmulDescSetAttribute");
    sym(desc_destroy, "cublasLtMatmulDescDestroy");
    sym(layout_create, "cublasLtMatrixLayoutCreate");
    sym(layout_destroy, "cublasLtMatrixLayoutDestroy");
    sym(matmul, "cublasLtMatmul");
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

}  // namespace

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = x.shape[1], n = w.shape[0];
  APUS_CHECK(x.rank() == 2 && w.rank() == 2 && w.shape[1] == k && y.shape == Shape({m, n}) && w.contiguous() &&
                 x.dtype == y.dtype && (!bias || bias->numel() == n),
             "linear: x ", shape_str(x.shape), ", w ", shape_str(w.shape), ", y ", shape_str(y.shape));
  APUS_CHECK(!is_stored_quantized(w.dtype) && !w.int8_matmul, "linear on the GPU: weights stored as ",
             dtype_name(w.dtype), w.int8_matmul ? " (the int8 tier)" : "", " run on the CPU only so far");
  if (m == 0) return;
  // Weights (and bias) in the activation dtype, as torch_dtype converts them.
  ArenaScope scope(*c.arena);
  const Tensor wx = w.dtype == x.dtype ? w : Tensor::in(*c.arena, w.shape, x.dtype);
  if (w.dtype != x.dtype) {
    Tensor to = wx;
    copy(c, w, to);
  }
  Tensor bx;
  if (bias) {
    bx = bias->dtype == x.dtype ? *bias : Tensor::in(*c.arena, {n}, x.dtype);
    if (bias->dtype != x.dtype) copy(c, *bias, bx);
  }
  const cudaDataType_t t = cuda_type(x.dtype);
  Lt& l = lt();
  cublasLtMatmulDesc_t op = nullptr;
  check_lt(l.desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa), "transa");
  check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb), "transb");
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_ptr = bx.data;
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue), "epilogue");
    check_lt(l.desc_set(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof bias_ptr), "bias");
  }
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  check_lt(l.layout_create(&a, t, uint64_t(k), uint64_t(n), int64_t(k)), "layout w");
  check_lt(l.layout_create(&b, t, uint64_t(k), uint64_t(m), x.row_stride()), "layout x");
  check_lt(l.layout_create(&d, t, uint64_t(n), uint64_t(m), y.row_stride()), "layout y");
  const float one = 1.0f, zero = 0.0f;
  check_lt(l.matmul(l.handle, op, &one, wx.data, a, x.data, b, &zero, y.data, d, y.data, d, nullptr, l.workspace,
                    l.workspace_bytes, stream()),
           "matmul");
  l.layout_destroy(a);
  l.layout_destroy(b);
  l.layout_destroy(d);
  l.desc_destroy(op);
}

}  // namespace apus::cuda
