// The op table: every op of the list (ops/op_list.h) in cases written once, each run on every
// backend present against the reference backend (src/ops/ref: plain f64 loops with the op
// contract's roundings), as llama.cpp's test-backend-ops runs every backend against the CPU. The
// backends: the CPU in f32 and bf16, and in bf16 on the f32 path AVX2-only CPUs take (widened);
// the shadow device (shadow_device.h), on which every case reaches its op through device memory
// as on a GPU (in f32 only: it runs the CPU's kernels, so its numbers are the CPU's and one dtype
// proves each case's staging); CUDA where the build has it, skipped with the reason where no GPU
// runs. Each case on each backend is its own test, on fresh random inputs (seed printed) with
// poisoned outputs.
//
// The bound is what the arithmetic allows (op_bounds.h). f32: relative L2 2e-6 (fp32 accumulation
// against f64). bf16: both backends round the same values at the same places, so they may differ
// only where fp32 and f64 land on opposite sides of a bf16 rounding boundary: at most 1 % of
// elements differing at all, each by at most two bf16 ulps (a flipped intermediate rounding
// reaches the output through the next step: 1.5 ulp measured through GroupNorm's SiLU). An op that
// drops a rounding rule differs in 12-70 % of its elements, which test_ops.cpp's
// RoundingRulesAreVisibleToTheBound shows for each. Attention through a fused softmax (cuDNN's
// SDPA, cuda.attention=cudnn) rounds its probabilities elsewhere and is held to that rounding's
// own bound against the exact result (op_bounds.h, FusedAgreement).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/variants.h"
#include "io/weights/quant_weights.h"
#include "op_bounds.h"
#include "op_inputs.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/ops.h"
#include "shadow_device.h"
#include "test_util.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace apus {
namespace {

using ops::OpId;
using ops::Rounding;
using test::OpInputs;

// A case's operands: inputs drawn on the host (the op gets copies in the backend's memory), the
// outputs' starting contents (poisoned, or the operand an in-place op updates), and what a
// predicate op answers.
struct Operands {
  std::vector<Tensor> in, out;
  std::vector<bool> answers;
};

using Call = std::function<void(Context&, Operands&)>;

// One draw of a case: its operands and the call, which finds them in the context's memory.
struct Drawn {
  Operands operands;
  Call call;
  // An attention case's terms, each a plain attention into out[0] (the differential form's two;
  // empty: the call is its one term): what a fused softmax's allowance is computed from
  // (op_bounds.h).
  std::vector<Call> terms = {};
};

struct OpCase {
  std::string name;
  OpId op;
  Bound bound;
  std::function<Drawn(OpInputs&)> draw;
  // Inputs holding NaN or infinities: the outputs must be non-finite exactly where the
  // reference's are (their poison is a finite sentinel, so an unwritten one shows), the finite
  // rest within the bound.
  bool nonfinite = false;
  // A quantised tier's linear (int8, fp8): skipped where the target's device refuses the tier
  // (Backend::refuses: int8 on a CPU with neither VNNI nor AVX2, fp8 on a GPU before Ada).
  Products tier = Products::decoded;
  // Attention scores rounded step by step (Rounding::each_step): only the contract's kernels take
  // them, so a fused-softmax target holds them to the contract's bound too.
  bool rounded_scores = false;
};

constexpr Rounding kRoundings[] = {Rounding::once, Rounding::each_step};
std::string tag(Rounding r) { return r == Rounding::once ? "once" : "each_step"; }

// cos and sin [rows, width] (f32) of angles drawn from [0, 10).
std::vector<Tensor> random_angles(OpInputs& d, int64_t rows, int64_t width) {
  Tensor cos = Tensor::heap({rows, width}, DType::f32), sin = Tensor::heap({rows, width}, DType::f32);
  for (int64_t i = 0; i < rows * width; ++i) {
    const double a = double(d.rng() % 1000) / 100.0;
    cos.ptr<float>()[i] = float(std::cos(a));
    sin.ptr<float>()[i] = float(std::sin(a));
  }
  return {cos, sin};
}

// i64 [n] key mask: 1 where `valid` holds.
template <typename Valid> Tensor key_mask(int64_t n, Valid&& valid) {
  Tensor t = Tensor::heap({n}, DType::i64);
  for (int64_t j = 0; j < n; ++j) t.ptr<int64_t>()[j] = valid(j);
  return t;
}

// Rounded step by step, LN(x) * (1 + scale) is rounded before the shift is added: a one-ulp flip of
// that intermediate (the backend's f32 statistics against the reference's f64) is several ulps of
// an output the shift cancels to near zero (4 ulps, seed 524490684), so those cases are held as
// an inner rounding is.
Bound modulated_bound(Rounding r) { return r == Rounding::each_step ? Bound::inner_rounding : Bound::rounding; }

void add_norm_cases(std::vector<OpCase>& cases) {
  for (const Rounding r : kRoundings) {
    cases.push_back(
        {"layer_norm_modulate_" + tag(r), OpId::layer_norm_modulate, modulated_bound(r), [r](OpInputs& d) -> Drawn {
           const int64_t m = 9, dim = 96;
           return {{{d.random({m, dim}, 3.0f), d.random({1, dim}), d.random({1, dim}, 0.5f)}, {d.poisoned({m, dim})}},
                   [r](Context& c, Operands& t) {
                     ops::layer_norm_modulate(c, t.in[0], t.in[1], t.in[2], t.out[0], 1e-6f, r);
                   }};
         }});
    // Two samples of five rows, each with its own shift and scale; x a column view.
    cases.push_back({"modulate_per_sample_" + tag(r), OpId::modulate, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       const int64_t m = 10, dim = 96;
                       return {{{d.random({m, dim + 7}, 2.0f), d.random({2, dim}), d.random({2, dim}, 0.5f)},
                                {d.poisoned({m, dim})}},
                               [r](Context& c, Operands& t) {
                                 ops::modulate(c, t.in[0].cols(7, 7 + dim), t.in[1], t.in[2], t.out[0], r);
                               }};
                     }});
    cases.push_back({"modulate_one_for_all_rows_" + tag(r), OpId::modulate, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       const int64_t m = 37, dim = 96;
                       return {
                           {{d.random({m, dim}), d.random({1, dim}), d.random({1, dim})}, {d.poisoned({m, dim})}},
                           [r](Context& c, Operands& t) { ops::modulate(c, t.in[0], t.in[1], t.in[2], t.out[0], r); }};
                     }});
    cases.push_back({"rms_norm_per_head_" + tag(r), OpId::rms_norm, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       const int64_t m = 11, g = 16;
                       return {
                           {{d.random({m, 4 * g}, 2.0f), d.random({g}, 1.0f, DType::bf16)}, {d.poisoned({m, 4 * g})}},
                           [r](Context& c, Operands& t) { ops::rms_norm(c, t.in[0], t.in[1], t.out[0], 1e-6f, g, r); }};
                     }});
    cases.push_back({"gate_sigmoid_" + tag(r), OpId::gate_sigmoid, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       const int64_t dim = 96;
                       return {{{d.random({2, dim + 7}, 2.0f)}, {d.poisoned({2, dim})}}, [r](Context& c, Operands& t) {
                                 ops::gate_sigmoid(c, t.in[0].cols(3, 3 + dim), t.out[0], r);
                               }};
                     }});
    cases.push_back({"affine_" + tag(r), OpId::affine, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       return {
                           {{d.random({12, 16}, 2.0f), d.random({16}), d.random({16})}, {d.poisoned({12, 16})}},
                           [r](Context& c, Operands& t) { ops::affine(c, t.in[0], t.in[1], t.in[2], t.out[0], r); }};
                     }});
  }
  // Per-sample shift, scale and gate ([2, D] column views of one modulation tensor), batch of two.
  cases.push_back({"layer_norm_modulate_batch_2", OpId::layer_norm_modulate, modulated_bound(Rounding::each_step),
                   [](OpInputs& d) -> Drawn {
                     const int64_t n = 9, dim = 32;
                     return {{{d.random({2 * n, dim}, 2.0f), d.random({2, 3 * dim}, 0.5f)}, {d.poisoned({2 * n, dim})}},
                             [](Context& c, Operands& t) {
                               ops::layer_norm_modulate(c, t.in[0], t.in[1].cols(0, dim), t.in[1].cols(dim, 2 * dim),
                                                        t.out[0], 1e-6f, Rounding::each_step);
                             }};
                   }});
}

void add_rope_cases(std::vector<OpCase>& cases) {
  for (const auto style : {ops::RopeStyle::interleaved, ops::RopeStyle::half}) {
    const std::string name = style == ops::RopeStyle::half ? "half" : "interleaved";
    for (const Rounding r : kRoundings) {
      cases.push_back(
          {"rope_" + name + "_" + tag(r), OpId::rope, Bound::rounding, [r, style](OpInputs& d) -> Drawn {
             const int64_t s = 7, hd = 16;
             return {{random_angles(d, s, hd / 2), {d.random({s, 3 * hd})}},
                     [r, style](Context& c, Operands& t) { ops::rope(c, t.out[0], t.in[0], t.in[1], hd, style, r); }};
           }});
      // Partial RoPE: 12 of each head's 16 pairs turn.
      cases.push_back(
          {"rope_partial_12_of_16_" + name + "_" + tag(r), OpId::rope, Bound::rounding,
           [r, style](OpInputs& d) -> Drawn {
             const int64_t m = 37, hd = 32;
             return {{random_angles(d, m, 12), {d.random({m, 3 * hd})}},
                     [r, style](Context& c, Operands& t) { ops::rope(c, t.out[0], t.in[0], t.in[1], hd, style, r); }};
           }});
    }
  }
  // Partial RoPE as Stable Audio's: a table half as wide turns the first half of each head.
  for (const Rounding r : kRoundings)
    cases.push_back({"rope_partial_half_" + tag(r), OpId::rope, Bound::rounding, [r](OpInputs& d) -> Drawn {
                       const int64_t s = 7, hd = 16;
                       return {{random_angles(d, s, hd / 4), {d.random({s, 3 * hd})}}, [r](Context& c, Operands& t) {
                                 ops::rope(c, t.out[0], t.in[0], t.in[1], hd, ops::RopeStyle::half, r);
                               }};
                     }});
  // One sample's table serving both samples of a batch.
  cases.push_back({"rope_batch_2", OpId::rope, Bound::rounding, [](OpInputs& d) -> Drawn {
                     const int64_t n = 9, dim = 32;
                     Tensor cos = Tensor::heap({n, dim / 4}, DType::f32), sin = Tensor::heap({n, dim / 4}, DType::f32);
                     for (int64_t i = 0; i < cos.numel(); ++i) {
                       cos.ptr<float>()[i] = float(std::cos(0.1 * double(i)));
                       sin.ptr<float>()[i] = float(std::sin(0.1 * double(i)));
                     }
                     return {{{cos, sin}, {d.random({2 * n, dim}, 2.0f)}}, [](Context& c, Operands& t) {
                               ops::rope(c, t.out[0], t.in[0], t.in[1], dim / 2, ops::RopeStyle::half,
                                         Rounding::each_step);
                             }};
                   }});
}

// One operand of [q, k, v] spoiled with `bad`: query row 5 of head 1, key 7 of key head 0, or
// value 9 of key head 1 (heads of width d).
void spoil(std::vector<Tensor>& qkv, const std::string& operand, float bad, int64_t d) {
  Tensor& t = qkv[operand == "q" ? 0 : operand == "k" ? 1 : 2];
  const int64_t row = operand == "q" ? 5 : operand == "k" ? 7 : 9, head = operand == "k" ? 0 : 1;
  for (int64_t e = 0; e < d; ++e) OpInputs::store(t, row * t.shape[1] + head * d + e, bad);
}

// The two terms of a differential attention over inputs q, k, q2, k2, v, each a plain attention.
std::vector<Call> difference_terms(int64_t d, float scale, ops::AttentionOptions options) {
  return {[=](Context& c, Operands& t) { ops::attention(c, t.in[0], t.in[1], t.in[4], t.out[0], d, scale, options); },
          [=](Context& c, Operands& t) { ops::attention(c, t.in[2], t.in[3], t.in[4], t.out[0], d, scale, options); }};
}

void add_attention_cases(std::vector<OpCase>& cases) {
  // 300 rows: two full 128-row query blocks and a partial one; 4 query heads over 2 key heads.
  const int64_t s = 300, d = 16, hq = 4, hk = 2;
  auto qkv = [](OpInputs& in, std::vector<Tensor> extra = {}) {
    std::vector<Tensor> t = {in.random({s, hq * d}), in.random({s, hk * d}), in.random({s, hk * d})};
    t.insert(t.end(), extra.begin(), extra.end());
    return t;
  };
  auto padded = [] { return key_mask(s, [](int64_t j) { return j < 250; }); };
  // Attention without a band, each case through both CPU kernels (below).
  std::vector<OpCase> full;
  for (const bool causal : {false, true})
    full.push_back({causal ? "attention_causal_padded" : "attention_padded", OpId::attention, Bound::inner_rounding,
                    [=](OpInputs& in) -> Drawn {
                      return {{qkv(in, {padded()}), {in.poisoned({s, hq * d})}}, [=](Context& c, Operands& t) {
                                ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, 0.25f, {causal, &t.in[3]});
                              }};
                    }});
  // Over a thousand keys in heads of 64: the direct kernel's key panels, its P·V in runs of 512 keys
  // added up and two column panels, causal rows reaching into different runs.
  full.push_back(
      {"attention_long_causal_padded", OpId::attention, Bound::inner_rounding, [](OpInputs& in) -> Drawn {
         const int64_t n = 1100, hd = 64;
         const Tensor valid = key_mask(n, [](int64_t j) { return j < 1000; });
         return {{{in.random({n, 2 * hd}), in.random({n, hd}), in.random({n, hd}), valid}, {in.poisoned({n, 2 * hd})}},
                 [](Context& c, Operands& t) {
                   ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], hd, 0.125f, {true, &t.in[3]});
                 }};
       }});
  // Without a key mask, in the head widths of the models (klein's joint attention: 128; a batch of
  // two for -base's guidance branches), and causal over grouped heads of 64: what cuDNN's fused
  // SDPA takes (cuda.attention=cudnn) and the flash kernel's widths.
  for (const auto& [name, heads, kv_heads, width, samples, causal] :
       {std::tuple{"attention_plain_heads_128", int64_t(2), int64_t(2), int64_t(128), int64_t(1), false},
        std::tuple{"attention_plain_batch_2", int64_t(2), int64_t(2), int64_t(128), int64_t(2), false},
        std::tuple{"attention_plain_causal_grouped", int64_t(4), int64_t(2), int64_t(64), int64_t(1), true}})
    full.push_back(
        {name, OpId::attention, Bound::inner_rounding, [=](OpInputs& in) -> Drawn {
           return {{{in.random({s, heads * width}), in.random({s, kv_heads * width}), in.random({s, kv_heads * width})},
                    {in.poisoned({s, heads * width})}},
                   [=](Context& c, Operands& t) {
                     ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], width, 0.125f, {causal, nullptr, samples});
                   }};
         }});
  // A band |i - j| <= 17 (SAME's decoder), alone and with padding, per sample of a batch of two.
  for (const bool pad : {false, true})
    cases.push_back({pad ? "attention_band_padded" : "attention_band", OpId::attention, Bound::inner_rounding,
                     [=](OpInputs& in) -> Drawn {
                       return {{pad ? qkv(in, {padded()}) : qkv(in), {in.poisoned({s, hq * d})}},
                               [=](Context& c, Operands& t) {
                                 ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, 0.25f,
                                                {false, pad ? &t.in[3] : nullptr, 2, 0.0f, Rounding::once, 17});
                               }};
                     }});
  // The band through the CPU's other kernel (GEMM tiles; the direct AVX512-BF16 kernel is the
  // default where the CPU has it), and causal, capped and rounded step by step through both.
  for (const int tiles : {0, 1})
    for (const bool shaped : {false, true}) {
      if (!tiles && !shaped) continue;  // attention_band_padded above
      const ops::AttentionOptions band{
          shaped, nullptr, 2, shaped ? 5.0f : 0.0f, shaped ? Rounding::each_step : Rounding::once, 17};
      OpCase one{std::string("attention_band") + (shaped ? "_causal_capped" : "_padded") + (tiles ? "_tiles" : ""),
                 OpId::attention, Bound::inner_rounding, [=](OpInputs& in) -> Drawn {
                   return {{qkv(in, {padded()}), {in.poisoned({s, hq * d})}}, [=](Context& c, Operands& t) {
                             cpu::band_attention_knob.set(tiles ? 2 : 1);
                             ops::AttentionOptions with_pad = band;
                             with_pad.key_valid = &t.in[3];
                             ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, 0.25f, with_pad);
                             cpu::band_attention_knob.set(0);
                           }};
                 }};
      one.rounded_scores = shaped;
      cases.push_back(one);
    }
  // Gemma's scores: capped at 5 (small enough that tanh bends these scores), formed in fp32 or
  // rounded step by step as eager PyTorch does in bf16.
  for (const Rounding r : kRoundings) {
    OpCase one{"attention_softcap_" + tag(r), OpId::attention, Bound::inner_rounding, [=](OpInputs& in) -> Drawn {
                 return {
                     {qkv(in, {padded()}), {in.poisoned({s, hq * d})}}, [=](Context& c, Operands& t) {
                       ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, 0.25f, {false, &t.in[3], 1, 5.0f, r});
                     }};
               }};
    one.rounded_scores = r == Rounding::each_step;
    full.push_back(one);
  }
  // A batch of two samples of 70 rows with a key mask each (50 and 61 real keys).
  for (const bool causal : {false, true})
    full.push_back({causal ? "attention_batch_2_causal" : "attention_batch_2", OpId::attention, Bound::inner_rounding,
                    [=](OpInputs& in) -> Drawn {
                      const int64_t n = 70;
                      const Tensor valid = key_mask(2 * n, [](int64_t j) { return j < n ? j < 50 : j < n + 61; });
                      return {
                          {{in.random({2 * n, hq * d}), in.random({2 * n, hk * d}), in.random({2 * n, hk * d}), valid},
                           {in.poisoned({2 * n, hq * d})}},
                          [=](Context& c, Operands& t) {
                            ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, 0.25f, {causal, &t.in[3], 2});
                          }};
                    }});
  // Two samples of 75 rows; with SAME's band |i - j| <= 17 through both CPU kernels.
  for (const int64_t window : {0, 17, -17})
    (window == 0 ? full : cases)
        .push_back({window == 0  ? "differential_attention"
                    : window > 0 ? "differential_attention_band"
                                 : "differential_attention_band_tiles",
                    OpId::differential_attention, Bound::inner_rounding, [window](OpInputs& in) -> Drawn {
                      const int64_t n = 150, hd = 64, h = 2;
                      std::vector<Tensor> q_k_q2_k2_v;
                      for (int i = 0; i < 5; ++i) q_k_q2_k2_v.push_back(in.random({n, h * hd}));
                      const ops::AttentionOptions options{false, nullptr, 2, 0.0f, Rounding::once, std::abs(window)};
                      return {{q_k_q2_k2_v, {in.poisoned({n, h * hd})}},
                              [=](Context& c, Operands& t) {
                                cpu::band_attention_knob.set(window < 0 ? 2 : 1);
                                ops::differential_attention(c, t.in[0], t.in[1], t.in[2], t.in[3], t.in[4], t.out[0],
                                                            hd, 0.125f, options);
                                cpu::band_attention_knob.set(0);
                              },
                              difference_terms(hd, 0.125f, options)};
                    }});
  // Grouped: 4 query heads over 2 key heads, two samples of 150 rows.
  full.push_back({"differential_attention_grouped", OpId::differential_attention, Bound::inner_rounding,
                  [=](OpInputs& in) -> Drawn {
                    const std::vector<Tensor> q_k_v = qkv(in);
                    const Tensor q2 = in.random({s, hq * d}), k2 = in.random({s, hk * d});
                    return {{{q_k_v[0], q_k_v[1], q2, k2, q_k_v[2]}, {in.poisoned({s, hq * d})}},
                            [=](Context& c, Operands& t) {
                              ops::differential_attention(c, t.in[0], t.in[1], t.in[2], t.in[3], t.in[4], t.out[0], d,
                                                          0.25f, {false, nullptr, 2});
                            },
                            difference_terms(d, 0.25f, {false, nullptr, 2})};
                  }});
  // NaN and +Inf in each operand, as torch propagates them: a NaN score or an infinite maximum
  // makes its row NaN (query row 5 of head 1, key 7 of key head 0: every row that sees it), a
  // non-finite value reaches every row of its head. Without a band through both CPU kernels
  // (`full`), with SAME's band (window 4) and the differential form's second query below.
  for (const float bad : {NAN, INFINITY})
    for (const char* operand : {"q", "k", "v"})
      for (const bool causal : {false, true}) {
        if (causal && operand[0] == 'v') continue;  // a value is seen or not: causal adds nothing
        OpCase one{
            std::string("attention_") + (std::isnan(bad) ? "nan_" : "inf_") + operand + (causal ? "_causal" : ""),
            OpId::attention, Bound::inner_rounding, [=](OpInputs& in) -> Drawn {
              std::vector<Tensor> t = qkv(in);
              spoil(t, operand, bad, d);
              return {{t, {in.sentinel({s, hq * d})}}, [=](Context& c, Operands& o) {
                        ops::attention(c, o.in[0], o.in[1], o.in[2], o.out[0], d, 0.25f, {causal});
                      }};
            }};
        one.nonfinite = true;
        full.push_back(one);
      }
  // (A value outside a row's band is not tested: the GEMM tiles' P·V spans the block's keys, so a
  // NaN there reaches the block's rows as 0 x NaN, where the reference sums the band alone.)
  for (const int tiles : {0, 1})
    for (const char* operand : {"q", "k"}) {
      OpCase band{std::string("attention_band_nan_") + operand + (tiles ? "_tiles" : ""), OpId::attention,
                  Bound::inner_rounding, [=](OpInputs& in) -> Drawn {
                    std::vector<Tensor> t = qkv(in);
                    spoil(t, operand, NAN, d);
                    return {{t, {in.sentinel({s, hq * d})}}, [=](Context& c, Operands& o) {
                              cpu::band_attention_knob.set(tiles ? 2 : 1);
                              ops::attention(c, o.in[0], o.in[1], o.in[2], o.out[0], d, 0.25f,
                                             {false, nullptr, 2, 0.0f, Rounding::once, 4});
                              cpu::band_attention_knob.set(0);
                            }};
                  }};
      band.nonfinite = true;
      cases.push_back(band);
    }
  OpCase second_query{"differential_attention_nan_q2", OpId::differential_attention, Bound::inner_rounding,
                      [=](OpInputs& in) -> Drawn {
                        std::vector<Tensor> t = qkv(in);
                        Tensor q2 = in.random({s, hq * d}), k2 = in.random({s, hk * d});
                        std::vector<Tensor> only_q2 = {q2};
                        spoil(only_q2, "q", NAN, d);
                        return {{{t[0], t[1], only_q2[0], k2, t[2]}, {in.sentinel({s, hq * d})}},
                                [=](Context& c, Operands& o) {
                                  ops::differential_attention(c, o.in[0], o.in[1], o.in[2], o.in[3], o.in[4], o.out[0],
                                                              d, 0.25f, {false, nullptr, 2});
                                },
                                difference_terms(d, 0.25f, {false, nullptr, 2})};
                      }};
  second_query.nonfinite = true;
  full.push_back(second_query);
  // The direct AVX512-BF16 kernel (the default where the CPU has it and no AMX) and the GEMM tiles.
  for (const OpCase& one : full)
    for (const int tiles : {0, 1}) {
      OpCase arm = one;
      if (tiles) arm.name += "_tiles";
      arm.draw = [tiles, draw = one.draw](OpInputs& in) -> Drawn {
        Drawn drawn = draw(in);
        drawn.call = [tiles, call = drawn.call](Context& c, Operands& t) {
          cpu::attention_kernel_knob.set(tiles ? 2 : 1);
          call(c, t);
          cpu::attention_kernel_knob.set(0);
        };
        return drawn;
      };
      cases.push_back(arm);
    }
}

void add_activation_cases(std::vector<OpCase>& cases) {
  const int64_t m = 13, f = 40;
  for (const Rounding r : kRoundings)
    for (const auto act : {ops::Activation::silu, ops::Activation::gelu_tanh, ops::Activation::sin_pi}) {
      const std::string name = act == ops::Activation::silu        ? "silu"
                               : act == ops::Activation::gelu_tanh ? "gelu_tanh"
                                                                   : "sin_pi";
      cases.push_back({"glu_" + name + "_" + tag(r), OpId::glu, Bound::rounding, [=](OpInputs& d) -> Drawn {
                         return {{{d.random({m, f}, 2.0f), d.random({m, f})}, {d.poisoned({m, f})}},
                                 [=](Context& c, Operands& t) { ops::glu(c, t.in[0], t.in[1], t.out[0], act, r); }};
                       }});
    }
  cases.push_back({"silu", OpId::silu, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {{{d.random({m, f}, 2.0f)}, {d.poisoned({m, f})}},
                             [](Context& c, Operands& t) { ops::silu(c, t.in[0], t.out[0]); }};
                   }});
  // DyT ends in gamma * tanh + beta, which cancels to near zero where beta meets -gamma tanh: there
  // fp32 against f64 is an inner rounding (one element measured 187 "ulps" of a 5e-9 result), so
  // it is held to the relative L2 bound, over enough elements that one flipped rounding of a
  // large output stays a small share of it. Such outputs gather in the columns whose beta nearly
  // cancels gamma tanh, so the share of differing elements moves by whole columns: a wide row
  // (192 distinct per-head parameters, not 24) keeps one unlucky column near 0.5 % of the output
  // (seed 1153404673 put 1.2 % of a 96-wide per-head case over the 1 % bound). Gamma and beta for
  // the whole row or per head (G = D / 4); alpha in f32 or in the activation dtype.
  const int64_t dm = 16, df = 768;
  struct Dyt {
    const char* name;
    int64_t group;
    bool alpha_f32;
  };
  for (const Rounding r : kRoundings)
    for (const Dyt v :
         {Dyt{"dyt", df, true}, Dyt{"dyt_per_head", df / 4, true}, Dyt{"dyt_alpha_in_act_dtype", df, false}})
      cases.push_back(
          {std::string(v.name) + "_" + tag(r), OpId::dyt, Bound::inner_rounding, [=](OpInputs& d) -> Drawn {
             return {{{d.random({dm, df}, 2.0f), d.random({1}, 2.0f, v.alpha_f32 ? DType::f32 : d.act),
                       d.random({v.group}), d.random({v.group})},
                      {d.poisoned({dm, df})}},
                     [r](Context& c, Operands& t) { ops::dyt(c, t.in[0], t.in[1], t.in[2], t.in[3], t.out[0], r); }};
           }});
  for (const Rounding r : kRoundings)
    for (const bool gated : {true, false})
      cases.push_back(
          {(gated ? "add_gated_" : "add_") + tag(r), OpId::add_gated, Bound::rounding, [=](OpInputs& d) -> Drawn {
             return {{{d.random({m, f}), d.random({1, f})}, {d.random({m, f})}}, [=](Context& c, Operands& t) {
                       ops::add_gated(c, t.out[0], t.in[0], gated ? &t.in[1] : nullptr, r);
                     }};
           }});
  // A gate per sample: [2, D] as a column view of a wider tensor.
  cases.push_back({"add_gated_batch_2", OpId::add_gated, Bound::rounding, [](OpInputs& d) -> Drawn {
                     const int64_t n = 9, dim = 32;
                     return {{{d.random({2 * n, dim}), d.random({2, 3 * dim}, 0.5f)}, {d.random({2 * n, dim}, 2.0f)}},
                             [](Context& c, Operands& t) {
                               const Tensor gate = t.in[1].cols(2 * dim, 3 * dim);
                               ops::add_gated(c, t.out[0], t.in[0], &gate, Rounding::each_step);
                             }};
                   }});
}

void add_sampler_cases(std::vector<OpCase>& cases) {
  const int64_t m = 21, n = 33;
  cases.push_back({"euler_update", OpId::euler_update, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({m, n})}, {d.random({m, n})}},
                             [](Context& c, Operands& t) { ops::euler_update(c, t.out[0], t.in[0], -0.2871f); }};
                   }});
  for (const bool f32_noise : {true, false})
    cases.push_back(
        {f32_noise ? "pingpong_update" : "pingpong_update_noise_in_act_dtype", OpId::pingpong_update, Bound::rounding,
         [f32_noise](OpInputs& d) -> Drawn {
           return {{{d.random({m, n}), d.random({m, n}, 1.0f, f32_noise ? DType::f32 : d.act)}, {d.random({m, n})}},
                   [](Context& c, Operands& t) {
                     ops::pingpong_update(c, t.out[0], t.in[0], t.in[1], 0.8909032f, 0.7455466f);
                   }};
         }});
  // blend with a weight per row (quarters as an inpainting mask gives, and any value in [0, 1] as
  // a scheduler's sigma), with one weight for every row, and in place over either operand.
  const int64_t bm = 24, bn = 40;
  auto row_weights = [](OpInputs& d) {
    Tensor w = Tensor::heap({bm}, DType::f32);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int64_t r = 0; r < bm; ++r) w.ptr<float>()[r] = r % 2 ? float(r % 5) / 4 : unit(d.rng);
    return w;
  };
  auto one_weight = [] {
    Tensor w = Tensor::heap({1}, DType::f32);
    w.ptr<float>()[0] = 0.8751057f;
    return w;
  };
  cases.push_back({"blend", OpId::blend, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {{{d.random({bm, bn}), d.random({bm, bn}), row_weights(d)}, {d.poisoned({bm, bn})}},
                             [](Context& c, Operands& t) { ops::blend(c, t.in[0], t.in[1], t.in[2], t.out[0]); }};
                   }});
  cases.push_back({"blend_one_weight", OpId::blend, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {{{d.random({bm, bn}), d.random({bm, bn}), one_weight()}, {d.poisoned({bm, bn})}},
                             [](Context& c, Operands& t) { ops::blend(c, t.in[0], t.in[1], t.in[2], t.out[0]); }};
                   }});
  cases.push_back({"blend_into_a", OpId::blend, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {{{d.random({bm, bn}), row_weights(d)}, {d.random({bm, bn})}},
                             [](Context& c, Operands& t) { ops::blend(c, t.out[0], t.in[0], t.in[1], t.out[0]); }};
                   }});
  cases.push_back({"blend_into_b", OpId::blend, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {{{d.random({bm, bn}), one_weight()}, {d.random({bm, bn})}},
                             [](Context& c, Operands& t) { ops::blend(c, t.in[0], t.out[0], t.in[1], t.out[0]); }};
                   }});
  // Guidance over a batch of three samples of 64 frames, 14 of them padding; APG off, full, half.
  // The projection's fp32 reductions flip an inner bf16 rounding now and then, which the scale
  // carries to the output as a 2-ulp difference: over 6144 outputs one such flip stays inside the
  // relative L2 bound (over 336 it did not: seed 2337988239).
  for (const auto& [name, apg] : {std::pair{"off", 0.0f}, std::pair{"full", 1.0f}, std::pair{"half", 0.5f}})
    cases.push_back({std::string("guided_velocity_apg_") + name, OpId::guided_velocity, Bound::inner_rounding,
                     [apg = apg](OpInputs& d) -> Drawn {
                       return {{{d.random({192, 32}, 1.0f, DType::f32), d.random({192, 32}), d.random({192, 32})},
                                {d.poisoned({192, 32})}},
                               [apg](Context& c, Operands& t) {
                                 ops::guided_velocity(c, t.in[0], t.in[1], t.in[2], t.out[0], 0.7455466f, 7.0f, apg, 3,
                                                      50);
                               }};
                     }});
}

// A clean [29, 70] tensor and copies with one NaN, Inf or -Inf each at a random place.
std::vector<Tensor> with_one_nonfinite(OpInputs& d) {
  std::vector<Tensor> in = {d.random({29, 70})};
  std::uniform_int_distribution<int64_t> pick(0, in[0].numel() - 1);
  for (const float bad : {NAN, INFINITY, -INFINITY}) {
    Tensor t = OpInputs::clone(in[0]);
    OpInputs::store(t, pick(d.rng), bad);
    in.push_back(t);
  }
  return in;
}

void add_layout_cases(std::vector<OpCase>& cases) {
  const int64_t m = 21, n = 33;
  cases.push_back({"copy", OpId::copy, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({m, n})}, {d.poisoned({m, n})}},
                             [](Context& c, Operands& t) { ops::copy(c, t.in[0], t.out[0]); }};
                   }});
  // f32 values into the activation dtype.
  cases.push_back({"copy_convert", OpId::copy, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({m, n}, 1.0f, DType::f32)}, {d.poisoned({m, n})}},
                             [](Context& c, Operands& t) { ops::copy(c, t.in[0], t.out[0]); }};
                   }});
  // with_one_nonfinite's tensors, asked whole, as rank 3, and through a column view that may or
  // may not hold the bad value.
  cases.push_back({"all_finite", OpId::all_finite, Bound::exact, [](OpInputs& d) -> Drawn {
                     return {{with_one_nonfinite(d), {}}, [](Context& c, Operands& t) {
                               for (const Tensor& x : t.in) {
                                 t.answers.push_back(ops::all_finite(c, x));
                                 t.answers.push_back(ops::all_finite(c, x.reshape({1, 29, 70})));
                                 t.answers.push_back(ops::all_finite(c, x.cols(3, 50)));
                               }
                             }};
                   }});
  // with_one_nonfinite's four tensors' flags into slots of a poisoned vector (two slots left
  // poisoned: the op writes its own slot only), whole and through a column view.
  cases.push_back({"nonfinite_flag", OpId::nonfinite_flag, Bound::exact, [](OpInputs& d) -> Drawn {
                     return {{with_one_nonfinite(d), {d.poisoned({10}, DType::i32)}}, [](Context& c, Operands& t) {
                               for (size_t i = 0; i < t.in.size(); ++i) {
                                 ops::nonfinite_flag(c, t.in[i], t.out[0], int64_t(2 * i));
                                 ops::nonfinite_flag(c, t.in[i].cols(3, 50), t.out[0], int64_t(2 * i + 1));
                               }
                             }};
                   }});
  cases.push_back({"transpose", OpId::transpose, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({m, n})}, {d.poisoned({n, m})}},
                             [](Context& c, Operands& t) { ops::transpose(c, t.in[0], t.out[0]); }};
                   }});
  cases.push_back({"permute", OpId::permute, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({3, 4, 5, 2, 2})}, {d.poisoned({5, 3, 2, 4, 2})}}, [](Context& c, Operands& t) {
                               ops::permute(c, t.in[0], t.out[0], {2, 0, 3, 1, 4});
                             }};
                   }});
  cases.push_back({"embedding", OpId::embedding, Bound::rounding, [](OpInputs& d) -> Drawn {
                     Tensor ids = Tensor::heap({9}, DType::i32);
                     for (int64_t i = 0; i < 9; ++i) ids.ptr<int32_t>()[i] = int32_t(d.rng() % 50);
                     return {{{d.random({50, 24}, 1.0f, DType::bf16), ids}, {d.poisoned({9, 24})}},
                             [](Context& c, Operands& t) { ops::embedding(c, t.in[0], t.in[1], t.out[0]); }};
                   }});
  cases.push_back({"embedding_table_in_act_dtype", OpId::embedding, Bound::rounding, [](OpInputs& d) -> Drawn {
                     Tensor ids = Tensor::heap({6}, DType::i32);
                     for (int64_t i = 0; i < 6; ++i) ids.ptr<int32_t>()[i] = int32_t(d.rng() % 40);
                     return {{{d.random({40, 24}), ids}, {d.poisoned({6, 24})}},
                             [](Context& c, Operands& t) { ops::embedding(c, t.in[0], t.in[1], t.out[0]); }};
                   }});
  // A GGUF's token table as stored (llama.cpp quantises it with the rest): rows expanded as looked up.
  for (DType stored : {DType::q8_0, DType::q4_k})
    cases.push_back({"embedding_" + std::string(dtype_name(stored)) + "_table", OpId::embedding, Bound::rounding,
                     [stored](OpInputs& d) -> Drawn {
                       Tensor ids = Tensor::heap({7}, DType::i32);
                       for (int64_t i = 0; i < 7; ++i) ids.ptr<int32_t>()[i] = int32_t(d.rng() % 30);
                       return {{{d.random_stored({30, 256}, stored), ids}, {d.poisoned({7, 256})}},
                               [](Context& c, Operands& t) { ops::embedding(c, t.in[0], t.in[1], t.out[0]); }};
                     }});
  // The image's bytes, poisoned with a level a pixel rarely takes (255 is any clipped white).
  cases.push_back({"image_to_rgb8", OpId::image_to_rgb8, Bound::exact, [](OpInputs& d) -> Drawn {
                     Tensor rgb = Tensor::heap({5, 7, 3}, DType::u8);
                     std::memset(rgb.data, 0xab, rgb.nbytes());
                     return {{{d.random({1, 3, 5, 7}, 0.8f)}, {rgb}},
                             [](Context& c, Operands& t) { ops::image_to_rgb8(c, t.in[0], t.out[0]); }};
                   }});
}

void add_image_cases(std::vector<OpCase>& cases) {
  const int64_t ci = 8, co = 6, h = 9, wd = 7;
  auto weights = [](OpInputs& d, Shape s, float scale) { return d.random(std::move(s), scale, DType::bf16); };
  for (const int64_t stride : {1, 2})
    cases.push_back(
        {"conv2d_3x3_stride_" + std::to_string(stride), OpId::conv2d, Bound::rounding, [=](OpInputs& d) -> Drawn {
           const int64_t ho = (h + 2 - 3) / stride + 1, wo = (wd + 2 - 3) / stride + 1;
           return {{{d.random({1, ci, h, wd}), weights(d, {co, ci, 3, 3}, 0.2f), weights(d, {co}, 1.0f)},
                    {d.poisoned({1, co, ho, wo})}},
                   [stride](Context& c, Operands& t) {
                     ops::conv2d(c, t.in[0], t.in[1], &t.in[2], t.out[0], stride, 1, 1);
                   }};
         }});
  // The encoder's downsampling: stride 2, no padding before, one row and column after. An even
  // input as in the VAE, and an odd one whose last row and column the padding is needed for; large
  // enough (384 outputs) that one bf16 rounding flip stays inside the bound's 1 %.
  for (const int64_t side : {16, 17})
    cases.push_back(
        {"conv2d_downsample_" + std::to_string(side), OpId::conv2d, Bound::rounding, [=](OpInputs& d) -> Drawn {
           const int64_t o = (side + 1 - 3) / 2 + 1;
           return {{{d.random({1, ci, side, side}), weights(d, {co, ci, 3, 3}, 0.2f), weights(d, {co}, 1.0f)},
                    {d.poisoned({1, co, o, o})}},
                   [](Context& c, Operands& t) { ops::conv2d(c, t.in[0], t.in[1], &t.in[2], t.out[0], 2, 0, 1); }};
         }});
  cases.push_back({"conv2d_1x1", OpId::conv2d, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {
                         {{d.random({1, ci, h, wd}), weights(d, {co, ci, 1, 1}, 0.3f)}, {d.poisoned({1, co, h, wd})}},
                         [](Context& c, Operands& t) { ops::conv2d(c, t.in[0], t.in[1], nullptr, t.out[0], 1, 0, 0); }};
                   }});
  cases.push_back({"conv2d_batch_2", OpId::conv2d, Bound::rounding, [=](OpInputs& d) -> Drawn {
                     return {
                         {{d.random({2, 8, 6, 5}, 2.0f), weights(d, {4, 8, 3, 3}, 0.2f)}, {d.poisoned({2, 4, 6, 5})}},
                         [](Context& c, Operands& t) { ops::conv2d(c, t.in[0], t.in[1], nullptr, t.out[0], 1, 1, 1); }};
                   }});
  for (const bool fuse : {false, true})
    for (const Rounding r : kRoundings)
      cases.push_back({std::string(fuse ? "group_norm_silu_" : "group_norm_") + tag(r), OpId::group_norm,
                       Bound::rounding, [=](OpInputs& d) -> Drawn {
                         return {{{d.random({1, ci, h, wd}, 3.0f), weights(d, {ci}, 1.0f), weights(d, {ci}, 1.0f)},
                                  {d.poisoned({1, ci, h, wd})}},
                                 [=](Context& c, Operands& t) {
                                   ops::group_norm(c, t.in[0], t.in[1], t.in[2], t.out[0], 4, 1e-6f, fuse, r);
                                 }};
                       }});
  cases.push_back(
      {"group_norm_silu_batch_2", OpId::group_norm, Bound::rounding, [=](OpInputs& d) -> Drawn {
         return {
             {{d.random({2, 8, 6, 5}, 2.0f), weights(d, {8}, 1.0f), weights(d, {8}, 1.0f)}, {d.poisoned({2, 8, 6, 5})}},
             [](Context& c, Operands& t) {
               ops::group_norm(c, t.in[0], t.in[1], t.in[2], t.out[0], 4, 1e-6f, true, Rounding::each_step);
             }};
       }});
  for (const int64_t batch : {1, 2})
    cases.push_back({batch == 1 ? "upsample_nearest2x" : "upsample_nearest2x_batch_2", OpId::upsample_nearest2x,
                     Bound::rounding, [=](OpInputs& d) -> Drawn {
                       return {{{d.random({batch, ci, h, wd})}, {d.poisoned({batch, ci, 2 * h, 2 * wd})}},
                               [](Context& c, Operands& t) { ops::upsample_nearest2x(c, t.in[0], t.out[0]); }};
                     }});
}

void add_table_cases(std::vector<OpCase>& cases) {
  // RoPE tables: Qwen's one axis in f32, FLUX's four axes in f64, from 2-D positions.
  const int64_t s = 37;
  cases.push_back({"rope_tables_qwen", OpId::rope_tables, Bound::tables, [](OpInputs& d) -> Drawn {
                     Tensor pos = Tensor::heap({s, 1}, DType::i64);
                     for (int64_t i = 0; i < s; ++i) pos.ptr<int64_t>()[i] = i * 13;
                     return {{{pos}, {d.poisoned({s, 64}, DType::f32), d.poisoned({s, 64}, DType::f32)}},
                             [](Context& c, Operands& t) {
                               ops::rope_tables(c, t.in[0], {128}, 1e6, ops::RopeMath::f32, t.out[0], t.out[1]);
                             }};
                   }});
  cases.push_back({"rope_tables_flux", OpId::rope_tables, Bound::tables, [](OpInputs& d) -> Drawn {
                     Tensor pos = Tensor::heap({s, 4}, DType::i64);
                     for (int64_t i = 0; i < 4 * s; ++i) pos.ptr<int64_t>()[i] = int64_t(d.rng() % 4096);
                     return {
                         {{pos}, {d.poisoned({s, 64}, DType::f32), d.poisoned({s, 64}, DType::f32)}},
                         [](Context& c, Operands& t) {
                           ops::rope_tables(c, t.in[0], {32, 32, 32, 32}, 2000, ops::RopeMath::f64, t.out[0], t.out[1]);
                         }};
                   }});
  cases.push_back({"timestep_embedding", OpId::timestep_embedding, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{}, {d.poisoned({1, 256})}},
                             [](Context& c, Operands& t) { ops::timestep_embedding(c, 738.5f, t.out[0]); }};
                   }});
  for (const auto& [name, time] :
       {std::pair{"0", 0.0f}, std::pair{"0_078125", 0.078125f}, std::pair{"0_6937", 0.6937f}, std::pair{"1", 1.0f}})
    cases.push_back({std::string("fourier_features_t_") + name, OpId::fourier_features, Bound::rounding,
                     [t = time](OpInputs& d) -> Drawn {
                       Tensor freqs = Tensor::heap({64}, DType::f32);
                       for (int64_t i = 0; i < 64; ++i)
                         freqs.ptr<float>()[i] =
                             float(std::exp(std::log(0.5) + double(i) / 63 * (std::log(1e4) - std::log(0.5))));
                       return {{{freqs}, {d.poisoned({1, 128})}},
                               [t](Context& c, Operands& o) { ops::fourier_features(c, t, o.in[0], o.out[0]); }};
                     }});
}

void add_linear_cases(std::vector<OpCase>& cases) {
  // x and y column views of wider tensors: the 5 columns left of y must stay as they are (zeros).
  cases.push_back(
      {"linear_bias_views", OpId::linear, Bound::rounding, [](OpInputs& d) -> Drawn {
         const int64_t m = 37, k = 70, n = 45;
         Tensor y = d.poisoned({m, n + 5});
         for (int64_t r = 0; r < m; ++r) std::memset(y.row(r), 0, 5 * dtype_size(d.act));
         return {{{d.random({m, k + 9}), d.random({n, k}, 0.1f, DType::bf16), d.random({n}, 1.0f, DType::bf16)}, {y}},
                 [](Context& c, Operands& t) {
                   Tensor yv = t.out[0].cols(5, 5 + n);
                   ops::linear(c, t.in[0].cols(9, 9 + k), t.in[1], &t.in[2], yv);
                 }};
       }});
  // Weights run as stored, expanded panel by panel (70 outputs: a full panel and a partial one at
  // K = 512's panel of 64); K-formats need rows of 256.
  for (DType stored : {DType::q8_0, DType::q4_0, DType::q4_1, DType::q5_0, DType::q5_1, DType::q4_k, DType::q5_k,
                       DType::q6_k, DType::fp8_e4m3, DType::fp8_e5m2, DType::i8, DType::fp4_e2m1})
    cases.push_back({"linear_" + std::string(dtype_name(stored)) + "_weights", OpId::linear, Bound::rounding,
                     [stored](OpInputs& d) -> Drawn {
                       const int64_t m = 9, k = 512, n = 70;
                       return {{{d.random({m, k}), d.random_stored({n, k}, stored), d.random({n}, 1.0f, DType::bf16)},
                                {d.poisoned({m, n})}},
                               [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
                     }});
  // ComfyUI's block-scaled layouts: int8 with a scale a row, mxfp8, nvfp4 (the panel boundary at
  // row 64 checks each panel reads its own rows' factors).
  struct Scaled {
    const char* name;
    DType codes, factors;
    int64_t block;
  };
  for (const Scaled s :
       {Scaled{"int8_row_scaled", DType::i8, DType::f32, 512}, Scaled{"mxfp8", DType::fp8_e4m3, DType::e8m0, 32},
        Scaled{"nvfp4", DType::fp4_e2m1, DType::fp8_e4m3, 16}})
    cases.push_back(
        {"linear_" + std::string(s.name) + "_weights", OpId::linear, Bound::rounding, [s](OpInputs& d) -> Drawn {
           const int64_t m = 9, k = 512, n = 70;
           return {{{d.random({m, k}), d.random_block_scaled({n, k}, s.codes, s.factors, s.block),
                     d.random({n}, 1.0f, DType::bf16)},
                    {d.poisoned({m, n})}},
                   [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
         }});
  // The quantised tiers. int8: integer sums are exact, the scales' arithmetic is spelled out, so
  // every element equals the reference's. fp8: the rows' codes are the reference's bit for bit (the
  // same fp32 steps), the products exact, the sums in fp32 in any order: held as a plain linear's
  // rounding. Each with a row of zeros (scale 0) among its rows; x and y column views; a
  // checkpoint's codes with a scale a row and a tensor scale (ComfyUI's int8, BFL's and ComfyUI's
  // fp8; for fp8 also a tensor scale alone, BFL's), flagged as the tier flags them.
  for (const Products tier : {Products::int8, Products::fp8}) {
    const bool int8 = tier == Products::int8;
    const std::string name = int8 ? "linear_int8_tier" : "linear_fp8_tier";
    const Bound bound = int8 ? Bound::exact : Bound::rounding;
    const DType codes = int8 ? DType::i8 : DType::fp8_e4m3;
    cases.push_back({name, OpId::linear, bound,
                     [tier](OpInputs& d) -> Drawn {
                       const int64_t m = 37, k = 512, n = 70;
                       Tensor x = d.random({m, k}, 3.0f);
                       std::memset(x.row(5), 0, size_t(k) * dtype_size(x.dtype));
                       const Tensor w = quantize_tier_weight(d.random({n, k}, 0.1f, DType::bf16), tier, "w");
                       return {{{x, w, d.random({n}, 1.0f, DType::f32)}, {d.poisoned({m, n})}},
                               [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
                     },
                     /*nonfinite=*/false, tier});
    cases.push_back({name + "_views", OpId::linear, bound,
                     [tier](OpInputs& d) -> Drawn {
                       const int64_t m = 9, k = 96, n = 45;
                       Tensor y = d.poisoned({m, n + 5});
                       for (int64_t r = 0; r < m; ++r) std::memset(y.row(r), 0, 5 * dtype_size(d.act));
                       const Tensor w = quantize_tier_weight(d.random({n, k}, 0.2f, DType::f32), tier, "w");
                       return {{{d.random({m, k + 9}), w}, {y}}, [](Context& c, Operands& t) {
                                 Tensor yv = t.out[0].cols(5, 5 + n);
                                 ops::linear(c, t.in[0].cols(9, 9 + k), t.in[1], nullptr, yv);
                               }};
                     },
                     /*nonfinite=*/false, tier});
    // fp8's row-scaled checkpoint in the shapes cuBLASLt's epilogue takes (cuda.fp8_scales).
    for (const bool row_scaled : int8 ? std::vector<bool>{true} : std::vector<bool>{true, false})
      cases.push_back({name + "_checkpoint_" + (row_scaled ? "row_scaled" : "tensor_scaled"), OpId::linear, bound,
                       [=](OpInputs& d) -> Drawn {
                         const int64_t m = 9, k = 512, n = !int8 && row_scaled ? 80 : 70;
                         Tensor w = row_scaled ? d.random_block_scaled({n, k}, codes, DType::f32, k)
                                               : d.random_stored({n, k}, codes);
                         w.encoding.code_scale = 0.75f;
                         w.encoding.products = tier;
                         return {{{d.random({m, k}), w, d.random({n}, 1.0f, DType::bf16)}, {d.poisoned({m, n})}},
                                 [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
                       },
                       /*nonfinite=*/false, tier});
  }

  // Past every block of apus's AVX2 kernel (rows past a 72-row task, columns past a 768-column task
  // and a 16-wide panel, an odd k past a 512-code block), with rows and weights whose codes are all
  // +-127: the largest sums, exact only where no 16-bit lane saturates.
  cases.push_back({"linear_int8_tier_blocks", OpId::linear, Bound::exact,
                   [](OpInputs& d) -> Drawn {
                     const int64_t m = 80, k = 1031, n = 790;
                     Tensor x = d.random({m, k}, 3.0f);
                     Tensor w = d.random({n, k}, 0.1f, DType::bf16);
                     for (int64_t i = 0; i < k; ++i) {
                       const float sign = (i * 7919) % 3 ? 1.0f : -1.0f;
                       OpInputs::store(x, 2 * k + i, 2.5f * sign);
                       OpInputs::store(x, 3 * k + i, -2.5f * sign);
                       OpInputs::store(w, 4 * k + i, 0.125f * sign);
                     }
                     return {{{x, quantize_int8_weight(w, "w"), d.random({n}, 1.0f, DType::f32)}, {d.poisoned({m, n})}},
                             [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
                   },
                   /*nonfinite=*/false, /*tier=*/Products::int8});
  // Shapes cuBLASLt's epilogue takes (cuda.fp8_scales=epilogue: k and n multiples of 16, the bias
  // in y's dtype), a row of zeros among them.
  cases.push_back({"linear_fp8_tier_epilogue_shapes", OpId::linear, Bound::rounding,
                   [](OpInputs& d) -> Drawn {
                     const int64_t m = 37, k = 512, n = 96;
                     Tensor x = d.random({m, k}, 3.0f);
                     std::memset(x.row(11), 0, size_t(k) * dtype_size(x.dtype));
                     const Tensor w = quantize_fp8_weight(d.random({n, k}, 0.1f, DType::bf16), "w");
                     return {{{x, w, d.random({n})}, {d.poisoned({m, n})}},
                             [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], &t.in[2], t.out[0]); }};
                   },
                   /*nonfinite=*/false, /*tier=*/Products::fp8});
  cases.push_back({"linear", OpId::linear, Bound::rounding, [](OpInputs& d) -> Drawn {
                     return {{{d.random({37, 96}), d.random({45, 96}, 0.2f, DType::bf16)}, {d.poisoned({37, 45})}},
                             [](Context& c, Operands& t) { ops::linear(c, t.in[0], t.in[1], nullptr, t.out[0]); }};
                   }});
}

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> all;
    add_linear_cases(all);
    add_norm_cases(all);
    add_rope_cases(all);
    add_attention_cases(all);
    add_activation_cases(all);
    add_sampler_cases(all);
    add_layout_cases(all);
    add_image_cases(all);
    add_table_cases(all);
    return all;
  }();
  return cases;
}

// A backend the table runs, in one activation dtype; `backend` gives null with the reason when it
// cannot run here.
struct Target {
  std::string name;
  DType act;
  bool widened;  // the CPU's f32 path for bf16 (cpu::native_bf16_knob off)
  Backend* (*backend)(std::string& why);
  bool panels = false;  // weights split into output panels as stored formats' (cpu::linear_panels_knob)
  // Other variant knobs set for this target (knob, choice): a backend's correct-first kernels.
  std::vector<std::pair<std::string, std::string>> choices = {};
  // Its attention rounds probabilities as a fused softmax does (op_bounds.h, FusedAgreement).
  bool fused_softmax = false;
  // Runs the attention cases alone.
  bool only_attention = false;
};

Backend* cpu(std::string&) { return &cpu_backend(); }
Backend* shadow(std::string&) { return &test::shadow_device(); }
#if APUS_HAS_CUDA
Backend* cuda(std::string& why) { return cuda_available(&why) ? &cuda_backend(0) : nullptr; }
#endif

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
    {"cpu_f32", DType::f32, false, cpu},
    {"cpu_bf16", DType::bf16, false, cpu},
    // The contract's kernels under the fused-softmax bound: it and its reference hold on every
    // attention case before a GPU's fused arm is judged by them.
    {"cpu_bf16_fused_bound", DType::bf16, false, cpu, false, {}, true, true},
    {"cpu_bf16_widened", DType::bf16, true, cpu},
    {"cpu_bf16_widened_avx2", DType::bf16, true, cpu, false, {{"cpu.widened_gemm", "avx2"}, {"cpu.int8_gemm", "avx2"}}},
    {"cpu_bf16_panels", DType::bf16, false, cpu, true},
    {"shadow_f32", DType::f32, false, shadow},
#if APUS_HAS_CUDA
    {"cuda_f32", DType::f32, false, cuda},
    {"cuda_bf16", DType::bf16, false, cuda},
    {"cuda_bf16_first", DType::bf16, false, cuda, false, {{"cuda.attention", "rows"}, {"cuda.conv", "direct"}}},
    {"cuda_bf16_products", DType::bf16, false, cuda, false, {{"cuda.attention", "gemm"}}},
    {"cuda_bf16_flash_lean", DType::bf16, false, cuda, false, {{"cuda.flash_code", "lean"}}},
    {"cuda_f32_cudnn", DType::f32, false, cuda, false, {{"cuda.conv", "cudnn"}}},
    {"cuda_bf16_cudnn", DType::bf16, false, cuda, false, {{"cuda.conv", "cudnn"}}},
    {"cuda_bf16_staged_decode", DType::bf16, false, cuda, false, {{"cuda.stored_decode", "staged"}}},
    {"cuda_bf16_fp8_epilogue", DType::bf16, false, cuda, false, {{"cuda.fp8_scales", "epilogue"}}},
    {"cuda_bf16_cudnn_attention", DType::bf16, false, cuda, false, {{"cuda.attention", "cudnn"}}, true},
#endif
  };
  return all;
}

std::vector<Tensor> host_copies(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> copies;
  for (const Tensor& t : tensors) copies.push_back(OpInputs::clone(t));
  return copies;
}

std::vector<Tensor> uploaded(Backend& backend, const std::vector<Tensor>& tensors) {
  std::vector<Tensor> copies;
  for (const Tensor& t : tensors) copies.push_back(backend.upload(OpInputs::clone(t)));
  return copies;
}

// f32 copies of the floating-point tensors (the key masks as they are).
std::vector<Tensor> widened(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> copies;
  for (const Tensor& t : tensors) {
    if (t.dtype != DType::bf16 && t.dtype != DType::f32) {
      copies.push_back(OpInputs::clone(t));
      continue;
    }
    Tensor f = Tensor::heap(t.shape, DType::f32);
    const std::vector<float> values = to_f32_vector(t);
    std::memcpy(f.data, values.data(), f.nbytes());
    copies.push_back(std::move(f));
  }
  return copies;
}

// An attention case's exact output (the reference on f32 copies of its inputs) and each element's
// allowance under a fused softmax (op_bounds.h): its terms' and, for a difference, its own rounding.
std::pair<Tensor, std::vector<double>> fused_reference(const Drawn& drawn, Arena& arena) {
  Context ref32{&arena, DType::f32, nullptr, false, &reference_backend()};
  const size_t values = drawn.terms.empty() ? 2 : 4;  // v of attention(q, k, v), of (q, k, q2, k2, v)
  const auto run = [&](const Call& call, bool absolute_values) {
    Operands f32{widened(drawn.operands.in), widened(drawn.operands.out)};
    if (absolute_values)
      for (int64_t i = 0; i < f32.in[values].numel(); ++i)
        f32.in[values].ptr<float>()[i] = std::fabs(f32.in[values].ptr<float>()[i]);
    call(ref32, f32);
    return std::move(f32.out[0]);
  };
  Tensor exact = run(drawn.call, false);
  const std::vector<float> o = to_f32_vector(exact);
  std::vector<double> allowance(o.size(), 0.0);
  for (const Call& term : drawn.terms.empty() ? std::vector<Call>{drawn.call} : drawn.terms) {
    const std::vector<float> a = to_f32_vector(run(term, false)), m = to_f32_vector(run(term, true));
    for (size_t i = 0; i < o.size(); ++i) allowance[i] += fused_term_allowance(a[i], m[i]);
  }
  if (drawn.terms.size() > 1)
    for (size_t i = 0; i < o.size(); ++i) allowance[i] += kProbabilityRounding * std::fabs(o[i]);
  return {std::move(exact), std::move(allowance)};
}

// Output i non-finite exactly where the reference's is (NaN where it is NaN), those elements then
// zeroed in both so that the finite rest is compared as usual. The reference must have some.
void expect_same_nonfinite(Tensor& mine, Tensor& want, size_t i) {
  const std::vector<float> a = to_f32_vector(mine), b = to_f32_vector(want);
  int64_t nonfinite = 0, wrong = 0;
  for (size_t j = 0; j < a.size(); ++j) {
    if (std::isfinite(b[j])) {
      wrong += !std::isfinite(a[j]);
      continue;
    }
    ++nonfinite;
    wrong += std::isfinite(a[j]) || std::isnan(a[j]) != std::isnan(b[j]);
    OpInputs::store(mine, int64_t(j), 0.0f);
    OpInputs::store(want, int64_t(j), 0.0f);
  }
  EXPECT_GT(nonfinite, 0) << "output " << i << ": the reference has no NaN or infinity to propagate";
  EXPECT_EQ(wrong, 0) << "output " << i << ": " << wrong << " of " << a.size()
                      << " elements finite where the reference's are not, or the other way";
}

// (target, case), indices into targets() and op_cases().
class OpTable : public ::testing::TestWithParam<std::tuple<size_t, size_t>> {
 protected:
  void TearDown() override {
    for (Knob* knob : knobs()) knob->set(0);
  }
};

TEST_P(OpTable, MatchesTheReference) {
  const Target& target = targets()[std::get<0>(GetParam())];
  const OpCase& k = op_cases()[std::get<1>(GetParam())];
  std::string why;
  Backend* backend = target.backend(why);
  if (!backend) GTEST_SKIP() << target.name << " cannot run here: " << why;
  if (target.only_attention && k.op != OpId::attention && k.op != OpId::differential_attention)
    GTEST_SKIP() << target.name << " runs the attention cases alone";
  if (!backend->supports(k.op))
    GTEST_SKIP() << "backend " << backend->name() << " does not run op " << ops::op_name(k.op);
  // A tier on a GPU multiplies on its tensor cores; every other target computes on this CPU.
  const std::string refusal = (target.name.rfind("cuda", 0) == 0 ? *backend : cpu_backend()).refuses(k.tier);
  if (!refusal.empty()) GTEST_SKIP() << refusal;
  cpu::native_bf16_knob.set(target.widened ? 1 : 0);
  cpu::linear_panels_knob.set(target.panels ? 1 : 0);
  for (const auto& [name, choice] : target.choices) find_knob(name).set(find_knob(name).index_of(choice));

  OpInputs draw(target.act);
  const Drawn drawn = k.draw(draw);
  Arena host_arena, device_arena(size_t(64) << 20, false, *backend);
  Context ref{&host_arena, target.act, nullptr, false, &reference_backend()};
  Context dev{&device_arena, target.act, nullptr, false, backend};
  Operands want{drawn.operands.in, host_copies(drawn.operands.out)};
  drawn.call(ref, want);
  Operands got{uploaded(*backend, drawn.operands.in), uploaded(*backend, drawn.operands.out)};
  drawn.call(dev, got);

  for (size_t i = 0; i < want.out.size(); ++i) {
    Tensor mine = backend->download(got.out[i]), wanted = OpInputs::clone(want.out[i]);
    if (k.nonfinite) {
      expect_same_nonfinite(mine, wanted, i);
    } else {
      for (float v : to_f32_vector(mine)) {
        EXPECT_TRUE(std::isfinite(v)) << "output " << i << " left unwritten or NaN";
        if (!std::isfinite(v)) break;
      }
    }
    if (target.fused_softmax && !k.rounded_scores &&
        (k.op == OpId::attention || k.op == OpId::differential_attention)) {
      const auto [exact, allowance] = fused_reference(drawn, host_arena);
      const FusedAgreement g = fused_agreement(mine, wanted, exact, allowance);
      std::printf("[ measure ] %s %s output %zu: worst %.2f of its allowance, rel L2 %.2e (the contract's %.2e)\n",
                  target.name.c_str(), k.name.c_str(), i, g.worst, g.rel_l2, g.contract_rel_l2);
      EXPECT_TRUE(holds_fused(g)) << "output " << i << ": worst " << g.worst << " of its allowance, rel L2 " << g.rel_l2
                                  << " against the contract's " << g.contract_rel_l2;
      continue;
    }
    const Agreement g = agreement(mine, wanted);
    std::printf("[ measure ] %s %s output %zu: rel L2 %.2e, %.3f%% differ, worst %.2f ulp\n", target.name.c_str(),
                k.name.c_str(), i, g.rel_l2, 100 * g.differing, g.worst_ulps);
    EXPECT_TRUE(holds(k.bound, g, mine.dtype))
        << "output " << i << ": rel L2 " << g.rel_l2 << ", " << g.differing << " differ, worst " << g.worst_ulps
        << " ulp (" << g.worst_ulps_above_floor << " above the accumulation floor)";
  }
  EXPECT_EQ(got.answers, want.answers);
}

INSTANTIATE_TEST_SUITE_P(Backends, OpTable,
                         ::testing::Combine(::testing::Range(size_t(0), targets().size()),
                                            ::testing::Range(size_t(0), op_cases().size())),
                         [](const auto& info) {
                           return targets()[std::get<0>(info.param)].name + "_" +
                                  op_cases()[std::get<1>(info.param)].name;
                         });

// x rounded to `bits` significant bits, to nearest (8: bf16's).
float round_bits(float x, int bits) {
  int e = 0;
  const double m = std::frexp(double(x), &e);
  return float(std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits));
}

// One head of attention as a fused kernel computes it (FlashAttention's schedule): key tiles of
// 64, exp(s - running max) rounded to `bits` before P·V, the running sum of the unrounded terms
// dividing last, the output rounded to bf16.
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int bits) {
  const int64_t n = q.shape[0], keys = k.shape[0], d = q.shape[1];
  const std::vector<float> qs = to_f32_vector(q), ks = to_f32_vector(k), vs = to_f32_vector(v);
  Tensor o = Tensor::heap({n, d}, DType::bf16);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<float> scores(size_t(keys), 0.0f), acc(size_t(d), 0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      float dot = 0;
      for (int64_t e = 0; e < d; ++e) dot += qs[size_t(i * d + e)] * ks[size_t(j * d + e)];
      scores[size_t(j)] = dot * scale;
    }
    float m = -INFINITY, l = 0;
    for (int64_t t = 0; t < keys; t += 64) {
      const int64_t end = std::min(keys, t + 64);
      const float m_new = std::max(m, *std::max_element(scores.begin() + t, scores.begin() + end));
      const float rescale = std::exp(m - m_new);
      l *= rescale;
      for (float& a : acc) a *= rescale;
      for (int64_t j = t; j < end; ++j) {
        const float p = std::exp(scores[size_t(j)] - m_new);
        l += p;
        for (int64_t e = 0; e < d; ++e) acc[size_t(e)] += round_bits(p, bits) * vs[size_t(j * d + e)];
      }
      m = m_new;
    }
    for (int64_t e = 0; e < d; ++e) OpInputs::store(o, i * d + e, acc[size_t(e)] / l);
  }
  return o;
}

// x - y of two bf16 tensors, rounded to bf16: the differential form's difference of its terms.
Tensor difference(const Tensor& x, const Tensor& y) {
  const std::vector<float> a = to_f32_vector(x), b = to_f32_vector(y);
  Tensor o = Tensor::heap(x.shape, DType::bf16);
  for (size_t i = 0; i < a.size(); ++i) OpInputs::store(o, int64_t(i), a[i] - b[i]);
  return o;
}

// The fused-softmax bound (op_bounds.h) on attentions of the table's size (300 queries and keys,
// a head of 64), one term and the differential form's two: the contract passes it; a fused kernel
// (fused_attention, probabilities in bf16) passes it and fails the contract's own bound (why it
// has one of its own); the same kernel with probabilities rounded to 4 bits fails it.
TEST(FusedSoftmaxBound, HoldsAFusedKernelAndCatchesCoarserProbabilities) {
  const int64_t n = 300, d = 64;
  const float scale = 0.125f;
  OpInputs in(DType::bf16);
  std::vector<Tensor> inputs;
  for (int i = 0; i < 5; ++i) inputs.push_back(in.random({n, d}));
  const Call one = [=](Context& c, Operands& t) {
    ops::attention(c, t.in[0], t.in[1], t.in[2], t.out[0], d, scale, {});
  };
  const Call two = [=](Context& c, Operands& t) {
    ops::differential_attention(c, t.in[0], t.in[1], t.in[2], t.in[3], t.in[4], t.out[0], d, scale, {});
  };
  const Drawn single{{{inputs[0], inputs[1], inputs[2]}, {in.poisoned({n, d})}}, one};
  const Drawn differential{{inputs, {in.poisoned({n, d})}}, two, difference_terms(d, scale, {})};
  const auto fused = [&](const Drawn& drawn, int bits) {
    const std::vector<Tensor>& x = drawn.operands.in;
    if (drawn.terms.empty()) return fused_attention(x[0], x[1], x[2], scale, bits);
    return difference(fused_attention(x[0], x[1], x[4], scale, bits), fused_attention(x[2], x[3], x[4], scale, bits));
  };
  for (const Drawn* drawn : {&single, &differential}) {
    Arena arena;
    Context ref{&arena, DType::bf16, nullptr, false, &reference_backend()};
    Operands contract{drawn->operands.in, host_copies(drawn->operands.out)};
    drawn->call(ref, contract);
    const auto [exact, allowance] = fused_reference(*drawn, arena);
    const Tensor bf16 = fused(*drawn, 8);
    const FusedAgreement itself = fused_agreement(contract.out[0], contract.out[0], exact, allowance),
                         in_bf16 = fused_agreement(bf16, contract.out[0], exact, allowance),
                         four_bits = fused_agreement(fused(*drawn, 4), contract.out[0], exact, allowance);
    const char* form = drawn->terms.empty() ? "attention" : "differential attention";
    for (const auto& [what, g] :
         {std::pair{"the contract", itself}, std::pair{"fused, bf16", in_bf16}, std::pair{"fused, 4 bits", four_bits}})
      std::printf("[ measure ] %s, %s: worst %.2f of its allowance, rel L2 %.3e (the contract's %.3e)\n", form, what,
                  g.worst, g.rel_l2, g.contract_rel_l2);
    EXPECT_TRUE(holds_fused(itself)) << form;
    EXPECT_TRUE(holds_fused(in_bf16)) << form;
    EXPECT_FALSE(holds(Bound::inner_rounding, agreement(bf16, contract.out[0]), DType::bf16)) << form;
    EXPECT_FALSE(holds_fused(four_bits)) << form;
  }
}

// Adding an op to the list without a case here fails: every op of APUS_OPS has at least one.
TEST(OpTableCoverage, EveryOpHasACase) {
  std::set<size_t> covered;
  for (const OpCase& k : op_cases()) covered.insert(size_t(k.op));
  for (size_t op = 0; op < ops::kOpCount; ++op)
    EXPECT_TRUE(covered.count(op)) << "op " << ops::kOpNames[op] << " has no case in the op table";
}

}  // namespace
}  // namespace apus
