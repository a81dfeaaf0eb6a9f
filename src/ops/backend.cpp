#include "ops/backend.h"

#include <cstdlib>
#include <cstring>

#include "apus/apus.h"
#include "core/error.h"
#include "core/scaled_codes.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace apus {

#if APUS_HAS_CUDA
namespace {

// This process's place among those a launcher started on its host (Open MPI's
// OMPI_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID, MPICH's MPI_LOCALRANKID); 0 without one.
int launched_local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* v = std::getenv(name);
    if (v && *v && std::atoi(v) >= 0) return std::atoi(v);
  }
  return 0;
}

}  // namespace
#endif

namespace {

// e with its block factors (if any) replaced by move(factors).
template <typename Move> WeightEncoding with_factors_moved(const WeightEncoding& e, Move move) {
  WeightEncoding moved = e;
  if (e.block_scales) {
    auto scales = std::make_shared<BlockScales>(*e.block_scales);
    scales->factors = move(e.block_scales->factors);
    moved.block_scales = std::move(scales);
  }
  return moved;
}

}  // namespace

WeightEncoding encoding_on(Backend& device, const WeightEncoding& host) {
  return with_factors_moved(host, [&](const Tensor& t) { return device.upload(t); });
}

WeightEncoding encoding_off(Backend& device, const WeightEncoding& on_device) {
  return with_factors_moved(on_device, [&](const Tensor& t) { return device.download(t); });
}

void HostBackend::upload_into(const Tensor& host, Tensor& to) {
  APUS_CHECK(host.contiguous() && to.contiguous() && host.nbytes() == to.nbytes(),
             "upload_into: expected two contiguous tensors of the same bytes, got ", shape_str(host.shape), " and ",
             shape_str(to.shape));
  std::memcpy(to.data, host.data, host.nbytes());
}

void HostBackend::all_gather(const ProcessGroup& group, void* data, const std::vector<size_t>& bytes,
                             const char* what) {
  group.all_gather(data, bytes, what);
}

void HostBackend::all_to_all(const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                             void* recv, const std::vector<size_t>& recv_bytes, const char* what) {
  group.all_to_all(send, send_bytes, recv, recv_bytes, what);
}

Backend* backend_for(const std::string& device) {
  if (device == "cpu") return nullptr;
  APUS_CHECK(device == "cuda" || device.rfind("cuda:", 0) == 0, "device '", device,
             "' is not known (expected cpu, cuda or cuda:N)");
  int ordinal = 0;
  if (device.size() > 5) {
    const std::string n = device.substr(5);
    APUS_CHECK(!n.empty() && n.size() < 4 && n.find_first_not_of("0123456789") == std::string::npos, "device '", device,
               "': expected cuda:N with N a device number");
    ordinal = std::stoi(n);
  }
#if APUS_HAS_CUDA
  // "cuda" alone is the first GPU, or under a launcher the rank's own among its host's GPUs (its
  // local rank, modulo their count), so that `mpirun -np 4 apus ... --device cuda` puts each rank
  // on a GPU of its own.
  if (device == "cuda") {
    const int gpus = cuda_device_count();
    if (gpus > 0) ordinal = launched_local_rank() % gpus;
  }
  return &cuda_backend(ordinal);
#else
  fail("device '", device, "': this build has no CUDA backend (nvcc was not found when it was configured)");
#endif
}

}  // namespace apus
