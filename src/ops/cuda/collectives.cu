// NCCL between the ranks' GPUs (collectives.h). NCCL is opened at the first split's exchange
// (libnccl.so.2: the toolkit's, or the one PyTorch's wheels bring), as cuBLASLt is at the first
// GEMM, so a binary with the CUDA backend starts where NCCL is absent and refuses only splits.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "ops/cuda/collectives.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/loaded_library.h"

#if APUS_HAS_NCCL
#include <nccl.h>
#endif

namespace apus::cuda {

#if APUS_HAS_NCCL

namespace {

struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  std::string missing;  // why it cannot be used; empty when it can

  Nccl() {
    LoadedLibrary lib("NCCL", {"libnccl.so.2", "libnccl.so"});
    lib.function(get_unique_id, "ncclGetUniqueId");
    lib.function(init_rank, "ncclCommInitRank");
    lib.function(abort, "ncclCommAbort");
    lib.function(async_error, "ncclCommGetAsyncError");
    lib.function(error_string, "ncclGetErrorString");
    lib.function(all_gather, "ncclAllGather");
    lib.function(broadcast, "ncclBroadcast");
    lib.function(send, "ncclSend");
    lib.function(recv, "ncclRecv");
    lib.function(group_start, "ncclGroupStart");
    lib.function(group_end, "ncclGroupEnd");
    missing = lib.missing();
  }
  void check(ncclResult_t r, const char* call, const char* what) const {
    APUS_CHECK(r == ncclSuccess, "NCCL ", call, " (", what, "): ", error_string(r));
  }
};

const Nccl& nccl() {
  static const Nccl instance;
  return instance;
}

// One group's communicator on one GPU, with the stream its exchanges run on and the events that
// order them after the ops before and before the ops after.
struct Communicator {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
};

using CommKey = std::tuple<const ProcessGroup*, int, int, int>;  // group, GPU, rank, ranks

std::mutex comm_mutex;
std::map<CommKey, Communicator> comms;

// Rank 0's NCCL id passed to every rank over the group's own all-gather, then every rank joins.
Communicator& communicator(int device, const ProcessGroup& group) {
  const Nccl& n = nccl();
  APUS_CHECK(n.missing.empty(), "splitting over GPUs: ", n.missing);
  const CommKey key{&group, device, group.rank(), group.size()};
  std::lock_guard<std::mutex> lock(comm_mutex);
  const auto found = comms.find(key);
  if (found != comms.end()) return found->second;
  const int ranks = group.size(), me = group.rank();
  ncclUniqueId id{};
  if (me == 0) n.check(n.get_unique_id(&id), "ncclGetUniqueId", "opening the GPUs' exchanges");
  std::vector<char> ids(sizeof id * size_t(ranks), 0);
  std::memcpy(ids.data() + sizeof id * size_t(me), &id, sizeof id);
  group.all_gather(ids.data(), std::vector<size_t>(size_t(ranks), sizeof id), "the GPUs' NCCL id");
  std::memcpy(&id, ids.data(), sizeof id);
  check(cudaSetDevice(device), "select the device");
  Communicator c;
  n.check(n.init_rank(&c.comm, ranks, id, me), "ncclCommInitRank", "opening the GPUs' exchanges");
  check(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "create the exchanges' stream");
  check(cudaEventCreateWithFlags(&c.ready, cudaEventDisableTiming), "create an event");
  check(cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming), "create an event");
  return comms.emplace(key, c).first->second;
}

// Queues enqueue(communicator) on the exchanges' stream after the ops queued so far, makes the ops
// queued after it wait for it, and waits for it against the group's timeout: past it (or on an
// error NCCL reports meanwhile) the communicator is aborted and dropped, and the group loses the
// exchange. Waited for here, each exchange is a host synchronisation: the GPU idles about a launch
// latency after it (the next op is queued once it ends), small beside a step's exchanges.
template <typename Enqueue> void exchange(int device, const ProcessGroup& group, const char* verb, const char* what,
                                          double sent, Enqueue&& enqueue) {
  const Nccl& n = nccl();
  Communicator& c = communicator(device, group);
  check(cudaSetDevice(device), "select the device");
  const auto start = std::chrono::steady_clock::now();
  check(cudaEventRecord(c.ready, stream()), "order an exchange after the ops before it");
  check(cudaStreamWaitEvent(c.stream, c.ready, 0), "order an exchange after the ops before it");
  n.check(n.group_start(), "ncclGroupStart", what);
  enqueue(c);
  n.check(n.group_end(), "ncclGroupEnd", what);
  check(cudaEventRecord(c.done, c.stream), "order the ops after an exchange");
  check(cudaStreamWaitEvent(stream(), c.done, 0), "order the ops after an exchange");
  const auto deadline = start + std::chrono::duration<double>(group.timeout());
  for (;;) {
    const cudaError_t state = cudaEventQuery(c.done);
    if (state == cudaSuccess) break;
    APUS_CHECK(state == cudaErrorNotReady, verb, " ", what, " between the GPUs: ", cudaGetErrorString(state));
    ncclResult_t async = ncclSuccess;
    n.async_error(c.comm, &async);
    const bool late = std::chrono::steady_clock::now() > deadline;
    if (async != ncclSuccess || late) {
      n.abort(c.comm);
      {
        std::lock_guard<std::mutex> lock(comm_mutex);
        comms.erase(CommKey{&group, device, group.rank(), group.size()});
      }
      group.lose(async != ncclSuccess
                     ? detail::concat(verb, " ", what, " over NCCL: ", n.error_string(async))
                     : detail::concat(verb, " ", what, " over NCCL: not every rank's GPU arrived within ",
                                      group.timeout(), " s (one failed or hangs; --rank-timeout sets the wait)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  group.count_exchange(sent, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

std::vector<size_t> offsets_of(const std::vector<size_t>& bytes) {
  std::vector<size_t> at(bytes.size(), 0);
  for (size_t r = 1; r < bytes.size(); ++r) at[r] = at[r - 1] + bytes[r - 1];
  return at;
}

}  // namespace

bool nccl_usable(std::string* why) {
  const std::string& missing = nccl().missing;
  if (!missing.empty() && why) *why = missing;
  return missing.empty();
}

void all_gather(int device, const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what) {
  const int ranks = group.size(), me = group.rank();
  APUS_CHECK(int(bytes.size()) == ranks, what, ": ", bytes.size(), " parts for ", ranks, " ranks");
  const std::vector<size_t> at = offsets_of(bytes);
  char* base = static_cast<char*>(data);
  const bool equal = std::all_of(bytes.begin(), bytes.end(), [&](size_t b) { return b == bytes[0]; });
  const Nccl& n = nccl();
  exchange(device, group, "gathering", what, double(bytes[size_t(me)]) * (ranks - 1), [&](Communicator& c) {
    // Equal parts: NCCL's ring all-gather, in place; unequal ones (a rank holding fewer heads or
    // rows): each rank's part broadcast from it, in place, all in one NCCL group.
    if (equal) {
      if (bytes[0] > 0)
        n.check(n.all_gather(base + at[size_t(me)], base, bytes[0], ncclUint8, c.comm, c.stream), "ncclAllGather",
                what);
      return;
    }
    for (int r = 0; r < ranks; ++r)
      if (bytes[size_t(r)] > 0)
        n.check(
            n.broadcast(base + at[size_t(r)], base + at[size_t(r)], bytes[size_t(r)], ncclUint8, r, c.comm, c.stream),
            "ncclBroadcast", what);
  });
}

void all_to_all(int device, const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, const char* what) {
  const int ranks = group.size(), me = group.rank();
  APUS_CHECK(int(send_bytes.size()) == ranks && int(recv_bytes.size()) == ranks, what, ": ", send_bytes.size(), " and ",
             recv_bytes.size(), " parts for ", ranks, " ranks");
  APUS_CHECK(send_bytes[size_t(me)] == recv_bytes[size_t(me)], what, ": this rank sends itself ",
             send_bytes[size_t(me)], " bytes and expects ", recv_bytes[size_t(me)]);
  const std::vector<size_t> out = offsets_of(send_bytes), in = offsets_of(recv_bytes);
  const char* from = static_cast<const char*>(send);
  char* to = static_cast<char*>(recv);
  double sent = 0;
  for (int j = 0; j < ranks; ++j)
    if (j != me) sent += double(send_bytes[size_t(j)]);
  const Nccl& n = nccl();
  exchange(device, group, "exchanging", what, sent, [&](Communicator& c) {
    if (send_bytes[size_t(me)] > 0)
      check(cudaMemcpyAsync(to + in[size_t(me)], from + out[size_t(me)], send_bytes[size_t(me)],
                            cudaMemcpyDeviceToDevice, c.stream),
            "copy a rank's own part");
    // Point to point, the non-empty parts only (a rank holding no heads sends and receives none).
    for (int j = 0; j < ranks; ++j) {
      if (j == me) continue;
      if (send_bytes[size_t(j)] > 0)
        n.check(n.send(from + out[size_t(j)], send_bytes[size_t(j)], ncclUint8, j, c.comm, c.stream), "ncclSend", what);
      if (recv_bytes[size_t(j)] > 0)
        n.check(n.recv(to + in[size_t(j)], recv_bytes[size_t(j)], ncclUint8, j, c.comm, c.stream), "ncclRecv", what);
    }
  });
}

#else

bool nccl_usable(std::string* why) {
  if (why) *why = "this build found no nccl.h (NCCL's headers) when it was configured";
  return false;
}

void all_gather(int, const ProcessGroup&, void*, const std::vector<size_t>&, const char* what) {
  fail(what, ": this build has no NCCL");
}

void all_to_all(int, const ProcessGroup&, const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&,
                const char* what) {
  fail(what, ": this build has no NCCL");
}

#endif

}  // namespace apus::cuda
