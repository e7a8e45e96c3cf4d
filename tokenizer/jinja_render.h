// The interpreter of the chat-template language: statements, expressions, and the builtin
// filters, tests, methods and globals, with jinja2's (Python's) semantics as
// tokenizer/chat_template.h states them. The lexer and parser are in jinja_parse.cc
// (jinja_ast.h), values in jinja_value.cc (jinja_value.h).
//
// Private to flywheel_tokenizer.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "tokenizer/jinja_ast.h"

namespace flywheel::tokenizer::jinja {

// Renders `tmpl` with the keys of `context` as its variables. Errors are
// ChatTemplate::Render's (kInvalidArgument naming the template line, kResourceExhausted past
// the size limits). Reentrant: `tmpl` is only read.
Result<std::string> RenderTemplate(const Template& tmpl, const nlohmann::ordered_json& context);

// As RenderTemplate, and appends to `spans` the [begin, end) byte range of the output that
// each `{% generation %}` block produced, in render order (empty ones left out). A generation
// block that renders into anything but the template's own output (a macro's body, a block
// set, a filter block) fails the render with kInvalidArgument naming its line: its place in
// the output is unknown.
Result<std::string> RenderTemplateWithGenerationSpans(
    const Template& tmpl, const nlohmann::ordered_json& context,
    std::vector<std::pair<size_t, size_t>>* spans);

}  // namespace flywheel::tokenizer::jinja
