#pragma once
// A split's exchanges between the ranks' GPUs (issue 43): NCCL, device memory to device memory,
// one communicator per group and GPU, bootstrapped over the group's own exchanges (MPI on the
// host). What the CUDA backend's Backend::all_gather / all_to_all / exchanges run.
#include <string>
#include <vector>

#include "apus/apus.h"

namespace apus::cuda {

// Whether this build and machine have NCCL (nccl.h when built, libnccl.so.2 when run); if not, why.
bool nccl_usable(std::string* why);

// ProcessGroup::all_gather and all_to_all over GPU `device`'s memory, queued after the ops before
// them and waited for against the group's timeout (NCCL itself would wait forever for a rank that
// hangs): past it the communicator is aborted and the group loses the exchange (ProcessGroup::lose).
void all_gather(int device, const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what);
void all_to_all(int device, const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, const char* what);

}  // namespace apus::cuda
