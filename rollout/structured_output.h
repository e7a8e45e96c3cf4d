// Structured outputs in the OpenAI API (rollout/openai_api.h): a request's
// response_format / guided_* / structured_outputs fields, compiled into the token guide the
// engine samples with (tokenizer/token_guide.h), cached per grammar.
//
//   response_format     {"type": "text"} (nothing), {"type": "json_object"} (any JSON
//                       object), {"type": "json_schema", "json_schema": {"name", "schema",
//                       "strict"}} (the subset in tokenizer/json_schema.h)
//   guided_json         a schema (object, or its JSON text), as vLLM takes it
//   guided_regex        a regex (tokenizer/grammar.h); the whole answer matches it
//   guided_choice       a list of strings; the answer is exactly one of them
//   structured_outputs  {"json" | "regex" | "choice": ...}, vLLM's newer spelling
// At most one may be given. Refused with InvalidArgument naming the field: an unsupported
// schema construct or regex feature, a choice this vocabulary cannot write, a grammar no
// token can begin, guided_grammar / structured_outputs.grammar (EBNF is not supported).
#pragma once

#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/tokenizer.h"
#include "tokenizer/token_guide.h"

namespace flywheel::rollout {

class GuideCache {
 public:
  explicit GuideCache(std::shared_ptr<const model::Tokenizer> tokenizer, size_t capacity = 16);
  // The guide `request` asks for; nullptr when it asks for none. Thread-safe.
  Result<std::shared_ptr<tokenizer::TokenGuide>> ForRequest(const nlohmann::ordered_json& request);
  // Guides compiled since start (the rest were found in the cache).
  int64_t compiled() const;

 private:
  // The grammar `kind` ("json_object", "json_schema", "regex", "choice") of `spec`.
  Result<std::shared_ptr<tokenizer::TokenGuide>> Get(const std::string& kind, const nlohmann::ordered_json& spec,
                                                     const std::string& field);
  Result<std::unique_ptr<tokenizer::ByteGrammar>> Compile(const std::string& kind,
                                                          const nlohmann::ordered_json& spec,
                                                          const std::string& field) const;
  Result<std::shared_ptr<const tokenizer::TokenBytes>> Vocabulary();  // REQUIRES: mutex_

  std::shared_ptr<const model::Tokenizer> tokenizer_;
  size_t capacity_;
  mutable std::mutex mutex_;
  std::shared_ptr<const tokenizer::TokenBytes> vocabulary_;  // built on first use
  std::list<std::string> recent_;  // most recently used first
  std::map<std::string, std::pair<std::shared_ptr<tokenizer::TokenGuide>, std::list<std::string>::iterator>>
      guides_;
  int64_t compiled_ = 0;
};

}  // namespace flywheel::rollout
