# Sourced by the MPI tests: mpi_ready NAME APUS exits 77 (skipped) naming the reason without
# mpirun or without MPI in APUS's build, and lets mpirun start ranks here (as root in CI, more
# ranks than cores).
mpi_ready() {
  command -v mpirun > /dev/null || { echo "$1: no mpirun (Debian's openmpi-bin)" >&2; exit 77; }
  "$2" --version | grep -q "MPI ranks" || { echo "$1: this apus was built without MPI" >&2; exit 77; }
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
}
