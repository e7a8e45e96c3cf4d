// Chat-template rendering with loss masks: where the assistant turns are in the rendered
// text (generation blocks, or prefix by prefix), and which tokens that makes trained.
#include "data/render.h"

#include <algorithm>
#include <utility>

namespace flywheel::data {

using nlohmann::ordered_json;

namespace {

ordered_json Head(const ordered_json& messages, size_t count) {
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < count && i < messages.size(); ++i) out.push_back(messages[i]);
  return out;
}

size_t CommonPrefix(const std::string& a, const std::string& b) {
  size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

bool IsPrefix(const std::string& prefix, const std::string& text) {
  return prefix.size() <= text.size() && text.compare(0, prefix.size(), prefix) == 0;
}

std::vector<std::string> DefaultEndOfTurn(const tokenizer::HfTokenizer& tokenizer) {
  std::vector<std::string> out;
  auto add = [&out](const std::string& text) {
    if (!text.empty() && std::find(out.begin(), out.end(), text) == out.end()) out.push_back(text);
  };
  for (int32_t id : tokenizer.StopTokens())
    if (id >= 0 && id < tokenizer.vocab_size() && tokenizer.IsSpecial(id)) add(tokenizer.TokenText(id));
  add(tokenizer.eos_token());
  return out;
}

}  // namespace

const char* SpanMethodName(SpanMethod method) {
  switch (method) {
    case SpanMethod::kGenerationBlocks: return "generation blocks";
    case SpanMethod::kPrefixes: return "prefixes";
    case SpanMethod::kPerTurn: return "per turn";
  }
  return "?";
}

int64_t TokenizedSequence::trained_tokens() const {
  return std::count(loss_mask.begin(), loss_mask.end(), uint8_t{1});
}

Result<ChatRenderer> ChatRenderer::Create(const tokenizer::HfTokenizer* tokenizer,
                                          RenderOptions options) {
  if (tokenizer == nullptr) return Status::InvalidArgument("no tokenizer");
  if (tokenizer->chat_template().empty())
    return Status::InvalidArgument("the tokenizer has no chat_template (tokenizer_config.json)");
  Result<tokenizer::ChatTemplate> parsed = tokenizer::ChatTemplate::Parse(tokenizer->chat_template());
  if (!parsed.ok()) return parsed.status().WithContext("chat template");
  return Create(tokenizer, std::move(parsed).value(), std::move(options));
}

Result<ChatRenderer> ChatRenderer::Create(const tokenizer::HfTokenizer* tokenizer,
                                          tokenizer::ChatTemplate chat_template,
                                          RenderOptions options) {
  if (tokenizer == nullptr) return Status::InvalidArgument("no tokenizer");
  if (!options.extra_context.is_object())
    return Status::InvalidArgument("extra template context must be a JSON object");
  if (options.max_tokens < 0) return Status::InvalidArgument("max_tokens must not be negative");
  std::vector<std::string> end_of_turn =
      options.end_of_turn.empty() ? DefaultEndOfTurn(*tokenizer) : options.end_of_turn;
  return ChatRenderer(tokenizer, std::move(chat_template), std::move(options),
                      std::move(end_of_turn));
}

ChatRenderer::ChatRenderer(const tokenizer::HfTokenizer* tokenizer,
                           tokenizer::ChatTemplate chat_template, RenderOptions options,
                           std::vector<std::string> end_of_turn)
    : tokenizer_(tokenizer),
      template_(std::move(chat_template)),
      options_(std::move(options)),
      end_of_turn_(std::move(end_of_turn)) {}

ordered_json ChatRenderer::Context(const ordered_json& messages, const ordered_json& tools,
                                   bool add_generation_prompt) const {
  ordered_json context = options_.extra_context;
  context["messages"] = messages;
  if (!tools.is_null()) context["tools"] = tools;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = tokenizer_->bos_token();
  context["eos_token"] = tokenizer_->eos_token();
  return context;
}

Result<std::string> ChatRenderer::RenderText(const ordered_json& messages, const ordered_json& tools,
                                             bool add_generation_prompt) const {
  Result<std::string> text = template_.Render(Context(messages, tools, add_generation_prompt));
  if (!text.ok()) return text.status().WithContext("chat template cannot render the line");
  return text;
}

// Where the turn's own text ends: after the last end-of-turn token text in [begin, end), or
// `end` when there is none.
static size_t CutAtEndOfTurn(const std::string& text, size_t begin, size_t end,
                             const std::vector<std::string>& end_of_turn) {
  size_t cut = std::string::npos;
  for (const std::string& marker : end_of_turn) {
    if (marker.size() > end - begin) continue;
    size_t at = text.rfind(marker, end - marker.size());
    if (at != std::string::npos && at >= begin) {
      size_t after = at + marker.size();
      if (cut == std::string::npos || after > cut) cut = after;
    }
  }
  return cut == std::string::npos ? end : cut;
}

Result<std::pair<size_t, size_t>> ChatRenderer::TurnSpan(const ordered_json& messages, size_t turn,
                                                         const ordered_json& tools,
                                                         std::string* with_turn) const {
  FW_ASSIGN_OR_RETURN(std::string prompt, RenderText(Head(messages, turn), tools, true));
  FW_ASSIGN_OR_RETURN(*with_turn, RenderText(Head(messages, turn + 1), tools, false));
  size_t begin = CommonPrefix(prompt, *with_turn);
  size_t end = CutAtEndOfTurn(*with_turn, begin, with_turn->size(), end_of_turn_);
  if (begin >= end)
    return Status::Mismatch("messages[" + std::to_string(turn) +
                            "]: the assistant turn renders no text of its own");
  return std::make_pair(begin, end);
}

Result<std::vector<TextSpans>> ChatRenderer::GenerationBlockSpans(
    const ordered_json& messages, const std::vector<bool>& trained, const ordered_json& tools) const {
  Result<tokenizer::ChatTemplate::Rendered> rendered =
      template_.RenderWithGenerationSpans(Context(messages, tools, false));
  if (!rendered.ok()) return rendered.status().WithContext("chat template cannot render the line");
  std::vector<size_t> assistants;
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i]["role"] == "assistant") assistants.push_back(i);
  const auto& blocks = rendered->generation_spans;
  bool all_trained = std::all_of(assistants.begin(), assistants.end(),
                                 [&](size_t i) { return trained[i]; });
  if (blocks.empty()) return Status::Mismatch("the template's generation blocks rendered nothing");
  if (blocks.size() != assistants.size() && !all_trained)
    return Status::Mismatch("the template's generation blocks produced " +
                            std::to_string(blocks.size()) + " spans for " +
                            std::to_string(assistants.size()) +
                            " assistant messages: a weight 0 turn cannot be told apart");
  TextSpans out;
  out.text = std::move(rendered->text);
  for (size_t k = 0; k < blocks.size(); ++k)
    if (blocks.size() != assistants.size() || trained[assistants[k]]) out.spans.push_back(blocks[k]);
  return std::vector<TextSpans>{std::move(out)};
}

Result<std::pair<SpanMethod, std::vector<TextSpans>>> ChatRenderer::TrainedSpans(
    const ordered_json& messages, const std::vector<bool>& trained, const ordered_json& tools) const {
  if (trained.size() != messages.size())
    return Status::InvalidArgument("one trained flag per message is needed");
  if (template_.has_generation_blocks()) {
    FW_ASSIGN_OR_RETURN(std::vector<TextSpans> spans, GenerationBlockSpans(messages, trained, tools));
    return std::make_pair(SpanMethod::kGenerationBlocks, std::move(spans));
  }
  std::vector<TextSpans> turns;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!trained[i]) continue;
    TextSpans turn;
    using Span = std::pair<size_t, size_t>;
    FW_ASSIGN_OR_RETURN(Span span, TurnSpan(messages, i, tools, &turn.text));
    turn.spans.push_back(span);
    turns.push_back(std::move(turn));
  }
  if (turns.empty()) return Status::InvalidArgument("no trained assistant turn");
  FW_ASSIGN_OR_RETURN(std::string whole, RenderText(messages, tools, false));
  bool stable = true;
  for (size_t k = 0; k < turns.size(); ++k) {
    stable = stable && IsPrefix(turns[k].text, whole);
    if (k > 0) stable = stable && turns[k].spans[0].first >= turns[k - 1].spans[0].second;
  }
  if (!stable) return std::make_pair(SpanMethod::kPerTurn, std::move(turns));
  TextSpans one{std::move(whole), {}};
  for (const TextSpans& turn : turns) one.spans.push_back(turn.spans[0]);
  return std::make_pair(SpanMethod::kPrefixes, std::vector<TextSpans>{std::move(one)});
}

Result<TokenizedSequence> ChatRenderer::Tokenize(TextSpans rendered) const {
  TokenizedSequence out;
  FW_ASSIGN_OR_RETURN(out.ids, tokenizer_->Encode(rendered.text));
  std::vector<std::pair<size_t, size_t>> pieces;
  pieces.reserve(out.ids.size());
  tokenizer::DecodeState state;
  std::string bytes;
  for (int32_t id : out.ids) {
    size_t before = bytes.size();
    FW_RETURN_IF_ERROR(tokenizer_->AppendPiece(id, /*skip_special_tokens=*/false, state, bytes));
    pieces.emplace_back(before, bytes.size());
  }
  if (bytes != rendered.text)
    return Status::Mismatch("the tokenizer does not give the rendered text back byte for byte "
                            "(from byte " + std::to_string(CommonPrefix(bytes, rendered.text)) +
                            "): the assistant spans cannot be placed on its tokens");
  out.loss_mask.assign(out.ids.size(), 0);
  for (size_t t = 0; t < pieces.size(); ++t) {
    auto [a, b] = pieces[t];
    for (const auto& [begin, end] : rendered.spans) {
      bool in = a == b ? (a >= begin && a < end) : (a < end && b > begin);
      if (!in) continue;
      out.loss_mask[t] = 1;
      if (a < begin || b > end) ++out.straddling_tokens;
      break;
    }
  }
  out.rendered = std::move(rendered);
  return out;
}

Status ChatRenderer::CheckLength(const TokenizedSequence& sequence) const {
  if (options_.max_tokens > 0 && static_cast<int64_t>(sequence.ids.size()) > options_.max_tokens)
    return Status::ResourceExhausted(std::to_string(sequence.ids.size()) +
                                     " tokens, over max_tokens " +
                                     std::to_string(options_.max_tokens));
  return Status::Ok();
}

Result<SftRendering> ChatRenderer::RenderSft(const Example& example) const {
  FW_ASSIGN_OR_RETURN(auto spans, TrainedSpans(example.messages, example.trained, example.tools));
  SftRendering out;
  out.method = spans.first;
  for (TextSpans& rendered : spans.second) {
    FW_ASSIGN_OR_RETURN(TokenizedSequence sequence, Tokenize(std::move(rendered)));
    FW_RETURN_IF_ERROR(CheckLength(sequence));
    out.sequences.push_back(std::move(sequence));
  }
  return out;
}

Result<DpoRendering> ChatRenderer::RenderDpo(const Example& example) const {
  FW_ASSIGN_OR_RETURN(std::string prompt, RenderText(example.messages, example.tools, true));
  DpoRendering out;
  for (bool chosen : {true, false}) {
    ordered_json all = example.messages;
    for (const ordered_json& message : chosen ? example.chosen : example.rejected) all.push_back(message);
    TextSpans rendered;
    FW_ASSIGN_OR_RETURN(rendered.text, RenderText(all, example.tools, false));
    size_t begin = CommonPrefix(prompt, rendered.text);
    size_t end = CutAtEndOfTurn(rendered.text, begin, rendered.text.size(), end_of_turn_);
    if (begin >= end)
      return Status::Mismatch(std::string(chosen ? "preferred" : "non_preferred") +
                              "_output renders no text of its own");
    rendered.spans.emplace_back(begin, end);
    FW_ASSIGN_OR_RETURN(TokenizedSequence sequence, Tokenize(std::move(rendered)));
    FW_RETURN_IF_ERROR(CheckLength(sequence));
    (chosen ? out.chosen : out.rejected) = std::move(sequence);
  }
  const auto& mask = out.chosen.loss_mask;
  out.prompt_tokens = std::find(mask.begin(), mask.end(), uint8_t{1}) - mask.begin();
  return out;
}

Result<PromptRendering> ChatRenderer::RenderPrompt(const Example& example) const {
  PromptRendering out;
  FW_ASSIGN_OR_RETURN(out.text, RenderText(example.messages, example.tools, true));
  FW_ASSIGN_OR_RETURN(out.ids, tokenizer_->Encode(out.text));
  if (options_.max_tokens > 0 && static_cast<int64_t>(out.ids.size()) >= options_.max_tokens)
    return Status::ResourceExhausted("the prompt has " + std::to_string(out.ids.size()) +
                                     " tokens, no room to answer within max_tokens " +
                                     std::to_string(options_.max_tokens));
  return out;
}

void RenderTally::Record(const SourceLine& source, const Status& status) {
  if (status.ok()) {
    ++rendered;
    return;
  }
  ++(status.code() == StatusCode::kResourceExhausted ? too_long : failed);
  if (static_cast<int64_t>(problems.size()) < max_kept)
    problems.push_back(source.Describe() + ": " + status.message());
}

void RenderTally::Record(const SftRendering& rendering) {
  sequences += static_cast<int64_t>(rendering.sequences.size());
  for (const TokenizedSequence& sequence : rendering.sequences)
    straddling_tokens += sequence.straddling_tokens;
  ++by_method[SpanMethodName(rendering.method)];
}

std::string RenderTally::Summary() const {
  return "rendered " + std::to_string(rendered) + " (" + std::to_string(sequences) +
         " sequences), dropped " + std::to_string(too_long + failed) + " (past max_tokens: " +
         std::to_string(too_long) + ", template or spans: " + std::to_string(failed) +
         "), straddling tokens " + std::to_string(straddling_tokens);
}

}  // namespace flywheel::data
