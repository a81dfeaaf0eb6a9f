#pragma once
// The reference backend: every op of ops/op_list.h as plain loops in f64, with the roundings the
// op contract names and nothing else; no libraries, no threads, no vectorisation tricks. It is
// slow on purpose: the op tests hold every other backend to it.
#include "core/error.h"
#include "ops/ops.h"

namespace apus::ref {

APUS_DECLARE_OPS

// Element (r, i) of a 2-D view, and a store rounded to the tensor's dtype (through f32, as the
// other backends round).
double get(const Tensor& t, int64_t r, int64_t i);
void put(Tensor& t, int64_t r, int64_t i, double v);
// v as the reference holds it after an op whose result has dtype dt.
double as(DType dt, double v);
// Any contiguous tensor as [rows, last dim].
Tensor rows2d(const Tensor& t);
double silu(double v);
// torch's gelu(approximate="tanh"), exactly 0 where its float tanh saturates to -1 (2u < -18).
double gelu_tanh(double v);

}  // namespace apus::ref
