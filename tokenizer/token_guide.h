// Structured outputs at the token level: a grammar (tokenizer/grammar.h) over a
// vocabulary. At each grammar state the guide gives the tokens whose bytes keep the output
// inside the grammar (computed once per state, from the vocabulary sorted by bytes so that
// tokens sharing a prefix share its walk, and cached), and advances the state by the token
// sampled. The rollout engine masks the sampling distribution with it (rollout/engine.h,
// SamplingParams::guide).
//
// A token is allowed at a state when every prefix of its bytes continues some word of the
// grammar (regex grammars never enter a state they cannot finish from); special tokens
// (BOS, EOS, chat markers) are never allowed by the grammar itself: the engine allows the
// request's stop tokens once the state is accepting.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "tokenizer/grammar.h"
#include "tokenizer/tokenizer.h"

namespace flywheel::tokenizer {

// Every token's bytes as it adds them mid-text (special tokens: none), sorted for the walk.
class TokenBytes {
 public:
  static Result<std::shared_ptr<const TokenBytes>> FromTokenizer(const Tokenizer& tokenizer);
  // Token i is `pieces[i]`; an empty piece is never allowed (special tokens).
  static std::shared_ptr<const TokenBytes> FromPieces(std::vector<std::string> pieces);

  int64_t size() const { return static_cast<int64_t>(pieces_.size()); }
  const std::string& piece(int32_t token) const { return pieces_[token]; }
  // Token ids with non-empty pieces in byte order, and each one's common prefix length with
  // the one before it.
  const std::vector<int32_t>& order() const { return order_; }
  const std::vector<uint16_t>& shared() const { return shared_; }

 private:
  std::vector<std::string> pieces_;
  std::vector<int32_t> order_;
  std::vector<uint16_t> shared_;
};

// The tokens a grammar state allows, one bit each.
struct TokenMask {
  std::vector<uint64_t> bits;
  int64_t allowed = 0;     // how many bits are set
  bool accepting = false;  // the text so far is a whole word: the request may stop here
  bool Allows(int64_t token) const {
    return token >= 0 && token < static_cast<int64_t>(bits.size()) * 64 &&
           ((bits[static_cast<size_t>(token) >> 6] >> (token & 63)) & 1);
  }
};

// Thread-safe; shared by every request with the same grammar.
class TokenGuide {
 public:
  // `grammar` is owned; `what` names it in messages. InvalidArgument when the vocabulary
  // cannot write any first token of it.
  static Result<std::shared_ptr<TokenGuide>> Create(std::unique_ptr<ByteGrammar> grammar,
                                                    std::shared_ptr<const TokenBytes> vocabulary);

  static constexpr int32_t kStart = 0;
  // The mask at `state` (a state this guide returned; any other allows nothing).
  std::shared_ptr<const TokenMask> Allowed(int32_t state);
  // The state after `token` at `state`; -1 when the token is not allowed there.
  int32_t Advance(int32_t state, int32_t token);
  std::string Describe() const { return description_; }
  int64_t vocab_size() const { return vocabulary_->size(); }
  // Masks computed since creation (the rest came from the cache).
  int64_t masks_computed() const;

 private:
  TokenGuide(std::unique_ptr<ByteGrammar> grammar, std::shared_ptr<const TokenBytes> vocabulary);
  int32_t Intern(const std::string& state);  // REQUIRES: mutex_
  std::shared_ptr<const TokenMask> Compute(const std::string& state);  // REQUIRES: mutex_

  mutable std::mutex mutex_;
  std::unique_ptr<ByteGrammar> grammar_;
  std::shared_ptr<const TokenBytes> vocabulary_;
  std::string description_;
  std::map<std::string, int32_t> ids_;
  std::vector<std::string> states_;
  std::vector<std::shared_ptr<const TokenMask>> masks_;  // by state; null: not computed
  int64_t cached_masks_ = 0, masks_computed_ = 0;
  std::map<std::pair<int32_t, int32_t>, int32_t> advanced_;  // (state, token) -> state
};

}  // namespace flywheel::tokenizer
