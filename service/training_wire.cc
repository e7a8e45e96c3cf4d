#include "service/training_wire.h"

#include <cmath>
#include <bit>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "base/json.h"

namespace flywheel::service {
namespace {

using json = nlohmann::json;

constexpr char kMagic[4] = {'F', 'W', 'B', '1'};
constexpr uint32_t kMaxHeaderBytes = 16u << 20;

enum class WireType { kI32, kF32, kU64 };

struct ArraySpec {
  std::string name;
  WireType type;
  size_t count;
  const char* data = nullptr;  // into the body
};

size_t ElementSize(WireType type) { return type == WireType::kU64 ? 8 : 4; }
const char* TypeName(WireType type) {
  return type == WireType::kI32 ? "i32" : type == WireType::kF32 ? "f32" : "u64";
}

// The per-datum fields: name, dtype, and elements per token (0: routing, per limits).
struct FieldInfo {
  const char* name;
  WireType type;
};
constexpr FieldInfo kFields[] = {
    {"tokens", WireType::kI32},       {"target_tokens", WireType::kI32},
    {"weights", WireType::kF32},      {"logprobs", WireType::kF32},
    {"advantages", WireType::kF32},   {"ref_logprobs", WireType::kF32},
    {"policy_versions", WireType::kU64}, {"routing", WireType::kI32},
    {"grads", WireType::kF32},
};

template <typename T>
void AppendLE(std::string& out, const T* values, size_t count) {
  static_assert(std::endian::native == std::endian::little, "little-endian hosts only");
  out.append(reinterpret_cast<const char*>(values), count * sizeof(T));
}

template <typename T>
std::vector<T> ReadLE(const char* data, size_t count) {
  std::vector<T> out(count);
  if (count > 0) std::memcpy(out.data(), data, count * sizeof(T));
  return out;
}

// The container: header JSON plus named arrays, in order.
struct Container {
  json header;
  std::vector<ArraySpec> arrays;
};

Result<Container> ParseContainer(std::string_view body) {
  if (body.size() < 8 || std::memcmp(body.data(), kMagic, 4) != 0) {
    return Status::InvalidArgument(
        "batch: the body does not start with the FWB1 magic (send Content-Type " +
        std::string(kBatchContentType) + " as docs/TRAINING_API.md describes)");
  }
  uint32_t header_bytes = 0;
  std::memcpy(&header_bytes, body.data() + 4, 4);
  if (header_bytes > kMaxHeaderBytes || header_bytes > body.size() - 8) {
    return Status::InvalidArgument("batch: header of " + std::to_string(header_bytes) +
                                   " bytes does not fit a body of " + std::to_string(body.size()));
  }
  Container c;
  c.header = ParseShallowJson(body.substr(8, header_bytes));
  if (c.header.is_discarded() || !c.header.is_object())
    return Status::InvalidArgument("batch: the header is not a JSON object");
  size_t offset = 8 + header_bytes;
  if (c.header.contains("arrays")) {
    const json& arrays = c.header["arrays"];
    if (!arrays.is_array()) return Status::InvalidArgument("batch: header \"arrays\" is not a list");
    std::set<std::string> seen;
    for (const json& a : arrays) {
      if (!a.is_object() || !a.contains("name") || !a["name"].is_string() ||
          !a.contains("dtype") || !a["dtype"].is_string() || !a.contains("count") ||
          !a["count"].is_number_unsigned()) {
        return Status::InvalidArgument(
            "batch: every entry of \"arrays\" needs a string name and dtype and a count >= 0");
      }
      ArraySpec spec;
      spec.name = a["name"].get<std::string>();
      const std::string dtype = a["dtype"].get<std::string>();
      if (dtype == "i32") {
        spec.type = WireType::kI32;
      } else if (dtype == "f32") {
        spec.type = WireType::kF32;
      } else if (dtype == "u64") {
        spec.type = WireType::kU64;
      } else {
        return Status::InvalidArgument("batch: array " + spec.name + " has dtype '" + dtype +
                                       "' (expected i32, f32 or u64)");
      }
      if (!seen.insert(spec.name).second)
        return Status::InvalidArgument("batch: array " + spec.name + " appears twice");
      const uint64_t count = a["count"].get<uint64_t>();
      const size_t size = ElementSize(spec.type);
      if (count > (body.size() - offset) / size) {
        return Status::InvalidArgument("batch: array " + spec.name + " of " +
                                       std::to_string(count) + " " + dtype +
                                       " runs past the end of the body");
      }
      spec.count = count;
      spec.data = body.data() + offset;
      offset += count * size;
      c.arrays.push_back(std::move(spec));
    }
    c.header.erase("arrays");
  }
  if (offset != body.size()) {
    return Status::InvalidArgument("batch: " + std::to_string(body.size() - offset) +
                                   " bytes after the last array");
  }
  return c;
}

std::string BuildContainer(json header, const std::vector<std::pair<ArraySpec, std::string>>& arrays) {
  json list = json::array();
  size_t total = 0;
  for (const auto& [spec, bytes] : arrays) {
    list.push_back({{"name", spec.name}, {"dtype", TypeName(spec.type)}, {"count", spec.count}});
    total += bytes.size();
  }
  header["arrays"] = std::move(list);
  const std::string text = header.dump();
  std::string out;
  out.reserve(8 + text.size() + total);
  out.append(kMagic, 4);
  const uint32_t n = static_cast<uint32_t>(text.size());
  AppendLE(out, &n, 1);
  out += text;
  for (const auto& [spec, bytes] : arrays) out += bytes;
  return out;
}

Result<std::vector<int64_t>> ReadLengths(const json& header, int64_t max_tokens) {
  if (!header.contains("lengths") || !header["lengths"].is_array())
    return Status::InvalidArgument("batch: header \"lengths\" (one length per datum) is missing");
  std::vector<int64_t> lengths;
  int64_t longest = 0;
  for (const json& l : header["lengths"]) {
    if (!l.is_number_integer() || l.get<int64_t>() < 1) {
      return Status::InvalidArgument("batch: datum " + std::to_string(lengths.size()) +
                                     " has length " + l.dump() + " (expected an integer >= 1)");
    }
    lengths.push_back(l.get<int64_t>());
    longest = std::max(longest, lengths.back());
    // The trainer pads every datum to the longest: that is what the limit counts.
    if (longest > max_tokens / static_cast<int64_t>(lengths.size())) {
      return Status::ResourceExhausted(
          "batch: " + std::to_string(lengths.size()) + " datums padded to " +
          std::to_string(longest) + " tokens exceed " + std::to_string(max_tokens) +
          " tokens (the server's --max-batch-tokens)");
    }
  }
  if (lengths.empty()) return Status::InvalidArgument("batch: no datums");
  return lengths;
}

Status ExpectNumber(const json& value, const std::string& key) {
  if (!value.is_number()) return Status::InvalidArgument(key + " must be a number, got " + value.dump());
  return Status::Ok();
}

}  // namespace

json ParseShallowJson(std::string_view text, int max_depth) {
  JsonLimits limits;
  limits.max_depth = max_depth;
  Result<json> parsed = ParseJson(text, "", limits);
  return parsed.ok() ? std::move(parsed).value() : json(json::value_t::discarded);
}

Result<WireBatch> DecodeBatch(std::string_view body, const WireLimits& limits) {
  FW_ASSIGN_OR_RETURN(Container c, ParseContainer(body));
  FW_ASSIGN_OR_RETURN(std::vector<int64_t> lengths, ReadLengths(c.header, limits.max_tokens));
  c.header.erase("lengths");
  int64_t tokens = 0;
  for (int64_t l : lengths) tokens += l;
  WireBatch batch;
  batch.datums.resize(lengths.size());
  std::set<std::string> given;
  for (const ArraySpec& a : c.arrays) {
    const FieldInfo* field = nullptr;
    for (const FieldInfo& f : kFields) {
      if (a.name == f.name) field = &f;
    }
    if (field == nullptr) {
      return Status::InvalidArgument("batch: unknown array '" + a.name +
                                     "' (known: tokens, target_tokens, weights, logprobs, "
                                     "advantages, ref_logprobs, policy_versions, routing, grads)");
    }
    if (a.type != field->type) {
      return Status::InvalidArgument("batch: array " + a.name + " must be " +
                                     TypeName(field->type) + ", got " + TypeName(a.type));
    }
    given.insert(a.name);
    const bool routing = a.name == "routing";
    int64_t per_token = 1;
    if (routing) {
      if (limits.routing_per_token <= 0)
        return Status::InvalidArgument("batch: routing given, but the model is not a mixture of experts");
      per_token = limits.routing_per_token;
    }
    if (static_cast<int64_t>(a.count) != tokens * per_token) {
      return Status::InvalidArgument(
          "batch: array " + a.name + " has " + std::to_string(a.count) + " elements; the " +
          std::to_string(lengths.size()) + " datums' lengths add up to " + std::to_string(tokens) +
          (routing ? " tokens x " + std::to_string(per_token) + " (moe layers x top_k)" : "") +
          " (a field is given for every datum or for none)");
    }
    const char* p = a.data;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const size_t n = static_cast<size_t>(lengths[i] * per_token);
      trainer::Datum& d = batch.datums[i];
      if (a.name == "tokens") d.tokens = ReadLE<int32_t>(p, n);
      else if (a.name == "target_tokens") d.target_tokens = ReadLE<int32_t>(p, n);
      else if (a.name == "weights") d.weights = ReadLE<float>(p, n);
      else if (a.name == "logprobs") d.logprobs = ReadLE<float>(p, n);
      else if (a.name == "advantages") d.advantages = ReadLE<float>(p, n);
      else if (a.name == "ref_logprobs") d.ref_logprobs = ReadLE<float>(p, n);
      else if (a.name == "policy_versions") d.policy_versions = ReadLE<uint64_t>(p, n);
      else if (a.name == "routing") d.routing = ReadLE<int32_t>(p, n);
      else if (a.name == "grads") {
        if (batch.grads.empty()) batch.grads.resize(lengths.size());
        batch.grads[i] = ReadLE<float>(p, n);
      }
      p += n * ElementSize(a.type);
    }
  }
  for (const char* required : {"tokens", "target_tokens"}) {
    if (!given.count(required))
      return Status::InvalidArgument(std::string("batch: array ") + required + " is missing");
  }
  batch.header = std::move(c.header);
  return batch;
}

std::string EncodeBatch(json header, const std::vector<trainer::Datum>& datums,
                        const std::vector<std::vector<float>>& grads) {
  json lengths = json::array();
  for (const trainer::Datum& d : datums) lengths.push_back(d.tokens.size());
  header["lengths"] = std::move(lengths);
  std::vector<std::pair<ArraySpec, std::string>> arrays;
  auto add = [&](const char* name, WireType type, auto member) {
    bool any = false;
    for (const trainer::Datum& d : datums) any |= !(d.*member).empty();
    if (!any) return;
    std::string bytes;
    size_t count = 0;
    for (const trainer::Datum& d : datums) {
      AppendLE(bytes, (d.*member).data(), (d.*member).size());
      count += (d.*member).size();
    }
    arrays.push_back({ArraySpec{name, type, count}, std::move(bytes)});
  };
  add("tokens", WireType::kI32, &trainer::Datum::tokens);
  add("target_tokens", WireType::kI32, &trainer::Datum::target_tokens);
  add("weights", WireType::kF32, &trainer::Datum::weights);
  add("logprobs", WireType::kF32, &trainer::Datum::logprobs);
  add("advantages", WireType::kF32, &trainer::Datum::advantages);
  add("ref_logprobs", WireType::kF32, &trainer::Datum::ref_logprobs);
  add("policy_versions", WireType::kU64, &trainer::Datum::policy_versions);
  add("routing", WireType::kI32, &trainer::Datum::routing);
  if (!grads.empty()) {
    std::string bytes;
    size_t count = 0;
    for (const auto& g : grads) {
      AppendLE(bytes, g.data(), g.size());
      count += g.size();
    }
    arrays.push_back({ArraySpec{"grads", WireType::kF32, count}, std::move(bytes)});
  }
  return BuildContainer(std::move(header), arrays);
}

std::string EncodeForwardOutput(const trainer::ForwardOutput& output) {
  json header;
  json lengths = json::array();
  std::string lp, routing;
  size_t lp_count = 0, routing_count = 0;
  for (size_t i = 0; i < output.logprobs.size(); ++i) {
    lengths.push_back(output.logprobs[i].size());
    AppendLE(lp, output.logprobs[i].data(), output.logprobs[i].size());
    lp_count += output.logprobs[i].size();
    if (i < output.routing.size()) {
      AppendLE(routing, output.routing[i].data(), output.routing[i].size());
      routing_count += output.routing[i].size();
    }
  }
  header["lengths"] = std::move(lengths);
  std::vector<std::pair<ArraySpec, std::string>> arrays;
  arrays.push_back({ArraySpec{"logprobs", WireType::kF32, lp_count}, std::move(lp)});
  if (routing_count > 0)
    arrays.push_back({ArraySpec{"routing", WireType::kI32, routing_count}, std::move(routing)});
  return BuildContainer(std::move(header), arrays);
}

Result<trainer::ForwardOutput> DecodeForwardOutput(std::string_view body) {
  FW_ASSIGN_OR_RETURN(Container c, ParseContainer(body));
  FW_ASSIGN_OR_RETURN(std::vector<int64_t> lengths,
                      ReadLengths(c.header, std::numeric_limits<int64_t>::max()));
  int64_t tokens = 0;
  for (int64_t l : lengths) tokens += l;
  trainer::ForwardOutput out;
  out.logprobs.resize(lengths.size());
  out.routing.resize(lengths.size());
  for (const ArraySpec& a : c.arrays) {
    if (a.name == "logprobs" && a.type == WireType::kF32 && static_cast<int64_t>(a.count) == tokens) {
      const char* p = a.data;
      for (size_t i = 0; i < lengths.size(); ++i) {
        out.logprobs[i] = ReadLE<float>(p, lengths[i]);
        p += lengths[i] * 4;
      }
    } else if (a.name == "routing" && a.type == WireType::kI32 && tokens > 0 &&
               a.count % tokens == 0) {
      const size_t per = a.count / tokens;
      const char* p = a.data;
      for (size_t i = 0; i < lengths.size(); ++i) {
        out.routing[i] = ReadLE<int32_t>(p, lengths[i] * per);
        p += lengths[i] * per * 4;
      }
    } else {
      return Status::InvalidArgument("forward answer: unexpected array " + a.name);
    }
  }
  return out;
}

Result<trainer::LossConfig> LossConfigFromJson(const json& j) {
  trainer::LossConfig c;
  if (j.is_null()) return c;
  if (!j.is_object()) return Status::InvalidArgument("loss_config must be a JSON object");
  const std::map<std::string, double*> numbers = {
      {"norm_length", &c.norm_length}, {"clip_low", &c.clip_low},   {"clip_high", &c.clip_high},
      {"dual_clip", &c.dual_clip},     {"cispo_low", &c.cispo_low}, {"cispo_high", &c.cispo_high},
      {"dro_beta", &c.dro_beta},       {"dpo_beta", &c.dpo_beta},   {"kl_coef", &c.kl_coef},
      {"tis_cap", &c.tis_cap}};
  for (const auto& [key, value] : j.items()) {
    if (auto it = numbers.find(key); it != numbers.end()) {
      FW_RETURN_IF_ERROR(ExpectNumber(value, "loss_config." + key));
      *it->second = value.get<double>();
    } else if (key == "aggregation") {
      if (!value.is_string()) return Status::InvalidArgument("loss_config.aggregation must be a string");
      FW_ASSIGN_OR_RETURN(c.aggregation, trainer::ParseAggregation(value.get<std::string>()));
    } else if (key == "kl_estimator") {
      if (!value.is_string()) return Status::InvalidArgument("loss_config.kl_estimator must be a string");
      FW_ASSIGN_OR_RETURN(c.kl_estimator, trainer::ParseKlEstimator(value.get<std::string>()));
    } else {
      return Status::InvalidArgument(
          "unknown loss_config key '" + key +
          "' (known: aggregation, norm_length, clip_low, clip_high, dual_clip, cispo_low, "
          "cispo_high, dro_beta, dpo_beta, kl_coef, kl_estimator, tis_cap)");
    }
  }
  FW_RETURN_IF_ERROR(c.Validate());
  return c;
}

json ToJson(const trainer::LossConfig& c) {
  const char* kl = c.kl_estimator == trainer::KlEstimator::kK1   ? "k1"
                   : c.kl_estimator == trainer::KlEstimator::kK2 ? "k2"
                                                                 : "k3";
  return {{"aggregation", trainer::AggregationString(c.aggregation)},
          {"norm_length", c.norm_length},
          {"clip_low", c.clip_low},
          {"clip_high", c.clip_high},
          {"dual_clip", c.dual_clip},
          {"cispo_low", c.cispo_low},
          {"cispo_high", c.cispo_high},
          {"dro_beta", c.dro_beta},
          {"dpo_beta", c.dpo_beta},
          {"kl_coef", c.kl_coef},
          {"kl_estimator", kl},
          {"tis_cap", c.tis_cap}};
}

Result<trainer::AdamWParams> AdamFromJson(const json& j) {
  trainer::AdamWParams p;
  if (j.is_null()) return p;
  if (!j.is_object()) return Status::InvalidArgument("adam must be a JSON object");
  const std::map<std::string, double*> numbers = {
      {"lr", &p.lr},     {"beta1", &p.beta1},       {"beta2", &p.beta2},
      {"eps", &p.eps},   {"weight_decay", &p.weight_decay}, {"grad_clip", &p.grad_clip}};
  for (const auto& [key, value] : j.items()) {
    auto it = numbers.find(key);
    if (it == numbers.end()) {
      return Status::InvalidArgument("unknown adam key '" + key +
                                     "' (known: lr, beta1, beta2, eps, weight_decay, grad_clip)");
    }
    FW_RETURN_IF_ERROR(ExpectNumber(value, "adam." + key));
    *it->second = value.get<double>();
  }
  FW_RETURN_IF_ERROR(p.Validate());
  return p;
}

json ToJson(const trainer::AdamWParams& p) {
  return {{"lr", p.lr},   {"beta1", p.beta1},
          {"beta2", p.beta2}, {"eps", p.eps},
          {"weight_decay", p.weight_decay}, {"grad_clip", p.grad_clip}};
}

json ToJson(const trainer::Metrics& m) {
  return {{"loss", m.loss},
          {"kl_sampler_k3", m.kl_sampler_k3},
          {"clip_fraction", m.clip_fraction},
          {"kl_reference", m.kl_reference},
          {"tis_truncated", m.tis_truncated},
          {"aux_loss", m.aux_loss},
          {"grad_norm", m.grad_norm},
          {"tokens_per_s", m.tokens_per_s},
          {"sequences", m.sequences},
          {"tokens", m.tokens},
          {"step", m.step}};
}

Result<trainer::Metrics> MetricsFromJson(const json& j) {
  if (!j.is_object()) return Status::InvalidArgument("metrics must be a JSON object");
  trainer::Metrics m;
  try {
    m.loss = j.value("loss", 0.0);
    m.kl_sampler_k3 = j.value("kl_sampler_k3", 0.0);
    m.clip_fraction = j.value("clip_fraction", 0.0);
    m.kl_reference = j.value("kl_reference", 0.0);
    m.tis_truncated = j.value("tis_truncated", 0.0);
    m.aux_loss = j.value("aux_loss", 0.0);
    m.grad_norm = j.value("grad_norm", 0.0);
    m.tokens_per_s = j.value("tokens_per_s", 0.0);
    m.sequences = j.value("sequences", int64_t{0});
    m.tokens = j.value("tokens", int64_t{0});
    m.step = j.value("step", uint64_t{0});
  } catch (const json::exception& e) {
    return Status::InvalidArgument(std::string("metrics: ") + e.what());
  }
  return m;
}

}  // namespace flywheel::service
