// JSON schemas for structured outputs (response_format json_schema, guided_json): a schema
// of the subset below compiled to a regex (tokenizer/grammar.h) whose every match is a
// compact JSON document valid against it.
//
// Supported: "type" (string, integer, number, boolean, null, object, array, or a list of
// them), "properties" (written in the schema's order), "required", "additionalProperties"
// (no others are ever written), "items", "minItems", "maxItems", "minLength", "maxLength",
// "pattern" (the whole string matches it; one that could write '"', '\' or a control
// character is refused), "format" (date, time, date-time, uuid), "enum", "const", "anyOf";
// annotations (title, description, default, examples, $schema, $id, $comment, readOnly,
// writeOnly, deprecated) are ignored. Anything else is refused by name with its path
// (e.g. "'minimum' at $.properties.age is not supported"): $ref, oneOf, allOf, not,
// minimum/maximum, uniqueItems, prefixItems, patternProperties, an object without
// "properties", an array without "items".
//
// Optional properties before the first required one are written as one alternative per
// possible first property, each followed by the rest: about 30 of them build (in ~0.15 s);
// many more exceed the automaton's limits and are refused (list them in "required",
// nullable if need be, as OpenAI's strict mode does).
//
// What is written: no whitespace but an optional single space after ',' and ':'; integers
// of at most 16 digits; numbers with at most 16 fraction digits and a 2-digit exponent (so any
// parser reads it as a finite double);
// strings of any characters (escapes included) unless bounded.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace flywheel::tokenizer {

// Nesting deeper than this (objects and arrays in the schema) is refused.
inline constexpr int kJsonSchemaMaxDepth = 32;
// The longest regex a schema may compile to (CompileRegex's max_bytes for it): optional
// properties before the first required one repeat the rest once each.
inline constexpr size_t kJsonSchemaMaxRegexBytes = size_t{4} << 20;

// InvalidArgument naming the unsupported keyword or bad value and where it is.
Result<std::string> JsonSchemaRegex(const nlohmann::ordered_json& schema);

// Whether `value` is valid against `schema` (the subset above; a string's "pattern" must
// match it whole, as the compiled regex writes it). The mismatch names where.
Status CheckJsonSchema(const nlohmann::ordered_json& schema, const nlohmann::ordered_json& value);

}  // namespace flywheel::tokenizer
