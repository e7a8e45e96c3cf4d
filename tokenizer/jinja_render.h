// The interpreter of the chat-template language: statements, expressions, and the builtin
// filters, tests, methods and globals, with jinja2's (Python's) semantics as
// tokenizer/chat_template.h states them. The lexer and parser are in jinja_parse.cc
// (jinja_ast.h), values in jinja_value.cc (jinja_value.h).
//
// Private to flywheel_tokenizer.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "tokenizer/jinja_ast.h"

namespace flywheel::tokenizer::jinja {

// Renders `tmpl` with the keys of `context` as its variables. Errors are
// ChatTemplate::Render's (kInvalidArgument naming the template line, kResourceExhausted past
// the size limits). Reentrant: `tmpl` is only read.
Result<std::string> RenderTemplate(const Template& tmpl, const nlohmann::ordered_json& context);

}  // namespace flywheel::tokenizer::jinja
