// Grammars for structured outputs: languages over byte strings that a sampler follows one
// token at a time (tokenizer/token_guide.h masks the vocabulary with them).
//
//   CompileRegex       a regular expression (the subset below), matched against the whole
//                      output; compiled to a DFA over UTF-8 bytes up front, so a pattern too
//                      large is refused when it arrives, never mid-answer.
//   JsonObjectGrammar  any JSON object (OpenAI's response_format {"type": "json_object"}): a
//                      pushdown machine, nesting up to kJsonGrammarMaxDepth.
//   json_schema.h      a JSON schema subset, compiled to a regex.
//
// Regex subset: literals (any UTF-8), `.` (any character but \n), classes `[a-z]`, `[^...]`,
// escapes \d \w \s \D \W \S \n \r \t \f \v \xHH \uHHHH and escaped punctuation, groups
// `(...)`, `(?:...)`, `(?P<name>...)` / `(?<name>...)`, alternation `|`, quantifiers `* + ?
// {n} {n,} {n,m}` (a lazy `?` suffix is accepted: the language is the same), and `^` / `$`
// at the ends (the match is always whole). Refused by name: back-references, lookaround,
// \b \B, inline flags, possessive quantifiers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::tokenizer {

// Limits on a compiled regex (a larger one is refused with InvalidArgument).
inline constexpr int64_t kRegexMaxRepeat = 1000;     // n and m in {n,m}
inline constexpr int64_t kRegexMaxNfaStates = 200000;
inline constexpr int64_t kRegexMaxDfaStates = 50000;
inline constexpr int64_t kRegexMaxDfaEntries = 4 << 20;  // DFA states x byte classes (16 MiB)
// NFA states visited while building the DFA: a pattern that needs more is refused, so a
// hostile one costs a request at most ~0.2 s of one core.
inline constexpr int64_t kRegexMaxWork = 20000000;
inline constexpr int kJsonGrammarMaxDepth = 32;
// Consecutive whitespace bytes JsonObjectGrammar allows between tokens (so a model cannot
// spend its whole answer on spaces; enough for pretty-printed JSON).
inline constexpr int kJsonGrammarMaxWhitespace = 24;

// A language over byte strings, walked a byte at a time. A state is an opaque byte string:
// equal strings are the same state. Not thread-safe (TokenGuide serialises its calls).
class ByteGrammar {
 public:
  virtual ~ByteGrammar() = default;
  virtual std::string Start() = 0;
  // Advances `state` by `byte`. False: no word of the language begins with what was read
  // plus `byte` (`state` is then unspecified).
  virtual bool Step(std::string& state, uint8_t byte) = 0;
  // Whether what was read is a whole word of the language.
  virtual bool Accepting(const std::string& state) = 0;
  // What the grammar is, for messages ("regex ^[a-z]+$", "a JSON object").
  virtual std::string Describe() const = 0;
};

// Errors name the pattern's offending part and its byte offset. Patterns longer than
// `max_bytes` are refused (a JSON schema's regex may be long: its caller raises it; the
// automaton limits above bound the work either way).
inline constexpr size_t kRegexMaxBytes = 65536;
Result<std::unique_ptr<ByteGrammar>> CompileRegex(std::string_view pattern, size_t max_bytes = kRegexMaxBytes);
std::unique_ptr<ByteGrammar> JsonObjectGrammar();

// `literal` as a regex matching exactly it.
std::string EscapeRegex(std::string_view literal);
// A regex matching exactly one of `choices` (guided_choice).
std::string ChoiceRegex(const std::vector<std::string>& choices);

// Whether `grammar` accepts `text` whole (tests and checks).
bool GrammarAccepts(ByteGrammar& grammar, std::string_view text);

}  // namespace flywheel::tokenizer
