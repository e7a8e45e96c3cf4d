#include "tokenizer/tokenizer.h"

#include <algorithm>

namespace flywheel::tokenizer {

Status Tokenizer::AppendPiece(int32_t id, bool skip_special_tokens, DecodeState& state,
                              std::string& bytes) const {
  if (id < 0 || id >= vocab_size())
    return Status::InvalidArgument("token " + std::to_string(id) + " is outside the vocabulary [0, " +
                                   std::to_string(vocab_size()) + ")");
  if (skip_special_tokens && IsSpecial(id)) return Status::Ok();
  const int32_t one[] = {id};
  FW_ASSIGN_OR_RETURN(std::string piece, Decode(one));
  bytes += piece;
  ++state.pieces;
  return Status::Ok();
}

std::optional<int32_t> Tokenizer::TokenId(std::string_view token) const {
  auto ids = Encode(token);
  if (ids.ok() && ids->size() == 1) return (*ids)[0];
  return std::nullopt;
}

Result<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

Result<std::string> ByteTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size()) {
      return Status::InvalidArgument("token " + std::to_string(id) + " at position " +
                                     std::to_string(i) +
                                     " is outside the byte vocabulary [0, 258)");
    }
    if (id < 256) out.push_back(static_cast<char>(id));
  }
  return out;
}

CharTokenizer::CharTokenizer(std::string alphabet) : alphabet_(std::move(alphabet)) {
  std::fill(std::begin(index_), std::end(index_), -1);
  for (size_t i = 0; i < alphabet_.size(); ++i)
    index_[static_cast<unsigned char>(alphabet_[i])] = static_cast<int32_t>(i);
}

Result<std::unique_ptr<CharTokenizer>> CharTokenizer::Create(std::string alphabet) {
  if (alphabet.empty()) return Status::InvalidArgument("char tokenizer: the alphabet is empty");
  bool seen[256] = {};
  for (unsigned char c : alphabet) {
    if (seen[c])
      return Status::InvalidArgument(std::string("char tokenizer: '") + static_cast<char>(c) +
                                     "' appears twice");
    seen[c] = true;
  }
  return std::unique_ptr<CharTokenizer>(new CharTokenizer(std::move(alphabet)));
}

Result<std::vector<int32_t>> CharTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const int32_t id = index_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      return Status::InvalidArgument(
          "character " + std::to_string(static_cast<unsigned char>(text[i])) + " at offset " +
          std::to_string(i) + " is not in the tokenizer's alphabet");
    }
    ids.push_back(id);
  }
  return ids;
}

Result<std::string> CharTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size()) {
      return Status::InvalidArgument("token " + std::to_string(id) + " at position " +
                                     std::to_string(i) + " is outside the vocabulary [0, " +
                                     std::to_string(vocab_size()) + ")");
    }
    if (id < static_cast<int32_t>(alphabet_.size())) out.push_back(alphabet_[id]);
  }
  return out;
}

}  // namespace flywheel::tokenizer
