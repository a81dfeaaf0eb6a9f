#pragma once
// A ProcessGroup's exchanges as the model code makes them (issue 43): counting, each files the
// bytes this rank sends the others (CostLog::mark_sent) and moves nothing; running, each is a
// span on the trace, run by the context's backend over its memory (MPI on the host, NCCL between
// GPUs).
#include <vector>

#include "apus/apus.h"
#include "ops/ops.h"

namespace apus {

void all_gather(Context& c, const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what);
void all_to_all(Context& c, const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, const char* what);

}  // namespace apus
