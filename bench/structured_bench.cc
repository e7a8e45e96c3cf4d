#include "bench/structured_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <set>
#include <sstream>

#include "base/json.h"
#include "bench/stats.h"
#include "model/model.h"
#include "model/model_config.h"
#include "rollout/engine.h"
#include "tokenizer/grammar.h"
#include "tokenizer/json_schema.h"
#include "tokenizer/token_guide.h"

namespace flywheel::bench {
namespace {

using Clock = std::chrono::steady_clock;
using ojson = nlohmann::ordered_json;
using rollout::Engine;
using rollout::GenerationRequest;
using rollout::GenerationResult;

constexpr int64_t kMaxTokens = 700;  // the schema's longest answer is under 650 bytes

const char* const kSchema = R"({"type": "object", "properties": {
  "name": {"type": "string", "minLength": 1, "maxLength": 16},
  "age": {"type": "integer"},
  "city": {"enum": ["Paris", "London", "Berlin", "Tokyo", "Lima"]},
  "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
  "active": {"type": "boolean"},
  "address": {"type": "object", "properties": {
      "street": {"type": "string", "maxLength": 24},
      "zip": {"type": "string", "pattern": "[0-9]{5}"}}, "required": ["street", "zip"]},
  "nickname": {"type": ["string", "null"], "maxLength": 8}},
  "required": ["name", "age", "city", "scores", "active", "address"]})";

// A BPE-shaped vocabulary of `vocab` ids; the last is the stop token (no bytes).
std::vector<std::string> Pieces(int64_t vocab) {
  std::vector<std::string> pieces;
  std::set<std::string> seen;
  auto add = [&](const std::string& p) {
    if (static_cast<int64_t>(pieces.size()) < vocab - 1 && (p.size() == 1 || seen.insert(p).second)) pieces.push_back(p);
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  const char* words[] = {"name", "age", "city", "scores", "active", "address", "street", "zip", "nickname",
                         "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from",
                         "true", "false", "null", "Paris", "London", "Berlin", "Tokyo", "Lima", "Main",
                         "Street", "Road", "John", "Anna", "Smith", "North", "value", "data", "user"};
  for (const char* w : words) {
    for (const std::string& p : {std::string(w), " " + std::string(w), "\"" + std::string(w) + "\"",
                                 "\"" + std::string(w) + "\":", "\"" + std::string(w) + "\": "}) add(p);
  }
  for (const char* p : {"{\"", "\":", "\": ", "\",", "\", \"", "\"}", "}}", "],", "[", "[\"", "\"]", ", ", ": ",
                        "0.", "00", "000", "\\u00", "\\n", "\\\""}) add(p);
  for (int i = 10; i < 1000; ++i) add(std::to_string(i));
  for (int a = 0x20; a < 0x7F; ++a) {
    for (int b = 0x20; b < 0x7F; ++b) add(std::string{static_cast<char>(a), static_cast<char>(b)});
  }
  pieces.resize(static_cast<size_t>(vocab));  // the last: the stop token
  return pieces;
}

GenerationRequest Request(std::shared_ptr<tokenizer::TokenGuide> guide, uint64_t seed, int64_t max_tokens,
                          int32_t stop) {
  GenerationRequest r;
  r.prompt = {'{', 'n', 'a', 'm', 'e', '"', ':', ' '};
  r.params.max_tokens = max_tokens;
  r.params.temperature = 1.0;
  r.params.seed = seed;
  if (guide) r.params.stop_tokens = {stop};
  r.params.guide = std::move(guide);
  return r;
}

// Step times of `requests` while every one of them decodes (admission steps left out).
std::vector<double> RunningSteps(Engine& engine, const std::vector<GenerationRequest>& requests) {
  for (const GenerationRequest& r : requests) (void)engine.Submit(r);
  std::vector<double> times;
  while (engine.active() + engine.waiting() > 0) {
    const bool all_running = engine.active() == requests.size() && engine.waiting() == 0;
    const auto start = Clock::now();
    const std::vector<GenerationResult> finished = engine.Step();
    if (all_running && finished.empty()) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return times;
}

struct Validity {
  int64_t valid = 0, total = 0, tokens = 0;
  std::string first_invalid, example;
};

Validity Validate(const std::vector<GenerationResult>& results, const std::vector<std::string>& pieces,
                  const ojson& schema, int32_t stop) {
  Validity v;
  for (const GenerationResult& r : results) {
    ++v.total;
    v.tokens += static_cast<int64_t>(r.tokens.size());
    std::string text;
    for (int32_t t : r.tokens) text += pieces[static_cast<size_t>(t)];
    auto doc = ParseJson<ojson>(text, "the answer");
    Status ok = r.finish_reason != "stop" || r.tokens.empty() || r.tokens.back() != stop
                    ? Status::Mismatch("finished with '" + r.finish_reason + "'")
                    : doc.ok() ? tokenizer::CheckJsonSchema(schema, *doc) : doc.status();
    if (ok.ok()) {
      ++v.valid;
      if (v.example.empty()) v.example = text;
    } else if (v.first_invalid.empty()) {
      v.first_invalid = text + ": " + ok.ToString();
    }
  }
  return v;
}

}  // namespace

Result<std::string> RunStructuredBench(const StructuredBenchOptions& o, bool& targets_met) {
  model::ModelConfig config = model::DemoDenseConfig();
  torch::manual_seed(1);
  auto model = std::make_shared<model::TransformerImpl>(config);
  const std::vector<std::string> pieces = Pieces(config.vocab_size);
  const int32_t stop = static_cast<int32_t>(config.vocab_size - 1);
  auto vocabulary = tokenizer::TokenBytes::FromPieces(pieces);
  const ojson schema = ojson::parse(kSchema);
  FW_ASSIGN_OR_RETURN(const std::string regex, tokenizer::JsonSchemaRegex(schema));
  auto make_guide = [&]() -> Result<std::shared_ptr<tokenizer::TokenGuide>> {
    FW_ASSIGN_OR_RETURN(auto grammar, tokenizer::CompileRegex(regex, tokenizer::kJsonSchemaMaxRegexBytes));
    return tokenizer::TokenGuide::Create(std::move(grammar), vocabulary);
  };
  FW_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, {.max_batch = o.concurrent, .max_sequence = 720}, 1));
  FW_ASSIGN_OR_RETURN(auto cold_guide, make_guide());
  // Cold: the first batch computes every mask it meets.
  std::vector<GenerationRequest> batch;
  for (int64_t i = 0; i < o.concurrent; ++i) batch.push_back(Request(cold_guide, 1000 + i, 48, stop));
  const std::vector<double> cold = RunningSteps(*engine, batch);
  // Validity, on a guide of its own (its masks computed on the way too).
  FW_ASSIGN_OR_RETURN(auto guide, make_guide());
  std::vector<GenerationRequest> answers;
  for (int64_t i = 0; i < o.requests; ++i) answers.push_back(Request(guide, static_cast<uint64_t>(i), kMaxTokens, stop));
  const auto start = Clock::now();
  FW_ASSIGN_OR_RETURN(const std::vector<GenerationResult> results, engine->Generate(answers));
  const double answer_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const Validity v = Validate(results, pieces, schema, stop);
  // Overhead: interleaved rounds of unguided and guided (warm) batches.
  std::vector<double> plain, guided;
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<GenerationRequest> p, g;
    for (int64_t i = 0; i < o.concurrent; ++i) {
      p.push_back(Request(nullptr, 500 + i + round * 100, 48, stop));
      g.push_back(Request(guide, static_cast<uint64_t>(i), 48, stop));  // as the answers: masks cached
    }
    for (double t : RunningSteps(*engine, p)) plain.push_back(t);
    for (double t : RunningSteps(*engine, g)) guided.push_back(t);
  }
  const double plain_ms = Median(plain) * 1e3, guided_ms = Median(guided) * 1e3, cold_ms = Median(cold) * 1e3;
  const double overhead = plain_ms > 0 ? guided_ms / plain_ms - 1 : 0;
  targets_met = overhead <= 0.15;
  std::ostringstream report;
  char line[512];
  report << "### Structured outputs\n\nJSON-schema answers from the demo-size dense model (random weights) on a "
            "BPE-shaped vocabulary of " << config.vocab_size << " tokens, engine to engine, temperature 1, "
         << o.concurrent << " at a time (`flywheel bench serving`).\n\n| figure | measured | target |\n|---|---|---|\n";
  std::snprintf(line, sizeof line, "| answers that end, parse and validate | %lld / %lld | all |\n",
                static_cast<long long>(v.valid), static_cast<long long>(v.total));
  report << line;
  std::snprintf(line, sizeof line, "| tokens per answer (mean); answers per second | %.1f; %.1f | |\n",
                v.total ? static_cast<double>(v.tokens) / static_cast<double>(v.total) : 0.0,
                answer_seconds > 0 ? static_cast<double>(v.total) / answer_seconds : 0.0);
  report << line;
  std::snprintf(line, sizeof line,
                "| decode step, %lld running: unguided / guided (masks cached) | %.2f / %.2f ms: overhead %+.1f%% | <= +15%% |\n",
                static_cast<long long>(o.concurrent), plain_ms, guided_ms, overhead * 100);
  report << line;
  std::snprintf(line, sizeof line, "| decode step, first guided batch (every mask computed on the way) | %.2f ms (%lld masks) | |\n",
                cold_ms, static_cast<long long>(cold_guide->masks_computed()));
  report << line;
  report << "\nAn answer: `" << v.example.substr(0, 300) << "`\n\nChecks: every answer valid: " << (v.valid == v.total ? "yes" : "NO")
         << "; overhead within 15%: " << (targets_met ? "yes" : "NO") << (o.check_timing ? "" : " (not enforced)") << "\n";
  if (v.valid != v.total) return Status::Mismatch("an answer is not valid: " + v.first_invalid + "\n" + report.str());
  if (o.check_timing && !targets_met) return Status::Mismatch("the overhead target was missed\n" + report.str());
  return report.str();
}

}  // namespace flywheel::bench
