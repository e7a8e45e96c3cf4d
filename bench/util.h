// Small pieces the benchmarks share: result tables (aligned text and Markdown) and scratch
// directories. Statistics are in bench/stats.h; the parallel loop is checkpoint/parallel.h's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"

namespace flywheel::bench {

// Replaces the section of a Markdown file that starts with the line `heading` (up to the
// next "## " heading or the end) with `section`, or appends it; creates the file if
// missing; writes atomically. (bench/markdown.cc)
Status WriteMarkdownSection(const std::string& path, const std::string& heading,
                            const std::string& section);

// A benchmark's scratch directory, removed on every way out of the run unless kept:
// `work_dir` when given (created if missing; removed afterwards only if this run created
// it and `keep` is false), else a fresh <$TMPDIR or /tmp>/<prefix>-XXXXXX (removed unless
// `keep`).
class ScopedWorkDir {
 public:
  ScopedWorkDir() = default;
  ScopedWorkDir(const ScopedWorkDir&) = delete;
  ScopedWorkDir& operator=(const ScopedWorkDir&) = delete;
  ~ScopedWorkDir() {
    if (remove_) {
      std::error_code ignored;
      std::filesystem::remove_all(path_, ignored);
    }
  }
  const std::string& path() const { return path_; }

  Status Prepare(const std::string& work_dir, const std::string& prefix, bool keep) {
    if (!work_dir.empty()) {
      std::error_code error;
      const bool created = std::filesystem::create_directories(work_dir, error);
      if (error) return Status::IOError("cannot create work dir " + work_dir + ": " + error.message());
      path_ = std::filesystem::absolute(work_dir).string();
      remove_ = created && !keep;
      return Status::Ok();
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      return Status::IOError("cannot create a work dir from " + pattern + ": " + std::strerror(errno));
    }
    path_ = pattern;
    remove_ = !keep;
    return Status::Ok();
  }

 private:
  std::string path_;
  bool remove_ = false;
};

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
};

// A check's verdict as the reports print it.
inline std::string PassFail(bool pass) { return pass ? "PASS" : "FAIL"; }

// `value` with `digits` decimals ("-" for NaN or infinity).
inline std::string Fixed(double value, int digits) {
  if (!std::isfinite(value)) return "-";
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

// 1234567 -> "1,234,567".
inline std::string Grouped(uint64_t value) {
  std::string digits = std::to_string(value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Display width of UTF-8 text (code points; the tables use no wide characters).
inline size_t Utf8Width(const std::string& text) {
  size_t width = 0;
  for (unsigned char c : text) width += (c & 0xC0) != 0x80;
  return width;
}

// Aligned text, indented two spaces: first column left-aligned, the others right-aligned.
inline std::string RenderText(const Table& table) {
  std::vector<size_t> widths(table.header.size(), 0);
  auto widen = [&](const std::vector<std::string>& cells) {
    for (size_t i = 0; i < cells.size(); ++i) widths[i] = std::max(widths[i], Utf8Width(cells[i]));
  };
  widen(table.header);
  for (const auto& row : table.rows) widen(row);
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out = "  ";
    for (size_t i = 0; i < cells.size(); ++i) {
      const std::string pad(widths[i] - Utf8Width(cells[i]), ' ');
      if (i > 0) out += "  ";
      out += i == 0 ? cells[i] + pad : pad + cells[i];
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out + "\n";
  };
  std::string out = line(table.header);
  size_t total = 0;
  for (size_t width : widths) total += width;
  out += "  " + std::string(total + 2 * (widths.size() - 1), '-') + "\n";
  for (const auto& row : table.rows) out += line(row);
  return out;
}

// A GitHub Markdown table, numbers right-aligned.
inline std::string RenderMarkdown(const Table& table) {
  auto line = [](const std::vector<std::string>& cells) {
    std::string out = "|";
    for (const std::string& cell : cells) out += " " + cell + " |";
    return out + "\n";
  };
  std::string out = line(table.header);
  out += "|";
  for (size_t i = 0; i < table.header.size(); ++i) out += i == 0 ? " --- |" : " ---: |";
  out += "\n";
  for (const auto& row : table.rows) out += line(row);
  return out;
}

}  // namespace flywheel::bench
