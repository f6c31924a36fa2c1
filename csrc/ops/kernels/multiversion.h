// What the host kernels share to run their loops at full vector width from one binary.
#pragma once

// The best vector ISA is picked at run time. x86-64-v3/v4 rather than plain "avx2"/"avx512f" because those
// alone do not enable FMA, and ATen's AVX2/AVX-512 kernels (which the optimizer steps must agree with) use FMA.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HYDRA_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HYDRA_MULTIVERSION
#endif

// A loop's helpers must be inlined into each clone, or they run at the default ISA's width.
#if defined(__GNUC__)
#define HYDRA_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define HYDRA_ALWAYS_INLINE inline
#endif
