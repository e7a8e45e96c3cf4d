// Reference implementations from the npm registry for the tests: installs pinned packages
// into a cache under the build directory (once) and runs node scripts against them. When
// node or the registry is not reachable, the callers skip with the reason.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace flywheel::testing {

// Runs `command` through the shell; its standard output, or nullopt when it fails.
inline std::optional<std::string> RunCapture(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buffer[65536];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  const int rc = pclose(pipe);
  if (rc != 0) return std::nullopt;
  return out;
}

// `packages` ("name@version") installed under FLYWHEEL_BUILD_DIR/npm/<name>; the folder (its
// node_modules inside) or nullopt with `why` set.
inline std::optional<std::string> NpmInstall(const std::string& name,
                                             const std::vector<std::string>& packages,
                                             std::string& why) {
  namespace fs = std::filesystem;
  if (!RunCapture("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1")) {
    why = "node and npm are not installed";
    return std::nullopt;
  }
  const fs::path dir = fs::path(FLYWHEEL_BUILD_DIR) / "npm" / name;
  const fs::path stamp = dir / ".installed";
  // Tests run in parallel: one installs, the others wait for it (the lock goes with the fd).
  fs::create_directories(dir.parent_path());
  struct Lock {
    int fd;
    ~Lock() {
      if (fd >= 0) ::close(fd);
    }
  } lock{::open((dir.string() + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644)};
  if (lock.fd < 0 || ::flock(lock.fd, LOCK_EX) != 0) {
    why = "cannot lock " + dir.string() + ".lock";
    return std::nullopt;
  }
  std::string wanted;
  for (const auto& p : packages) wanted += p + "\n";
  {
    std::ifstream in(stamp);
    std::stringstream have;
    have << in.rdbuf();
    if (in && have.str() == wanted) return dir.string();
  }
  fs::create_directories(dir);
  {
    std::ofstream pkg(dir / "package.json");
    pkg << R"({"name": "flywheel-test-)" << name << R"(", "private": true, "type": "module"})";
  }
  std::string command = "cd '" + dir.string() +
                        "' && timeout 240 npm install --no-audit --no-fund --loglevel=error";
  for (const auto& p : packages) command += " '" + p + "'";
  command += " >npm-install.log 2>&1";
  if (!RunCapture(command)) {
    why = "could not install " + wanted.substr(0, wanted.size() - 1) +
          " from the npm registry (offline?); see " + (dir / "npm-install.log").string();
    return std::nullopt;
  }
  std::ofstream(stamp) << wanted;
  return dir.string();
}

}  // namespace flywheel::testing
