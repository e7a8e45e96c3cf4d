#include "tokenizer/token_guide.h"

#include <algorithm>
#include <numeric>

namespace flywheel::tokenizer {
namespace {

// Cached masks per guide, in bytes (beyond it the cache starts again empty).
constexpr int64_t kMaskCacheBytes = int64_t{16} << 20;
constexpr size_t kMaxAdvanceCache = 1 << 20;

}  // namespace

Result<std::shared_ptr<const TokenBytes>> TokenBytes::FromTokenizer(const Tokenizer& tokenizer) {
  std::vector<std::string> pieces(static_cast<size_t>(tokenizer.vocab_size()));
  for (int32_t id = 0; id < static_cast<int32_t>(pieces.size()); ++id) {
    if (tokenizer.IsSpecial(id)) continue;
    // Mid-text: not the first piece, so no leading-space stripping.
    DecodeState state{.pieces = 1, .strip_left = 0};
    std::string bytes;
    if (tokenizer.AppendPiece(id, false, state, bytes).ok()) pieces[id] = std::move(bytes);
  }
  return FromPieces(std::move(pieces));
}

std::shared_ptr<const TokenBytes> TokenBytes::FromPieces(std::vector<std::string> pieces) {
  auto out = std::make_shared<TokenBytes>();
  out->pieces_ = std::move(pieces);
  for (int32_t id = 0; id < static_cast<int32_t>(out->pieces_.size()); ++id) {
    if (!out->pieces_[id].empty()) out->order_.push_back(id);
  }
  const auto& p = out->pieces_;
  std::sort(out->order_.begin(), out->order_.end(), [&](int32_t a, int32_t b) { return p[a] < p[b]; });
  out->shared_.resize(out->order_.size(), 0);
  for (size_t i = 1; i < out->order_.size(); ++i) {
    const std::string& a = p[out->order_[i - 1]];
    const std::string& b = p[out->order_[i]];
    size_t n = 0;
    while (n < a.size() && n < b.size() && a[n] == b[n] && n < 65535) ++n;
    out->shared_[i] = static_cast<uint16_t>(n);
  }
  return out;
}

TokenGuide::TokenGuide(std::unique_ptr<ByteGrammar> grammar, std::shared_ptr<const TokenBytes> vocabulary)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)), description_(grammar_->Describe()) {}

Result<std::shared_ptr<TokenGuide>> TokenGuide::Create(std::unique_ptr<ByteGrammar> grammar,
                                                       std::shared_ptr<const TokenBytes> vocabulary) {
  std::shared_ptr<TokenGuide> guide(new TokenGuide(std::move(grammar), std::move(vocabulary)));
  {
    std::lock_guard lock(guide->mutex_);
    guide->Intern(guide->grammar_->Start());
  }
  const std::shared_ptr<const TokenMask> first = guide->Allowed(kStart);
  if (first->allowed == 0 && !first->accepting) {
    return Status::InvalidArgument("this model's vocabulary has no token that can begin " + guide->Describe());
  }
  return guide;
}

int32_t TokenGuide::Intern(const std::string& state) {
  auto [it, fresh] = ids_.try_emplace(state, static_cast<int32_t>(states_.size()));
  if (fresh) {
    states_.push_back(state);
    masks_.emplace_back();
  }
  return it->second;
}

std::shared_ptr<const TokenMask> TokenGuide::Compute(const std::string& state) {
  auto mask = std::make_shared<TokenMask>();
  mask->bits.assign(static_cast<size_t>((vocabulary_->size() + 63) / 64), 0);
  mask->accepting = grammar_->Accepting(state);
  const std::vector<int32_t>& order = vocabulary_->order();
  const std::vector<uint16_t>& shared = vocabulary_->shared();
  // stack[d]: the state after the current token's first d bytes.
  std::vector<std::string> stack = {state};
  int64_t failed_at = -1;  // the byte of the last token that left the grammar
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t common = shared[i];
    // Shares the bytes up to the failing one with the token before: fails there too.
    if (failed_at >= 0 && common > failed_at) continue;
    failed_at = -1;
    const std::string& piece = vocabulary_->piece(order[i]);
    stack.resize(static_cast<size_t>(common) + 1);
    for (size_t d = static_cast<size_t>(common); d < piece.size(); ++d) {
      std::string next = stack[d];
      if (!grammar_->Step(next, static_cast<uint8_t>(piece[d]))) {
        failed_at = static_cast<int64_t>(d);
        break;
      }
      stack.push_back(std::move(next));
    }
    if (failed_at < 0) {
      mask->bits[static_cast<size_t>(order[i]) >> 6] |= uint64_t{1} << (order[i] & 63);
      ++mask->allowed;
    }
  }
  ++masks_computed_;
  return mask;
}

std::shared_ptr<const TokenMask> TokenGuide::Allowed(int32_t state) {
  std::lock_guard lock(mutex_);
  if (state < 0 || static_cast<size_t>(state) >= masks_.size()) {  // not a state of this guide: nothing
    static const auto kNothing = std::make_shared<const TokenMask>();
    return kNothing;
  }
  std::shared_ptr<const TokenMask>& slot = masks_.at(static_cast<size_t>(state));
  if (slot) return slot;
  const int64_t mask_bytes = std::max<int64_t>(8, (vocabulary_->size() + 7) / 8);
  if (cached_masks_ * mask_bytes >= kMaskCacheBytes) {
    for (auto& m : masks_) m.reset();
    cached_masks_ = 0;
  }
  std::shared_ptr<const TokenMask> mask = Compute(states_[static_cast<size_t>(state)]);
  masks_[static_cast<size_t>(state)] = mask;
  ++cached_masks_;
  return mask;
}

int32_t TokenGuide::Advance(int32_t state, int32_t token) {
  std::lock_guard lock(mutex_);
  if (token < 0 || token >= vocabulary_->size() || vocabulary_->piece(token).empty()) return -1;
  if (auto it = advanced_.find({state, token}); it != advanced_.end()) return it->second;
  std::string s = states_.at(static_cast<size_t>(state));
  for (char c : vocabulary_->piece(token)) {
    if (!grammar_->Step(s, static_cast<uint8_t>(c))) return -1;
  }
  if (advanced_.size() >= kMaxAdvanceCache) advanced_.clear();
  const int32_t next = Intern(s);
  advanced_[{state, token}] = next;
  return next;
}

int64_t TokenGuide::masks_computed() const {
  std::lock_guard lock(mutex_);
  return masks_computed_;
}

}  // namespace flywheel::tokenizer
