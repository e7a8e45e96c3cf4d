// Tokenizers behind one interface, so the serving API, the trainer's datasets and the demo
// tasks speak text whatever the model's vocabulary is.
//
//   ByteTokenizer  UTF-8 bytes as ids 0..255, then BOS 256 and EOS 257 (vocab 258): any text.
//   CharTokenizer  one id per character of a fixed alphabet, then BOS and EOS: tiny vocabularies
//                  for the demo tasks (digits and a few symbols); other characters are errors.
//   HfTokenizer    an HF `tokenizer.json` (tokenizer/hf_tokenizer.h): Qwen, Llama-3, Llama-2,
//                  Mistral and GPT-2 style BPE.
//
// Decoding goes token by token (AppendPiece) so that a stream can be decoded as it is
// generated (tokenizer/incremental.h): the bytes of a piece need not be whole UTF-8.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::tokenizer {

// What decoding carries from one token to the next (see Tokenizer::AppendPiece).
struct DecodeState {
  int64_t pieces = 0;       // tokens decoded so far (skipped special tokens not counted)
  int64_t strip_left = -1;  // leading characters still to strip (-1: not started)
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The text as it is: no BOS or other template tokens are added (special tokens written in
  // the text are recognised where the tokenizer has them).
  virtual Result<std::vector<int32_t>> Encode(std::string_view text) const = 0;
  // As a model's prompt: with the special tokens the tokenizer adds around a sequence (e.g.
  // Llama's BOS), as HF's `encode(text, add_special_tokens=True)`.
  virtual Result<std::vector<int32_t>> EncodePrompt(std::string_view text) const {
    return Encode(text);
  }
  // Special tokens (BOS/EOS) decode to nothing; ids outside the vocabulary are errors.
  virtual Result<std::string> Decode(std::span<const int32_t> ids) const = 0;
  // Appends the bytes token `id` adds to a decoded text after the tokens `state` has seen
  // (they need not be whole UTF-8 characters) and advances `state`. Special tokens add
  // nothing when `skip_special_tokens`. Decoding a sequence this way and repairing the
  // bytes as UTF-8 (unicode::AppendLossy) gives Decode's text.
  virtual Status AppendPiece(int32_t id, bool skip_special_tokens, DecodeState& state,
                             std::string& bytes) const;
  // Whether `id` is a special (control) token: BOS, EOS, chat markers.
  virtual bool IsSpecial(int32_t id) const { return id == bos() || id == eos(); }
  // The id of a token written as in the vocabulary (e.g. "<|im_end|>"), if there is one.
  virtual std::optional<int32_t> TokenId(std::string_view token) const;
  // The tokens that end a generation by default (EOS, and e.g. a chat model's end of turn).
  virtual std::vector<int32_t> StopTokens() const { return {eos()}; }
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
