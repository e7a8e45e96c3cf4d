// Chat templates: the Jinja `chat_template` of an HF `tokenizer_config.json`, rendered the
// way transformers' apply_chat_template renders it.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace flywheel::tokenizer {

class ChatTemplate {
 public:
  // Parses `source`; a construct outside the supported subset is refused by name here, never
  // at render time.
  static Result<ChatTemplate> Parse(std::string_view source);

  // Renders with `context` as the template's variables (messages, tools,
  // add_generation_prompt, enable_thinking, bos_token, eos_token, ...). Key order of
  // objects is kept (tojson prints keys in the order given).
  Result<std::string> Render(const nlohmann::ordered_json& context) const;

 private:
  struct Program;
  std::shared_ptr<const Program> program_;
};

}  // namespace flywheel::tokenizer
