// Rendering dataset examples (data/dataset.h) through the model's own chat template into
// token ids and a per-token loss mask that covers exactly the assistant tokens the template
// produced: the turn's content, its tool calls as the template writes them, any reasoning the
// template renders inside the turn, and its end-of-turn token. Never the template's markup
// (role headers, the generation prompt, the newline after the end token), never a turn
// with weight 0. docs/DATASETS.md states the rules for users.
//
// The template context is the one the OpenAI-compatible server renders prompts with
// (rollout/openai_api.cc): options.extra_context (e.g. enable_thinking, date_string), then
// messages, tools (when the example has them), add_generation_prompt, bos_token, eos_token.
// The text is tokenized as HF's apply_chat_template(tokenize=True) does: the whole rendered
// text at once, with no special tokens added (the template writes BOS itself).
//
// Where the assistant turns are (byte spans of the rendered text):
//   kGenerationBlocks  the template has transformers' `{% generation %}` blocks: the spans
//                      they produced, matched in order to the assistant messages (so weight 0
//                      can drop one); a template whose block count differs from the assistant
//                      message count can only train a conversation whose turns all train.
//   kPrefixes          otherwise, turn i (an assistant message) spans from where
//                      render(messages[:i], add_generation_prompt=true) and
//                      render(messages[:i+1]) part (their common prefix: the generation prompt
//                      is markup) to the end of the latter, cut after the last end-of-turn
//                      token text in it (RenderOptions::end_of_turn). When every such
//                      render(messages[:i+1]) is a prefix of the whole conversation's render,
//                      the conversation is one sequence with all its trained turns.
//   kPerTurn           otherwise (templates such as Qwen3's render a turn differently once a
//                      later user turn follows: earlier turns lose their <think> block), one
//                      sequence per trained turn: render(messages[:i+1]) with turn i
//                      trained, which is also the prompt the model saw when it wrote that turn.
//
// Spans to tokens: each token's bytes are found by decoding the ids piece by piece
// (Tokenizer::AppendPiece, special tokens kept); the pieces must give back the rendered text
// byte for byte (true of byte-level BPE: Qwen, Llama-3, GPT-2), else the example fails with
// kMismatch. A token is trained when any of its bytes lies in a trained span: a token that
// straddles a span boundary (BPE merged markup with content) is trained whole, as
// transformers' char_to_token mask does; such tokens are counted
// (TokenizedSequence::straddling_tokens).
//
// Too long: a sequence of more than max_tokens tokens fails the whole example with
// kResourceExhausted (dropped and counted by the caller, never cut mid-answer).
//
// Thread safety: a ChatRenderer is immutable; its methods may run concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "data/dataset.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"

namespace flywheel::data {

struct RenderOptions {
  // The most tokens a sequence may have (prompt and completion together); 0: no limit.
  int64_t max_tokens = 0;
  // Extra template variables (enable_thinking, date_string, ...), set before the others.
  nlohmann::ordered_json extra_context = nlohmann::ordered_json::object();
  // The text of the tokens that end an assistant turn; empty: those of the tokenizer's
  // special stop tokens (EOS and generation_config's eos_token_id list: <|im_end|>,
  // <|eot_id|>, ...) and its eos_token.
  std::vector<std::string> end_of_turn;
};

enum class SpanMethod { kGenerationBlocks, kPrefixes, kPerTurn };
const char* SpanMethodName(SpanMethod method);  // "generation blocks", "prefixes", "per turn"

// A rendered text and the byte spans of it that are trained.
struct TextSpans {
  std::string text;
  std::vector<std::pair<size_t, size_t>> spans;  // [begin, end), ascending, disjoint
};

struct TokenizedSequence {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;  // per id: 1 = in the loss
  TextSpans rendered;
  int64_t straddling_tokens = 0;  // trained tokens that also hold bytes outside the spans
  int64_t trained_tokens() const;
};

struct SftRendering {
  SpanMethod method = SpanMethod::kPrefixes;
  std::vector<TokenizedSequence> sequences;  // one, or one per trained turn (kPerTurn)
};

// DPO: each side is the prompt and its completion, tokenized whole, the completion masked.
struct DpoRendering {
  TokenizedSequence chosen;
  TokenizedSequence rejected;
  // Tokens of `chosen` before its first trained token (the prompt as the chosen side splits it).
  int64_t prompt_tokens = 0;
};

// An RL prompt: the messages rendered with add_generation_prompt=true.
struct PromptRendering {
  std::string text;
  std::vector<int32_t> ids;
};

class ChatRenderer {
 public:
  // `tokenizer` must outlive the renderer. The first form uses the tokenizer's own
  // chat_template() (kInvalidArgument when it has none, or it does not parse).
  static Result<ChatRenderer> Create(const tokenizer::HfTokenizer* tokenizer,
                                     RenderOptions options = {});
  static Result<ChatRenderer> Create(const tokenizer::HfTokenizer* tokenizer,
                                     tokenizer::ChatTemplate chat_template,
                                     RenderOptions options = {});

  // SFT: the trained turns of example.messages (Example::trained). Errors: kInvalidArgument
  // when the template cannot render the conversation (its message), kMismatch when the spans
  // cannot be placed (see above), kResourceExhausted past max_tokens.
  Result<SftRendering> RenderSft(const Example& example) const;
  // DPO: example.messages + chosen / rejected, the completion's span found by the prefix
  // rule (generation prompt excluded, cut after the last end-of-turn token). RenderSft's errors.
  Result<DpoRendering> RenderDpo(const Example& example) const;
  // RL: example.messages with add_generation_prompt=true. kResourceExhausted when the prompt
  // alone has max_tokens tokens or more (no room to answer).
  Result<PromptRendering> RenderPrompt(const Example& example) const;

  // The text-level part of RenderSft: the rendered sequences and their trained byte spans
  // (what tests compare with the jinja2 reference, tests/data/render_spans.py).
  Result<std::pair<SpanMethod, std::vector<TextSpans>>> TrainedSpans(
      const nlohmann::ordered_json& messages, const std::vector<bool>& trained,
      const nlohmann::ordered_json& tools) const;

  // Tokenizes `rendered` and masks the tokens that overlap its spans (see above).
  Result<TokenizedSequence> Tokenize(TextSpans rendered) const;

  const std::vector<std::string>& end_of_turn() const { return end_of_turn_; }

 private:
  ChatRenderer(const tokenizer::HfTokenizer* tokenizer, tokenizer::ChatTemplate chat_template,
               RenderOptions options, std::vector<std::string> end_of_turn);
  Result<std::string> RenderText(const nlohmann::ordered_json& messages,
                                 const nlohmann::ordered_json& tools,
                                 bool add_generation_prompt) const;
  nlohmann::ordered_json Context(const nlohmann::ordered_json& messages,
                                 const nlohmann::ordered_json& tools,
                                 bool add_generation_prompt) const;
  Result<std::vector<TextSpans>> GenerationBlockSpans(const nlohmann::ordered_json& messages,
                                                      const std::vector<bool>& trained,
                                                      const nlohmann::ordered_json& tools) const;
  Result<std::pair<size_t, size_t>> TurnSpan(const nlohmann::ordered_json& messages, size_t turn,
                                             const nlohmann::ordered_json& tools,
                                             std::string* with_turn) const;
  Status CheckLength(const TokenizedSequence& sequence) const;

  const tokenizer::HfTokenizer* tokenizer_;
  tokenizer::ChatTemplate template_;
  RenderOptions options_;
  std::vector<std::string> end_of_turn_;
};

// Counts what rendering dropped, by reason, with the first `max_kept` `file:line: what`
// messages: a caller's tally over a dataset.
struct RenderTally {
  int64_t rendered = 0;            // examples rendered
  int64_t sequences = 0;           // sequences they gave (more than examples under kPerTurn)
  int64_t too_long = 0;            // dropped: past max_tokens
  int64_t failed = 0;              // dropped: the template or the span placement failed
  int64_t straddling_tokens = 0;   // over all sequences rendered
  std::map<std::string, int64_t> by_method;  // SpanMethodName -> examples
  std::vector<std::string> problems;
  int64_t max_kept = 1000;

  // Counts `status` (ok or not) for the example from `source`.
  void Record(const SourceLine& source, const Status& status);
  void Record(const SftRendering& rendering);
  // "rendered 98, dropped 2 (past max_tokens: 1, template or spans: 1), straddling tokens 0".
  std::string Summary() const;
};

}  // namespace flywheel::data
