// The statistics the benchmarks report, computed one way everywhere: the median of an even
// number of samples is the mean of the two middle ones. Header-only, so that the CUDA
// benchmark (built by nvcc alone in tools/gpu_check.sh) uses the same code.
#pragma once

#include <algorithm>
#include <vector>

namespace flywheel::bench {

// Lowest, median and highest of a set of samples (seconds, ms, ratios).
struct Spread {
  double min = 0, median = 0, max = 0;
  double spread() const { return median > 0 ? (max - min) / median : 0; }  // (max-min)/median
};

// All zero when `values` is empty.
inline Spread Summarize(std::vector<double> values) {
  if (values.empty()) return {};
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const double median = n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
  return {.min = values.front(), .median = median, .max = values.back()};
}

// The median of `values`; `if_empty` when there are none.
inline double Median(std::vector<double> values, double if_empty = 0) {
  return values.empty() ? if_empty : Summarize(std::move(values)).median;
}

}  // namespace flywheel::bench
