#pragma once
// The processes one command runs over (issue 43): MPI's world when a launcher (mpirun, srun)
// started this process as one of several and the build has MPI (Open MPI from Debian), else this
// process alone. Without MPI in the build or without a launcher nothing changes; a build without
// MPI started as one of several is refused, since every rank would do the whole work.
#include <string>

namespace apus::dist {

class World {
 public:
  // The world, MPI initialised on first use and finalised at exit.
  static const World& get();
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Rank 0's `text` on every rank.
  std::string broadcast(const std::string& text) const;

 private:
  World();
  int rank_ = 0, size_ = 1;
};

// Whether this build splits a command over MPI ranks.
bool built_with_mpi();

// How many processes the launcher's environment says were started together (Open MPI's
// OMPI_COMM_WORLD_SIZE, PMI's PMI_SIZE, Slurm's SLURM_NTASKS under srun); 1 without a launcher.
int launched_size();

// The share of `count` items rank `rank` of `size` takes: items [first, first + count) in order,
// the first count % size ranks one more.
struct Share {
  int first = 0, count = 0;
};
Share share_of(int count, int rank, int size);

}  // namespace apus::dist
