#include "tools/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace flywheel::tools {
namespace {

constexpr auto kMinRedrawInterval = std::chrono::milliseconds(100);

// Scales `bytes` by the unit that `reference` calls for, so that "1.2/2.6 GB" share one.
struct Unit {
  double divisor;
  const char* name;
};
Unit UnitFor(uint64_t reference) {
  if (reference >= 1'000'000'000'000ull) return {1e12, "TB"};
  if (reference >= 1'000'000'000ull) return {1e9, "GB"};
  if (reference >= 1'000'000ull) return {1e6, "MB"};
  if (reference >= 1'000ull) return {1e3, "KB"};
  return {1, "B"};
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  const Unit unit = UnitFor(bytes);
  char text[64];
  if (unit.divisor == 1) {
    std::snprintf(text, sizeof(text), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(text, sizeof(text), "%.1f %s", static_cast<double>(bytes) / unit.divisor,
                  unit.name);
  }
  return text;
}

std::string FormatProgressLine(uint64_t done, uint64_t total, int width) {
  done = std::min(done, total);
  const double fraction = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  const int filled = static_cast<int>(fraction * width);
  std::string line = "[";
  line.append(static_cast<size_t>(filled), '#');
  line.append(static_cast<size_t>(width - filled), ' ');
  line += "]";
  const Unit unit = UnitFor(total);
  char text[96];
  if (unit.divisor == 1) {
    std::snprintf(text, sizeof(text), " %3d%%  %llu/%llu B", static_cast<int>(fraction * 100),
                  static_cast<unsigned long long>(done), static_cast<unsigned long long>(total));
  } else {
    std::snprintf(text, sizeof(text), " %3d%%  %.1f/%.1f %s", static_cast<int>(fraction * 100),
                  static_cast<double>(done) / unit.divisor,
                  static_cast<double>(total) / unit.divisor, unit.name);
  }
  line += text;
  return line;
}

ProgressBar::ProgressBar(std::FILE* out) : ProgressBar(out, ::isatty(::fileno(out)) == 1) {}

ProgressBar::ProgressBar(std::FILE* out, bool enabled) : out_(out), enabled_(enabled) {}

ProgressBar::~ProgressBar() {
  Finish();
}

void ProgressBar::Update(uint64_t done_bytes, uint64_t total_bytes) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  const Clock::time_point now = Clock::now();
  const bool complete = done_bytes >= total_bytes;
  if (drawn_ && !complete && now - last_draw_ < kMinRedrawInterval) return;
  const std::string line = FormatProgressLine(done_bytes, total_bytes);
  // Pad with spaces when the line got shorter, so no stale characters remain.
  const size_t padding = last_length_ > line.size() ? last_length_ - line.size() : 0;
  std::fprintf(out_, "\r%s%*s", line.c_str(), static_cast<int>(padding), "");
  std::fflush(out_);
  drawn_ = true;
  last_draw_ = now;
  last_length_ = line.size();
}

void ProgressBar::Finish() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (!drawn_) return;
  std::fprintf(out_, "\r%*s\r", static_cast<int>(last_length_), "");
  std::fflush(out_);
}

delta::ProgressFn ProgressBar::Callback() {
  return [this](uint64_t done_bytes, uint64_t total_bytes) { Update(done_bytes, total_bytes); };
}

}  // namespace flywheel::tools
