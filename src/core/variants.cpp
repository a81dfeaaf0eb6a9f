#include "core/variants.h"

#include <algorithm>

#include "core/error.h"

namespace apus {

namespace {

std::vector<Knob*>& registry() {
  static std::vector<Knob*> all;
  return all;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

Knob::Knob(std::string name, std::string about, std::vector<std::string> choices)
    : name_(std::move(name)),
      about_(std::move(about)),
      choices_(std::move(choices)),
      taken_(new std::atomic<int64_t>[choices_.size()]) {
  clear_taken();
  registry().push_back(this);
}

void Knob::set(int choice) {
  APUS_CHECK(choice >= 0 && size_t(choice) < choices_.size(), name_, ": no choice ", choice);
  value_.store(choice, std::memory_order_relaxed);
}

int Knob::index_of(const std::string& choice) const {
  for (size_t i = 0; i < choices_.size(); ++i)
    if (choices_[i] == choice) return int(i);
  fail(name_, ": no choice '", choice, "' (choices: ", joined(choices_), ")");
}

void Knob::clear_taken() {
  for (size_t i = 0; i < choices_.size(); ++i) taken_[i].store(0, std::memory_order_relaxed);
}

const std::vector<Knob*>& knobs() { return registry(); }

Knob& find_knob(const std::string& name) {
  std::vector<std::string> names;
  for (Knob* k : registry()) {
    if (k->name() == name) return *k;
    names.push_back(k->name());
  }
  fail("no variant knob '", name, "' (knobs: ", joined(names), "; apus bench --list-variants)");
}

void set_knobs(const std::string& spec, const std::string& origin) {
  size_t at = 0;
  while (at < spec.size()) {
    const size_t end = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, end - at);
    const size_t eq = item.find('=');
    APUS_CHECK(eq != std::string::npos && eq > 0, origin, ": '", item, "' is not NAME=CHOICE (", origin,
               "=cpu.native_bf16=off,device.steps=graphs)");
    try {
      Knob& knob = find_knob(item.substr(0, eq));
      knob.set(knob.index_of(item.substr(eq + 1)));
    } catch (const Error& e) {
      fail(origin, ": ", e.what());
    }
    at = end + 1;
  }
}

}  // namespace apus
