// Bring-your-own-trainer drops: an external trainer writes <watch>/<version>/ with
// model.safetensors, or shards plus model.safetensors.index.json, and then an empty COMMIT
// file, last. A version directory without COMMIT is never read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/safetensors.h"

namespace flywheel::sync {

inline constexpr const char* kCommitMarker = "COMMIT";

struct Drop {
  uint64_t version = 0;
  std::string path;  // the version directory
};

// Committed version directories under `watch_dir` with a version above `after_version`,
// in ascending numeric order (9 before 10). A name is a version when it is 1 to 19 ASCII
// digits without a leading zero (no sign, no '+', no "007"; "0" is version 0), so names
// and versions map one to one. Other names, entries that are not directories (symlinks
// to directories count), and directories without a COMMIT file are skipped silently.
// Fails only if `watch_dir` cannot be listed.
Result<std::vector<Drop>> ScanDrops(const std::string& watch_dir, uint64_t after_version);

// Opens a drop: <path>/model.safetensors, else the sharded checkpoint indexed by
// <path>/model.safetensors.index.json. Validates it fully (checkpoint/safetensors.h); the
// error is prefixed with "drop <path>: " and names what is wrong with it.
Result<Checkpoint> OpenDrop(const Drop& drop);

}  // namespace flywheel::sync
