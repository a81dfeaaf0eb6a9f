#pragma once
// A batch of requests as bytes, for a server's rank 0 to hand the other ranks (issue 43): every
// setting that decides the result; and results as bytes, for the other ranks to hand rank 0. The callbacks and flags
// travel as whether they are given: every rank of a split makes the previews rank 0 makes (a clip's preview decodes
// over the ranks) and agrees the finish flag before each step (pipeline/split.h).
#include <atomic>
#include <string>
#include <vector>

#include "apus/apus.h"

namespace apus::dist {

std::string encode(const std::vector<ImageRequest>& batch);
std::string encode(const std::vector<AudioRequest>& batch);
// Decoded with a sink that drops the previews where rank 0's request had one, `finish` where it
// had a finish flag, and no parallelism (the receiver sets it).
std::vector<ImageRequest> decode_images(const std::string& bytes, const std::atomic<bool>* finish);
std::vector<AudioRequest> decode_audio(const std::string& bytes, const std::atomic<bool>* finish);

// A rank's results as bytes, for a server's batch split (each rank renders its share of the
// outputs; rank 0 gathers them): every member.
std::string encode(const std::vector<ImageResult>& results);
std::string encode(const std::vector<AudioResult>& results);
// Appends what encode() wrote to `results`.
void decode(const std::string& bytes, std::vector<ImageResult>& results);
void decode(const std::string& bytes, std::vector<AudioResult>& results);

}  // namespace apus::dist
