// Op throughput at FLUX.2 klein sizes, reported as FLOP/s against the machine's bf16 GEMM
// ceiling. Run: build/bench_ops [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/variants.h"
#include "io/weights/quant_weights.h"
#include "models/flux2/vae_decoder.h"
#include "ops/adapters.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/ops.h"
#include "sampling/torch_rng.h"

namespace apus {
namespace {

Tensor filled(Shape s, DType dt) {
  Tensor t = Tensor::heap(std::move(s), dt);
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::bf16) t.ptr<uint16_t>()[i] = f32_to_bf16(d(rng));
    else t.ptr<float>()[i] = d(rng);
  }
  return t;
}

// args: tokens, in features, out features
void BM_Linear(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor x = filled({m, k}, DType::bf16), w = filled({n, k}, DType::bf16), y = Tensor::heap({m, n}, DType::bf16);
  for (auto _ : st) ops::linear(c, x, w, nullptr, y);
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate);
}
// single block linear1 / linear2, double block qkv, the text encoder MLP, at 512^2 (1536 tokens)
BENCHMARK(BM_Linear)
    ->Args({1536, 3072, 27648})
    ->Args({1536, 12288, 3072})
    ->Args({1024, 3072, 3072})
    ->Args({512, 2560, 9728})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// Stable Audio 3 medium, 30 s clip: DiT qkv / FF in / FF out at 452 rows (388 latents + 64
// memory tokens), SAME-L's at 6596 rows (388 latents x 17 tokens)
BENCHMARK(BM_Linear)
    ->Args({452, 1536, 7680})
    ->Args({452, 1536, 12288})
    ->Args({452, 6144, 1536})
    ->Args({6596, 1536, 7680})
    ->Args({6596, 1536, 9216})
    ->Args({6596, 4608, 1536})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The linear as a CPU without bf16 dot products runs it (cpu.native_bf16=off: bf16 widened to f32,
// single-threaded sgemm tiles of 64 rows for bit-stable rows), at klein's 1024 x 3072 x 3072.
void BM_LinearWidened(benchmark::State& st) {
  const KnobScope widened("cpu.native_bf16", "off");
  BM_Linear(st);
}
BENCHMARK(BM_LinearWidened)
    ->Args({1024, 3072, 3072})
    ->Args({452, 1536, 7680})
    ->Args({452, 4096, 1024})
    ->Args({512, 2560, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The same with apus's AVX2 kernel (cpu.widened_gemm=avx2, the default on CPUs without AVX-512):
// beside BM_LinearWidened under ONEDNN_MAX_CPU_ISA=AVX2, what an AVX2-only CPU runs either way.
void BM_LinearWidenedAvx2(benchmark::State& st) {
  const KnobScope kernel("cpu.widened_gemm", "avx2");
  BM_LinearWidened(st);
}
BENCHMARK(BM_LinearWidenedAvx2)
    ->Args({1024, 3072, 3072})
    ->Args({452, 1536, 7680})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A linear whose weights run as stored (GGUF blocks, fp8 e4m3): what the panel-wise expansion costs
// over bf16 weights at klein's 1024 x 3072 x 3072. args: tokens, in, out, DType, panel size (the
// cpu.linear_panel_mb choice: 0 the default 32 MiB, 1 8 MiB, 2 2 MiB). Random bytes with
// small f16 scales: the values do not matter to the time.
void BM_LinearStored(benchmark::State& st) {
  Knob& panel_mb = find_knob("cpu.linear_panel_mb");
  const KnobScope panel(panel_mb, int(st.range(4)));
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  const DType stored = DType(st.range(3));
  Tensor x = filled({m, k}, DType::bf16), w = Tensor::heap({n, k}, stored), y = Tensor::heap({m, n}, DType::bf16);
  std::mt19937 rng(1);
  auto* bytes = w.ptr<uint8_t>();
  for (size_t i = 0; i < w.nbytes(); ++i) bytes[i] = uint8_t(rng() & 0x3f);  // small codes, finite scales
  for (auto _ : st) ops::linear(c, x, w, nullptr, y);
  st.SetLabel(std::string(dtype_name(stored)) + " panels of " + panel_mb.choices()[size_t(st.range(4))] + " MiB");
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LinearStored)
    ->ArgsProduct({{1024},
                   {3072},
                   {3072},
                   {int64_t(DType::q8_0), int64_t(DType::q4_0), int64_t(DType::q4_1), int64_t(DType::q5_0),
                    int64_t(DType::q5_1), int64_t(DType::q4_k), int64_t(DType::q5_k), int64_t(DType::q6_k),
                    int64_t(DType::fp8_e4m3)},
                   {0}})
    ->ArgsProduct({{1024, 1536}, {3072}, {3072, 27648}, {int64_t(DType::q8_0), int64_t(DType::fp8_e4m3)}, {1, 2}})
    ->ArgsProduct({{1536}, {3072}, {27648}, {int64_t(DType::q8_0), int64_t(DType::fp8_e4m3)}, {0}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A quantised tier's linear (io/weights/quant_weights.h) beside BM_Linear's bf16 at the same
// shapes: the activations' quantisation, the GEMM of codes and the scaling pass together.
// args: tokens, in, out.
void tier_linear(benchmark::State& st, Tensor (*quantize)(const Tensor&, const std::string&)) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor x = filled({m, k}, DType::bf16), y = Tensor::heap({m, n}, DType::bf16);
  const Tensor w = quantize(filled({n, k}, DType::bf16), "w");
  for (auto _ : st) ops::linear(c, x, w, nullptr, y);
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate);
}
void BM_LinearInt8(benchmark::State& st) { tier_linear(st, quantize_int8_weight); }
// The fp8 tier on a CPU: e4m3 codes through the bf16 GEMM, the weight decoded a panel at a time.
void BM_LinearFp8(benchmark::State& st) { tier_linear(st, quantize_fp8_weight); }
BENCHMARK(BM_LinearFp8)
    ->Args({1024, 3072, 3072})
    ->Args({452, 1536, 7680})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_LinearInt8)
    ->Args({1536, 3072, 27648})
    ->Args({1536, 12288, 3072})
    ->Args({1024, 3072, 3072})
    ->Args({512, 2560, 9728})
    ->Args({452, 1536, 7680})
    ->Args({6596, 1536, 7680})
    // Stable Audio 3 small-music, 30 s: the DiT's FF out and attention projections (1024 wide);
    // Qwen3's k and v (1024 wide, 512 tokens)
    ->Args({452, 4096, 1024})
    ->Args({452, 1024, 1024})
    ->Args({512, 2560, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The int8 tier on apus's AVX2 kernel (cpu.int8_gemm=avx2: vpmaddwd on int16-widened codes), what
// a CPU without VNNI runs; beside BM_LinearInt8 under ONEDNN_MAX_CPU_ISA=AVX2_VNNI it tells whether
// oneDNN's AVX-VNNI kernels (Intel client chips) beat it.
void BM_LinearInt8Avx2(benchmark::State& st) {
  const KnobScope own(find_knob("cpu.int8_gemm"), 1);
  BM_LinearInt8(st);
}
BENCHMARK(BM_LinearInt8Avx2)
    ->Args({1024, 3072, 3072})
    ->Args({452, 1536, 7680})
    ->Args({452, 4096, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The stored formats' panel split alone: bf16 weights run whole (arm 0) or a panel of output
// features at a time as GGUF blocks and fp8 run (arm 1, knob cpu.linear_panels), no decode.
// args: tokens, in, out, arm. With BM_LinearStored's rows it parts a stored format's cost into the
// split's and the decode's.
void BM_LinearSplit(benchmark::State& st) {
  const KnobScope panels(find_knob("cpu.linear_panels"), int(st.range(3)));
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor x = filled({m, k}, DType::bf16), w = filled({n, k}, DType::bf16), y = Tensor::heap({m, n}, DType::bf16);
  for (auto _ : st) ops::linear(c, x, w, nullptr, y);
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LinearSplit)
    ->ArgsProduct({{1024}, {3072}, {3072}, {0, 1}})
    ->ArgsProduct({{1536}, {3072}, {27648}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// A linear with a request's adapter beside it (ops/adapters.h): its products and the scaled add
// over what the bare linear costs, at klein's 1024 x 3072 x 3072. args: tokens, in, out, kind, rank:
// kind 0 none, 1 a LoRA (bf16 factors, rank r), 2 a LoHa of ranks r x r (read as the f32 rank-r^2
// pair it is exactly), 3 a LoKr of LyCORIS's factor-16 default (outer [16, 16] and inner
// [out/16, in/16], whole f32). FLOP/s counts the base GEMM's FLOPs only, so the rates compare.
void BM_LinearAdapted(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), k = st.range(1), n = st.range(2), kind = st.range(3), r = st.range(4);
  Tensor x = filled({m, k}, DType::bf16), w = filled({n, k}, DType::bf16), y = Tensor::heap({m, n}, DType::bf16);
  const std::string name = "w.weight";
  w.weight_name = &name;
  Adapters adapters;
  if (kind == 1)
    adapters.add(name, w.shape, LowRank{{filled({r, k}, DType::bf16), filled({n, r}, DType::bf16)}, 0.8f, "bench"});
  if (kind == 2)
    adapters.add(name, w.shape,
                 LowRank{{filled({r * r, k}, DType::f32), filled({n, r * r}, DType::f32)}, 0.8f, "bench"});
  if (kind == 3) {
    LowRank f{{Tensor{}, filled({n / 16, k / 16}, DType::f32)}, 0.8f, "bench"};
    f.outer = Factor{Tensor{}, filled({16, 16}, DType::f32)};
    adapters.add(name, w.shape, f);
  }
  const AdapterScope scope(c, &adapters);
  for (auto _ : st) ops::linear(c, x, w, nullptr, y);
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LinearAdapted)
    ->Args({1024, 3072, 3072, 0, 0})
    ->Args({1024, 3072, 3072, 1, 16})
    ->Args({1024, 3072, 3072, 1, 64})
    ->Args({1024, 3072, 3072, 2, 16})
    ->Args({1024, 3072, 3072, 3, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// One attention tile's GEMM as the attention kernels call it, single-threaded: a query block's
// scores Q [rows, 64] · K^T over `keys` keys. args: rows, keys. What a call costs beyond its FLOPs.
void BM_AttentionTileGemm(benchmark::State& st) {
  const int64_t m = st.range(0), n = st.range(1), d = 64;
  Tensor q = filled({m, d}, DType::bf16), k = filled({n, d}, DType::bf16), s = Tensor::heap({m, n}, DType::f32);
  for (auto _ : st) cpu::gemm(q, k.data, DType::bf16, 1, d, nullptr, s, d, n);
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * m * n * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AttentionTileGemm)->Args({128, 162})->Args({128, 452})->Args({8, 8})->UseRealTime();

// SAME-L's differential band attention |i - j| <= 17: args tokens, query rows per task
// Stable Audio 3 medium's DiT self-attention at 30 s: 452 tokens, 24 heads of 64, one softmax;
// arg: query rows per task
void BM_Sa3Attention(benchmark::State& st) {
  const KnobScope block(cpu::attention_block_knob, cpu::attention_block_knob.index_of(std::to_string(st.range(0))));
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t s = 452, h = 24, d = 64;
  Tensor q = filled({s, h * d}, DType::bf16), k = filled({s, h * d}, DType::bf16), v = filled({s, h * d}, DType::bf16),
         o = Tensor::heap({s, h * d}, DType::bf16);
  for (auto _ : st) ops::attention(c, q, k, v, o, d, 0.125f, {});
  st.counters["FLOP/s"] = benchmark::Counter(4.0 * s * s * h * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sa3Attention)->Arg(128)->Arg(256)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same DiT's differential attention, self (452 keys) and cross (257 text tokens + duration).
// args: keys, kernel (0 direct, 1 GEMM tiles)
// args: keys (452 self, 257 cross), kernel (0 direct, 1 GEMM tiles), query rows per task
void BM_Sa3DifferentialAttention(benchmark::State& st) {
  const KnobScope block(cpu::attention_block_knob, cpu::attention_block_knob.index_of(std::to_string(st.range(2))));
  const KnobScope kernel(cpu::attention_kernel_knob, st.range(1) ? 2 : 1);
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t s = 452, keys = st.range(0), h = 24, d = 64;
  Tensor q = filled({s, h * d}, DType::bf16), q2 = filled({s, h * d}, DType::bf16),
         k = filled({keys, h * d}, DType::bf16), k2 = filled({keys, h * d}, DType::bf16),
         v = filled({keys, h * d}, DType::bf16), o = Tensor::heap({s, h * d}, DType::bf16);
  for (auto _ : st) ops::differential_attention(c, q, k, q2, k2, v, o, d, 0.125f, {});
  st.counters["FLOP/s"] = benchmark::Counter(8.0 * s * keys * h * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sa3DifferentialAttention)
    ->ArgsProduct({{452, 257}, {0, 1}, {128}})
    ->ArgsProduct({{452, 257}, {1}, {32, 64, 256, 512}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// SAME's band. args: tokens, query rows per task, kernel (0 direct, 1 GEMM tiles)
void BM_BandAttention(benchmark::State& st) {
  const KnobScope block(cpu::attention_block_knob, cpu::attention_block_knob.index_of(std::to_string(st.range(1))));
  const KnobScope kernel(cpu::band_attention_knob, st.range(2) ? 2 : 1);
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t s = st.range(0), h = 24, d = 64;
  Tensor q = filled({s, 2 * h * d}, DType::bf16), k = filled({s, 2 * h * d}, DType::bf16),
         v = filled({s, h * d}, DType::bf16), o = Tensor::heap({s, h * d}, DType::bf16);
  const ops::AttentionOptions band{false, nullptr, 1, 0.0f, ops::Rounding::once, 17};
  for (auto _ : st)
    ops::differential_attention(c, q.cols(0, h * d), k.cols(0, h * d), q.cols(h * d, 2 * h * d),
                                k.cols(h * d, 2 * h * d), v, o, d, 0.125f, band);
}
BENCHMARK(BM_BandAttention)->ArgsProduct({{6596}, {32, 128}, {0, 1}})->Unit(benchmark::kMillisecond)->UseRealTime();

// The band as a CPU without bf16 dot products runs it (cpu.native_bf16=off). args as BM_BandAttention's.
void BM_BandAttentionWidened(benchmark::State& st) {
  const KnobScope widened("cpu.native_bf16", "off");
  BM_BandAttention(st);
}
BENCHMARK(BM_BandAttentionWidened)
    ->ArgsProduct({{6596}, {32, 128}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// args: tokens, heads, query rows per task, causal, kernel (0 direct, 1 GEMM tiles)
void BM_Attention(benchmark::State& st) {
  const KnobScope block(cpu::attention_block_knob, cpu::attention_block_knob.index_of(std::to_string(st.range(2))));
  const KnobScope kernel(cpu::attention_kernel_knob, st.range(4) ? 2 : 1);
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t s = st.range(0), h = st.range(1), d = 128;
  Tensor q = filled({s, h * d}, DType::bf16), k = filled({s, h * d}, DType::bf16), v = filled({s, h * d}, DType::bf16),
         o = Tensor::heap({s, h * d}, DType::bf16);
  const bool causal = st.range(3) != 0;
  for (auto _ : st) ops::attention(c, q, k, v, o, d, 0.088f, {causal});
  st.counters["FLOP/s"] =
      benchmark::Counter((causal ? 2.0 : 4.0) * s * s * h * d, benchmark::Counter::kIsIterationInvariantRate);
}
// klein's joint attention at 512x512 and 1024x1024 (24 heads); Qwen3's causal prompt (32 heads, 512 tokens)
BENCHMARK(BM_Attention)
    ->ArgsProduct({{1536, 4608}, {24}, {128}, {0}, {0, 1}})
    ->ArgsProduct({{512}, {32}, {128}, {1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The same attention as a CPU without bf16 dot products runs it (cpu.native_bf16=off: the widened
// direct kernel, or the GEMM tiles on widened f32), at klein 512x512's joint attention and Qwen3's
// causal prompt. args as BM_Attention's, then the tiles' widened GEMM (cpu.widened_gemm: 1 apus's
// AVX2 kernel, 2 oneDNN's tiles).
void BM_AttentionWidened(benchmark::State& st) {
  const KnobScope widened("cpu.native_bf16", "off");
  const KnobScope kernel(find_knob("cpu.widened_gemm"), int(st.range(5)));
  BM_Attention(st);
}
BENCHMARK(BM_AttentionWidened)
    ->Args({1536, 24, 128, 0, 0, 1})
    ->Args({1536, 24, 128, 0, 1, 1})
    ->Args({1536, 24, 128, 0, 1, 2})
    ->Args({512, 32, 128, 1, 0, 1})
    ->Args({512, 32, 128, 1, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The FLUX.2 VAE's mid-block attention: one head of 512 channels over the latent's tokens (4096 at
// 512x512, 16384 at 1024x1024). args: tokens, kernel (0 direct, 1 GEMM tiles)
void BM_VaeAttention(benchmark::State& st) {
  const KnobScope kernel(cpu::attention_kernel_knob, st.range(1) ? 2 : 1);
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t s = st.range(0), d = 512;
  Tensor q = filled({s, d}, DType::bf16), k = filled({s, d}, DType::bf16), v = filled({s, d}, DType::bf16),
         o = Tensor::heap({s, d}, DType::bf16);
  for (auto _ : st) ops::attention(c, q, k, v, o, d, 0.044f, {});
  st.counters["FLOP/s"] = benchmark::Counter(4.0 * s * s * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_VaeAttention)->ArgsProduct({{4096, 16384}, {0, 1}})->Unit(benchmark::kMillisecond)->UseRealTime();

// args: channels in, channels out, spatial side, layout (0 plain, 1 blocked)
void BM_Conv3x3(benchmark::State& st) {
  const KnobScope layout(cpu::conv_layout_knob, st.range(3) ? 0 : 1);
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t ci = st.range(0), co = st.range(1), hw = st.range(2);
  Tensor x = filled({1, ci, hw, hw}, DType::bf16), w = filled({co, ci, 3, 3}, DType::bf16),
         b = filled({co}, DType::bf16), y = Tensor::heap({1, co, hw, hw}, DType::bf16);
  for (auto _ : st) ops::conv2d(c, x, w, &b, y, 1, 1, 1);
  st.counters["FLOP/s"] =
      benchmark::Counter(2.0 * ci * co * 9 * hw * hw, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Conv3x3)
    ->ArgsProduct({{512}, {512}, {64}, {0, 1}})
    ->ArgsProduct({{256}, {256}, {256}, {0, 1}})
    ->ArgsProduct({{128}, {128}, {512}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The VAE decoder's last upsample (256 channels, 256 -> 512). args: channels, input side
void BM_Upsample(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t ch = st.range(0), hw = st.range(1);
  Tensor x = filled({1, ch, hw, hw}, DType::bf16), y = Tensor::heap({1, ch, 2 * hw, 2 * hw}, DType::bf16);
  for (auto _ : st) ops::upsample_nearest2x(c, x, y);
  st.counters["B/s"] = benchmark::Counter(10.0 * ch * hw * hw, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Upsample)->Args({256, 256})->Unit(benchmark::kMillisecond)->UseRealTime();

// args: rows, features
void BM_LayerNormModulate(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), d = st.range(1);
  Tensor x = filled({m, d}, DType::bf16), sh = filled({1, d}, DType::bf16), sc = filled({1, d}, DType::bf16),
         y = Tensor::heap({m, d}, DType::bf16);
  for (auto _ : st) ops::layer_norm_modulate(c, x, sh, sc, y, 1e-6f, ops::Rounding::each_step);
  st.counters["B/s"] = benchmark::Counter(4.0 * m * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LayerNormModulate)->Args({1536, 3072})->Unit(benchmark::kMillisecond)->UseRealTime();

// SAME-L's element-wise ops at a 30 s clip's chunk (2176 tokens). args: rows, features, group
// (DyT's gamma/beta width: the row, or a head of 64)
void BM_Dyt(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), d = st.range(1), g = st.range(2);
  Tensor x = filled({m, d}, DType::bf16), alpha = filled({1}, DType::bf16), gamma = filled({g}, DType::bf16),
         beta = filled({g}, DType::bf16), y = Tensor::heap({m, d}, DType::bf16);
  for (auto _ : st) ops::dyt(c, x, alpha, gamma, beta, y, ops::Rounding::each_step);
  st.counters["B/s"] = benchmark::Counter(4.0 * m * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Dyt)->Args({2176, 1536, 1536})->Args({2176, 3072, 64})->Unit(benchmark::kMillisecond)->UseRealTime();

// RoPE in place on a column view (q and k of a fused projection). args: rows, view width, row
// stride, head_dim, turned pairs per head, style (0 half: SAME / SA3, 1 interleaved: FLUX)
void BM_Rope(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), d = st.range(1), stride = st.range(2), hd = st.range(3), half = st.range(4);
  Tensor all = filled({m, stride}, DType::bf16), cos = filled({m, half}, DType::f32),
         sin = filled({m, half}, DType::f32);
  Tensor x = all.cols(0, d);
  const auto style = st.range(5) ? ops::RopeStyle::interleaved : ops::RopeStyle::half;
  for (auto _ : st) ops::rope(c, x, cos, sin, hd, style, ops::Rounding::once);
  st.counters["B/s"] = benchmark::Counter(4.0 * m * d, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Rope)
    ->Args({2176, 3072, 4608, 64, 16, 0})
    ->Args({1536, 6144, 9216, 128, 64, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// args: rows, features, activation (0 silu, 1 sin_pi)
void BM_Glu(benchmark::State& st) {
  Arena arena;
  Context c{&arena, DType::bf16};
  const int64_t m = st.range(0), f = st.range(1);
  Tensor a = filled({m, f}, DType::bf16), b = filled({m, f}, DType::bf16), y = Tensor::heap({m, f}, DType::bf16);
  const auto act = st.range(2) ? ops::Activation::sin_pi : ops::Activation::silu;
  for (auto _ : st) ops::glu(c, a, b, y, act, ops::Rounding::each_step);
  st.counters["B/s"] = benchmark::Counter(6.0 * m * f, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Glu)->Args({2176, 4608, 1})->Args({452, 6144, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

// A whole VAE decode on a real-size checkpoint named by $APUS_MODEL (e.g. an `apus synth` one).
// args: image side
void BM_VaeDecode(benchmark::State& st) {
  const char* model = std::getenv("APUS_MODEL");
  if (!model) {
    st.SkipWithError("set APUS_MODEL to a klein checkpoint directory");
    return;
  }
  Arena arena;
  Context c{&arena, DType::bf16};
  const ModelDir dir = ModelDir::open(model);
  const auto vae = flux2::VaeDecoder::load(dir.config("vae"), dir.weights("vae"));
  vae.make_resident();
  const int64_t side = st.range(0), tokens = side / 16;
  Tensor x = filled({tokens * tokens, vae.config().packed_channels()}, DType::bf16);
  Tensor image = Tensor::heap({1, 3, side, side}, DType::bf16);
  for (auto _ : st) vae.decode(c, x, tokens, tokens, image);
}
BENCHMARK(BM_VaeDecode)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

// torch's CPU draws in one call of `n` values: randn (float32, the x86 kernel; SAME's decoder
// noise, a chunk's millions of draws, on the host while a device runs the DiT), or rand's uniforms
// alone (the generator's sequential part of randn). args: n, normal
void BM_TorchDraws(benchmark::State& st) {
  std::vector<float> out(size_t(st.range(0)));
  TorchGenerator g(42);
  for (auto _ : st) {
    if (st.range(1)) g.randn(out.data(), st.range(0));
    else g.rand(out.data(), st.range(0));
  }
  st.counters["values/s"] = benchmark::Counter(double(st.range(0)), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TorchDraws)->ArgsProduct({{1 << 22}, {1, 0}})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace apus

BENCHMARK_MAIN();
