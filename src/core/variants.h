#pragma once
// Kernel variant knobs: static configuration a backend reads at each call (the attention kernel's
// block size, the conv layout, the bf16 path...), so two arms of a change run in one process on
// the same inputs (`apus bench --ab knob=a,b`). A kernel also files which choice's code it took,
// so an A/B can tell two arms that ran the same code (a choice this machine cannot take) from two
// that really differ.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace apus {

class Knob {
 public:
  // Registers the knob under `name` ("cpu.conv_layout"); choices[0] is the default.
  Knob(std::string name, std::string about, std::vector<std::string> choices);
  Knob(const Knob&) = delete;
  Knob& operator=(const Knob&) = delete;

  const std::string& name() const { return name_; }
  const std::string& about() const { return about_; }
  const std::vector<std::string>& choices() const { return choices_; }
  int value() const { return value_.load(std::memory_order_relaxed); }
  void set(int choice);
  // The choice named `choice`, or an error naming the knob and its choices.
  int index_of(const std::string& choice) const;

  // A kernel ran the code of `choice`.
  void took(int choice) { taken_[size_t(choice)].fetch_add(1, std::memory_order_relaxed); }
  int64_t taken(int choice) const { return taken_[size_t(choice)].load(std::memory_order_relaxed); }
  void clear_taken();

 private:
  std::string name_, about_;
  std::vector<std::string> choices_;
  std::atomic<int> value_{0};
  std::unique_ptr<std::atomic<int64_t>[]> taken_;
};

// Every knob the linked backends registered, in registration order.
const std::vector<Knob*>& knobs();
// The knob named `name`, or an error listing them.
Knob& find_knob(const std::string& name);
// Sets knobs from "NAME=CHOICE[,NAME=CHOICE...]" (the environment's APUS_KNOBS: a choice for a
// whole process, as a split's ranks or a test script need), an error naming `origin` and the item
// on a bad one.
void set_knobs(const std::string& spec, const std::string& origin);

// A knob at one choice until the scope ends, then back at the choice it had (a bench arm, a test,
// a gate candidate).
class KnobScope {
 public:
  KnobScope(Knob& knob, int choice) : knob_(knob), before_(knob.value()) { knob.set(choice); }
  KnobScope(const std::string& name, const std::string& choice)
      : KnobScope(find_knob(name), find_knob(name).index_of(choice)) {}
  KnobScope(const KnobScope&) = delete;
  KnobScope& operator=(const KnobScope&) = delete;
  ~KnobScope() { knob_.set(before_); }

 private:
  Knob& knob_;
  int before_;
};

}  // namespace apus
