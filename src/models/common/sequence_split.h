#pragma once
// Ulysses sequence parallelism (issue 43; DeepSpeed-Ulysses): each rank holds its share of every
// sample's tokens, for every head. An attention over the whole sequence exchanges queries, keys
// and values (an all-to-all) so that each rank holds every token for its share of the heads,
// attends, and exchanges the output back. Everything else a transformer does is per token, so the
// rest of the model runs on the rank's own tokens. Each head's attention sees the same keys in the
// same order as in one process, so its output is one process's, bit for bit.
#include <cstdint>
#include <vector>

#include "apus/apus.h"
#include "core/share.h"
#include "ops/ops.h"

namespace apus {

struct SequenceSplit {
  const ProcessGroup* group = nullptr;
  // The runs a sample's sequence is made of, in order (klein: its text, then its image), each
  // split over the ranks on its own: a rank's local sequence is its share of each run, in the same
  // order, so a model's per-run code (the text's weights, the image's) holds for it unchanged.
  std::vector<int64_t> runs;

  Share share(size_t run, int rank) const { return share_of(runs[run], rank, group->size()); }
  int64_t local_tokens(int rank) const;  // its shares of every run
  int64_t tokens() const;                // the whole sequence
};

// Keys and values every sample attends to beside its own, placed in its whole sequence before
// token `at` (klein's cached reference keys: [text; references; image]): [R, heads x head_dim],
// every head, every rank holding them whole; the same for every sample.
struct ExtraKeys {
  const Tensor* k = nullptr;
  const Tensor* v = nullptr;
  int64_t at = 0;
};

// o = attention(q, k, v) over each sample's whole sequence, per head, or with two query and key
// terms (qs, ks of two each) differential_attention: every tensor [batch x the rank's tokens,
// heads x head_dim] holds this rank's tokens; keys and values have the queries' heads. With
// `extra` (one term) the keys and values are each sample's whole sequence with extra's placed in
// it. Counting, files what the rank sends (CostLog::mark_sent) and the attention of its heads.
void sequence_attention(Context& c, const SequenceSplit& split, const std::vector<const Tensor*>& qs,
                        const std::vector<const Tensor*>& ks, const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                        const ops::AttentionOptions& options, const ExtraKeys& extra = {});

}  // namespace apus
