// Helpers shared by grading/'s graders. Private to grading/.
#pragma once

#include <string>

#include "grading/grader.h"

namespace flywheel::grading {

// Adds `outcome` to counters.rewarded / continued / ungraded / failed.
void CountOutcome(GraderCounters& counters, const Outcome& outcome);

// Ungraded samples in a row; Record() says when the run of them passed the limit.
class FailureStreak {
 public:
  explicit FailureStreak(int limit) : limit_(limit) {}
  // True when this failure makes the streak longer than the limit.
  bool Fail() { return ++streak_ > limit_; }
  void Succeed() { streak_ = 0; }
  int streak() const { return streak_; }

 private:
  int limit_;
  int streak_ = 0;
};

}  // namespace flywheel::grading
