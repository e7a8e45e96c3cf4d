#include "rl/warmup.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "data/dataset.h"
#include "data/render.h"
#include "tokenizer/hf_tokenizer.h"

namespace flywheel::rl {
namespace {

using nlohmann::json;
using trainer::Datum;

// A rendered sequence and its per-token weights; weights[i] weighs predicting tokens[i].
Datum MakeDatum(const std::vector<int32_t>& sequence, const std::vector<float>& weights) {
  Datum d;
  d.tokens.assign(sequence.begin(), sequence.end() - 1);
  d.target_tokens.assign(sequence.begin() + 1, sequence.end());
  d.weights.assign(weights.begin() + 1, weights.end());
  return d;
}

// The non-blank lines of a JSONL file as objects, each with its 1-based line number in
// "__line" (for error messages).
Result<std::vector<json>> ReadJsonl(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + what + " " + path);
  std::vector<json> lines;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!value.is_object()) {
      return Status::InvalidArgument(what + " " + path + ":" + std::to_string(number) +
                                     ": not a JSON object");
    }
    value["__line"] = number;
    lines.push_back(std::move(value));
  }
  if (lines.empty()) return Status::InvalidArgument(what + " " + path + " has no examples");
  return lines;
}

// Appends one chat message's tokens and weights; returns the weight it added.
Result<double> AppendMessage(const json& message, const model::Tokenizer& tokenizer,
                             const std::string& where, std::vector<int32_t>& sequence,
                             std::vector<float>& weights) {
  if (!message.is_object() || !message.contains("role") || !message["role"].is_string() ||
      !message.contains("content") || !message["content"].is_string()) {
    return Status::InvalidArgument(where + ": every message needs string role and content");
  }
  const std::string role = message["role"];
  if (role != "system" && role != "user" && role != "assistant") {
    return Status::InvalidArgument(where + ": unknown role '" + role + "'");
  }
  double weight = role == "assistant" ? 1.0 : 0.0;
  if (message.contains("weight")) {
    if (!message["weight"].is_number() || message["weight"].get<double>() < 0) {
      return Status::InvalidArgument(where + ": weight must be a number >= 0");
    }
    weight = message["weight"].get<double>();
  }
  Result<std::vector<int32_t>> ids = tokenizer.Encode(message["content"].get<std::string>());
  if (!ids.ok()) return Status::InvalidArgument(where + ": " + ids.status().message());
  if (role == "assistant") ids->push_back(tokenizer.eos());
  double total = 0;
  for (int32_t id : *ids) {
    sequence.push_back(id);
    weights.push_back(static_cast<float>(weight));
    total += weight;
  }
  return total;
}

Result<Datum> SftDatum(const json& line, const model::Tokenizer& tokenizer, const std::string& where) {
  const json messages = line.value("messages", json());
  if (!messages.is_array() || messages.empty()) {
    return Status::InvalidArgument(where + ": needs a non-empty \"messages\" array");
  }
  std::vector<int32_t> sequence = {tokenizer.bos()};
  std::vector<float> weights = {0};
  double total = 0;
  for (const json& message : messages) {
    FW_ASSIGN_OR_RETURN(double added, AppendMessage(message, tokenizer, where, sequence, weights));
    total += added;
  }
  if (sequence.size() < 2 || total <= 0) {
    return Status::InvalidArgument(where + ": no token carries weight (no assistant message?)");
  }
  return MakeDatum(sequence, weights);
}

Status AppendDpoPair(const json& line, const model::Tokenizer& tokenizer, const std::string& where,
                     std::vector<Datum>& datums) {
  for (const char* key : {"prompt", "chosen", "rejected"}) {
    if (!line.contains(key) || !line[key].is_string()) {
      return Status::InvalidArgument(where + ": needs string \"prompt\", \"chosen\" and \"rejected\"");
    }
  }
  Result<std::vector<int32_t>> prompt = tokenizer.Encode(line["prompt"].get<std::string>());
  if (!prompt.ok()) return Status::InvalidArgument(where + ": " + prompt.status().message());
  for (const char* key : {"chosen", "rejected"}) {
    Result<std::vector<int32_t>> answer = tokenizer.Encode(line[key].get<std::string>());
    if (!answer.ok()) return Status::InvalidArgument(where + ": " + answer.status().message());
    std::vector<int32_t> sequence = {tokenizer.bos()};
    sequence.insert(sequence.end(), prompt->begin(), prompt->end());
    std::vector<float> weights(sequence.size(), 0.0f);
    answer->push_back(tokenizer.eos());
    for (int32_t id : *answer) {
      sequence.push_back(id);
      weights.push_back(1.0f);
    }
    datums.push_back(MakeDatum(sequence, weights));
  }
  return Status::Ok();
}

// ---- through the model's chat template (data/) ----

// The tokenizer's chat template, when it is a model directory's tokenizer that has one.
const tokenizer::HfTokenizer* Templated(const model::Tokenizer& tokenizer) {
  const auto* hf = dynamic_cast<const tokenizer::HfTokenizer*>(&tokenizer);
  return hf != nullptr && !hf->chat_template().empty() ? hf : nullptr;
}

// A rendered sequence as a datum; BOS first unless the template wrote it.
Datum SequenceDatum(const data::TokenizedSequence& sequence, int32_t bos) {
  std::vector<int32_t> ids = sequence.ids;
  std::vector<float> weights(sequence.loss_mask.begin(), sequence.loss_mask.end());
  if (ids.empty() || ids.front() != bos) {
    ids.insert(ids.begin(), bos);
    weights.insert(weights.begin(), 0.0f);
  }
  return MakeDatum(ids, weights);
}

// Reads `path` as `format` through data::DatasetReader and renders each example with the
// template; skipped lines and dropped examples are warned and counted.
Result<std::vector<Datum>> LoadTemplated(const std::string& path, data::Format format, const char* what,
                                         const tokenizer::HfTokenizer& tokenizer, int64_t max_tokens,
                                         const std::function<void(const std::string&)>& warn) {
  data::ReadOptions read;
  read.format = format;
  FW_ASSIGN_OR_RETURN(std::unique_ptr<data::DatasetReader> reader, data::DatasetReader::Open(path, read));
  data::RenderOptions render;
  // BOS may be prepended: one token of the context kept for it.
  render.max_tokens = max_tokens > 1 ? max_tokens - 1 : 0;
  Result<data::ChatRenderer> renderer = data::ChatRenderer::Create(&tokenizer, render);
  if (!renderer.ok()) return renderer.status().WithContext(std::string(what) + " " + path);
  data::RenderTally tally;
  std::vector<Datum> datums;
  data::Example example;
  for (;;) {
    Result<bool> more = reader->Next(&example);
    if (!more.ok()) return more.status().WithContext(what);
    if (!*more) break;
    Status rendered;
    if (format == data::Format::kSft) {
      Result<data::SftRendering> sft = renderer->RenderSft(example);
      rendered = sft.status();
      if (sft.ok()) {
        tally.Record(*sft);
        for (const data::TokenizedSequence& sequence : sft->sequences)
          datums.push_back(SequenceDatum(sequence, tokenizer.bos()));
      }
    } else {
      Result<data::DpoRendering> dpo = renderer->RenderDpo(example);
      rendered = dpo.status();
      if (dpo.ok()) {
        datums.push_back(SequenceDatum(dpo->chosen, tokenizer.bos()));
        datums.push_back(SequenceDatum(dpo->rejected, tokenizer.bos()));
      }
    }
    tally.Record(example.source, rendered);
    if (!rendered.ok() && warn) warn(std::string(what) + " " + example.source.Describe() + ": dropped: " + rendered.message());
  }
  const data::DatasetReport& report = reader->report();
  if (warn) {
    for (const std::string& problem : report.problems) warn(std::string(what) + " " + problem);
    if (report.skipped > 0 || tally.too_long + tally.failed > 0)
      warn(std::string(what) + " " + report.Summary() + "; " + tally.Summary());
  }
  if (datums.empty()) {
    return Status::InvalidArgument(std::string(what) + " " + path + " has no usable example (" +
                                   report.Summary() + "; " + tally.Summary() + ")");
  }
  return datums;
}

// The OpenAI preference format through the plain rendering (no template): the input
// messages' contents, then the answer's content and EOS.
Result<std::vector<Datum>> LoadPlainOpenAiDpo(const std::string& path, const model::Tokenizer& tokenizer) {
  data::ReadOptions read;
  read.format = data::Format::kDpo;
  FW_ASSIGN_OR_RETURN(std::unique_ptr<data::DatasetReader> reader, data::DatasetReader::Open(path, read));
  std::vector<Datum> datums;
  data::Example example;
  for (;;) {
    Result<bool> more = reader->Next(&example);
    if (!more.ok()) return more.status().WithContext("dpo.dataset");
    if (!*more) break;
    const std::string where = "dpo.dataset " + example.source.Describe();
    std::string prompt;
    for (const auto& message : example.messages) {
      if (message.contains("content") && message["content"].is_string()) prompt += message["content"].get<std::string>();
    }
    json line = {{"prompt", prompt}};
    for (const auto& [key, side] : {std::pair{"chosen", &example.chosen}, std::pair{"rejected", &example.rejected}}) {
      const auto& answer = side->at(0);
      line[key] = answer.contains("content") && answer["content"].is_string() ? answer["content"].get<std::string>() : "";
    }
    FW_RETURN_IF_ERROR(AppendDpoPair(line, tokenizer, where, datums));
  }
  if (!reader->report().problems.empty()) {
    return Status::InvalidArgument("dpo.dataset " + reader->report().problems.front());
  }
  return datums;
}

// Whether the first non-blank line of `path` is in the OpenAI preference format.
bool IsOpenAiDpo(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
    return value.is_object() && value.contains("input");
  }
  return false;
}

std::string Where(const std::string& what, const std::string& path, const json& line) {
  return what + " " + path + ":" + std::to_string(line["__line"].get<int>());
}

void SayProgress(const WarmupContext& context, const char* what, int64_t step, int64_t steps,
                 double loss) {
  if ((step + 1) % 10 != 0 && step + 1 != steps) return;
  char line[128];
  std::snprintf(line, sizeof line, "%s  %4lld/%lld  loss %.4f", what,
                static_cast<long long>(step + 1), static_cast<long long>(steps), loss);
  if (context.say) context.say(line);
}

bool Stopped(const WarmupContext& context) { return context.stop && context.stop->load(); }

}  // namespace

Result<std::vector<Datum>> LoadSftDataset(const std::string& path, const model::Tokenizer& tokenizer,
                                          int64_t max_tokens,
                                          const std::function<void(const std::string&)>& warn) {
  if (const tokenizer::HfTokenizer* hf = Templated(tokenizer)) {
    return LoadTemplated(path, data::Format::kSft, "sft.dataset", *hf, max_tokens, warn);
  }
  FW_ASSIGN_OR_RETURN(std::vector<json> lines, ReadJsonl(path, "sft.dataset"));
  std::vector<Datum> datums;
  for (const json& line : lines) {
    FW_ASSIGN_OR_RETURN(Datum datum, SftDatum(line, tokenizer, Where("sft.dataset", path, line)));
    datums.push_back(std::move(datum));
  }
  return datums;
}

Result<std::vector<Datum>> LoadDpoDataset(const std::string& path, const model::Tokenizer& tokenizer,
                                          int64_t max_tokens,
                                          const std::function<void(const std::string&)>& warn) {
  if (IsOpenAiDpo(path)) {
    if (const tokenizer::HfTokenizer* hf = Templated(tokenizer)) {
      return LoadTemplated(path, data::Format::kDpo, "dpo.dataset", *hf, max_tokens, warn);
    }
    return LoadPlainOpenAiDpo(path, tokenizer);
  }
  FW_ASSIGN_OR_RETURN(std::vector<json> lines, ReadJsonl(path, "dpo.dataset"));
  std::vector<Datum> datums;
  for (const json& line : lines) {
    FW_RETURN_IF_ERROR(AppendDpoPair(line, tokenizer, Where("dpo.dataset", path, line), datums));
  }
  return datums;
}

Status RunSft(trainer::TrainingClient& client, const pipeline::RunConfig& config,
              const model::Tokenizer& tokenizer, const WarmupContext& context) {
  FW_ASSIGN_OR_RETURN(std::vector<Datum> examples, LoadSftDataset(config.sft.dataset, tokenizer, context.max_tokens, context.warn));
  trainer::AdamWParams adam = context.adam;
  adam.lr = config.sft.lr;
  std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed));
  for (int64_t step = 0; step < config.sft.steps && !Stopped(context); ++step) {
    std::vector<Datum> batch;
    for (int64_t i = 0; i < config.sft.batch_size; ++i) batch.push_back(examples[rng() % examples.size()]);
    FW_ASSIGN_OR_RETURN(trainer::Metrics fb, client.ForwardBackward(batch, "cross_entropy"));
    FW_RETURN_IF_ERROR(client.OptimStep(adam).status());
    SayProgress(context, "sft", step, config.sft.steps, fb.loss);
  }
  return Status::Ok();
}

Status RunDpo(trainer::TrainingClient& client, const pipeline::RunConfig& config,
              const model::Tokenizer& tokenizer, const WarmupContext& context) {
  FW_ASSIGN_OR_RETURN(std::vector<Datum> pairs, LoadDpoDataset(config.dpo.dataset, tokenizer, context.max_tokens, context.warn));
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput reference, client.Forward(pairs));
  for (size_t i = 0; i < pairs.size(); ++i) pairs[i].ref_logprobs = reference.logprobs[i];
  trainer::AdamWParams adam = context.adam;
  adam.lr = config.dpo.lr;
  trainer::LossConfig loss;
  loss.dpo_beta = config.dpo.beta;
  std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed) + 1);
  const size_t pair_count = pairs.size() / 2;
  for (int64_t step = 0; step < config.dpo.steps && !Stopped(context); ++step) {
    std::vector<Datum> batch;
    for (int64_t i = 0; i < config.dpo.batch_size; ++i) {
      const size_t p = rng() % pair_count;
      batch.push_back(pairs[2 * p]);
      batch.push_back(pairs[2 * p + 1]);
    }
    FW_ASSIGN_OR_RETURN(trainer::Metrics fb, client.ForwardBackward(batch, "dpo", loss));
    FW_RETURN_IF_ERROR(client.OptimStep(adam).status());
    SayProgress(context, "dpo", step, config.dpo.steps, fb.loss);
  }
  return Status::Ok();
}

}  // namespace flywheel::rl
