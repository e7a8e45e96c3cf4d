// A chat template is a parsed Jinja program (jinja_parse.cc) run by the renderer
// (jinja_render.cc).
#include "tokenizer/chat_template.h"

#include <utility>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_render.h"

namespace flywheel::tokenizer {

struct ChatTemplate::Program {
  std::unique_ptr<jinja::Template> tmpl;
  bool has_generation_blocks = false;
};

Result<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<jinja::Template> tmpl, jinja::ParseTemplate(source));
  auto program = std::make_shared<Program>();
  program->has_generation_blocks = jinja::HasGenerationBlocks(*tmpl);
  program->tmpl = std::move(tmpl);
  ChatTemplate result;
  result.program_ = std::move(program);
  return result;
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  return jinja::RenderTemplate(*program_->tmpl, context);
}

Result<ChatTemplate::Rendered> ChatTemplate::RenderWithGenerationSpans(
    const nlohmann::ordered_json& context) const {
  Rendered rendered;
  FW_ASSIGN_OR_RETURN(rendered.text, jinja::RenderTemplateWithGenerationSpans(
                                         *program_->tmpl, context, &rendered.generation_spans));
  return rendered;
}

bool ChatTemplate::has_generation_blocks() const { return program_->has_generation_blocks; }

}  // namespace flywheel::tokenizer
