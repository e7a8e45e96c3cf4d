#include "rollout/structured_output.h"

#include "base/json.h"
#include "tokenizer/grammar.h"
#include "tokenizer/json_schema.h"

namespace flywheel::rollout {
namespace {

using ojson = nlohmann::ordered_json;

// The schema of guided_json / structured_outputs.json: an object, or its JSON text.
Result<ojson> SchemaValue(const ojson& spec, const std::string& field) {
  if (spec.is_object()) return spec;
  if (spec.is_string()) return ParseJson<ojson>(spec.get<std::string>(), "'" + field + "'");
  return Status::InvalidArgument("'" + field + "' must be a JSON schema (an object or its JSON text)");
}

// response_format's kind and spec; kind empty for "text".
Status ResponseFormat(const ojson& format, std::string& kind, ojson& spec) {
  if (!format.is_object() || !format.contains("type") || !format["type"].is_string())
    return Status::InvalidArgument("'response_format' must be an object with a string 'type'");
  const std::string type = format["type"].get<std::string>();
  if (type == "text") return Status::Ok();
  if (type == "json_object") {
    kind = "json_object";
    return Status::Ok();
  }
  if (type != "json_schema")
    return Status::InvalidArgument("'response_format.type' must be text, json_object or json_schema, got '" +
                                   type + "'");
  auto js = format.find("json_schema");
  if (js == format.end() || !js->is_object() || !js->contains("schema"))
    return Status::InvalidArgument("'response_format.json_schema' must be an object with a 'schema'");
  kind = "json_schema";
  spec = (*js)["schema"];
  if (!spec.is_object()) return Status::InvalidArgument("'response_format.json_schema.schema' must be an object");
  return Status::Ok();
}

// Which structured-output field `request` uses: kind, spec and the field's name.
Status Requested(const ojson& request, std::string& kind, ojson& spec, std::string& field) {
  int given = 0;
  auto take = [&](const ojson& holder, const char* key, const char* as, const std::string& name) -> Status {
    auto it = holder.find(key);
    if (it == holder.end() || it->is_null()) return Status::Ok();
    ++given;
    field = name;
    if (std::string(as) == "grammar")
      return Status::InvalidArgument("'" + name + "' (EBNF grammars) is not supported; use a JSON schema, a regex or a choice");
    if (std::string(as) == "json_schema") {
      FW_ASSIGN_OR_RETURN(spec, SchemaValue(*it, name));
    } else {
      spec = *it;
    }
    kind = as;
    return Status::Ok();
  };
  if (auto rf = request.find("response_format"); rf != request.end() && !rf->is_null()) {
    ++given;
    field = "response_format";
    FW_RETURN_IF_ERROR(ResponseFormat(*rf, kind, spec));
    if (kind.empty()) --given;  // "text" is no constraint
  }
  FW_RETURN_IF_ERROR(take(request, "guided_json", "json_schema", "guided_json"));
  FW_RETURN_IF_ERROR(take(request, "guided_regex", "regex", "guided_regex"));
  FW_RETURN_IF_ERROR(take(request, "guided_choice", "choice", "guided_choice"));
  FW_RETURN_IF_ERROR(take(request, "guided_grammar", "grammar", "guided_grammar"));
  if (auto so = request.find("structured_outputs"); so != request.end() && !so->is_null()) {
    if (!so->is_object()) return Status::InvalidArgument("'structured_outputs' must be an object");
    FW_RETURN_IF_ERROR(take(*so, "json", "json_schema", "structured_outputs.json"));
    FW_RETURN_IF_ERROR(take(*so, "regex", "regex", "structured_outputs.regex"));
    FW_RETURN_IF_ERROR(take(*so, "choice", "choice", "structured_outputs.choice"));
    FW_RETURN_IF_ERROR(take(*so, "grammar", "grammar", "structured_outputs.grammar"));
  }
  if (given > 1)
    return Status::InvalidArgument(
        "give at most one of response_format (json_object, json_schema), guided_json, guided_regex, "
        "guided_choice, structured_outputs");
  return Status::Ok();
}

}  // namespace

GuideCache::GuideCache(std::shared_ptr<const model::Tokenizer> tokenizer, size_t capacity)
    : tokenizer_(std::move(tokenizer)), capacity_(capacity) {}

Result<std::shared_ptr<tokenizer::TokenGuide>> GuideCache::ForRequest(const ojson& request) {
  std::string kind, field;
  ojson spec;
  FW_RETURN_IF_ERROR(Requested(request, kind, spec, field));
  if (kind.empty()) return std::shared_ptr<tokenizer::TokenGuide>();
  return Get(kind, spec, field);
}

Result<std::unique_ptr<tokenizer::ByteGrammar>> GuideCache::Compile(const std::string& kind, const ojson& spec,
                                                                    const std::string& field) const {
  if (kind == "json_object") return tokenizer::JsonObjectGrammar();
  std::string regex;
  if (kind == "json_schema") {
    auto r = tokenizer::JsonSchemaRegex(spec);
    if (!r.ok()) return Status::InvalidArgument("'" + field + "': " + r.status().message());
    regex = *r;
  } else if (kind == "regex") {
    if (!spec.is_string()) return Status::InvalidArgument("'" + field + "' must be a string");
    regex = spec.get<std::string>();
  } else {
    if (!spec.is_array() || spec.empty())
      return Status::InvalidArgument("'" + field + "' must be a non-empty list of strings");
    std::vector<std::string> choices;
    for (const ojson& c : spec) {
      if (!c.is_string() || c.get<std::string>().empty())
        return Status::InvalidArgument("'" + field + "' entries must be non-empty strings, got " + c.dump());
      // Each choice must be writable in this vocabulary.
      auto ids = tokenizer_->Encode(c.get<std::string>());
      auto back = ids.ok() ? tokenizer_->Decode(*ids) : Result<std::string>(ids.status());
      if (!back.ok() || *back != c.get<std::string>())
        return Status::InvalidArgument("'" + field + "' entry " + c.dump() + " cannot be written with this model's vocabulary");
      choices.push_back(c.get<std::string>());
    }
    regex = tokenizer::ChoiceRegex(choices);
  }
  auto grammar = tokenizer::CompileRegex(
      regex, kind == "json_schema" ? tokenizer::kJsonSchemaMaxRegexBytes : tokenizer::kRegexMaxBytes);
  if (!grammar.ok()) {
    std::string hint;
    if (kind == "json_schema")
      hint = " (optional properties before the first required one multiply the automaton: list them in "
             "'required', nullable if need be, as OpenAI's strict mode does)";
    return Status::InvalidArgument("'" + field + "': " + grammar.status().message() + hint);
  }
  return std::move(*grammar);
}

Result<std::shared_ptr<const tokenizer::TokenBytes>> GuideCache::Vocabulary() {
  if (!vocabulary_) {
    FW_ASSIGN_OR_RETURN(vocabulary_, tokenizer::TokenBytes::FromTokenizer(*tokenizer_));
  }
  return vocabulary_;
}

Result<std::shared_ptr<tokenizer::TokenGuide>> GuideCache::Get(const std::string& kind, const ojson& spec,
                                                               const std::string& field) {
  const std::string key = kind + "\n" + spec.dump();
  std::shared_ptr<const tokenizer::TokenBytes> vocabulary;
  {
    std::lock_guard lock(mutex_);
    if (auto it = guides_.find(key); it != guides_.end()) {
      recent_.splice(recent_.begin(), recent_, it->second.second);
      return it->second.first;
    }
    FW_ASSIGN_OR_RETURN(vocabulary, Vocabulary());
  }
  // Compiled outside the lock: other requests' lookups go on meanwhile.
  FW_ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::ByteGrammar> grammar, Compile(kind, spec, field));
  auto guide = tokenizer::TokenGuide::Create(std::move(grammar), vocabulary);
  if (!guide.ok()) return Status::InvalidArgument("'" + field + "': " + guide.status().message());
  std::lock_guard lock(mutex_);
  ++compiled_;
  if (guides_.count(key) == 0) {
    recent_.push_front(key);
    guides_[key] = {*guide, recent_.begin()};
    if (guides_.size() > capacity_) {
      guides_.erase(recent_.back());
      recent_.pop_back();
    }
  }
  return *guide;
}

int64_t GuideCache::compiled() const {
  std::lock_guard lock(mutex_);
  return compiled_;
}

}  // namespace flywheel::rollout
