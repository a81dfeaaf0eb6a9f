#pragma once
// The processes one command runs over (issue 43): MPI's world when a launcher (mpirun, srun)
// started this process as one of several and the build has MPI (Open MPI from Debian), else this
// process alone. Without MPI in the build or without a launcher nothing changes; a build without
// MPI started as one of several is refused, since every rank would do the whole work.
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"

namespace apus::dist {

// What an exchange throws once a server's ranks are lost (World::throw_when_lost): the request in
// flight is answered (503) before the job ends.
class RanksLost : public Error {
 public:
  using Error::Error;
};

class World final : public ProcessGroup {
 public:
  // The world, MPI initialised on first use and finalised at exit.
  static World& get();
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Rank 0's `text` on every rank (`what` names it in a failure), each waiting at most timeout();
  // with `idle` the other ranks wait for rank 0 however long it takes (a server's ranks between
  // requests).
  std::string broadcast(const std::string& text, const char* what, bool idle = false) const;
  // Every rank's `mine`, in rank order, on every rank (parts of any length): two all-gathers.
  std::vector<std::string> all_gather_text(const std::string& mine, const char* what) const;
  // Each waits at most timeout() for the slowest rank; past it the job ends (abort) naming the
  // exchange.
  void all_gather(void* data, const std::vector<size_t>& bytes, const char* what) const override;
  void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, const char* what) const override;

  // What this rank's exchanges moved so far: how many, the bytes it sent to the other ranks (an
  // all-gather: its part to each) and the seconds it spent in them (waiting included).
  struct Traffic {
    int64_t calls = 0;
    double sent = 0, seconds = 0;
  };
  Traffic traffic() const { return traffic_; }
  // Puts the count back to `t` (an earlier traffic()): exchanges that were no request's.
  void set_traffic(const Traffic& t) const { traffic_ = t; }
  // How long a collective waits for the other ranks (600 s unless set): a rank that hangs or died
  // ends the job instead of leaving the others waiting forever.
  double timeout() const override { return timeout_s_; }
  void set_timeout(double seconds);
  // Where the ranks run: "3 ranks on node1 (2), node2 (1)", the hosts in rank order.
  std::string placement() const;
  // How many ranks run on this rank's host, itself included (a collective).
  int ranks_here() const;
  // A server's world: an exchange that cannot complete (a rank past the timeout, or interrupt())
  // throws RanksLost instead of ending the job at once, so that rank 0 answers the request first;
  // every exchange after it throws too.
  void throw_when_lost() { throws_when_lost_ = true; }
  // Safe from a signal handler: the exchange in flight, and every later one, fail now (mpirun's
  // SIGTERM when another rank died: it kills this one a second later).
  void interrupt() const { interrupted_ = true; }
  bool lost() const { return lost_ || interrupted_; }
  // What an exchange that cannot complete does: ends the job (abort) or, serving, throws
  // RanksLost; `message` names the exchange.
  [[noreturn]] void lose(const std::string& message) const override;
  // A device's exchange between the ranks (a GPU backend's, over NCCL), in traffic() too.
  void count_exchange(double sent, double seconds) const override { count(sent, seconds); }
  // Ends every rank's process, this one's `message` (one line) on stderr first: a rank that fails
  // must not leave the others waiting in a collective. One process: prints and exits.
  [[noreturn]] void abort(const std::string& message) const;

 private:
  World();
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 600;
  mutable Traffic traffic_;
  bool throws_when_lost_ = false;
  mutable std::atomic<bool> lost_{false};
  mutable std::atomic<bool> interrupted_{false};
  // The all-gather and the all-to-all themselves, uncounted: seconds they took.
  double gather(void* data, const std::vector<size_t>& bytes, const char* what) const;
  double exchange(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, const char* what) const;
  void count(double sent, double seconds) const;
  // Exchanges after a loss fail at once: the other ranks are gone or out of step.
  void check_not_lost(const char* what) const;
  // Every rank's host name, in rank order (a collective).
  std::vector<std::string> host_names() const;
};

// Whether this build splits a command over MPI ranks.
bool built_with_mpi();

// How many processes the launcher's environment says were started together (Open MPI's
// OMPI_COMM_WORLD_SIZE, PMI's PMI_SIZE, Slurm's SLURM_NTASKS under srun); 1 without a launcher.
int launched_size();

}  // namespace apus::dist
