#include "models/common/sequence_split.h"

#include "core/error.h"
#include "models/common/exchange.h"

namespace apus {

int64_t SequenceSplit::local_tokens(int rank) const {
  int64_t n = 0;
  for (size_t run = 0; run < runs.size(); ++run) n += share(run, rank).count;
  return n;
}

int64_t SequenceSplit::tokens() const {
  int64_t n = 0;
  for (const int64_t r : runs) n += r;
  return n;
}

namespace {

// A [rows, cols] view of `count` elements of a flat buffer from element `first`.
Tensor part(const Tensor& flat, int64_t first, int64_t rows, int64_t cols) {
  return flat.rows(first, first + rows * cols).reshape({rows, cols});
}

// Copies each sample's rows of one rank's local sequence (`local` [batch x its tokens, w]) to
// their places in the whole sequence (`whole` [batch x all tokens, w]), or back from them.
void place_rows(Context& c, const SequenceSplit& split, int rank, int64_t batch, Tensor local, Tensor whole,
                bool to_whole) {
  const int64_t mine = split.local_tokens(rank), all = split.tokens();
  for (int64_t b = 0; b < batch; ++b) {
    int64_t at = 0, run_start = 0;
    for (size_t run = 0; run < split.runs.size(); ++run) {
      const Share s = split.share(run, rank);
      if (s.count > 0) {
        Tensor l = local.rows(b * mine + at, b * mine + at + s.count);
        Tensor w = whole.rows(b * all + run_start + s.first, b * all + run_start + s.first + s.count);
        if (to_whole) ops::copy(c, l, w);
        else ops::copy(c, w, l);
      }
      at += s.count;
      run_start += split.runs[run];
    }
  }
}

}  // namespace

void sequence_attention(Context& c, const SequenceSplit& split, const std::vector<const Tensor*>& qs,
                        const std::vector<const Tensor*>& ks, const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                        const ops::AttentionOptions& options, const ExtraKeys& extra) {
  const ProcessGroup& group = *split.group;
  const int n = group.size(), me = group.rank();
  const Tensor& q = *qs[0];
  const int64_t batch = options.batch, d = head_dim, heads = q.shape[1] / d;
  const int64_t mine = split.local_tokens(me), all = split.tokens();
  // Exchanged as one: the query terms, the key terms, the values.
  std::vector<const Tensor*> terms = qs;
  terms.insert(terms.end(), ks.begin(), ks.end());
  terms.push_back(&v);
  for (const Tensor* t : terms)
    APUS_CHECK(t->shape == Shape({batch * mine, q.shape[1]}) && qs.size() == ks.size() && qs.size() <= 2,
               "sequence-parallel attention: ", shape_str(t->shape), " among ", qs.size(), " query and ", ks.size(),
               " key terms, expected [", batch, " x ", mine, " local tokens, ", q.shape[1],
               "] (keys and values need the queries' heads)");
  const int64_t nt = int64_t(terms.size());
  APUS_CHECK(!options.key_valid && !options.causal && options.window == 0,
             "sequence-parallel attention: key masks, causal and windowed attention are not split yet");
  const size_t element = dtype_bytes(q.dtype, 1);
  const Share my_heads = share_of(heads, me, n);
  ArenaScope arena(*c.arena);
  // Out: to rank j, every term of this rank's tokens for j's heads, one after another.
  std::vector<size_t> out_bytes, in_bytes;
  int64_t out_total = 0, in_total = 0;
  for (int j = 0; j < n; ++j) {
    const int64_t out = nt * batch * mine * share_of(heads, j, n).count * d;
    const int64_t in = nt * batch * split.local_tokens(j) * my_heads.count * d;
    out_bytes.push_back(size_t(out) * element);
    in_bytes.push_back(size_t(in) * element);
    out_total += out;
    in_total += in;
  }
  Tensor send = Tensor::in(*c.arena, {out_total}, q.dtype), recv = Tensor::in(*c.arena, {in_total}, q.dtype);
  int64_t at = 0;
  for (int j = 0; j < n; ++j) {
    const Share h = share_of(heads, j, n);
    for (const Tensor* t : terms) {
      Tensor to = part(send, at, batch * mine, h.count * d);
      if (h.count > 0) ops::copy(c, t->cols(h.first * d, (h.first + h.count) * d), to);
      at += batch * mine * h.count * d;
    }
  }
  all_to_all(c, group, send.data, out_bytes, recv.data, in_bytes, "attention's queries, keys and values");
  // Every token for this rank's heads, in the sequence's order.
  const int64_t w = my_heads.count * d;
  std::vector<Tensor> whole;
  for (int64_t t = 0; t < nt; ++t) whole.push_back(Tensor::in(*c.arena, {batch * all, w}, q.dtype));
  Tensor attended = Tensor::in(*c.arena, {batch * all, w}, o.dtype);
  if (w > 0) {
    at = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t rows = batch * split.local_tokens(i);
      for (Tensor& t : whole) {
        place_rows(c, split, i, batch, part(recv, at, rows, w), t, true);
        at += rows * w;
      }
    }
    if (extra.k) {
      APUS_CHECK(qs.size() == 1 && extra.v && extra.at >= 0 && extra.at <= all &&
                     extra.k->shape == Shape({extra.k->shape[0], heads * d}) && extra.v->shape == extra.k->shape,
                 "sequence-parallel attention: extra keys ", shape_str(extra.k->shape), " before token ", extra.at,
                 " of ", all, ", expected [R, ", heads * d, "] for one query term");
      // Each sample's keys and values: its sequence up to `at`, the extra ones of this rank's
      // heads, then the rest.
      const int64_t r = extra.k->shape[0], sk = all + r;
      auto with_extra = [&](const Tensor& own, const Tensor& added) {
        Tensor out = Tensor::in(*c.arena, {batch * sk, w}, q.dtype);
        const Tensor mine_of_added = added.cols(my_heads.first * d, (my_heads.first + my_heads.count) * d);
        for (int64_t b = 0; b < batch; ++b) {
          Tensor head = out.rows(b * sk, b * sk + extra.at),
                 middle = out.rows(b * sk + extra.at, b * sk + extra.at + r),
                 tail = out.rows(b * sk + extra.at + r, (b + 1) * sk);
          if (extra.at > 0) ops::copy(c, own.rows(b * all, b * all + extra.at), head);
          ops::copy(c, mine_of_added, middle);
          if (extra.at < all) ops::copy(c, own.rows(b * all + extra.at, (b + 1) * all), tail);
        }
        return out;
      };
      const Tensor k_all = with_extra(whole[1], *extra.k), v_all = with_extra(whole[2], *extra.v);
      ops::attention(c, whole[0], k_all, v_all, attended, d, scale, options);
    } else if (qs.size() == 2) {
      ops::differential_attention(c, whole[0], whole[2], whole[1], whole[3], whole[4], attended, d, scale, options);
    } else {
      ops::attention(c, whole[0], whole[1], whole[2], attended, d, scale, options);
    }
  }
  // Back: to rank i, the attended rows of its tokens for this rank's heads.
  std::vector<size_t> back_out, back_in;
  int64_t back_total = 0, ret_total = 0;
  for (int i = 0; i < n; ++i) {
    back_out.push_back(size_t(batch * split.local_tokens(i) * w) * element);
    back_in.push_back(size_t(batch * mine * share_of(heads, i, n).count * d) * element);
    back_total += batch * split.local_tokens(i) * w;
    ret_total += batch * mine * share_of(heads, i, n).count * d;
  }
  Tensor back = Tensor::in(*c.arena, {back_total}, o.dtype), ret = Tensor::in(*c.arena, {ret_total}, o.dtype);
  at = 0;
  for (int i = 0; i < n && w > 0; ++i) {
    const int64_t rows = batch * split.local_tokens(i);
    place_rows(c, split, i, batch, part(back, at, rows, w), attended, false);
    at += rows * w;
  }
  all_to_all(c, group, back.data, back_out, ret.data, back_in, "attention's output");
  at = 0;
  for (int j = 0; j < n; ++j) {
    const Share h = share_of(heads, j, n);
    if (h.count == 0) continue;
    Tensor cols = o.cols(h.first * d, (h.first + h.count) * d);
    ops::copy(c, part(ret, at, batch * mine, h.count * d), cols);
    at += batch * mine * h.count * d;
  }
}

}  // namespace apus
