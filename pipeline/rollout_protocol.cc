#include "pipeline/rollout_protocol.h"

#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "base/json.h"

namespace flywheel::pipeline {
namespace {

using nlohmann::json;

std::string Quote(const std::string& text) { return "\"" + text + "\""; }

Result<json> ParseObject(std::string_view body, const char* what) {
  FW_ASSIGN_OR_RETURN(json document, ParseJson(body, what));
  if (!document.is_object()) {
    return Status::InvalidArgument(std::string(what) + ": not a JSON object");
  }
  return document;
}

Status Bad(const std::string& where, const std::string& key, const char* want) {
  return Status::InvalidArgument(where + Quote(key) + " must be " + want);
}

// A number of type T read exactly: integers must be integers in T's range, so that a
// hostile 1e30 or -1 does not wrap into a valid-looking id or version.
template <class T>
bool ReadNumber(const json& value, T& out) {
  if constexpr (std::is_floating_point_v<T>) {
    if (!value.is_number()) return false;
    out = value.get<T>();
    return true;
  } else {
    if (value.is_number_unsigned()) {
      const uint64_t v = value.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) return false;
      out = static_cast<T>(v);
      return true;
    }
    if (value.is_number_integer()) {
      const int64_t v = value.get<int64_t>();
      if constexpr (std::is_unsigned_v<T>) {
        if (v < 0) return false;
      } else {
        if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) return false;
      }
      out = static_cast<T>(v);
      return true;
    }
    return false;
  }
}

constexpr const char* Want(const int32_t*) { return "an array of int32"; }
constexpr const char* Want(const int64_t*) { return "an array of integers"; }
constexpr const char* Want(const uint64_t*) { return "an array of non-negative integers"; }
constexpr const char* Want(const float*) { return "an array of numbers"; }
constexpr const char* Want(const uint8_t*) { return "an array of 0 and 1"; }

// Reads object[key] into `out`. Absent: `required` fails, else `out` keeps its default.
template <class T>
Status Field(const json& object, const std::string& key, T& out, bool required,
             const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (required) return Status::InvalidArgument(where + "missing " + Quote(key));
    return Status::Ok();
  }
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) return Bad(where, key, "a string");
    out = it->template get<std::string>();
  } else if constexpr (std::is_arithmetic_v<T>) {
    if (!ReadNumber(*it, out)) {
      return Bad(where, key, std::is_floating_point_v<T> ? "a number" : "an integer in range");
    }
  } else {  // std::vector<number>
    using E = typename T::value_type;
    if (!it->is_array()) return Bad(where, key, Want(static_cast<const E*>(nullptr)));
    out.clear();
    out.reserve(it->size());
    for (const json& element : *it) {
      E value{};
      if (!ReadNumber(element, value)) return Bad(where, key, Want(static_cast<const E*>(nullptr)));
      out.push_back(value);
    }
  }
  return Status::Ok();
}

Result<RolloutSample> ParseSample(const json& s, const std::string& where) {
  if (!s.is_object()) return Status::InvalidArgument(where + "not an object");
  RolloutSample sample;
  FW_RETURN_IF_ERROR(Field(s, "prompt_tokens", sample.prompt_tokens, true, where));
  FW_RETURN_IF_ERROR(Field(s, "tokens", sample.tokens, true, where));
  FW_RETURN_IF_ERROR(Field(s, "logprobs", sample.logprobs, true, where));
  FW_RETURN_IF_ERROR(Field(s, "versions", sample.versions, true, where));
  FW_RETURN_IF_ERROR(Field(s, "reward", sample.reward, true, where));
  FW_RETURN_IF_ERROR(Field(s, "routing", sample.routing, false, where));
  FW_RETURN_IF_ERROR(Field(s, "mask", sample.mask, false, where));
  for (uint8_t m : sample.mask) {
    if (m > 1) return Bad(where, "mask", Want(static_cast<const uint8_t*>(nullptr)));
  }
  if (!sample.routing.empty()) {
    FW_RETURN_IF_ERROR(Field(s, "routing_shape", sample.routing_shape, false, where));
    if (sample.routing_shape.size() != 3) {
      return Status::InvalidArgument(where + "routing needs routing_shape [rows, layers, top_k]");
    }
  }
  return sample;
}

Status ReadHeader(const json& request, SubmitRequest& out) {
  const std::string where = "submission: ";
  FW_RETURN_IF_ERROR(Field(request, "claim", out.claim, true, where));
  FW_RETURN_IF_ERROR(Field(request, "worker", out.worker, true, where));
  FW_RETURN_IF_ERROR(Field(request, "incarnation", out.incarnation, false, where));
  return Status::Ok();
}

const char* KindName(ClaimAnswer::Kind kind) {
  switch (kind) {
    case ClaimAnswer::Kind::kOk: return "ok";
    case ClaimAnswer::Kind::kWait: return "wait";
    case ClaimAnswer::Kind::kDone: return "done";
  }
  return "done";
}

}  // namespace

std::string ToJson(const ClaimRequest& r) {
  return json{{"worker", r.worker},
              {"incarnation", r.incarnation},
              {"version", r.version},
              {"serving_since_unix_us", r.serving_since_unix_us},
              {"max_groups", r.max_groups}}
      .dump();
}

std::string ToJson(const ClaimAnswer& a) {
  json out = {{"status", KindName(a.kind)}};
  switch (a.kind) {
    case ClaimAnswer::Kind::kOk: {
      json groups = json::array();
      for (const ClaimedGroup& g : a.groups) {
        json group = {{"claim", g.claim}, {"prompt", g.prompt}, {"answer", g.answer}};
        if (g.messages.is_array()) group["messages"] = g.messages;
        groups.push_back(std::move(group));
      }
      out["trainer_version"] = a.trainer_version;
      out["groups"] = std::move(groups);
      out["group_size"] = a.group_size;
      out["temperature"] = a.temperature;
      out["max_tokens"] = a.max_tokens;
      if (a.max_turns > 1) {
        out["max_turns"] = a.max_turns;
        out["max_episode_tokens"] = a.max_episode_tokens;
      }
      break;
    }
    case ClaimAnswer::Kind::kWait:
      out["retry_ms"] = a.retry_ms;
      out["reason"] = a.reason;
      break;
    case ClaimAnswer::Kind::kDone:
      break;
  }
  return out.dump();
}

std::string ToJson(const SubmitRequest& r) {
  json samples = json::array();
  for (const RolloutSample& s : r.samples) {
    json sample = {{"prompt_tokens", s.prompt_tokens},
                   {"tokens", s.tokens},
                   {"logprobs", s.logprobs},
                   {"versions", s.versions},
                   {"reward", s.reward}};
    if (!s.routing.empty()) {
      sample["routing"] = s.routing;
      sample["routing_shape"] = s.routing_shape;
    }
    if (!s.mask.empty()) sample["mask"] = s.mask;
    samples.push_back(std::move(sample));
  }
  return json{{"worker", r.worker},
              {"incarnation", r.incarnation},
              {"claim", r.claim},
              {"samples", std::move(samples)}}
      .dump();
}

std::string ToJson(const SubmitAnswer& a) {
  json out = {{"accepted", a.accepted}};
  if (!a.accepted) out["reason"] = a.reason;
  return out.dump();
}

Result<ClaimRequest> ParseClaimRequest(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json request, ParseObject(body, "claim request"));
  const std::string where = "claim request: ";
  ClaimRequest r;
  FW_RETURN_IF_ERROR(Field(request, "worker", r.worker, true, where));
  FW_RETURN_IF_ERROR(Field(request, "incarnation", r.incarnation, false, where));
  FW_RETURN_IF_ERROR(Field(request, "version", r.version, true, where));
  FW_RETURN_IF_ERROR(Field(request, "serving_since_unix_us", r.serving_since_unix_us, false, where));
  FW_RETURN_IF_ERROR(Field(request, "max_groups", r.max_groups, false, where));
  if (r.worker.empty() || r.max_groups < 1) {
    return Status::InvalidArgument(where + "worker must be named and max_groups >= 1");
  }
  return r;
}

Result<ClaimAnswer> ParseClaimAnswer(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json answer, ParseObject(body, "claim answer"));
  const std::string where = "claim answer: ";
  std::string status;
  FW_RETURN_IF_ERROR(Field(answer, "status", status, true, where));
  ClaimAnswer a;
  if (status == "wait") {
    a.kind = ClaimAnswer::Kind::kWait;
    FW_RETURN_IF_ERROR(Field(answer, "retry_ms", a.retry_ms, false, where));
    FW_RETURN_IF_ERROR(Field(answer, "reason", a.reason, false, where));
    return a;
  }
  if (status == "done") return ClaimAnswer::Done();
  if (status != "ok") return Status::InvalidArgument(where + "unknown status " + Quote(status));
  a.kind = ClaimAnswer::Kind::kOk;
  FW_RETURN_IF_ERROR(Field(answer, "trainer_version", a.trainer_version, false, where));
  FW_RETURN_IF_ERROR(Field(answer, "group_size", a.group_size, false, where));
  FW_RETURN_IF_ERROR(Field(answer, "temperature", a.temperature, false, where));
  FW_RETURN_IF_ERROR(Field(answer, "max_tokens", a.max_tokens, false, where));
  FW_RETURN_IF_ERROR(Field(answer, "max_turns", a.max_turns, false, where));
  FW_RETURN_IF_ERROR(Field(answer, "max_episode_tokens", a.max_episode_tokens, false, where));
  if (a.group_size < 1 || a.max_tokens < 1 || a.max_turns < 1) {
    return Status::InvalidArgument(where + "group_size, max_tokens and max_turns must be >= 1");
  }
  auto groups = answer.find("groups");
  if (groups == answer.end() || !groups->is_array()) {
    return Status::InvalidArgument(where + "\"groups\" must be an array");
  }
  for (size_t i = 0; i < groups->size(); ++i) {
    const json& g = (*groups)[i];
    const std::string at = where + "group " + std::to_string(i) + ": ";
    if (!g.is_object()) return Status::InvalidArgument(at + "not an object");
    ClaimedGroup group;
    FW_RETURN_IF_ERROR(Field(g, "claim", group.claim, true, at));
    FW_RETURN_IF_ERROR(Field(g, "prompt", group.prompt, true, at));
    FW_RETURN_IF_ERROR(Field(g, "answer", group.answer, true, at));
    if (auto messages = g.find("messages"); messages != g.end()) {
      if (!messages->is_array()) return Status::InvalidArgument(at + "\"messages\" must be an array");
      group.messages = *messages;
    }
    if (a.max_turns > 1 && !group.messages.is_array()) {
      return Status::InvalidArgument(at + "a multi-turn claim needs \"messages\"");
    }
    a.groups.push_back(std::move(group));
  }
  return a;
}

Result<SubmitRequest> ParseSubmitHeader(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json request, ParseObject(body, "submission"));
  SubmitRequest r;
  FW_RETURN_IF_ERROR(ReadHeader(request, r));
  return r;
}

Result<SubmitRequest> ParseSubmitRequest(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json request, ParseObject(body, "submission"));
  SubmitRequest r;
  FW_RETURN_IF_ERROR(ReadHeader(request, r));
  auto samples = request.find("samples");
  if (samples == request.end() || !samples->is_array()) {
    return Status::InvalidArgument("submission: \"samples\" must be an array of samples");
  }
  r.samples.reserve(samples->size());
  for (size_t i = 0; i < samples->size(); ++i) {
    FW_ASSIGN_OR_RETURN(RolloutSample sample,
                        ParseSample((*samples)[i], "sample " + std::to_string(i) + ": "));
    r.samples.push_back(std::move(sample));
  }
  return r;
}

std::string ToJson(const TurnRequest& r) {
  json samples = json::array();
  for (const TurnRequest::Item& item : r.samples) samples.push_back({{"index", item.index}, {"tokens", item.tokens}});
  return json{{"worker", r.worker}, {"incarnation", r.incarnation}, {"claim", r.claim}, {"samples", std::move(samples)}}
      .dump();
}

std::string ToJson(const TurnAnswer& a) {
  json samples = json::array();
  for (const TurnOutcome& o : a.samples) {
    json sample = {{"index", o.index}, {"kind", o.kind}};
    if (o.kind == "reward") sample["reward"] = o.reward;
    if (o.kind == "continue") sample["messages"] = o.messages;
    if (o.kind == "ungraded") sample["reason"] = o.reason;
    samples.push_back(std::move(sample));
  }
  // A reason may hold a grader's bytes cut mid-character: replaced, never a throw.
  return json{{"samples", std::move(samples)}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<TurnRequest> ParseTurnRequest(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json request, ParseObject(body, "turn request"));
  const std::string where = "turn request: ";
  TurnRequest r;
  FW_RETURN_IF_ERROR(Field(request, "worker", r.worker, true, where));
  FW_RETURN_IF_ERROR(Field(request, "incarnation", r.incarnation, false, where));
  FW_RETURN_IF_ERROR(Field(request, "claim", r.claim, true, where));
  auto samples = request.find("samples");
  if (samples == request.end() || !samples->is_array()) {
    return Status::InvalidArgument(where + "\"samples\" must be an array");
  }
  for (size_t i = 0; i < samples->size(); ++i) {
    const json& s = (*samples)[i];
    const std::string at = where + "sample " + std::to_string(i) + ": ";
    if (!s.is_object()) return Status::InvalidArgument(at + "not an object");
    TurnRequest::Item item;
    FW_RETURN_IF_ERROR(Field(s, "index", item.index, true, at));
    FW_RETURN_IF_ERROR(Field(s, "tokens", item.tokens, true, at));
    r.samples.push_back(std::move(item));
  }
  return r;
}

Result<TurnAnswer> ParseTurnAnswer(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json answer, ParseObject(body, "turn answer"));
  const std::string where = "turn answer: ";
  auto samples = answer.find("samples");
  if (samples == answer.end() || !samples->is_array()) {
    return Status::InvalidArgument(where + "\"samples\" must be an array");
  }
  TurnAnswer a;
  for (size_t i = 0; i < samples->size(); ++i) {
    const json& s = (*samples)[i];
    const std::string at = where + "sample " + std::to_string(i) + ": ";
    if (!s.is_object()) return Status::InvalidArgument(at + "not an object");
    TurnOutcome o;
    FW_RETURN_IF_ERROR(Field(s, "index", o.index, true, at));
    FW_RETURN_IF_ERROR(Field(s, "kind", o.kind, true, at));
    if (o.kind == "reward") {
      FW_RETURN_IF_ERROR(Field(s, "reward", o.reward, true, at));
    } else if (o.kind == "continue") {
      auto messages = s.find("messages");
      if (messages == s.end() || !messages->is_array()) return Status::InvalidArgument(at + "\"messages\" must be an array");
      o.messages = *messages;
    } else if (o.kind == "ungraded") {
      FW_RETURN_IF_ERROR(Field(s, "reason", o.reason, false, at));
    } else {
      return Status::InvalidArgument(at + "unknown kind " + Quote(o.kind));
    }
    a.samples.push_back(std::move(o));
  }
  return a;
}

Result<SubmitAnswer> ParseSubmitAnswer(std::string_view body) {
  FW_ASSIGN_OR_RETURN(json answer, ParseObject(body, "submit answer"));
  const std::string where = "submit answer: ";
  SubmitAnswer a;
  auto accepted = answer.find("accepted");
  if (accepted == answer.end() || !accepted->is_boolean()) {
    return Status::InvalidArgument(where + "\"accepted\" must be a boolean");
  }
  a.accepted = accepted->get<bool>();
  FW_RETURN_IF_ERROR(Field(answer, "reason", a.reason, false, where));
  return a;
}

}  // namespace flywheel::pipeline
