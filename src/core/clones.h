#pragma once
// Functions compiled once per instruction set and chosen at load by an ifunc resolver
// (AVX-512, AVX2, baseline), so one binary runs every x86-64 CPU at its width. Under TSan the
// resolvers, instrumented, run while the dynamic loader relocates the program, before TSan's
// runtime exists, and crash: a TSan build gets the baseline code only.
#if defined(__SANITIZE_THREAD__)
#define APUS_CLONES
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define APUS_CLONES
#endif
#endif
#ifndef APUS_CLONES
#define APUS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
