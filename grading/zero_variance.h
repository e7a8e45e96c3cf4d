// Zero-variance filtering (issue 34 part 5; on by default, as in the seeds): a group of
// completions of one prompt whose graded rewards are all equal carries no advantage signal
// and is dropped before the loss; ungraded samples are left out of the decision (and of the
// loss). Thread safety: Decide() and counters() may be called from any thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>

namespace flywheel::grading {

struct GroupVerdict {
  bool keep = false;
  size_t graded = 0;
  size_t ungraded = 0;
  std::string reason;  // when dropped: "zero variance" or "fewer than 2 graded samples"
};

struct ZeroVarianceCounters {
  uint64_t groups = 0;
  uint64_t kept = 0;
  uint64_t dropped_zero_variance = 0;
  uint64_t dropped_too_few_graded = 0;
  uint64_t ungraded_samples = 0;
};

class ZeroVarianceFilter {
 public:
  // enabled = false keeps groups whose rewards are all equal (their advantages are zero);
  // groups with fewer than 2 graded samples are dropped either way. Rewards within
  // `tolerance` of each other count as equal.
  explicit ZeroVarianceFilter(bool enabled = true, double tolerance = 0)
      : enabled_(enabled), tolerance_(tolerance) {}

  // One group's rewards, nullopt for an ungraded sample.
  GroupVerdict Decide(std::span<const std::optional<double>> rewards);
  ZeroVarianceCounters counters() const;

 private:
  const bool enabled_;
  const double tolerance_;
  mutable std::mutex mu_;
  ZeroVarianceCounters counters_;  // GUARDED_BY(mu_)
};

}  // namespace flywheel::grading
