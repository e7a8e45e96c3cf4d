// Files as one adapter over the in-memory codec (delta/delta.h): checkpoints are
// safetensors files or sharded directories, deltas are container files.
//
// Every output is written atomically: to a temporary name in the destination directory,
// verified, fsynced, then renamed. A failed call leaves no output and never touches an
// existing file at the output path.
#pragma once

#include <string>

#include "base/env.h"
#include "base/status.h"
#include "delta/delta.h"
#include "delta/inspect.h"

namespace flywheel::delta {

struct FileEncodeStats {
  uint64_t checkpoint_bytes = 0;
  uint64_t delta_bytes = 0;
  uint64_t changed_words = 0;
  uint64_t total_words = 0;
  Hash128 base_hash;
  Hash128 target_hash;
};

// Encodes base -> target into `out_path`. The target's __metadata__ goes into the
// manifest (options.metadata entries take precedence).
Result<FileEncodeStats> EncodeFiles(const std::string& base_path, const std::string& target_path,
                                    const std::string& out_path, EncodeOptions options);
// Encodes a keyframe of `target_path` into `out_path`.
Result<FileEncodeStats> EncodeKeyframeFile(const std::string& target_path,
                                           const std::string& out_path, EncodeOptions options);

struct FileApplyStats {
  uint64_t target_version = 0;
  Hash128 target_hash;
  uint64_t changed_words = 0;
};

// Applies the delta (or keyframe) at `delta_path` to the checkpoint at `base_path` (may be
// empty for a keyframe) and writes the target to `out_path` as one .safetensors file, in
// the manifest's tensor order with the manifest's metadata. Refuses a base whose hash
// differs from the one the delta names. The base is always hashed from disk:
// options.state_tensor_hashes is ignored.
Result<FileApplyStats> ApplyFiles(const std::string& base_path, const std::string& delta_path,
                                  const std::string& out_path, const ApplyOptions& options = {});

// Reads a whole delta file into memory (size-checked) for DeltaView::Parse
// (Env::ReadFile).
Result<std::vector<std::byte>> ReadDeltaFile(const std::string& path, Env* env = Env::Default());

// Reads, parses (default DecodeLimits) and summarizes the delta or keyframe at `path`
// (delta/inspect.h); fails with the read or parse error. Payloads are not decoded.
Result<DeltaSummary> InspectDeltaFile(const std::string& path);

// Writes bytes atomically: temporary file, fsync, rename, directory fsync. The one
// implementation is in base/env.h; this name stays for the callers that know it.
using ::flywheel::WriteFileAtomically;

}  // namespace flywheel::delta
