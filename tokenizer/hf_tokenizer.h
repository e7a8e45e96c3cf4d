// HF tokenizers from their `tokenizer.json` (the format of the `tokenizers` library), in C++:
// what Qwen2/Qwen3, Llama-3, GPT-2, Llama-2 and Mistral checkpoints ship.
//
// Supported, each exactly as the `tokenizers` library does it:
//   model          BPE: merges with ranks (as "a b" strings or ["a", "b"] pairs),
//                  `ignore_merges`, `byte_fallback` (<0xXX> tokens), `unk_token` + `fuse_unk`
//   normalizer     NFC, NFKC, NFD, NFKD, Prepend, Replace (a string pattern), Sequence
//   pre_tokenizer  ByteLevel (`add_prefix_space`, `use_regex`: the GPT-2 split), Split with
//                  one of the split patterns below (or a literal string), Metaspace
//                  (`prepend_scheme` always/first/never, `split`), Digits, Sequence
//   post_processor TemplateProcessing (single sequences), ByteLevel, RobertaProcessing,
//                  BertProcessing, Sequence
//   decoder        ByteLevel, Metaspace, Replace (string), ByteFallback, Fuse, Strip, Sequence
//   added tokens   matched in the raw text before anything else (leftmost, longest first),
//                  `special`, `lstrip`, `rstrip`, `single_word`, `normalized` (those are
//                  matched in the normalized text)
// Split patterns: the regexes are recognised, not interpreted, and run as hand-written
// matchers over Unicode classes (tokenizer/unicode.h): Qwen2/Qwen3's, Llama-3's (= the
// cl100k pattern) and GPT-2's. `\s` is Unicode's White_Space, as in the Rust library.
// Anything else a file uses (another model type, a regex outside the list, a normalizer such
// as Precompiled or BertNormalizer, BPE dropout, subword prefixes) is refused by name at load
// time: never approximated.
//
// tokenizer_config.json (optional, beside tokenizer.json) gives `bos_token`, `eos_token`,
// `chat_template` and `model_max_length`; generation_config.json (optional, beside them) the
// model's `eos_token_id` list, which become StopTokens().
//
// Thread-safe: encoding keeps a bounded cache of words it has seen, behind a mutex.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "tokenizer/tokenizer.h"

namespace flywheel::tokenizer {

class HfTokenizer final : public Tokenizer {
 public:
  // `path`: a model directory (its tokenizer.json, and tokenizer_config.json and
  // generation_config.json when present) or a tokenizer.json file (the other two are looked
  // for beside it).
  static Result<std::unique_ptr<HfTokenizer>> Load(const std::string& path);
  // From the files' contents; `config` and `generation_config` may be empty.
  static Result<std::unique_ptr<HfTokenizer>> FromJson(std::string_view tokenizer_json,
                                                       std::string_view config = {},
                                                       std::string_view generation_config = {});
  ~HfTokenizer() override;

  Result<std::vector<int32_t>> Encode(std::string_view text) const override;
  Result<std::vector<int32_t>> EncodePrompt(std::string_view text) const override;
  Result<std::string> Decode(std::span<const int32_t> ids) const override;
  Result<std::string> Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  Status AppendPiece(int32_t id, bool skip_special_tokens, DecodeState& state,
                     std::string& bytes) const override;
  bool IsSpecial(int32_t id) const override;
  std::optional<int32_t> TokenId(std::string_view token) const override;
  std::vector<int32_t> StopTokens() const override;
  int64_t vocab_size() const override;
  int32_t bos() const override;  // -1 when the tokenizer has none
  int32_t eos() const override;  // -1 when the tokenizer has none

  // The token as the vocabulary writes it (e.g. "Ġhello", "<|im_end|>").
  std::string TokenText(int32_t id) const;
  const std::string& bos_token() const;
  const std::string& eos_token() const;
  // tokenizer_config.json's `chat_template` (the "default" one when it is a list); empty
  // when there is none.
  const std::string& chat_template() const;
  // tokenizer_config.json's `model_max_length`; 0 when absent or unbounded.
  int64_t model_max_length() const;
  // One line: "BPE, 151669 tokens (26 added), byte-level, split: qwen2, NFC".
  std::string Describe() const;

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flywheel::tokenizer
