#pragma once
// Adapters (LoRA, DoRA and LyCORIS's LoHa and LoKr) a request applies to a model's weights without
// changing them: each linear whose weight has adapters adds, after its own product,
// scale * x·ΔW^T per adapter in order, as PEFT's layers compute beside their base layer (each
// product and the scaled term rounded to the activation dtype, then added). ΔW is a product of
// two factors (LoRA; LoHa as the exact rank r1·r2 expansion of its Hadamard product) or the
// Kronecker product of two such matrices (LoKr), never expanded. A DoRA (Stable Audio 3's
// dora-rows) then rescales each output: W' = diag(m / ||W + ΔW||_row) (W + ΔW), the row norms
// found at the adapter's first use from the weight the linear multiplies by (||W||² + 2 B·(A W^T)
// + ||B A||² per row, in fp32) and the bias kept out of the rescaling. A resident model serves
// requests with and without adapters from the same weights.
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/share.h"
#include "core/tensor.h"

namespace apus {

class Backend;
struct Context;

// A matrix [rows, cols] as up·down (up [rows, r], down [r, cols]), or whole in `up` (down undefined).
struct Factor {
  Tensor down;  // PEFT's lora_A, kohya's lora_down
  Tensor up;    // lora_B, lora_up
  int64_t rows() const { return up.dim(0); }
  int64_t cols() const { return down.defined() ? down.dim(1) : up.dim(1); }
};

// ΔW = scale · inner (a LoRA, a LoHa), or scale · kron(outer, inner) when `outer` is defined (a
// LoKr: ΔW[i·p + k, j·q + l] = outer[i, j] · inner[k, l]).
struct LowRank {
  Factor inner;
  float scale = 1;
  std::string source;  // "FILE: key" for errors
  Factor outer;
  // DoRA's magnitude per output row [rows] (f32); undefined for every other kind.
  Tensor magnitude;
  // A LoKr's rows of ΔW that the weight holds (tensor parallelism, Adapters::keep_rows), in order:
  // its term is formed whole and these rows of it added. Empty: every row.
  std::vector<Share> kept;
  bool kronecker() const { return outer.up.defined(); }
  bool decomposed() const { return magnitude.defined(); }
  int64_t rows() const { return kronecker() ? outer.rows() * inner.rows() : inner.rows(); }
  int64_t cols() const { return kronecker() ? outer.cols() * inner.cols() : inner.cols(); }
  // The rows it changes of the weight as held.
  int64_t held_rows() const {
    if (kept.empty()) return rows();
    int64_t n = 0;
    for (const Share& s : kept) n += s.count;
    return n;
  }
};

class Adapters {
 public:
  // Adds `f` to the weight named `weight`, checked against that weight's [out, in] shape. A DoRA
  // must be a weight's first adapter (its norms are those of the weight alone plus its change).
  void add(const std::string& weight, const Shape& weight_shape, LowRank f);
  const std::vector<LowRank>* find(const std::string& weight) const;
  // `weight` held as its rows `rows` only (tensor parallelism, in the order held): its adapters'
  // changes cut to them (a pair's up factor, a DoRA's magnitudes, a LoKr's kept rows; dropped
  // where no row is held).
  void keep_rows(const std::string& weight, const std::vector<Share>& rows);
  bool empty() const { return by_weight_.empty(); }
  // The weights with adapters that no linear has applied yet (a model that copied the weight, or
  // never runs it): an adapter must not be dropped silently.
  std::vector<std::string> unapplied() const;
  void mark_applied(const std::string& weight) const;
  // Every factor copied into `device`'s memory, where the linears it adapts run.
  void upload(Backend& device);
  // A DoRA's per-output gain m / ||W + ΔW||_row and the shift (1 - gain) · bias that keeps the bias
  // out of it, for the weight `w` (and `bias`) the linear uses: computed on c's backend at the
  // first call, then kept.
  struct Gain {
    Tensor scale, shift;
  };
  const Gain& gain(Context& c, const LowRank& f, const Tensor& w, const Tensor* bias) const;

 private:
  mutable std::map<const LowRank*, Gain> gains_;
  std::map<std::string, std::vector<LowRank>> by_weight_;
  mutable std::mutex mutex_;
  mutable std::set<std::string> applied_;
};

// While it lives, the linears run on `c` apply `adapters` (null: none).
class AdapterScope {
 public:
  AdapterScope(Context& c, const Adapters* adapters);
  ~AdapterScope();
  AdapterScope(const AdapterScope&) = delete;
  AdapterScope& operator=(const AdapterScope&) = delete;

 private:
  Context& c_;
  const Adapters* previous_;
};

namespace ops {
// What linear runs after its product when the context carries adapters for w (ops.cpp).
void apply_adapters(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);
}  // namespace ops

}  // namespace apus
