// A terminal progress bar for long encodes and applies.
//
// Usable directly as a delta::ProgressFn (the codec calls it from worker threads). It
// draws `\r[########        ]  45%  1.2/2.6 GB` on its stream, at most ~10 times a second,
// and only when that stream is a terminal: redirected or piped stderr stays clean, so a
// script sees exactly the lines the command prints. Finish() (or the destructor) erases
// the bar so that the next line starts on a clean row.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include "delta/delta.h"

namespace flywheel::tools {

// "1.5 GB", "12.0 MB", "512 B": decimal units, one decimal, for humans.
std::string FormatBytes(uint64_t bytes);

// The bar's text without the leading '\r': `[####    ]  45%  1.2/2.6 GB`. `width` is the
// number of cells between the brackets. `done` is clamped to `total`.
std::string FormatProgressLine(uint64_t done, uint64_t total, int width = 30);

class ProgressBar {
 public:
  // Draws on `out` only if `out` is a terminal (isatty).
  explicit ProgressBar(std::FILE* out = stderr);
  // Draws on `out` if and only if `enabled` (a seam for tests and for --no-progress).
  ProgressBar(std::FILE* out, bool enabled);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Thread-safe. Redraws if 100 ms passed since the last draw, or when done == total.
  void Update(uint64_t done_bytes, uint64_t total_bytes);
  // Erases the bar (if one was drawn). Later updates are ignored.
  void Finish();

  bool enabled() const { return enabled_; }
  // A ProgressFn that forwards to Update(); REQUIRES: this bar outlives every call.
  delta::ProgressFn Callback();

 private:
  using Clock = std::chrono::steady_clock;

  std::FILE* const out_;
  const bool enabled_;
  std::mutex mu_;
  bool drawn_ = false;           // GUARDED_BY(mu_)
  bool finished_ = false;        // GUARDED_BY(mu_)
  Clock::time_point last_draw_;  // GUARDED_BY(mu_)
  size_t last_length_ = 0;       // GUARDED_BY(mu_)
};

}  // namespace flywheel::tools
