#pragma once
// apus public API: prompt in, image out.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace apus {

struct ImageOptions {
  std::string model_dir;          // diffusers layout of black-forest-labs/FLUX.2-klein-4B
  std::string prompt;
  int width = 1024, height = 1024;
  int steps = 4;
  std::optional<uint64_t> seed;   // drawn from the OS when absent; reported in the result
  std::string noise_file;         // safetensors holding "noise" [1, 128, H/16, W/16]; overrides seed
  bool fp32 = false;              // parity mode: fp32 activations (weights stay as stored)
};

struct StageTime {
  std::string name;
  double seconds;
};

struct ImageResult {
  int width = 0, height = 0;
  uint64_t seed = 0;
  std::vector<uint8_t> rgb;  // height * width * 3
  std::vector<StageTime> stages;
};

// Progress lines ("step 2/4 ...") go to `progress` as they happen.
ImageResult generate_image(const ImageOptions& options,
                           const std::function<void(const std::string&)>& progress = {});

// Peak resident memory of this process so far, in bytes (VmHWM).
uint64_t peak_rss_bytes();

}  // namespace apus
