#pragma once
// Functions compiled once per instruction set and chosen at load by an ifunc resolver
// (AVX-512, x86-64-v3, baseline), so one binary runs every x86-64 CPU at its width. Not "avx2":
// GCC's avx2 clone has no FMA, so each std::fma of the math helpers was a call to libm's fmaf and
// nothing vectorised (GLU and DyT at 0.2-0.3 GFLOP/s on an AVX2-only EPYC, docs/SPEED.md session
// 23). x86-64-v3 is AVX2 with FMA; GCC's resolver picks by the CPU's features, AVX512F first, then
// x86-64-v3 (objdump of a resolver). Under TSan the resolvers, instrumented, run while the dynamic
// loader relocates the program, before TSan's runtime exists, and crash: a TSan build gets the
// baseline code only. So does a clang build (the sanitizer and fuzz builds): Debian's clang 14
// compiles a C++ function's target_clones as one function for the first target, AVX-512 code that
// faulted on an AVX2-only CPU (SIGILL in softmax_row_bf16, session 29).
#if defined(__SANITIZE_THREAD__) || defined(__clang__)
#define APUS_CLONES
#else
#define APUS_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#endif
