// Decoding a token stream as it is generated: each call returns the text the new token
// completes, never part of a UTF-8 sequence, so that streamed chunks concatenate to exactly
// the text Decode gives for the whole sequence.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"
#include "tokenizer/tokenizer.h"

namespace flywheel::tokenizer {

class IncrementalDecoder {
 public:
  // `after_prompt`: the tokens continue a text (a generation after its prompt), so the first
  // one is not the start of the text (SentencePiece decoders keep its leading space, as
  // vLLM's answers do).
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true,
                              bool after_prompt = false)
      : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {
    if (after_prompt) state_.pieces = 1, state_.strip_left = 0;
  }

  // Adds a token; returns the text that is now complete (possibly empty: the token ended
  // inside a character, or it is a skipped special token).
  Result<std::string> Add(int32_t id);
  // What is left: an unfinished character at the end becomes U+FFFD.
  std::string Finish();
  // All text returned so far.
  const std::string& text() const { return text_; }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  DecodeState state_;
  std::string pending_;  // bytes of a character not yet complete
  std::string text_;
};

}  // namespace flywheel::tokenizer
