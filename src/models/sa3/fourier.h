#pragma once
// The official ExpoFourierFeatures' frequencies, shared by the DiT's timestep and the duration
// conditioner.
#include <cstdint>

#include "core/tensor.h"

namespace apus::sa3 {

// exp(linspace(0, 1, n) (ln max - ln min) + ln min) in fp32 as torch computes it: the span a
// double rounded once, product and sum rounded each, torch's linspace. The 10 kHz feature turns by
// t f 2 pi ~ 5e4 radians, so one ulp of a frequency moves it visibly. Heap f32 [n].
Tensor expo_fourier_frequencies(int64_t n, double min_freq = 0.5, double max_freq = 10000.0);

}  // namespace apus::sa3
