#include "dist/world.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "core/error.h"

#ifdef APUS_HAS_MPI
// MPI's C API only: Open MPI's mpi.h pulls in its deprecated C++ bindings otherwise.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace apus::dist {

int launched_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      const int n = std::atoi(v);
      if (n > 0) return n;
    }
  }
  return 1;
}

void World::set_timeout(double seconds) {
  APUS_CHECK(std::isfinite(seconds) && seconds > 0, "--rank-timeout ", seconds, ": expected seconds above 0");
  timeout_s_ = seconds;
}

#ifdef APUS_HAS_MPI

bool built_with_mpi() { return true; }

World::World() {
  if (launched_size() == 1) return;
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    // Serialized: a server's exchanges run on its model workers' threads, one at a time.
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    APUS_CHECK(provided >= MPI_THREAD_SERIALIZED, "MPI gives threads level ", provided,
               ", and apus exchanges from its workers' threads (MPI_THREAD_SERIALIZED)");
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    });
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

void World::all_gather(void* data, const std::vector<size_t>& bytes, const char* what) const {
  APUS_CHECK(int(bytes.size()) == size_, what, ": ", bytes.size(), " parts for ", size_, " ranks");
  const double seconds = gather(data, bytes, what);
  count(double(bytes[size_t(rank_)]) * (size_ - 1), seconds);
}

void World::count(double sent, double seconds) const {
  ++traffic_.calls;
  traffic_.sent += sent;
  traffic_.seconds += seconds;
}

std::vector<std::string> World::host_names() const {
  char name[MPI_MAX_PROCESSOR_NAME + 1] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  const size_t width = MPI_MAX_PROCESSOR_NAME + 1, n = size_t(size_);
  std::vector<char> names(width * n, 0);
  std::memcpy(names.data() + width * size_t(rank_), name, size_t(length));
  gather(names.data(), std::vector<size_t>(n, width), "the ranks' host names");
  std::vector<std::string> hosts;
  for (size_t r = 0; r < n; ++r) hosts.emplace_back(names.data() + width * r);
  return hosts;
}

int World::ranks_here() const {
  const std::vector<std::string> hosts = host_names();
  return int(std::count(hosts.begin(), hosts.end(), hosts[size_t(rank_)]));
}

std::string World::placement() const {
  std::vector<std::pair<std::string, int>> hosts;
  for (const std::string& host : host_names()) {
    if (hosts.empty() || hosts.back().first != host) hosts.emplace_back(host, 0);
    ++hosts.back().second;
  }
  std::string out = std::to_string(size_) + " ranks on ";
  for (size_t i = 0; i < hosts.size(); ++i)
    out += (i ? ", " : "") + hosts[i].first + " (" + std::to_string(hosts[i].second) + ")";
  return out;
}

namespace {

constexpr int kExchangeTag = 43;

// MPI's counts and offsets of parts laid one after another: ints, so a part or an offset past
// 2 GiB is refused rather than wrapped.
struct Layout {
  std::vector<int> counts, offsets;
};
Layout layout_of(const std::vector<size_t>& bytes, const char* what) {
  Layout l;
  size_t offset = 0;
  for (const size_t b : bytes) {
    APUS_CHECK(b <= size_t(INT_MAX) && offset <= size_t(INT_MAX), what, ": a part of ", b, " bytes at offset ", offset,
               " is beyond MPI's int counts (2 GiB)");
    l.counts.push_back(int(b));
    l.offsets.push_back(int(offset));
    offset += b;
  }
  return l;
}

// Seconds until `requests` complete, polled against the world's deadline (MPI's blocking
// collectives wait forever on a rank that hangs) unless `bounded` is false: a server's idle ranks
// wait for its next request. A loss (interrupt()) ends the wait either way.
double wait(const World& world, std::vector<MPI_Request>& requests, const char* verb, const char* what,
            bool bounded = true) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(world.timeout());
  for (int done = 0;;) {
    MPI_Testall(int(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (world.lost())
      world.lose(detail::concat(verb, " ", what, ": the job is ending (a rank failed, or mpirun was stopped)"));
    if (bounded && std::chrono::steady_clock::now() > deadline)
      world.lose(detail::concat(verb, " ", what, ": not every rank arrived within ", world.timeout(),
                                " s (one failed or hangs; --rank-timeout sets the wait)"));
    std::this_thread::sleep_for(std::chrono::microseconds(bounded ? 50 : 1000));
  }
}

}  // namespace

void World::lose(const std::string& message) const {
  if (!throws_when_lost_) abort(message);
  lost_ = true;
  throw RanksLost(detail::concat("rank ", rank_, " of ", size_, ": ", message));
}

void World::check_not_lost(const char* what) const {
  if (lost_) throw RanksLost(detail::concat(what, ": an earlier exchange between the ranks failed; the job is ending"));
}

std::string World::broadcast(const std::string& text, const char* what, bool idle) const {
  if (size_ == 1) return text;
  check_not_lost(what);
  unsigned long long length = text.size();
  std::vector<MPI_Request> request(1);
  MPI_Ibcast(&length, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD, &request[0]);
  wait(*this, request, "broadcasting", what, rank_ == 0 || !idle);
  APUS_CHECK(length <= (unsigned long long)INT_MAX, what, ": ", length, " bytes are beyond MPI's int counts (2 GiB)");
  std::string out = rank_ == 0 ? text : std::string(length, '\0');
  MPI_Ibcast(out.data(), int(length), MPI_CHAR, 0, MPI_COMM_WORLD, &request[0]);
  wait(*this, request, "broadcasting", what);
  return out;
}

double World::gather(void* data, const std::vector<size_t>& bytes, const char* what) const {
  const Layout l = layout_of(bytes, what);
  if (size_ == 1) return 0;
  check_not_lost(what);
  std::vector<MPI_Request> request(1);
  MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, l.counts.data(), l.offsets.data(), MPI_BYTE, MPI_COMM_WORLD,
                  &request[0]);
  return wait(*this, request, "gathering", what);
}

void World::all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes, const char* what) const {
  APUS_CHECK(int(send_bytes.size()) == size_ && int(recv_bytes.size()) == size_, what, ": ", send_bytes.size(), " and ",
             recv_bytes.size(), " parts for ", size_, " ranks");
  double sent = 0;
  for (int j = 0; j < size_; ++j)
    if (j != rank_) sent += double(send_bytes[size_t(j)]);
  count(sent, exchange(send, send_bytes, recv, recv_bytes, what));
}

double World::exchange(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes, const char* what) const {
  const Layout out = layout_of(send_bytes, what), in = layout_of(recv_bytes, what);
  check_not_lost(what);
  // Point to point, the non-empty parts only: Open MPI 4.1's MPI_Ialltoallv hangs where some
  // parts are empty (a rank with no heads), and its blocking one has no deadline.
  std::memcpy(static_cast<char*>(recv) + in.offsets[size_t(rank_)],
              static_cast<const char*>(send) + out.offsets[size_t(rank_)], send_bytes[size_t(rank_)]);
  std::vector<MPI_Request> requests;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    if (recv_bytes[size_t(j)] > 0)
      MPI_Irecv(static_cast<char*>(recv) + in.offsets[size_t(j)], in.counts[size_t(j)], MPI_BYTE, j, kExchangeTag,
                MPI_COMM_WORLD, &requests.emplace_back());
    if (send_bytes[size_t(j)] > 0)
      MPI_Isend(static_cast<const char*>(send) + out.offsets[size_t(j)], out.counts[size_t(j)], MPI_BYTE, j,
                kExchangeTag, MPI_COMM_WORLD, &requests.emplace_back());
  }
  return wait(*this, requests, "exchanging", what);
}

void World::abort(const std::string& message) const {
  std::fprintf(stderr, "error: rank %d of %d: %s\n", rank_, size_, message.c_str());
  std::fflush(stderr);
  if (size_ > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

#else

bool built_with_mpi() { return false; }

World::World() {
  const int launched = launched_size();
  APUS_CHECK(launched == 1, "started as one of ", launched,
             " processes (mpirun or srun), but this apus was built without MPI, so each would do the whole work: "
             "rebuild with Open MPI installed (libopenmpi-dev), or run one process");
}

std::string World::broadcast(const std::string& text, const char*, bool) const { return text; }

void World::lose(const std::string& message) const { abort(message); }

void World::check_not_lost(const char*) const {}

void World::all_gather(void*, const std::vector<size_t>& bytes, const char* what) const {
  APUS_CHECK(bytes.size() == 1, what, ": ", bytes.size(), " parts for one process");
}

void World::all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                       const std::vector<size_t>& recv_bytes, const char* what) const {
  APUS_CHECK(send_bytes.size() == 1 && recv_bytes == send_bytes, what, ": ", send_bytes.size(),
             " parts for one process");
  std::memcpy(recv, send, send_bytes[0]);
}

std::string World::placement() const { return "1 rank"; }

int World::ranks_here() const { return 1; }

void World::abort(const std::string& message) const {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::exit(1);
}

#endif

std::vector<std::string> World::all_gather_text(const std::string& mine, const char* what) const {
  const size_t n = size_t(size_), me = size_t(rank_);
  std::vector<uint64_t> lengths(n, 0);
  lengths[me] = mine.size();
  all_gather(lengths.data(), std::vector<size_t>(n, sizeof(uint64_t)), what);
  std::vector<size_t> bytes(lengths.begin(), lengths.end()), at(n, 0);
  for (size_t r = 1; r < n; ++r) at[r] = at[r - 1] + bytes[r - 1];
  std::string all(at[n - 1] + bytes[n - 1], '\0');
  std::memcpy(all.data() + at[me], mine.data(), mine.size());
  all_gather(all.data(), bytes, what);
  std::vector<std::string> parts;
  for (size_t r = 0; r < n; ++r) parts.push_back(all.substr(at[r], bytes[r]));
  return parts;
}

World& World::get() {
  static World world;
  return world;
}

}  // namespace apus::dist
