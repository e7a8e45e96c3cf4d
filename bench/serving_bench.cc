#include "bench/serving_bench.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "bench/stats.h"
#include "bench/util.h"
#include "model/model.h"
#include "model/model_config.h"
#include "rollout/engine.h"
#include "rollout/openai_api.h"
#include "tokenizer/hf_tokenizer.h"
#include "transport/asio.h"
#include "transport/http.h"

namespace flywheel::bench {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct StreamRun {
  double first_token_s = 0, total_s = 0;
  std::string text;
  std::vector<int32_t> ids;
  size_t chunks = 0;
};

Result<StreamRun> Streamed(uint16_t port, const std::string& body) {
  StreamRun run;
  std::string buffer;
  bool parse_error = false;
  const auto start = Clock::now();
  auto response = transport::HttpPostStream(
      {"127.0.0.1", port}, "/v1/completions", body, {.timeout = std::chrono::seconds(600)},
      [&](std::string_view data) {
        buffer.append(data);
        for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
          const std::string event = buffer.substr(0, end);
          buffer.erase(0, end + 2);
          if (event == "data: [DONE]" || event.rfind("data: ", 0) != 0) continue;
          json chunk = json::parse(event.substr(6), nullptr, false);
          if (chunk.is_discarded() || chunk["choices"].empty()) {
            parse_error = true;
            continue;
          }
          const json& c = chunk["choices"][0];
          if (run.ids.empty() && !c["token_ids"].empty()) run.first_token_s = Since(start);
          for (const json& t : c["token_ids"]) run.ids.push_back(t.get<int32_t>());
          run.text += c["text"].get<std::string>();
          ++run.chunks;
        }
        return true;
      });
  run.total_s = Since(start);
  if (!response.ok()) return response.status();
  if (response->status != 200 || parse_error)
    return Status::Internal("the streamed answer failed (HTTP " + std::to_string(response->status) + ")");
  return run;
}

// The timed rounds: the same request whole and streamed; medians come from these.
struct ServingTimes {
  std::vector<double> first, streamed_total, whole_total;
  bool same = true;  // the streamed text and ids equal the whole answer's, every round
  size_t chunks = 0;
};

// Round -1 warms up; every round asks for the whole answer, then for the stream.
Status TimeRounds(const ServingBenchOptions& options, uint16_t port, const std::string& body,
                  ServingTimes& t) {
  json streamed_body = json::parse(body);
  streamed_body["stream"] = true;
  for (int r = -1; r < options.rounds; ++r) {
    const auto start = Clock::now();
    auto whole = transport::HttpPost({"127.0.0.1", port}, "/v1/completions", body,
                                     {.timeout = std::chrono::seconds(600)});
    const double whole_s = Since(start);
    if (!whole.ok() || whole->status != 200) {
      return whole.ok() ? Status::Internal("the whole answer failed: " + whole->body)
                        : whole.status();
    }
    FW_ASSIGN_OR_RETURN(StreamRun run, Streamed(port, streamed_body.dump()));
    json answer = json::parse(whole->body);
    t.same = t.same && run.text == answer["choices"][0]["text"].get<std::string>() &&
             run.ids == answer["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    if (r < 0) continue;
    t.first.push_back(run.first_token_s);
    t.streamed_total.push_back(run.total_s);
    t.whole_total.push_back(whole_s);
    t.chunks = run.chunks;
  }
  return Status::Ok();
}

// The report's text (a Markdown table and the checks); `targets_met` says whether the first
// token and the streamed end came within their targets.
std::string ServingReport(const ServingBenchOptions& options, int64_t parameters,
                          const std::string& tokenizer_name, const ServingTimes& t,
                          bool& targets_met) {
  const double ttft = Median(t.first), st = Median(t.streamed_total), wt = Median(t.whole_total);
  std::ostringstream report;
  char line[512];
  std::snprintf(line, sizeof(line),
                "model: demo dense (%.1fM parameters, fp32, random weights), tokenizer: %s; "
                "%d threads\nrequest: %lld prompt tokens, %lld new tokens, one request at a "
                "time over loopback HTTP; medians of %d rounds\n\n",
                static_cast<double>(parameters) / 1e6, tokenizer_name.c_str(),
                torch::get_num_threads(), static_cast<long long>(options.prompt_tokens),
                static_cast<long long>(options.max_tokens), options.rounds);
  report << line;
  report << "| answer | first token (s) | last token (s) | vs whole answer |\n|---|---|---|---|\n";
  std::snprintf(line, sizeof(line),
                "| streamed (%zu chunks) | %.3f | %.3f | first token at %.3fx, end at %.2fx |\n",
                t.chunks, ttft, st, ttft / wt, st / wt);
  report << line;
  std::snprintf(line, sizeof(line), "| whole (stream: false) | %.3f | %.3f | 1.00x |\n", wt, wt);
  report << line;
  const bool fast_first = ttft <= 0.25 * wt, cheap = st <= 1.15 * wt;
  std::snprintf(line, sizeof(line),
                "\nchecks: streamed text and ids equal the whole answer: %s; first token within "
                "0.25x the whole answer: %s; streamed end within 1.15x: %s\n",
                t.same ? "yes" : "NO", fast_first ? "yes" : "NO", cheap ? "yes" : "NO");
  report << line;
  targets_met = fast_first && cheap;
  return report.str();
}

}  // namespace

namespace {

// The HTTP section: the streamed answer against the whole one.
Result<std::string> HttpSection(const ServingBenchOptions& options, bool& targets_met) {
  std::shared_ptr<const model::Tokenizer> tok;
  std::string tokenizer_name = "bytes";
  model::ModelConfig config = model::DemoDenseConfig();
  if (!options.tokenizer.empty()) {
    FW_ASSIGN_OR_RETURN(auto hf, tokenizer::HfTokenizer::Load(options.tokenizer));
    tokenizer_name = hf->Describe();
    config.vocab_size = hf->vocab_size();
    tok = std::move(hf);
  } else {
    tok = std::make_shared<model::ByteTokenizer>();
  }
  torch::manual_seed(1);
  auto model = std::make_shared<model::TransformerImpl>(config);
  FW_ASSIGN_OR_RETURN(auto engine, rollout::Engine::Create(model, {.max_batch = 4, .max_sequence = 1024, .share_prefixes = false}, 1));
  rollout::CompletionService service(std::shared_ptr<rollout::Engine>(std::move(engine)), tok);
  boost::asio::io_context io;
  auto guard = boost::asio::make_work_guard(io);
  FW_ASSIGN_OR_RETURN(auto server, transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, {}));
  service.Register(*server);
  std::thread thread([&] { io.run(); });
  std::mt19937_64 rng(7);
  std::vector<int32_t> prompt;
  const int64_t prompt_vocab = std::min<int64_t>(tok->vocab_size(), 256);
  for (int64_t i = 0; i < options.prompt_tokens; ++i) prompt.push_back(static_cast<int32_t>(rng() % prompt_vocab));
  const std::string body = json{{"prompt", prompt}, {"max_tokens", options.max_tokens}, {"seed", 3},
                                {"temperature", 1.0}, {"ignore_eos", true}}.dump();
  ServingTimes times;
  const Status failed = TimeRounds(options, server->port(), body, times);
  boost::asio::post(io, [&] { server->Stop(); });
  guard.reset();
  thread.join();
  FW_RETURN_IF_ERROR(failed);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  std::string report = ServingReport(options, parameters, tokenizer_name, times, targets_met);
  if (!times.same) return Status::Mismatch("the streamed answer differs from the whole answer\n" + report);
  return report;
}

}  // namespace

Status RunServingBench(const ServingBenchOptions& options, std::ostream& out) {
  torch::set_num_threads(options.threads > 0 ? options.threads
                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const std::string& only = options.section;
  if (!only.empty() && only != "http" && only != "prefixes" && only != "structured" && only != "decode")
    return Status::InvalidArgument("--section must be http, prefixes, structured or decode, got '" + only + "'");
  if (!only.empty() && !options.markdown_out.empty())
    return Status::InvalidArgument("--markdown writes the whole section: run every part (drop --section)");
  auto wanted = [&](const char* name) { return only.empty() || only == name; };
  std::string report;
  auto add = [&](const Result<std::string>& part) -> Status {
    FW_RETURN_IF_ERROR(part.status());
    out << (report.empty() ? "" : "\n") << *part << std::flush;
    report += (report.empty() ? "" : "\n") + *part;
    return Status::Ok();
  };
  bool http_met = true, met = false;
  if (wanted("http")) FW_RETURN_IF_ERROR(add(HttpSection(options, http_met)));
  PrefixBenchOptions prefixes = options.prefixes;
  prefixes.check_timing = prefixes.check_timing && options.check;
  if (wanted("prefixes")) FW_RETURN_IF_ERROR(add(RunPrefixBench(prefixes, met)));
  StructuredBenchOptions structured = options.structured;
  structured.check_timing = structured.check_timing && options.check;
  if (wanted("structured")) FW_RETURN_IF_ERROR(add(RunStructuredBench(structured, met)));
  DecodeBenchOptions decode = options.decode;
  decode.check_timing = decode.check_timing && options.check;
  if (wanted("decode")) FW_RETURN_IF_ERROR(add(RunDecodeBench(decode, met)));
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Serving benchmark",
                                            "## Serving benchmark\n\n" + report));
  }
  if (options.check && !http_met) return Status::Mismatch("a serving target was missed");
  return Status::Ok();
}

}  // namespace flywheel::bench
