#pragma once
// The "parameters" text an image is written with, in the form Automatic1111's web UI writes and
// reads (its infotext): the prompt, the negative prompt, then "Key: value" pairs.
#include <string>

#include "apus/apus.h"

namespace apus {

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model);

}  // namespace apus
