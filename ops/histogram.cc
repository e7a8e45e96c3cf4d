#include "ops/histogram.h"

#include <algorithm>

namespace flywheel::ops {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

std::vector<double> Histogram::LatencyBounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1,     2.5,    5,     10,   30,    60,   120, 300};
}

void Histogram::Observe(double seconds) {
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), seconds) - bounds_.begin());
  std::lock_guard lock(mutex_);
  counts_[bucket] += 1;
  sum_ += seconds;
  count_ += 1;
}

uint64_t Histogram::count() const {
  std::lock_guard lock(mutex_);
  return count_;
}

nlohmann::json Histogram::ToJson() const {
  std::lock_guard lock(mutex_);
  std::vector<uint64_t> cumulative;
  uint64_t running = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) cumulative.push_back(running += counts_[i]);
  return {{"histogram", {{"le", bounds_}, {"buckets", cumulative}, {"sum", sum_}, {"count", count_}}}};
}

}  // namespace flywheel::ops
