#pragma once
// What an image file carries of its request, the same from every front end (the CLI's file, the
// server's answer): the "parameters" text in the form Automatic1111's web UI writes and reads (its
// infotext: the prompt, the negative prompt, then "Key: value" pairs) and the software's name.
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"

namespace apus {

std::string infotext(const ImageRequest& request, const ImageResult& result, const ImageModel& model);
// The PNG text chunks of a result: parameters (infotext) and Software.
std::vector<std::pair<std::string, std::string>> image_metadata(const ImageRequest& request, const ImageResult& result,
                                                                const ImageModel& model);

}  // namespace apus
