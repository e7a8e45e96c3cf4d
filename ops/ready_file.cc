#include "ops/ready_file.h"

namespace flywheel::ops {

Status WriteReadyFile(const std::string& path, const nlohmann::json& document, Env* env) {
  const std::string text = document.dump() + "\n";
  return WriteFileAtomically(path, std::as_bytes(std::span(text.data(), text.size())), env)
      .WithContext("cannot write ready file " + path);
}

}  // namespace flywheel::ops
