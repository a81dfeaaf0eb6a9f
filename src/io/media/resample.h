#pragma once
// Sample-rate conversion as torchaudio's Resample computes it by default (the official Stable
// Audio 3 code resamples its input clips with it): a windowed-sinc FIR of lowpass_filter_width 6
// zero crossings at rolloff 0.99 of the lower Nyquist rate, Hann window (sinc_interp_hann), one
// filter per output phase of the reduced ratio, the kernel formed in float64 and kept as float32,
// the signal zero-padded by the filter's width, int ceil(new * length / orig) samples out.
#include <cstdint>
#include <vector>

namespace apus {

// planar [channels][frames] at `from` Hz -> planar at `to` Hz, the first `max_frames` output
// frames at most (each depends on its neighbourhood only); from == to returns the input. Rates
// whose reduced ratio needs a filter bank over 16 M taps (44101 -> 44100 Hz) are refused.
std::vector<std::vector<float>> resample(const std::vector<std::vector<float>>& planes, int from, int to,
                                         int64_t max_frames);

}  // namespace apus
