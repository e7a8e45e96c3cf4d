// A latency histogram for /v1/status and /metrics: fixed upper bounds in seconds, counts
// per bucket, sum and count. Observe() and ToJson() may be called from any thread.
//
// ToJson() is the status document's form of a histogram, which ops::MetricsText renders as
// a Prometheus histogram (<name>_bucket{le=...} cumulative counts, <name>_sum, <name>_count):
//   {"histogram": {"le": [0.001, ...], "buckets": [cumulative counts...], "sum": s, "count": n}}
#pragma once

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

namespace flywheel::ops {

class Histogram {
 public:
  // Upper bounds in seconds, ascending; +Inf is implied.
  explicit Histogram(std::vector<double> bounds = LatencyBounds());
  // 1 ms .. 300 s, for request latencies.
  static std::vector<double> LatencyBounds();

  void Observe(double seconds);
  nlohmann::json ToJson() const;
  uint64_t count() const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // GUARDED_BY(mutex_): per bucket, not cumulative; +Inf last
  double sum_ = 0;                // GUARDED_BY(mutex_)
  uint64_t count_ = 0;            // GUARDED_BY(mutex_)
};

}  // namespace flywheel::ops
