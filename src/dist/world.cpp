#include "dist/world.h"

#include <cstdlib>
#include <string>

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

Share share_of(int count, int rank, int size) {
  const int base = count / size, extra = count % size;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

#ifdef APUS_HAS_MPI

bool built_with_mpi() { return true; }

World::World() {
  if (launched_size() == 1) return;
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    });
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

std::string World::broadcast(const std::string& text) const {
  if (size_ == 1) return text;
  unsigned long long length = text.size();
  MPI_Bcast(&length, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  std::string out = rank_ == 0 ? text : std::string(length, '\0');
  MPI_Bcast(out.data(), int(length), MPI_CHAR, 0, MPI_COMM_WORLD);
  return out;
}

#else

bool built_with_mpi() { return false; }

World::World() {
  const int launched = launched_size();
  APUS_CHECK(launched == 1, "started as one of ", launched,
             " processes (mpirun or srun), but this apus was built without MPI, so each would do the whole work: "
             "rebuild with Open MPI installed (libopenmpi-dev), or run one process");
}

std::string World::broadcast(const std::string& text) const { return text; }

#endif

const World& World::get() {
  static const World world;
  return world;
}

}  // namespace apus::dist
