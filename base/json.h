// The one parser for JSON that crosses a trust boundary (a request body, a peer's report, an
// uploaded metadata document): size- and depth-limited, and never recursive on the input.
//
// Why: nlohmann's parser is iterative, but copying, comparing, dump()ing or converting a
// parsed value recurses once per nesting level, so 100,000 nested arrays in a 200 KB body
// overflow a thread's stack wherever the value is later touched. Parsing through this
// function bounds the nesting before any value exists, so every later recursion is bounded
// by JsonLimits::max_depth.
//
// Thread safety: stateless; call from any thread.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

#include "base/status.h"

namespace flywheel {

struct JsonLimits {
  // Arrays and objects nested deeper than this are refused ({"a": [1]} is depth 2).
  int max_depth = 64;
  // Longer documents are refused before any parsing.
  size_t max_bytes = size_t{64} << 20;
};

namespace json_internal {

// Forwards every SAX event to nlohmann's DOM builder and stops the parse (returns false) at
// the first container that would nest deeper than the limit.
template <typename Json>
class DepthLimitedSax {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  DepthLimitedSax(Json& result, int max_depth) : dom_(result, false), max_depth_(max_depth) {}

  bool null() { return dom_.null(); }
  bool boolean(bool value) { return dom_.boolean(value); }
  bool number_integer(number_integer_t value) { return dom_.number_integer(value); }
  bool number_unsigned(number_unsigned_t value) { return dom_.number_unsigned(value); }
  bool number_float(number_float_t value, const string_t& text) {
    return dom_.number_float(value, text);
  }
  bool string(string_t& value) { return dom_.string(value); }
  bool binary(binary_t& value) { return dom_.binary(value); }
  bool start_object(std::size_t elements) { return Enter() && dom_.start_object(elements); }
  bool key(string_t& value) { return dom_.key(value); }
  bool end_object() {
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t elements) { return Enter() && dom_.start_array(elements); }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& error) {
    error_ = error.what();
    error_position_ = position;
    return false;
  }

  bool too_deep() const { return too_deep_; }
  const std::string& error() const { return error_; }
  std::size_t error_position() const { return error_position_; }

 private:
  bool Enter() {
    if (++depth_ > max_depth_) {
      too_deep_ = true;
      return false;
    }
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<Json> dom_;
  int max_depth_;
  int depth_ = 0;
  bool too_deep_ = false;
  std::string error_;
  std::size_t error_position_ = 0;
};

// The byte offset of the first bracket nested deeper than `max_depth` (for the message).
std::size_t OffsetTooDeep(std::string_view text, int max_depth);

}  // namespace json_internal

// Parses `text` as one JSON document. Errors (InvalidArgument, message prefixed with
// `what`): longer than limits.max_bytes ("... is N bytes, over the limit of M"), nested
// deeper than limits.max_depth ("... nested deeper than 64 levels at byte N"), or not JSON
// (nlohmann's message, which names the byte).
// Json: nlohmann::json or nlohmann::ordered_json.
template <typename Json = nlohmann::json>
Result<Json> ParseJson(std::string_view text, std::string_view what, const JsonLimits& limits = {}) {
  const std::string prefix = what.empty() ? std::string("JSON") : std::string(what);
  if (text.size() > limits.max_bytes) {
    return Status::InvalidArgument(prefix + " is " + std::to_string(text.size()) +
                                   " bytes, over the limit of " +
                                   std::to_string(limits.max_bytes));
  }
  Json result;
  json_internal::DepthLimitedSax<Json> sax(result, limits.max_depth);
  const bool ok = Json::sax_parse(text, &sax, nlohmann::detail::input_format_t::json,
                                  /*strict=*/true, /*ignore_comments=*/false);
  if (sax.too_deep()) {
    return Status::InvalidArgument(
        prefix + ": JSON nested deeper than " + std::to_string(limits.max_depth) +
        " levels at byte " + std::to_string(json_internal::OffsetTooDeep(text, limits.max_depth)));
  }
  if (!ok) {
    return Status::InvalidArgument(prefix + ": not valid JSON: " +
                                   (sax.error().empty() ? std::string("parse failed") : sax.error()));
  }
  return result;
}

}  // namespace flywheel
