# Sourced by the MPI tests: mpi_ready NAME APUS exits 77 (skipped) naming the reason without
# mpirun or without MPI in APUS's build, and lets mpirun start ranks here (as root in CI, more
# ranks than cores). One process and the ranks run the widened bf16 kernels (APUS_KNOBS, which
# the ranks inherit), whose outputs do not depend on a call's shape, so the tests can compare
# bytes on every CPU: oneDNN's native bf16 kernels pick their summation order by the shape, and a
# rank's share of a linear's features lands a bf16 rounding from the whole call's on some AVX-512
# CPUs (docs/SPEED.md, session 32; a Zen 4 in session 36 for a Q8_0 GGUF over 3 ranks).
mpi_ready() {
  command -v mpirun > /dev/null || { echo "$1: no mpirun (Debian's openmpi-bin)" >&2; exit 77; }
  "$2" --version | grep -q "MPI ranks" || { echo "$1: this apus was built without MPI" >&2; exit 77; }
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  export APUS_KNOBS=cpu.native_bf16=off
}
