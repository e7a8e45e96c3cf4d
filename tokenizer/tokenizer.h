// Tokenizers behind one interface, so the serving API and the demo tasks can speak text
// while a real BPE tokenizer plugs in later.
//
//   ByteTokenizer  UTF-8 bytes as ids 0..255, then BOS 256 and EOS 257 (vocab 258): any text.
//   CharTokenizer  one id per character of a fixed alphabet, then BOS and EOS: tiny vocabularies
//                  for the demo tasks (digits and a few symbols); other characters are errors.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::tokenizer {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual Result<std::vector<int32_t>> Encode(std::string_view text) const = 0;
  // Special tokens (BOS/EOS) decode to nothing; ids outside the vocabulary are errors.
  virtual Result<std::string> Decode(std::span<const int32_t> ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos() const = 0;
  virtual int32_t eos() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  Result<std::vector<int32_t>> Encode(std::string_view text) const override;
  Result<std::string> Decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return 258; }
  int32_t bos() const override { return 256; }
  int32_t eos() const override { return 257; }
};

class CharTokenizer final : public Tokenizer {
 public:
  // `alphabet`: distinct single-byte characters, e.g. "0123456789+=, ".
  static Result<std::unique_ptr<CharTokenizer>> Create(std::string alphabet);
  Result<std::vector<int32_t>> Encode(std::string_view text) const override;
  Result<std::string> Decode(std::span<const int32_t> ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(alphabet_.size()) + 2; }
  int32_t bos() const override { return static_cast<int32_t>(alphabet_.size()); }
  int32_t eos() const override { return static_cast<int32_t>(alphabet_.size()) + 1; }

 private:
  explicit CharTokenizer(std::string alphabet);
  std::string alphabet_;
  int32_t index_[256];
};

}  // namespace flywheel::tokenizer
