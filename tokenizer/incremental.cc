#include "tokenizer/incremental.h"

#include "tokenizer/unicode.h"

namespace flywheel::tokenizer {

Result<std::string> IncrementalDecoder::Add(int32_t id) {
  FW_RETURN_IF_ERROR(tokenizer_.AppendPiece(id, skip_special_, state_, pending_));
  std::string out;
  const size_t kept = unicode::AppendLossy(pending_, out, /*final=*/false);
  pending_.erase(0, pending_.size() - kept);
  text_ += out;
  return out;
}

std::string IncrementalDecoder::Finish() {
  std::string out;
  unicode::AppendLossy(pending_, out, /*final=*/true);
  pending_.clear();
  text_ += out;
  return out;
}

}  // namespace flywheel::tokenizer
