// The training service's wire format (docs/TRAINING_API.md): token, mask, logprob and
// advantage arrays travel as raw little-endian arrays in a small container, not as JSON lists:
//
//   "FWB1" | header_bytes (u32 LE) | header (UTF-8 JSON) | arrays back to back, no padding
//
// header["arrays"] lists {"name","dtype","count"} (dtype i32, f32 or u64). A batch's header
// also has "lengths" (one T >= 1 per datum) and the call's scalars; each array holds every
// datum's values back to back, and a field is given for every datum or for none. Plus the
// JSON forms of the calls' parameters and answers (loss config, AdamW, metrics).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "trainer/training_client.h"

namespace flywheel::service {

inline constexpr const char* kBatchContentType = "application/x-flywheel-batch";

// A decoded batch: the header (its "arrays" and "lengths" consumed) and the datums; `grads`
// holds the per-datum "grads" arrays when the body had them (forward_backward_custom).
struct WireBatch {
  nlohmann::json header;
  std::vector<trainer::Datum> datums;
  std::vector<std::vector<float>> grads;
};

struct WireLimits {
  int64_t max_tokens = 1 << 20;    // datums x the longest datum (the padded batch)
  int64_t routing_per_token = 0;   // moe_layers x top_k: a routing array's elements per token
};

// Parses `text` as JSON nested at most `max_depth` deep (deeper documents would recurse deep
// in dump() and copies: a stack a client could overflow); discarded (is_discarded()) when it
// is not JSON or nests deeper.
nlohmann::json ParseShallowJson(std::string_view text, int max_depth = 16);

// Decodes a request body. InvalidArgument names what is wrong (magic, header, an array's
// dtype or count against "lengths", a field given for some datums only); ResourceExhausted
// when the batch has more tokens than limits.max_tokens.
Result<WireBatch> DecodeBatch(std::string_view body, const WireLimits& limits);
// The request body of `datums` (and `grads` when non-empty) with `header`'s scalars.
std::string EncodeBatch(nlohmann::json header, const std::vector<trainer::Datum>& datums,
                        const std::vector<std::vector<float>>& grads = {});

// forward's answer: "logprobs" (f32) and "routing" (i32, only when some datum has routing).
std::string EncodeForwardOutput(const trainer::ForwardOutput& output);
Result<trainer::ForwardOutput> DecodeForwardOutput(std::string_view body);

// JSON <-> the calls' parameters. Unknown keys and values of the wrong type are
// InvalidArgument naming the key.
Result<trainer::LossConfig> LossConfigFromJson(const nlohmann::json& json);
nlohmann::json ToJson(const trainer::LossConfig& config);
Result<trainer::AdamWParams> AdamFromJson(const nlohmann::json& json);
nlohmann::json ToJson(const trainer::AdamWParams& params);
nlohmann::json ToJson(const trainer::Metrics& metrics);
Result<trainer::Metrics> MetricsFromJson(const nlohmann::json& json);

}  // namespace flywheel::service
