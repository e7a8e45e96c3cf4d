// A role's --ready-file: the JSON document a process writes once its ports are bound
// ({"listen": ..., "http": ...} and whatever else its callers need), so that whoever
// started it (ops::AwaitReadyFile, a test, a supervisor) learns the real addresses without
// polling its ports.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "base/env.h"
#include "base/status.h"

namespace flywheel::ops {

// Writes `document` (one line of JSON and a newline) to `path` atomically through `env`
// (base/env.h WriteFileAtomically: a temporary file beside it, fsynced, renamed over it),
// so a reader sees either no file or the whole document. Errors name the path.
Status WriteReadyFile(const std::string& path, const nlohmann::json& document,
                      Env* env = Env::Default());

}  // namespace flywheel::ops
