#pragma once
// Pillow's Image.resize with the Lanczos filter (the resampling Flux2ImageProcessor applies to
// references over 1024x1024 pixels), reproduced byte for byte: separable passes, horizontal
// first, fixed-point coefficients with 22 fractional bits, rounded and clipped to 8 bits between
// the passes.
#include "apus/apus.h"

namespace apus {

Rgb8Image resize_lanczos(const Rgb8Image& image, int width, int height);
// Pillow's Image.resize with the nearest filter, byte for byte: output pixel x takes source pixel
// floor((x + 0.5) * in / out), the position stepped in doubles as Pillow's affine scaling does.
Rgb8Image resize_nearest(const Rgb8Image& image, int width, int height);
// Pillow's paste of `image` at (x, y) onto a new black image of width x height: what falls
// outside is cut.
Rgb8Image pasted(const Rgb8Image& image, int width, int height, int x, int y);

}  // namespace apus
