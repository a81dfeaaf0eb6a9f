// cuda.attention=cudnn: attention as one graph of cudnn-frontend (cudnn_attention.h), cuDNN's
// fused flash SDPA. The frontend is header-only (tools/install-deps.sh fetches it); it opens cuDNN
// and the CUDA runtime at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING), as the backend opens
// cuBLASLt: a binary with the backend still starts where neither is installed.
#include "ops/cuda/cudnn_attention.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/cuda_ops.h"

#if APUS_HAS_CUDNN_FRONTEND
#include <cudnn_frontend.h>

// The frontend's handle on libcudnn (it resolves every cuDNN call through it).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace apus::cuda {

bool cudnn_attention_takes(int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t o_stride) {
  const auto aligned = [](int64_t stride) { return stride % 8 == 0; };
  return head_dim % 8 == 0 && head_dim <= 128 && aligned(q_stride) && aligned(k_stride) && aligned(v_stride) &&
         aligned(o_stride);
}

#if APUS_HAS_CUDNN_FRONTEND

namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO };

// libcudnn opened once for the process: the toolkit's, or the one PyTorch's wheels bring.
void open_cudnn() {
  static std::once_flag once;
  static std::string missing;
  std::call_once(once, [] {
    for (const char* file : {"libcudnn.so.9", "libcudnn.so"})
      if ((fe::cudnn_dlhandle = dlopen(file, RTLD_NOW | RTLD_LOCAL))) return;
    missing = detail::concat("cannot open cuDNN (libcudnn.so.9): ", dlerror());
  });
  APUS_CHECK(missing.empty(), "cuda.attention=cudnn: ", missing);
}

fe::graph::Tensor_attributes operand(const char* name, Uid uid, const SdpaTensor& t) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({t.dim.begin(), t.dim.end()})
      .set_stride({t.stride.begin(), t.stride.end()})
      .set_data_type(fe::DataType_t::BFLOAT16);
}

// The graph of one attention: bf16 in and out, fp32 scores and sums, inference only (no softmax
// statistics written); for a GPU of compute capability `sm` (90: Hopper).
std::shared_ptr<fe::graph::Graph> sdpa_graph(const SdpaOperands& a, int sm) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_sm_version(sm);  // before the nodes: each copies the graph's context
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto q = graph->tensor(operand("q", kQ, sdpa_tensor(a.batch, a.sq, a.hq, a.d, a.q_stride)));
  const auto k = graph->tensor(operand("k", kK, sdpa_tensor(a.batch, a.sk, a.hk, a.d, a.k_stride)));
  const auto v = graph->tensor(operand("v", kV, sdpa_tensor(a.batch, a.sk, a.hk, a.d, a.v_stride)));
  auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(false).set_attn_scale(a.scale);
  if (a.causal) options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  const auto [o, stats] = graph->sdpa(q, k, v, options);
  const SdpaTensor out = sdpa_tensor(a.batch, a.sq, a.hq, a.d, a.o_stride);
  o->set_output(true)
      .set_uid(kO)
      .set_dim({out.dim.begin(), out.dim.end()})
      .set_stride({out.stride.begin(), out.stride.end()});
  return graph;
}

struct Dnn {
  cudnnHandle_t handle = nullptr;
  Dnn() {
    open_cudnn();
    const cudnnStatus_t s = fe::detail::create_handle(&handle);
    APUS_CHECK(s == CUDNN_STATUS_SUCCESS, "cuda.attention=cudnn: cudnnCreate failed (status ", int(s), ")");
  }
};

// One handle, made on the first such attention's device: enough for one GPU (as cuBLASLt's).
Dnn& dnn() {
  static Dnn instance;
  return instance;
}

// batch, sq, sk, hq, hk, d, the four row strides, the scale's bits, causal
using SdpaKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           uint32_t, bool>;

SdpaKey key_of(const SdpaOperands& a) {
  uint32_t scale = 0;
  std::memcpy(&scale, &a.scale, sizeof scale);
  return {a.batch, a.sq, a.sk, a.hq, a.hk, a.d, a.q_stride, a.k_stride, a.v_stride, a.o_stride, scale, a.causal};
}

// The shape's graph, built with cuDNN's heuristics once and kept; null when cuDNN declined it.
std::shared_ptr<fe::graph::Graph> built_graph(const SdpaOperands& a) {
  static std::mutex mutex;
  static std::map<SdpaKey, std::shared_ptr<fe::graph::Graph>> built;
  std::lock_guard<std::mutex> lock(mutex);
  const SdpaKey key = key_of(a);
  const auto found = built.find(key);
  if (found != built.end()) return found->second;
  // The GPU's compute capability from apus's own runtime, so that building the graph needs none of
  // the frontend's CUDA runtime calls (their library is opened only where one is asked for).
  int device = 0, major = 0, minor = 0;
  check(cudaGetDevice(&device), "the current device");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "the compute capability");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "the compute capability");
  std::shared_ptr<fe::graph::Graph> graph = sdpa_graph(a, 10 * major + minor);
  try {
    fe::error_t status = graph->build(dnn().handle, {fe::HeurMode_t::A});
    if (!status.is_good()) {
      // Said once a shape, on stderr: the arm asked for runs another kernel here, and why shows.
      std::fprintf(stderr,
                   "apus: cuda.attention=cudnn: cuDNN declines %lld x %lld heads of %lld (%lld rows, %lld keys): %s; "
                   "the flash kernel takes it\n",
                   (long long)a.batch, (long long)a.hq, (long long)a.d, (long long)a.sq, (long long)a.sk,
                   status.get_message().c_str());
      graph = nullptr;
    }
  } catch (const std::exception& e) {
    fail("cuda.attention=cudnn: ", e.what());
  }
  return built.emplace(key, graph).first->second;
}

}  // namespace

bool attention_by_cudnn(Context& c, const SdpaOperands& a) {
  Dnn& d = dnn();
  const std::shared_ptr<fe::graph::Graph> graph = built_graph(a);
  if (!graph) return false;
  APUS_CHECK(fe::detail::set_stream(d.handle, stream()) == CUDNN_STATUS_SUCCESS,
             "cuda.attention=cudnn: cudnnSetStream");
  int64_t bytes = 0;
  APUS_CHECK(graph->get_workspace_size(bytes).is_good(), "cuda.attention=cudnn: the graph's workspace size");
  ArenaScope scope(*c.arena);
  const Tensor workspace = Tensor::in(*c.arena, {std::max<int64_t>(1, bytes)}, DType::i8);
  std::unordered_map<int64_t, void*> pointers = {
      {kQ, const_cast<void*>(a.q)}, {kK, const_cast<void*>(a.k)}, {kV, const_cast<void*>(a.v)}, {kO, a.o}};
  fe::error_t run = graph->execute(d.handle, pointers, workspace.data);
  APUS_CHECK(run.is_good(), "cuda.attention=cudnn: ", run.get_message());
  return true;
}

std::string sdpa_graph_problem(const SdpaOperands& a, int sm) {
  try {
    open_cudnn();  // the checks ask cuDNN's version
    fe::error_t e = sdpa_graph(a, sm)->validate();
    return e.is_good() ? std::string() : e.get_message();
  } catch (const std::exception& e) {
    return e.what();
  }
}

#else

bool attention_by_cudnn(Context&, const SdpaOperands&) {
  fail(
      "cuda.attention=cudnn: this build found no cudnn-frontend headers (tools/install-deps.sh fetches them) or no "
      "cudnn.h when it was configured");
}

std::string sdpa_graph_problem(const SdpaOperands&, int) { return "this build has no cudnn-frontend"; }

#endif

}  // namespace apus::cuda
