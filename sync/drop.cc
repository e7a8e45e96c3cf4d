#include "sync/drop.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;

// Leading zeros are refused so that "7" and "007" cannot both claim version 7.
bool ParseVersionName(const std::string& name, uint64_t* version) {
  if (name.empty() || name.size() > 19) return false;
  if (name.size() > 1 && name[0] == '0') return false;
  uint64_t value = 0;
  for (char c : name) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  *version = value;
  return true;
}

}  // namespace

Result<std::vector<Drop>> ScanDrops(const std::string& watch_dir, uint64_t after_version) {
  std::vector<Drop> drops;
  std::error_code ec;
  fs::directory_iterator it(watch_dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    uint64_t version = 0;
    if (!ParseVersionName(it->path().filename().string(), &version)) continue;
    if (version <= after_version) continue;
    std::error_code entry_error;
    if (!it->is_directory(entry_error)) continue;
    if (!fs::exists(it->path() / kCommitMarker, entry_error)) continue;
    drops.push_back(Drop{version, it->path().string()});
  }
  if (ec) {
    return ec == std::errc::no_such_file_or_directory
               ? Status::NotFound("cannot list drop directory " + watch_dir + ": " + ec.message())
               : Status::IOError("cannot list drop directory " + watch_dir + ": " + ec.message());
  }
  std::sort(drops.begin(), drops.end(),
            [](const Drop& a, const Drop& b) { return a.version < b.version; });
  return drops;
}

Result<Checkpoint> OpenDrop(const Drop& drop) {
  // Checkpoint::Open on a directory prefers the index; a drop prefers the single file.
  const fs::path single = fs::path(drop.path) / "model.safetensors";
  std::error_code ec;
  const std::string target = fs::exists(single, ec) ? single.string() : drop.path;
  auto checkpoint = Checkpoint::Open(target);
  if (!checkpoint.ok()) return checkpoint.status().WithContext("drop " + drop.path);
  return checkpoint;
}

}  // namespace flywheel::sync
