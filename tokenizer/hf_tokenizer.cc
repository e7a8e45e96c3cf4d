#include "tokenizer/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "base/env.h"
#include "tokenizer/unicode.h"

namespace flywheel::tokenizer {

namespace {

using nlohmann::json;

constexpr uint32_t kNoRank = UINT32_MAX;
const std::string kEmpty;

// GPT-2's byte <-> character table: printable bytes stand for themselves, the others for
// U+0100 upwards, so that every byte is a visible character of the vocabulary.
std::array<char32_t, 256> ByteToChar() {
  std::array<char32_t, 256> table{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = direct[b] ? static_cast<char32_t>(b) : next++;
  return table;
}

// --- the split patterns ---------------------------------------------------------------

enum class SplitPattern {
  kQwen2,   // digits one at a time
  kLlama3,  // digits up to three at a time (OpenAI's cl100k pattern)
  kGpt2,
};

const char* PatternName(SplitPattern p) {
  switch (p) {
    case SplitPattern::kQwen2:
      return "qwen2";
    case SplitPattern::kLlama3:
      return "llama3";
    case SplitPattern::kGpt2:
      return "gpt2";
  }
  return "?";
}

constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Text as code points with their classes, for the matchers.
struct CodePoints {
  std::vector<char32_t> cp;
  std::vector<uint8_t> cls;
  std::vector<uint32_t> offset;  // byte offset of each code point; offset[n] = size

  void Assign(std::string_view s) {
    cp.clear(), cls.clear(), offset.clear();
    for (size_t i = 0; i < s.size();) {
      size_t len;
      bool valid;
      const char32_t c = unicode::DecodeAt(s, i, len, valid);
      cp.push_back(c);
      cls.push_back(valid ? unicode::ClassOf(c) : 0);
      offset.push_back(static_cast<uint32_t>(i));
      i += len;
    }
    offset.push_back(static_cast<uint32_t>(s.size()));
  }
  size_t size() const { return cp.size(); }
  bool L(size_t i) const { return cls[i] & unicode::kLetter; }
  bool N(size_t i) const { return cls[i] & unicode::kNumber; }
  bool S(size_t i) const { return cls[i] & unicode::kSpace; }
  bool Other(size_t i) const { return (cls[i] & 7) == 0; }  // [^\s\p{L}\p{N}]
};

// (?i:'s|'t|'re|'ve|'m|'ll|'d) (or the case-sensitive one) at i: the match's length, or 0.
size_t MatchContraction(const CodePoints& t, size_t i, bool fold) {
  if (t.cp[i] != U'\'' || i + 1 >= t.size()) return 0;
  auto is = [&](size_t k, char c) {
    if (k >= t.size()) return false;
    const char32_t v = t.cp[k];
    if (v == static_cast<char32_t>(c)) return true;
    if (!fold) return false;
    if (v == static_cast<char32_t>(c - 'a' + 'A')) return true;
    return c == 's' && v == 0x017F;  // LATIN SMALL LETTER LONG S folds to s
  };
  if (is(i + 1, 's') || is(i + 1, 't') || is(i + 1, 'm') || is(i + 1, 'd')) return 2;
  if ((is(i + 1, 'r') && is(i + 2, 'e')) || (is(i + 1, 'v') && is(i + 2, 'e')) ||
      (is(i + 1, 'l') && is(i + 2, 'l')))
    return 3;
  return 0;
}

// The end of the regex's match at i (leftmost-first alternation, as a backtracking engine
// finds it). Every code point is matched by some alternative, so the matches tile the text.
size_t MatchAt(const CodePoints& t, size_t i, SplitPattern pattern) {
  const size_t n = t.size();
  auto space_run_end = [&](size_t k) {
    while (k < n && t.S(k)) ++k;
    return k;
  };
  auto newline = [&](size_t k) { return t.cp[k] == U'\r' || t.cp[k] == U'\n'; };
  if (pattern == SplitPattern::kGpt2) {
    if (size_t m = MatchContraction(t, i, false)) return i + m;
    const size_t j = (t.cp[i] == U' ' && i + 1 < n) ? i + 1 : i;
    if (t.L(j)) {
      size_t k = j;
      while (k < n && t.L(k)) ++k;
      return k;
    }
    if (t.N(j)) {
      size_t k = j;
      while (k < n && t.N(k)) ++k;
      return k;
    }
    if (t.Other(j)) {
      size_t k = j;
      while (k < n && t.Other(k)) ++k;
      return k;
    }
  } else {
    if (size_t m = MatchContraction(t, i, true)) return i + m;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (t.L(i)) {
      size_t k = i;
      while (k < n && t.L(k)) ++k;
      return k;
    }
    if (!newline(i) && !t.N(i) && i + 1 < n && t.L(i + 1)) {
      size_t k = i + 1;
      while (k < n && t.L(k)) ++k;
      return k;
    }
    // \p{N}{1,K}
    if (t.N(i)) {
      const size_t most = pattern == SplitPattern::kLlama3 ? 3 : 1;
      size_t k = i;
      while (k < n && k - i < most && t.N(k)) ++k;
      return k;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    const size_t j = (t.cp[i] == U' ' && i + 1 < n && t.Other(i + 1)) ? i + 1 : i;
    if (t.Other(j)) {
      size_t k = j;
      while (k < n && t.Other(k)) ++k;
      while (k < n && newline(k)) ++k;
      return k;
    }
    // \s*[\r\n]+ : the whitespace run up to and including its last line break
    if (t.S(i)) {
      const size_t end = space_run_end(i);
      for (size_t k = end; k > i; --k) {
        if (newline(k - 1)) return k;
      }
    }
  }
  // \s+(?!\S) then \s+
  if (t.S(i)) {
    const size_t end = space_run_end(i);
    if (end == n) return end;
    if (end - i >= 2) return end - 1;
    return end;
  }
  return i + 1;  // not reached for these patterns: a lone code point
}

// --- pipeline stages ------------------------------------------------------------------

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext };

struct NormalizerStep {
  enum Kind { kForm, kPrepend, kReplace } kind = kForm;
  unicode::NormalForm form = unicode::NormalForm::kNFC;
  std::string a, b;
};

struct PreTokenizerStep {
  enum Kind { kRegexSplit, kStringSplit, kByteLevel, kMetaspace, kDigits } kind = kByteLevel;
  SplitPattern pattern = SplitPattern::kGpt2;
  std::string text;  // the literal of a string split; the Metaspace replacement
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = false;         // ByteLevel
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;  // Metaspace
  bool split = true;                                           // Metaspace
  bool individual_digits = false;                              // Digits
};

struct DecoderStep {
  enum Kind { kByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip } kind = kByteLevel;
  std::string a, b;   // Replace: pattern, content; Metaspace: replacement; Strip: content
  bool prepend = true;  // Metaspace: strip the first token's leading space
  int64_t start = 0, stop = 0;  // Strip
};

// A piece of text going through the pre-tokenizers.
struct Piece {
  std::string text;
  bool at_origin = false;  // starts at offset 0 of the original text (Metaspace "first")
};

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// Leftmost-longest matching of a set of literals in a text.
struct AddedMatcher {
  std::vector<const AddedToken*> tokens;  // longest first
  std::array<bool, 256> first{};

  void Build(std::vector<const AddedToken*> list) {
    tokens = std::move(list);
    std::stable_sort(tokens.begin(), tokens.end(), [](const AddedToken* x, const AddedToken* y) {
      return x->content.size() > y->content.size();
    });
    for (const AddedToken* t : tokens) first[static_cast<unsigned char>(t->content[0])] = true;
  }
  bool empty() const { return tokens.empty(); }
};

bool IsWordChar(std::string_view s, size_t at_byte, bool before) {
  // The code point just before or at `at_byte`.
  if (before) {
    if (at_byte == 0) return false;
    size_t k = at_byte - 1;
    while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    size_t len;
    bool valid;
    const char32_t c = unicode::DecodeAt(s, k, len, valid);
    return c == U'_' || (unicode::ClassOf(c) & (unicode::kLetter | unicode::kNumber));
  }
  if (at_byte >= s.size()) return false;
  size_t len;
  bool valid;
  const char32_t c = unicode::DecodeAt(s, at_byte, len, valid);
  return c == U'_' || (unicode::ClassOf(c) & (unicode::kLetter | unicode::kNumber));
}

struct Segment {
  std::string_view text;
  const AddedToken* token = nullptr;  // a matched added token (text is then its match)
  size_t offset = 0;                  // in the text it came from
};

// Splits `text` on the matcher's tokens, with lstrip/rstrip/single_word as HF applies them.
void SplitAdded(std::string_view text, const AddedMatcher& m, std::vector<Segment>& out,
                size_t base_offset) {
  size_t start = 0;  // of the text not yet emitted
  size_t i = 0;
  while (i < text.size()) {
    if (!m.first[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const AddedToken* hit = nullptr;
    for (const AddedToken* t : m.tokens) {
      if (text.compare(i, t->content.size(), t->content) != 0) continue;
      hit = t;  // the longest match here; a single_word one inside a word is no match at all
      if (t->single_word && (IsWordChar(text, i, true) ||
                             IsWordChar(text, i + t->content.size(), false)))
        hit = nullptr;
      break;
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    // lstrip / rstrip take the (Unicode) whitespace next to the token with it.
    if (hit->lstrip) {
      while (begin > start) {
        size_t k = begin - 1;
        while (k > start && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
        size_t len;
        bool valid;
        const char32_t c = unicode::DecodeAt(text, k, len, valid);
        if (!valid || k + len != begin || !(unicode::ClassOf(c) & unicode::kSpace)) break;
        begin = k;
      }
    }
    if (hit->rstrip) {
      while (end < text.size()) {
        size_t len;
        bool valid;
        const char32_t c = unicode::DecodeAt(text, end, len, valid);
        if (!valid || !(unicode::ClassOf(c) & unicode::kSpace)) break;
        end += len;
      }
    }
    if (begin > start) out.push_back({text.substr(start, begin - start), nullptr, base_offset + start});
    out.push_back({text.substr(begin, end - begin), hit, base_offset + begin});
    start = i = end;
  }
  if (start < text.size()) out.push_back({text.substr(start), nullptr, base_offset + start});
}

// An open-addressing map from a token pair to its merge (rank and merged token).
class MergeTable {
 public:
  void Reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmptyKey);
    values_.assign(cap, {});
    mask_ = cap - 1;
  }
  // false when the pair is already there (the first merge of a pair wins).
  bool Insert(int32_t a, int32_t b, uint32_t rank, int32_t merged) {
    const uint64_t key = Key(a, b);
    for (size_t i = Hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == kEmptyKey) {
        keys_[i] = key;
        values_[i] = {rank, merged};
        return true;
      }
      if (keys_[i] == key) return false;
    }
  }
  // The rank (kNoRank when the pair does not merge) and the merged token.
  std::pair<uint32_t, int32_t> Find(int32_t a, int32_t b) const {
    const uint64_t key = Key(a, b);
    for (size_t i = Hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return values_[i];
      if (keys_[i] == kEmptyKey) return {kNoRank, -1};
    }
  }

 private:
  static constexpr uint64_t kEmptyKey = UINT64_MAX;
  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  static size_t Hash(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
  std::vector<uint64_t> keys_;
  std::vector<std::pair<uint32_t, int32_t>> values_;
  size_t mask_ = 0;
};

Result<json> ParseJson(std::string_view text, const std::string& what) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(what + " is not valid JSON");
  return j;
}

// A JSON field that must be a string when present.
Result<std::string> StringField(const json& j, const char* key, const std::string& where,
                                const std::string& fallback = {}) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string())
    return Status::InvalidArgument(where + "." + key + " must be a string, got " + it->dump());
  return it->get<std::string>();
}

Result<bool> BoolField(const json& j, const char* key, const std::string& where, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return Status::InvalidArgument(where + "." + key + " must be true or false, got " + it->dump());
  return it->get<bool>();
}

// tokenizer_config.json writes special tokens as strings or as {"content": ...}.
std::string TokenContent(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return {};
}

// A whole file through the Env (base/env.h), as text.
Result<std::string> ReadText(const std::string& path) {
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, Env::Default()->ReadFile(path));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Every occurrence of `from` (non-empty) in `s` replaced by `to`.
std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  size_t begin = 0;
  for (size_t at; (at = s.find(from, begin)) != std::string::npos; begin = at + from.size())
    out.append(s, begin, at - begin).append(to);
  out.append(s, begin);
  return out;
}

// A byte-level token's bytes: each character mapped back to its byte; nullopt when one is
// not a byte character (the tokenizers library then keeps the token's text as it is).
std::optional<std::string> ByteLevelBytes(const std::string& token,
                                          const std::unordered_map<char32_t, uint8_t>& char_to_byte) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    size_t len;
    bool valid;
    const char32_t c = unicode::DecodeAt(token, i, len, valid);
    auto it = char_to_byte.find(c);
    if (!valid || it == char_to_byte.end()) return std::nullopt;
    out.push_back(static_cast<char>(it->second));
    i += len;
  }
  return out;
}

// A tokenizer.json component: null (none), a Sequence of components under `list_key` (each
// handed to `load`), or one component. Returns its type; empty when there is nothing more
// to load (null, or a Sequence loaded).
template <typename Load>
Result<std::string> ComponentType(const json& j, const std::string& where, const char* list_key,
                                  Load&& load) {
  if (j.is_null()) return std::string();
  if (!j.is_object()) return Status::InvalidArgument("tokenizer.json: " + where + " must be an object");
  FW_ASSIGN_OR_RETURN(std::string type, StringField(j, "type", where));
  if (type == "Sequence") {
    auto list = j.find(list_key);
    if (list == j.end() || !list->is_array())
      return Status::InvalidArgument("tokenizer.json: " + where + "." + list_key + " must be a list");
    for (size_t i = 0; i < list->size(); ++i)
      FW_RETURN_IF_ERROR(load((*list)[i], where + "[" + std::to_string(i) + "]"));
    return std::string();
  }
  if (type.empty()) return Status::InvalidArgument("tokenizer.json: " + where + " has no type");
  return type;
}

// One entry of model.merges: "a b" or ["a", "b"].
Result<std::pair<std::string, std::string>> MergePair(const json& merge, uint32_t rank) {
  if (merge.is_string()) {
    const std::string s = merge.get<std::string>();
    const size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
      return Status::InvalidArgument("tokenizer.json: merge " + std::to_string(rank) + " '" + s +
                                     "' is not two tokens separated by one space");
    return std::pair{s.substr(0, space), s.substr(space + 1)};
  }
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string())
    return std::pair{merge[0].get<std::string>(), merge[1].get<std::string>()};
  return Status::InvalidArgument("tokenizer.json: merge " + std::to_string(rank) + " " +
                                 merge.dump() + " is neither \"a b\" nor [\"a\", \"b\"]");
}

// --- reading pre-tokenizer steps --------------------------------------------------------

// A Split pre-tokenizer: a regex flywheel knows (behavior Isolated) or a literal string.
Status LoadSplitStep(const json& j, const std::string& where, PreTokenizerStep& step) {
  FW_ASSIGN_OR_RETURN(bool invert, BoolField(j, "invert", where, false));
  if (invert)
    return Status::InvalidArgument("tokenizer.json: " + where + ": Split with invert is not supported");
  FW_ASSIGN_OR_RETURN(std::string behavior, StringField(j, "behavior", where, "Isolated"));
  if (behavior == "Isolated") {
    step.behavior = SplitBehavior::kIsolated;
  } else if (behavior == "Removed") {
    step.behavior = SplitBehavior::kRemoved;
  } else if (behavior == "MergedWithPrevious") {
    step.behavior = SplitBehavior::kMergedWithPrevious;
  } else if (behavior == "MergedWithNext") {
    step.behavior = SplitBehavior::kMergedWithNext;
  } else {
    return Status::InvalidArgument("tokenizer.json: " + where + ": Split behavior '" + behavior +
                                   "' is not supported");
  }
  auto p = j.find("pattern");
  if (p != j.end() && p->is_object() && p->contains("Regex") && (*p)["Regex"].is_string()) {
    const std::string regex = (*p)["Regex"].get<std::string>();
    step.kind = PreTokenizerStep::kRegexSplit;
    if (regex == kQwen2Regex) {
      step.pattern = SplitPattern::kQwen2;
    } else if (regex == kLlama3Regex) {
      step.pattern = SplitPattern::kLlama3;
    } else if (regex == kGpt2Regex) {
      step.pattern = SplitPattern::kGpt2;
    } else {
      return Status::InvalidArgument(
          "tokenizer.json: " + where + ": the split regex " + json(regex).dump() +
          " is not one flywheel knows (it runs Qwen2/Qwen3's, Llama-3's and GPT-2's patterns)");
    }
    if (step.behavior != SplitBehavior::kIsolated)
      return Status::InvalidArgument("tokenizer.json: " + where +
                                     ": a regex Split must have behavior Isolated");
  } else if (p != j.end() && p->is_object() && p->contains("String") &&
             (*p)["String"].is_string() && !(*p)["String"].get<std::string>().empty()) {
    step.kind = PreTokenizerStep::kStringSplit;
    step.text = (*p)["String"].get<std::string>();
  } else {
    return Status::InvalidArgument("tokenizer.json: " + where +
                                   ": Split needs a pattern {\"Regex\": ...} or {\"String\": ...}");
  }
  return Status::Ok();
}

// A Metaspace pre-tokenizer: the replacement, split, and prepend_scheme (or the older
// add_prefix_space).
Status LoadMetaspaceStep(const json& j, const std::string& where, PreTokenizerStep& step) {
  step.kind = PreTokenizerStep::kMetaspace;
  FW_ASSIGN_OR_RETURN(step.text, StringField(j, "replacement", where, "\xE2\x96\x81"));
  FW_ASSIGN_OR_RETURN(step.split, BoolField(j, "split", where, true));
  FW_ASSIGN_OR_RETURN(std::string scheme, StringField(j, "prepend_scheme", where));
  if (scheme.empty()) {
    FW_ASSIGN_OR_RETURN(bool add, BoolField(j, "add_prefix_space", where, true));
    step.prepend = add ? PreTokenizerStep::kAlways : PreTokenizerStep::kNever;
  } else if (scheme == "always") {
    step.prepend = PreTokenizerStep::kAlways;
  } else if (scheme == "first") {
    step.prepend = PreTokenizerStep::kFirst;
  } else if (scheme == "never") {
    step.prepend = PreTokenizerStep::kNever;
  } else {
    return Status::InvalidArgument("tokenizer.json: " + where + ": Metaspace prepend_scheme '" +
                                   scheme + "' is not always, first or never");
  }
  return Status::Ok();
}

// --- the pre-tokenizer steps: each splits (or rewrites) one piece, appending to `out` ------

// The matches of a split pattern, in order (they cover the whole piece).
void SplitByPattern(const Piece& p, SplitPattern pattern, CodePoints& cps, std::vector<Piece>& out) {
  cps.Assign(p.text);
  for (size_t i = 0; i < cps.size();) {
    const size_t end = MatchAt(cps, i, pattern);
    out.push_back({p.text.substr(cps.offset[i], cps.offset[end] - cps.offset[i]), p.at_origin && i == 0});
    i = end;
  }
}

// Split on a literal string, with the tokenizers library's SplitDelimiterBehavior.
void SplitByString(const Piece& p, const PreTokenizerStep& step, std::vector<Piece>& out) {
  std::vector<std::pair<size_t, size_t>> parts;  // [begin, end) of text and matches, alternating
  size_t from = 0;
  for (size_t at; (at = p.text.find(step.text, from)) != std::string::npos; from = at + step.text.size()) {
    parts.push_back({from, at});
    parts.push_back({at, at + step.text.size()});
  }
  parts.push_back({from, p.text.size()});
  std::string carry;
  for (size_t k = 0; k < parts.size(); ++k) {
    const bool match = k % 2 == 1;
    std::string s = p.text.substr(parts[k].first, parts[k].second - parts[k].first);
    switch (step.behavior) {
      case SplitBehavior::kIsolated:
        if (!s.empty()) out.push_back({std::move(s), p.at_origin && parts[k].first == 0});
        break;
      case SplitBehavior::kRemoved:
        if (!match && !s.empty()) out.push_back({std::move(s), p.at_origin && parts[k].first == 0});
        break;
      case SplitBehavior::kMergedWithPrevious:
        carry += s;
        if (match || k + 1 == parts.size()) {
          if (!carry.empty()) out.push_back({std::move(carry), false});
          carry.clear();
        }
        break;
      case SplitBehavior::kMergedWithNext:
        if (match && !carry.empty()) {
          out.push_back({std::move(carry), false});
          carry.clear();
        }
        carry += s;
        if (k + 1 == parts.size() && !carry.empty()) out.push_back({std::move(carry), false});
        break;
    }
  }
}

// Metaspace: spaces become the replacement, prepended per the scheme; with `split`, each piece
// starts at a replacement (MergedWithNext).
void ApplyMetaspace(const Piece& p, const PreTokenizerStep& step, std::vector<Piece>& out) {
  std::string s;
  s.reserve(p.text.size() + 3);
  for (char c : p.text) {
    if (c == ' ')
      s += step.text;
    else
      s.push_back(c);
  }
  const bool prepend = step.prepend == PreTokenizerStep::kAlways ||
                       (step.prepend == PreTokenizerStep::kFirst && p.at_origin);
  if (prepend && s.compare(0, step.text.size(), step.text) != 0) s.insert(0, step.text);
  if (!step.split) {
    out.push_back({std::move(s), p.at_origin});
    return;
  }
  size_t begin = 0;
  for (size_t at = s.find(step.text, 1); at != std::string::npos; at = s.find(step.text, at + step.text.size())) {
    if (at > begin) out.push_back({s.substr(begin, at - begin), p.at_origin && begin == 0});
    begin = at;
  }
  out.push_back({s.substr(begin), p.at_origin && begin == 0});
}

// Digits: runs of numeric code points (Rust's char::is_numeric: Nd, Nl, No), as the library
// splits them; each digit alone with `individual_digits`.
void SplitDigits(const Piece& p, const PreTokenizerStep& step, std::vector<Piece>& out) {
  size_t begin = 0, i = 0;
  auto digit_length = [&](size_t k) -> size_t {
    size_t len;
    bool valid;
    const char32_t c = unicode::DecodeAt(p.text, k, len, valid);
    return valid && (unicode::ClassOf(c) & unicode::kNumber) ? len : 0;
  };
  while (i < p.text.size()) {
    size_t len = digit_length(i);
    if (len == 0) {
      ++i;
      continue;
    }
    if (i > begin) out.push_back({p.text.substr(begin, i - begin), p.at_origin && begin == 0});
    size_t j = i + len;
    if (!step.individual_digits)
      while (j < p.text.size() && (len = digit_length(j)) > 0) j += len;
    out.push_back({p.text.substr(i, j - i), p.at_origin && i == 0});
    begin = i = j;
  }
  if (begin < p.text.size()) out.push_back({p.text.substr(begin), p.at_origin && begin == 0});
}


}  // namespace

struct HfTokenizer::Impl {
  // The model.
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // by id; added tokens included
  MergeTable merges;
  bool ignore_merges = false;
  bool byte_fallback = false;
  bool fuse_unk = false;
  int32_t unk = -1;
  std::array<int32_t, 256> byte_fallback_ids{};  // <0xXX>
  // Byte-level: bytes are the model's symbols.
  bool byte_level = false;
  std::array<int32_t, 256> byte_ids{};
  std::array<char32_t, 256> byte_to_char = ByteToChar();
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  std::vector<std::string> decoded_bytes;  // byte-level: each token's bytes, by id

  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  std::vector<int32_t> prefix_ids, suffix_ids;  // the post-processor's

  std::vector<AddedToken> added;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  std::unordered_map<std::string, int32_t> added_by_content;
  AddedMatcher raw_matcher, normalized_matcher;

  std::string bos_token, eos_token, chat_template;
  int32_t bos = -1, eos = -1;
  int64_t model_max_length = 0;
  std::vector<int32_t> stop_tokens;
  int64_t vocab_size = 0;
  std::string description;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;
  static constexpr size_t kCacheEntries = 1 << 16;
  static constexpr size_t kCacheWordBytes = 128;

  Status LoadModel(const json& model);
  Status LoadVocab(const json& model);
  Status LoadMerges(const json& model);
  Status LoadNormalizer(const json& j, const std::string& where);
  Status LoadPreTokenizer(const json& j, const std::string& where);
  Status LoadDecoder(const json& j, const std::string& where);
  Status LoadPostProcessor(const json& j, const std::string& where);
  Status LoadAdded(const json& list);
  Result<int32_t> SpecialId(const std::string& content, const std::string& where) const;
  Status BuildByteTables();
  Status LoadConfig(std::string_view config_json);
  Status LoadGenerationConfig(std::string_view generation_json);
  void Describe();

  Result<std::string> Normalized(std::string_view text) const;
  void PreTokenize(std::string text, bool at_origin, std::vector<Piece>& out) const;
  void EncodeWord(std::string_view word, std::vector<int32_t>& ids) const;
  void Merge(std::vector<int32_t>& symbols) const;
  Status EncodeText(std::string_view text, std::vector<int32_t>& ids) const;
  Status AppendPiece(int32_t id, bool skip_special, DecodeState& state, std::string& bytes) const;
};

// --- loading --------------------------------------------------------------------------

Status HfTokenizer::Impl::LoadModel(const json& model) {
  if (!model.is_object()) return Status::InvalidArgument("tokenizer.json: 'model' is missing");
  FW_ASSIGN_OR_RETURN(std::string type, StringField(model, "type", "model"));
  if (type.empty() && model.contains("merges")) type = "BPE";
  if (type != "BPE")
    return Status::InvalidArgument("tokenizer.json: model type '" + type +
                                   "' is not supported (flywheel reads BPE models)");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    return Status::InvalidArgument("tokenizer.json: BPE dropout " + model["dropout"].dump() +
                                   " is not supported (it is for training, not serving)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    FW_ASSIGN_OR_RETURN(std::string v, StringField(model, key, "model"));
    if (!v.empty())
      return Status::InvalidArgument(std::string("tokenizer.json: model.") + key + " '" + v +
                                     "' is not supported");
  }
  FW_ASSIGN_OR_RETURN(ignore_merges, BoolField(model, "ignore_merges", "model", false));
  FW_ASSIGN_OR_RETURN(byte_fallback, BoolField(model, "byte_fallback", "model", false));
  FW_ASSIGN_OR_RETURN(fuse_unk, BoolField(model, "fuse_unk", "model", false));
  FW_RETURN_IF_ERROR(LoadVocab(model));
  FW_ASSIGN_OR_RETURN(std::string unk_token, StringField(model, "unk_token", "model"));
  if (!unk_token.empty()) {
    auto u = vocab.find(unk_token);
    if (u == vocab.end())
      return Status::InvalidArgument("tokenizer.json: unk_token '" + unk_token +
                                     "' is not in the vocabulary");
    unk = u->second;
  }
  FW_RETURN_IF_ERROR(LoadMerges(model));
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      auto it = vocab.find(name);
      byte_fallback_ids[b] = it == vocab.end() ? -1 : it->second;
    }
  }
  return Status::Ok();
}

// model.vocab: token -> id, ids in [0, 2^24), each id once.
Status HfTokenizer::Impl::LoadVocab(const json& model) {
  auto v = model.find("vocab");
  if (v == model.end() || !v->is_object())
    return Status::InvalidArgument("tokenizer.json: model.vocab must be an object of token -> id");
  vocab.reserve(v->size());
  for (auto it = v->begin(); it != v->end(); ++it) {
    if (!it.value().is_number_integer())
      return Status::InvalidArgument("tokenizer.json: vocab entry '" + it.key() +
                                     "' has a non-integer id " + it.value().dump());
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= (1 << 24))
      return Status::InvalidArgument("tokenizer.json: vocab entry '" + it.key() + "' has id " +
                                     std::to_string(id) + ", outside [0, 2^24)");
    if (static_cast<size_t>(id) >= id_to_token.size()) id_to_token.resize(id + 1);
    if (!id_to_token[id].empty())
      return Status::InvalidArgument("tokenizer.json: id " + std::to_string(id) +
                                     " is used by both '" + id_to_token[id] + "' and '" +
                                     it.key() + "'");
    id_to_token[id] = it.key();
    vocab.emplace(it.key(), static_cast<int32_t>(id));
  }
  return Status::Ok();
}

// model.merges, ranked in order: "a b" or ["a", "b"], a, b and ab all in the vocabulary.
Status HfTokenizer::Impl::LoadMerges(const json& model) {
  auto m = model.find("merges");
  if (m == model.end() || !m->is_array())
    return Status::InvalidArgument("tokenizer.json: model.merges must be a list");
  merges.Reserve(m->size());
  uint32_t rank = 0;
  for (const json& merge : *m) {
    FW_ASSIGN_OR_RETURN(auto pair, MergePair(merge, rank));
    const auto& [a, b] = pair;
    auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    for (auto [it, name] : {std::pair{ia, &a}, std::pair{ib, &b}}) {
      if (it == vocab.end())
        return Status::InvalidArgument("tokenizer.json: merge " + std::to_string(rank) + " ('" +
                                       a + "', '" + b + "') references '" + *name +
                                       "', which is not in the vocabulary");
    }
    if (im == vocab.end())
      return Status::InvalidArgument("tokenizer.json: merge " + std::to_string(rank) + " ('" + a +
                                     "', '" + b + "') makes '" + a + b +
                                     "', which is not in the vocabulary");
    merges.Insert(ia->second, ib->second, rank, im->second);
    ++rank;
  }
  return Status::Ok();
}

Status HfTokenizer::Impl::LoadNormalizer(const json& j, const std::string& where) {
  FW_ASSIGN_OR_RETURN(std::string type,
                      ComponentType(j, where, "normalizers", [this](const json& c, const std::string& w) {
                        return LoadNormalizer(c, w);
                      }));
  if (type.empty()) return Status::Ok();
  NormalizerStep step;
  if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD") {
    step.form = type == "NFC"    ? unicode::NormalForm::kNFC
                : type == "NFKC" ? unicode::NormalForm::kNFKC
                : type == "NFD"  ? unicode::NormalForm::kNFD
                                 : unicode::NormalForm::kNFKD;
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::kPrepend;
    FW_ASSIGN_OR_RETURN(step.a, StringField(j, "prepend", where));
  } else if (type == "Replace") {
    step.kind = NormalizerStep::kReplace;
    auto p = j.find("pattern");
    if (p == j.end() || !p->is_object() || !p->contains("String") || !(*p)["String"].is_string())
      return Status::InvalidArgument("tokenizer.json: " + where +
                                     ": Replace with a regex pattern is not supported (only "
                                     "{\"String\": ...} patterns)");
    step.a = (*p)["String"].get<std::string>();
    FW_ASSIGN_OR_RETURN(step.b, StringField(j, "content", where));
    if (step.a.empty())
      return Status::InvalidArgument("tokenizer.json: " + where + ": Replace of an empty string");
  } else {
    return Status::InvalidArgument("tokenizer.json: normalizer '" + type + "' (" + where +
                                   ") is not supported");
  }
  normalizer.push_back(std::move(step));
  return Status::Ok();
}

Status HfTokenizer::Impl::LoadPreTokenizer(const json& j, const std::string& where) {
  FW_ASSIGN_OR_RETURN(std::string type,
                      ComponentType(j, where, "pretokenizers", [this](const json& c, const std::string& w) {
                        return LoadPreTokenizer(c, w);
                      }));
  if (type.empty()) return Status::Ok();
  PreTokenizerStep step;
  if (type == "ByteLevel") {
    FW_ASSIGN_OR_RETURN(step.add_prefix_space, BoolField(j, "add_prefix_space", where, true));
    FW_ASSIGN_OR_RETURN(step.use_regex, BoolField(j, "use_regex", where, true));
    byte_level = true;
  } else if (type == "Split") {
    FW_RETURN_IF_ERROR(LoadSplitStep(j, where, step));
  } else if (type == "Metaspace") {
    FW_RETURN_IF_ERROR(LoadMetaspaceStep(j, where, step));
  } else if (type == "Digits") {
    step.kind = PreTokenizerStep::kDigits;
    FW_ASSIGN_OR_RETURN(step.individual_digits, BoolField(j, "individual_digits", where, false));
  } else {
    return Status::InvalidArgument("tokenizer.json: pre_tokenizer '" + type + "' (" + where +
                                   ") is not supported");
  }
  pre_tokenizer.push_back(std::move(step));
  return Status::Ok();
}

Status HfTokenizer::Impl::LoadDecoder(const json& j, const std::string& where) {
  FW_ASSIGN_OR_RETURN(std::string type,
                      ComponentType(j, where, "decoders", [this](const json& c, const std::string& w) {
                        return LoadDecoder(c, w);
                      }));
  if (type.empty()) return Status::Ok();
  DecoderStep step;
  if (type == "ByteLevel") {
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::kFuse;
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::kMetaspace;
    FW_ASSIGN_OR_RETURN(step.a, StringField(j, "replacement", where, "\xE2\x96\x81"));
    FW_ASSIGN_OR_RETURN(std::string scheme, StringField(j, "prepend_scheme", where));
    if (scheme.empty()) {
      FW_ASSIGN_OR_RETURN(step.prepend, BoolField(j, "add_prefix_space", where, true));
    } else {
      step.prepend = scheme != "never";
    }
  } else if (type == "Replace") {
    step.kind = DecoderStep::kReplace;
    auto p = j.find("pattern");
    if (p == j.end() || !p->is_object() || !p->contains("String") || !(*p)["String"].is_string() ||
        (*p)["String"].get<std::string>().empty())
      return Status::InvalidArgument("tokenizer.json: " + where +
                                     ": a Replace decoder needs a {\"String\": ...} pattern");
    step.a = (*p)["String"].get<std::string>();
    FW_ASSIGN_OR_RETURN(step.b, StringField(j, "content", where));
  } else if (type == "Strip") {
    step.kind = DecoderStep::kStrip;
    FW_ASSIGN_OR_RETURN(step.a, StringField(j, "content", where, " "));
    step.start = j.value("start", 0);
    step.stop = j.value("stop", 0);
    if (step.stop != 0)
      return Status::InvalidArgument("tokenizer.json: " + where +
                                     ": a Strip decoder that strips the end (stop " +
                                     std::to_string(step.stop) + ") is not supported");
  } else {
    return Status::InvalidArgument("tokenizer.json: decoder '" + type + "' (" + where +
                                   ") is not supported");
  }
  decoder.push_back(std::move(step));
  return Status::Ok();
}

Result<int32_t> HfTokenizer::Impl::SpecialId(const std::string& content,
                                             const std::string& where) const {
  auto a = added_by_content.find(content);
  if (a != added_by_content.end()) return a->second;
  auto v = vocab.find(content);
  if (v != vocab.end()) return v->second;
  return Status::InvalidArgument("tokenizer.json: " + where + " names '" + content +
                                 "', which is not a token");
}

Status HfTokenizer::Impl::LoadPostProcessor(const json& j, const std::string& where) {
  FW_ASSIGN_OR_RETURN(std::string type,
                      ComponentType(j, where, "processors", [this](const json& c, const std::string& w) {
                        return LoadPostProcessor(c, w);
                      }));
  if (type.empty()) return Status::Ok();
  if (type == "ByteLevel") return Status::Ok();  // offsets only: the ids stay as they are
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (auto [key, target] : {std::pair{"cls", &prefix_ids}, std::pair{"sep", &suffix_ids}}) {
      auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_string())
        return Status::InvalidArgument("tokenizer.json: " + where + "." + key +
                                       " must be [token, id]");
      FW_ASSIGN_OR_RETURN(int32_t id, SpecialId((*it)[0].get<std::string>(), where + "." + key));
      target->push_back(id);
    }
    return Status::Ok();
  }
  if (type != "TemplateProcessing")
    return Status::InvalidArgument("tokenizer.json: post_processor '" + type + "' (" + where +
                                   ") is not supported");
  auto single = j.find("single");
  if (single == j.end() || !single->is_array())
    return Status::InvalidArgument("tokenizer.json: " + where + ".single must be a list");
  const json specials = j.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (const json& item : *single) {
    if (item.contains("Sequence")) {
      if (seen_sequence)
        return Status::InvalidArgument("tokenizer.json: " + where + ".single has two sequences");
      seen_sequence = true;
      continue;
    }
    if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id") ||
        !item["SpecialToken"]["id"].is_string())
      return Status::InvalidArgument("tokenizer.json: " + where + ".single item " + item.dump() +
                                     " is neither a Sequence nor a SpecialToken");
    const std::string name = item["SpecialToken"]["id"].get<std::string>();
    std::vector<int32_t> ids;
    if (specials.contains(name) && specials[name].contains("ids") && specials[name]["ids"].is_array()) {
      for (const json& id : specials[name]["ids"]) {
        if (!id.is_number_integer())
          return Status::InvalidArgument("tokenizer.json: " + where + ": special token '" + name +
                                         "' has a non-integer id");
        ids.push_back(id.get<int32_t>());
      }
    } else {
      FW_ASSIGN_OR_RETURN(int32_t id, SpecialId(name, where));
      ids.push_back(id);
    }
    auto& target = seen_sequence ? suffix_ids : prefix_ids;
    target.insert(target.end(), ids.begin(), ids.end());
  }
  return Status::Ok();
}

Status HfTokenizer::Impl::LoadAdded(const json& list) {
  if (list.is_null()) return Status::Ok();
  if (!list.is_array()) return Status::InvalidArgument("tokenizer.json: added_tokens must be a list");
  added.reserve(list.size());  // pointers into it are kept below
  for (const json& t : list) {
    AddedToken token;
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        !t.contains("content") || !t["content"].is_string())
      return Status::InvalidArgument("tokenizer.json: added token " + t.dump() +
                                     " needs an integer id and a string content");
    token.id = t["id"].get<int32_t>();
    token.content = t["content"].get<std::string>();
    if (token.id < 0 || token.id >= (1 << 24) || token.content.empty())
      return Status::InvalidArgument("tokenizer.json: added token " + t.dump() +
                                     " has an id outside [0, 2^24) or no content");
    token.special = t.value("special", false);
    token.lstrip = t.value("lstrip", false);
    token.rstrip = t.value("rstrip", false);
    token.single_word = t.value("single_word", false);
    token.normalized = t.value("normalized", !token.special);
    added.push_back(std::move(token));
  }
  std::vector<const AddedToken*> raw, normalized;
  for (const AddedToken& t : added) {
    if (static_cast<size_t>(t.id) >= id_to_token.size()) id_to_token.resize(t.id + 1);
    if (!id_to_token[t.id].empty() && id_to_token[t.id] != t.content)
      return Status::InvalidArgument("tokenizer.json: added token '" + t.content + "' has id " +
                                     std::to_string(t.id) + ", which the vocabulary gives to '" +
                                     id_to_token[t.id] + "'");
    id_to_token[t.id] = t.content;
    added_by_id[t.id] = &t;
    added_by_content[t.content] = t.id;
    (t.normalized && !normalizer.empty() ? normalized : raw).push_back(&t);
  }
  raw_matcher.Build(std::move(raw));
  normalized_matcher.Build(std::move(normalized));
  return Status::Ok();
}

// --- encoding -------------------------------------------------------------------------

Result<std::string> HfTokenizer::Impl::Normalized(std::string_view text) const {
  std::string s(text);
  for (const NormalizerStep& step : normalizer) {
    switch (step.kind) {
      case NormalizerStep::kForm: {
        FW_ASSIGN_OR_RETURN(s, unicode::Normalize(s, step.form));
        break;
      }
      case NormalizerStep::kPrepend:
        if (!s.empty()) s.insert(0, step.a);
        break;
      case NormalizerStep::kReplace:
        s = ReplaceAll(s, step.a, step.b);
        break;
    }
  }
  return s;
}

void HfTokenizer::Impl::PreTokenize(std::string text, bool at_origin, std::vector<Piece>& out) const {
  std::vector<Piece> pieces;
  pieces.push_back({std::move(text), at_origin});
  std::vector<Piece> next;
  CodePoints cps;
  for (const PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    for (Piece& p : pieces) {
      if (p.text.empty()) continue;
      switch (step.kind) {
        case PreTokenizerStep::kRegexSplit:
          SplitByPattern(p, step.pattern, cps, next);
          break;
        case PreTokenizerStep::kByteLevel:
          if (step.add_prefix_space && p.text[0] != ' ') p.text.insert(0, " ");
          if (step.use_regex) {
            SplitByPattern(p, SplitPattern::kGpt2, cps, next);
          } else {
            next.push_back(std::move(p));
          }
          break;
        case PreTokenizerStep::kStringSplit:
          SplitByString(p, step, next);
          break;
        case PreTokenizerStep::kMetaspace:
          ApplyMetaspace(p, step, next);
          break;
        case PreTokenizerStep::kDigits:
          SplitDigits(p, step, next);
          break;
      }
    }
    pieces.swap(next);
  }
  for (Piece& p : pieces) {
    if (!p.text.empty()) out.push_back(std::move(p));
  }
}

// BPE merges over `symbols`, lowest rank first and leftmost among equals, as the tokenizers
// library does it.
void HfTokenizer::Impl::Merge(std::vector<int32_t>& symbols) const {
  const size_t n = symbols.size();
  if (n < 2) return;
  if (n <= 24) {
    for (;;) {
      uint32_t best = kNoRank;
      size_t at = 0;
      int32_t merged = -1;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        auto [rank, id] = merges.Find(symbols[i], symbols[i + 1]);
        if (rank < best) best = rank, at = i, merged = id;
      }
      if (best == kNoRank) return;
      symbols[at] = merged;
      symbols.erase(symbols.begin() + static_cast<ptrdiff_t>(at) + 1);
    }
  }
  // Long words: a heap of candidate merges over a linked list of symbols.
  std::vector<int32_t> id(symbols), prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) prev[i] = static_cast<int32_t>(i) - 1, next[i] = static_cast<int32_t>(i) + 1;
  next[n - 1] = -1;
  struct Candidate {
    uint32_t rank;
    int32_t pos, left, right, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    auto [rank, merged] = merges.Find(id[pos], id[next[pos]]);
    if (rank != kNoRank) heap.push({rank, pos, id[pos], id[next[pos]], merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0 || id[c.pos] != c.left || id[next[c.pos]] != c.right)
      continue;
    const int32_t gone = next[c.pos];
    id[c.pos] = c.merged;
    alive[gone] = false;
    next[c.pos] = next[gone];
    if (next[gone] >= 0) prev[next[gone]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  symbols.clear();
  for (int32_t i = 0; i >= 0; i = next[i]) symbols.push_back(id[i]);
}

void HfTokenizer::Impl::EncodeWord(std::string_view word, std::vector<int32_t>& ids) const {
  const bool cacheable = word.size() <= kCacheWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    auto it = cache.find(std::string(word));
    if (it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  if (byte_level) {
    if (ignore_merges) {
      std::string mapped;
      for (unsigned char b : word) unicode::AppendUtf8(byte_to_char[b], mapped);
      auto it = vocab.find(mapped);
      if (it != vocab.end()) symbols.push_back(it->second);
    }
    if (symbols.empty()) {
      for (unsigned char b : word) {
        if (byte_ids[b] >= 0) {
          symbols.push_back(byte_ids[b]);
        } else if (unk >= 0 && !(fuse_unk && !symbols.empty() && symbols.back() == unk)) {
          symbols.push_back(unk);
        }
      }
      Merge(symbols);
    }
  } else {
    auto whole = ignore_merges ? vocab.find(std::string(word)) : vocab.end();
    if (whole != vocab.end()) {
      symbols.push_back(whole->second);
    } else {
      for (size_t i = 0; i < word.size();) {
        size_t len;
        bool valid;
        unicode::DecodeAt(word, i, len, valid);
        auto it = vocab.find(std::string(word.substr(i, len)));
        if (it != vocab.end()) {
          symbols.push_back(it->second);
        } else {
          bool fell_back = byte_fallback;
          for (size_t k = 0; k < len && fell_back; ++k)
            fell_back = byte_fallback_ids[static_cast<unsigned char>(word[i + k])] >= 0;
          if (fell_back) {
            for (size_t k = 0; k < len; ++k)
              symbols.push_back(byte_fallback_ids[static_cast<unsigned char>(word[i + k])]);
          } else if (unk >= 0 && !(fuse_unk && !symbols.empty() && symbols.back() == unk)) {
            symbols.push_back(unk);
          }
        }
        i += len;
      }
      Merge(symbols);
    }
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    if (cache.size() < kCacheEntries) cache.emplace(std::string(word), std::move(symbols));
  }
}

Status HfTokenizer::Impl::EncodeText(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<Segment> raw;
  if (raw_matcher.empty()) {
    if (!text.empty()) raw.push_back({text, nullptr, 0});
  } else {
    SplitAdded(text, raw_matcher, raw, 0);
  }
  std::vector<Piece> pieces;
  for (const Segment& seg : raw) {
    if (seg.token != nullptr) {
      ids.push_back(seg.token->id);
      continue;
    }
    FW_ASSIGN_OR_RETURN(std::string normalized, Normalized(seg.text));
    std::vector<Segment> parts;
    if (normalized_matcher.empty()) {
      parts.push_back({normalized, nullptr, seg.offset});
    } else {
      SplitAdded(normalized, normalized_matcher, parts, seg.offset);
    }
    for (const Segment& part : parts) {
      if (part.token != nullptr) {
        ids.push_back(part.token->id);
        continue;
      }
      pieces.clear();
      PreTokenize(std::string(part.text), part.offset == 0, pieces);
      for (const Piece& p : pieces) EncodeWord(p.text, ids);
    }
  }
  return Status::Ok();
}

// --- decoding -------------------------------------------------------------------------

Status HfTokenizer::Impl::AppendPiece(int32_t id, bool skip_special, DecodeState& state,
                                      std::string& bytes) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token.size() || id_to_token[id].empty())
    return Status::InvalidArgument("token " + std::to_string(id) + " is not in the vocabulary");
  auto added_it = added_by_id.find(id);
  if (skip_special && added_it != added_by_id.end() && added_it->second->special) return Status::Ok();
  const bool first = state.pieces == 0;
  ++state.pieces;
  if (byte_level && decoder.size() == 1 && decoder[0].kind == DecoderStep::kByteLevel) {
    bytes += decoded_bytes[id];  // the common case, precomputed
    return Status::Ok();
  }
  std::string s = id_to_token[id];
  bool fused = false;
  for (const DecoderStep& step : decoder) {
    switch (step.kind) {
      case DecoderStep::kByteLevel:
        if (auto bytes = ByteLevelBytes(s, char_to_byte)) s = std::move(*bytes);
        break;
      case DecoderStep::kByteFallback:
        if (s.size() == 6 && s.compare(0, 3, "<0x") == 0 && s[5] == '>' &&
            std::isxdigit(static_cast<unsigned char>(s[3])) &&
            std::isxdigit(static_cast<unsigned char>(s[4])))
          s = std::string(1, static_cast<char>(std::stoi(s.substr(3, 2), nullptr, 16)));
        break;
      case DecoderStep::kFuse:
        fused = true;
        break;
      case DecoderStep::kReplace:
        s = ReplaceAll(s, step.a, step.b);
        break;
      case DecoderStep::kMetaspace:
        // As the tokenizers library does: every replacement character becomes a space,
        // except in the sequence's first token, where they all go (unless the scheme is
        // "never").
        s = ReplaceAll(s, step.a, first && step.prepend ? "" : " ");
        break;
      case DecoderStep::kStrip: {
        // After Fuse the tokens are one string: strip its start once; before, each token's.
        int64_t& left = state.strip_left;
        int64_t own = step.start;
        int64_t& budget = fused ? left : own;
        if (fused && left < 0) left = step.start;
        while (budget > 0 && s.compare(0, step.a.size(), step.a) == 0 && !step.a.empty()) {
          s.erase(0, step.a.size());
          --budget;
        }
        if (fused && !s.empty()) left = 0;  // the text has started: nothing more to strip
        break;
      }
    }
  }
  bytes += s;
  return Status::Ok();
}

// --- the class ------------------------------------------------------------------------

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file = path, dir;
  if (fs::is_directory(file, ec)) {
    dir = file;
    file = dir / "tokenizer.json";
  } else {
    dir = file.parent_path();
  }
  Env* env = Env::Default();
  if (!env->FileExists(file.string()))
    return Status::NotFound("no tokenizer.json at " + file.string() +
                            " (flywheel reads HF tokenizer.json files)");
  FW_ASSIGN_OR_RETURN(std::string tokenizer_json, ReadText(file.string()));
  // The two companions are optional; present, they must read.
  std::string config, generation;
  if (const std::string c = (dir / "tokenizer_config.json").string(); env->FileExists(c)) {
    FW_ASSIGN_OR_RETURN(config, ReadText(c));
  }
  if (const std::string g = (dir / "generation_config.json").string(); env->FileExists(g)) {
    FW_ASSIGN_OR_RETURN(generation, ReadText(g));
  }
  auto loaded = FromJson(tokenizer_json, config, generation);
  if (!loaded.ok())
    return Status(loaded.status().code(), file.string() + ": " + loaded.status().message());
  return loaded;
}

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(std::string_view tokenizer_json,
                                                           std::string_view config_json,
                                                           std::string_view generation_json) {
  FW_ASSIGN_OR_RETURN(json root, ParseJson(tokenizer_json, "tokenizer.json"));
  if (!root.is_object()) return Status::InvalidArgument("tokenizer.json is not a JSON object");
  auto impl = std::make_unique<Impl>();
  FW_RETURN_IF_ERROR(impl->LoadModel(root.value("model", json())));
  FW_RETURN_IF_ERROR(impl->LoadNormalizer(root.value("normalizer", json()), "normalizer"));
  FW_RETURN_IF_ERROR(impl->LoadPreTokenizer(root.value("pre_tokenizer", json()), "pre_tokenizer"));
  FW_RETURN_IF_ERROR(impl->LoadDecoder(root.value("decoder", json()), "decoder"));
  FW_RETURN_IF_ERROR(impl->LoadAdded(root.value("added_tokens", json())));
  FW_RETURN_IF_ERROR(impl->LoadPostProcessor(root.value("post_processor", json()), "post_processor"));
  FW_RETURN_IF_ERROR(impl->BuildByteTables());
  FW_RETURN_IF_ERROR(impl->LoadConfig(config_json));
  FW_RETURN_IF_ERROR(impl->LoadGenerationConfig(generation_json));
  impl->Describe();
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

// The byte <-> character tables of byte-level models (and of a ByteLevel decoder), the check
// that ids have no gaps, and each token's bytes for the byte-level decoder.
Status HfTokenizer::Impl::BuildByteTables() {
  if (byte_level) {
    for (int b = 0; b < 256; ++b) {
      char_to_byte[byte_to_char[b]] = static_cast<uint8_t>(b);
      std::string name;
      unicode::AppendUtf8(byte_to_char[b], name);
      auto it = vocab.find(name);
      byte_ids[b] = it == vocab.end() ? -1 : it->second;
      if (byte_ids[b] < 0 && unk < 0)
        return Status::InvalidArgument("tokenizer.json: a byte-level vocabulary without byte 0x" +
                                       std::string(1, "0123456789ABCDEF"[b >> 4]) +
                                       std::string(1, "0123456789ABCDEF"[b & 15]) +
                                       " and without an unk_token");
    }
  } else {
    for (const DecoderStep& step : decoder) {
      if (step.kind == DecoderStep::kByteLevel) {
        for (int b = 0; b < 256; ++b) char_to_byte[byte_to_char[b]] = static_cast<uint8_t>(b);
      }
    }
  }
  vocab_size = static_cast<int64_t>(id_to_token.size());
  for (size_t id = 0; id < id_to_token.size(); ++id) {
    if (id_to_token[id].empty())
      return Status::InvalidArgument("tokenizer.json: no token has id " + std::to_string(id) +
                                     " (ids must run from 0 without gaps)");
  }
  if (byte_level && decoder.size() == 1 && decoder[0].kind == DecoderStep::kByteLevel) {
    decoded_bytes.resize(id_to_token.size());
    for (size_t id = 0; id < id_to_token.size(); ++id)
      decoded_bytes[id] = ByteLevelBytes(id_to_token[id], char_to_byte).value_or(id_to_token[id]);
  }
  return Status::Ok();
}

// tokenizer_config.json: bos / eos (guessed from the vocabulary when absent), the chat
// template, model_max_length; eos is the first stop token.
Status HfTokenizer::Impl::LoadConfig(std::string_view config_json) {
  json config = json::object();
  if (!config_json.empty()) {
    FW_ASSIGN_OR_RETURN(config, ParseJson(config_json, "tokenizer_config.json"));
    if (!config.is_object()) return Status::InvalidArgument("tokenizer_config.json is not an object");
  }
  bos_token = TokenContent(config, "bos_token");
  eos_token = TokenContent(config, "eos_token");
  auto guess = [&](std::string& name, std::initializer_list<const char*> names) {
    if (!name.empty()) return;
    for (const char* n : names) {
      if (added_by_content.count(n) || vocab.count(n)) {
        name = n;
        return;
      }
    }
  };
  guess(bos_token, {"<s>", "<|begin_of_text|>"});
  guess(eos_token, {"</s>", "<|endoftext|>", "<|end_of_text|>"});
  if (!bos_token.empty()) {
    FW_ASSIGN_OR_RETURN(bos, SpecialId(bos_token, "tokenizer_config.json bos_token"));
  }
  if (!eos_token.empty()) {
    FW_ASSIGN_OR_RETURN(eos, SpecialId(eos_token, "tokenizer_config.json eos_token"));
  }
  if (auto it = config.find("chat_template"); it != config.end()) {
    if (it->is_string()) {
      chat_template = it->get<std::string>();
    } else if (it->is_array()) {
      for (const json& named : *it) {
        if (named.value("name", "") == "default" && named.contains("template") &&
            named["template"].is_string())
          chat_template = named["template"].get<std::string>();
      }
    }
  }
  if (auto it = config.find("model_max_length"); it != config.end() && it->is_number()) {
    const double v = it->get<double>();
    if (v > 0 && v < 1e12) model_max_length = static_cast<int64_t>(v);
  }
  if (eos >= 0) stop_tokens.push_back(eos);
  return Status::Ok();
}

// generation_config.json: its eos_token_id (one or a list) are stop tokens too.
Status HfTokenizer::Impl::LoadGenerationConfig(std::string_view generation_json) {
  if (generation_json.empty()) return Status::Ok();
  FW_ASSIGN_OR_RETURN(json generation, ParseJson(generation_json, "generation_config.json"));
  const json e = generation.is_object() ? generation.value("eos_token_id", json()) : json();
  for (const json& id : e.is_array() ? e : json::array({e})) {
    if (!id.is_number_integer()) continue;
    const int32_t v = id.get<int32_t>();
    if (v < 0 || v >= vocab_size)
      return Status::InvalidArgument("generation_config.json: eos_token_id " + std::to_string(v) +
                                     " is outside the vocabulary");
    if (std::find(stop_tokens.begin(), stop_tokens.end(), v) == stop_tokens.end())
      stop_tokens.push_back(v);
  }
  return Status::Ok();
}

// One line for logs: model, size, byte handling, split pattern, normalizers.
void HfTokenizer::Impl::Describe() {
  std::string split = "none";
  for (const PreTokenizerStep& step : pre_tokenizer) {
    if (step.kind == PreTokenizerStep::kRegexSplit) split = PatternName(step.pattern);
    if (step.kind == PreTokenizerStep::kByteLevel && step.use_regex) split = "gpt2";
    if (step.kind == PreTokenizerStep::kMetaspace) split = "metaspace";
  }
  std::string norm;
  for (const NormalizerStep& step : normalizer) {
    if (!norm.empty()) norm += "+";
    norm += step.kind == NormalizerStep::kForm      ? "normal form"
            : step.kind == NormalizerStep::kPrepend ? "prepend"
                                                    : "replace";
  }
  description = "BPE, " + std::to_string(vocab_size) + " tokens (" +
                std::to_string(added.size()) + " added), " +
                (byte_level ? "byte-level" : byte_fallback ? "byte fallback" : "characters") +
                ", split: " + split + (norm.empty() ? "" : ", normalizer: " + norm);
}

Result<std::vector<int32_t>> HfTokenizer::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  FW_RETURN_IF_ERROR(impl_->EncodeText(text, ids));
  return ids;
}

Result<std::vector<int32_t>> HfTokenizer::EncodePrompt(std::string_view text) const {
  std::vector<int32_t> ids = impl_->prefix_ids;
  FW_RETURN_IF_ERROR(impl_->EncodeText(text, ids));
  ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  return ids;
}

Result<std::string> HfTokenizer::Decode(std::span<const int32_t> ids) const {
  return Decode(ids, /*skip_special_tokens=*/true);
}

Result<std::string> HfTokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  DecodeState state;
  for (size_t i = 0; i < ids.size(); ++i) {
    Status s = impl_->AppendPiece(ids[i], skip_special_tokens, state, bytes);
    if (!s.ok()) return Status::InvalidArgument(s.message() + " (position " + std::to_string(i) + ")");
  }
  std::string text;
  text.reserve(bytes.size());
  unicode::AppendLossy(bytes, text, /*final=*/true);
  return text;
}

Status HfTokenizer::AppendPiece(int32_t id, bool skip_special_tokens, DecodeState& state,
                                std::string& bytes) const {
  return impl_->AppendPiece(id, skip_special_tokens, state, bytes);
}

bool HfTokenizer::IsSpecial(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

std::optional<int32_t> HfTokenizer::TokenId(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::vector<int32_t> HfTokenizer::StopTokens() const { return impl_->stop_tokens; }
int64_t HfTokenizer::vocab_size() const { return impl_->vocab_size; }
int32_t HfTokenizer::bos() const { return impl_->bos; }
int32_t HfTokenizer::eos() const { return impl_->eos; }

std::string HfTokenizer::TokenText(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) return {};
  return impl_->id_to_token[id];
}
const std::string& HfTokenizer::bos_token() const { return impl_->bos_token; }
const std::string& HfTokenizer::eos_token() const { return impl_->eos_token; }
const std::string& HfTokenizer::chat_template() const { return impl_->chat_template; }
int64_t HfTokenizer::model_max_length() const { return impl_->model_max_length; }
std::string HfTokenizer::Describe() const { return impl_->description; }

}  // namespace flywheel::tokenizer
