// `promtool check metrics` (Debian's prometheus package) on a /metrics text, for the tests
// that hold every role's metrics to the Prometheus naming conventions.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "ops/process.h"

namespace flywheel::testing {

// nullopt when promtool is not installed (the caller skips, saying so); else promtool's
// complaints, "" when it accepts the text.
inline std::optional<std::string> PromtoolComplaints(const std::string& metrics_text) {
  const char* promtool = "/usr/bin/promtool";
  if (::access(promtool, X_OK) != 0) return std::nullopt;
  std::string pattern = (std::filesystem::temp_directory_path() / "metrics.XXXXXX").string();
  const int fd = ::mkstemp(pattern.data());
  if (fd < 0) return "cannot create a temporary file";
  ::close(fd);
  { std::ofstream(pattern, std::ios::binary) << metrics_text; }
  Result<ops::Completion> done = ops::RunToCompletion(
      "/bin/sh", {"-c", std::string(promtool) + " check metrics < '" + pattern + "'"});
  std::filesystem::remove(pattern);
  if (!done.ok()) return done.status().ToString();
  if (done->exit_code == 0) return std::string();
  return "promtool exited with " + std::to_string(done->exit_code) + ": " + done->out + done->err;
}

}  // namespace flywheel::testing
