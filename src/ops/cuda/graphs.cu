// A device's sampler steps queued ahead of it (pipeline/driver.h): marks in the queue the host waits
// for, and the steps recorded as CUDA graphs (device.steps=graphs, pipeline/stage.h): a
// step's ops captured from the stream and launched as one graph, so the GPU runs them back to back
// without a launch from the host each. Every step is recorded again (its scalars, a sigma, change
// step to step), and the executable graph updated in place: a step has the previous one's
// topology, so cudaGraphExecUpdate only swaps parameters; a graph of another shape is
// instantiated afresh.
#include <cstdio>
#include <cstring>
#include <mutex>

#include "ops/backend.h"
#include "ops/cuda/cuda_ops.h"

namespace apus::cuda {

namespace {

// One thread's queue marks: an event each, recorded in turn.
struct Marks {
  cudaEvent_t events[Backend::kQueueMarks] = {};
  int next = 0;
};
// Never freed, as the recorder below.
thread_local Marks marks;

// Host bytes a recorded step stages (a sigma, a LoRA's gates: a few KiB on the models).
constexpr size_t kStagingBytes = size_t(1) << 20;

// One thread's recording (each thread has its own stream): the executable graph, and two pinned
// staging buffers used a step in turn. A graph's copy node reads its host source when the graph
// runs, and from pinned memory only, so the bytes upload_into is handed while recording are copied
// there and kept until the launch that reads them has run (two launches later: an event each).
struct Recorder {
  bool recording = false;
  cudaGraphExec_t exec = nullptr;
  char* staging[2] = {};
  cudaEvent_t read[2] = {};
  int turn = 0;
  size_t used = 0;
};
// Never freed: a thread's last graph and buffers live until the process ends.
thread_local Recorder recorder;

}  // namespace

int mark_queue() {
  Marks& m = marks;
  const int slot = m.next;
  if (!m.events[slot]) check(cudaEventCreateWithFlags(&m.events[slot], cudaEventDisableTiming), "a queue mark");
  check(cudaEventRecord(m.events[slot], stream()), "mark the queue");
  m.next = (slot + 1) % Backend::kQueueMarks;
  return slot;
}

void wait_for_mark(int slot) {
  APUS_CHECK(slot >= 0 && slot < Backend::kQueueMarks && marks.events[slot], "no queue mark ", slot);
  check(cudaEventSynchronize(marks.events[slot]), "wait for a queue mark");
}

bool begin_graph() {
  Recorder& r = recorder;
  APUS_CHECK(!r.recording, "device.steps=graphs: a step's graph is already being recorded");
  if (!r.staging[0]) {
    for (int b = 0; b < 2; ++b) {
      check(cudaHostAlloc(&r.staging[b], kStagingBytes, cudaHostAllocDefault), "pin a graph's staging buffer");
      check(cudaEventCreateWithFlags(&r.read[b], cudaEventDisableTiming), "a graph's staging event");
    }
  }
  check(cudaEventSynchronize(r.read[r.turn]), "wait for the graph that read the staging buffer");
  const cudaError_t e = cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    cudaGetLastError();
    static std::once_flag told;
    std::call_once(told, [&] {
      std::fprintf(stderr, "apus: device.steps=graphs: the stream cannot be recorded (%s); the steps run as called\n",
                   cudaGetErrorString(e));
    });
    return false;
  }
  r.used = 0;
  r.recording = true;
  return true;
}

void launch_graph() {
  Recorder& r = recorder;
  r.recording = false;
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(stream(), &graph), "device.steps=graphs: record a step's graph");
  if (r.exec) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(r.exec, graph, &info) != cudaSuccess) {
      cudaGetLastError();  // another topology: instantiated afresh below
      cudaGraphExecDestroy(r.exec);
      r.exec = nullptr;
    }
  }
  const cudaError_t made = r.exec ? cudaSuccess : cudaGraphInstantiate(&r.exec, graph, 0);
  cudaGraphDestroy(graph);
  check(made, "device.steps=graphs: instantiate a step's graph");
  check(cudaGraphLaunch(r.exec, stream()), "device.steps=graphs: launch a step's graph");
  check(cudaEventRecord(r.read[r.turn], stream()), "mark the staging buffer's reader");
  r.turn ^= 1;
}

void abandon_graph() noexcept {
  Recorder& r = recorder;
  if (!r.recording) return;
  r.recording = false;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream(), &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
}

void refuse_wait_in_graph(const char* what) {
  APUS_CHECK(!recorder.recording, "device.steps=graphs: ", what, " inside a recorded step (a step's ops must not ",
             "wait for the device)");
}

const void* host_source(const void* host, size_t bytes) {
  Recorder& r = recorder;
  if (!r.recording) return host;
  APUS_CHECK(r.used + bytes <= kStagingBytes, "device.steps=graphs: a step stages more than ", kStagingBytes,
             " bytes from the host into its graph");
  char* kept = r.staging[r.turn] + r.used;
  std::memcpy(kept, host, bytes);
  r.used += (bytes + 255) / 256 * 256;
  return kept;
}

}  // namespace apus::cuda
