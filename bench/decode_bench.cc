#include "bench/decode_bench.h"

#include <torch/torch.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <random>
#include <sstream>

#include "bench/stats.h"
#include "model/model.h"
#include "model/model_config.h"
#include "rollout/engine.h"

// OpenBLAS's name for the kernels it chose (absent without OpenBLAS).
extern "C" char* openblas_get_corename() __attribute__((weak));

namespace flywheel::bench {
namespace {

// The BLAS kernels in use, with advice when OpenBLAS fell back to SSE3 kernels on a CPU
// with AVX2 / AVX-512 (it does on virtual machines whose CPU model it does not know).
std::string BlasKernels() {
  if (openblas_get_corename == nullptr) return "not OpenBLAS";
  std::string core = openblas_get_corename();
  std::string lower = core;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "prescott" || lower == "core2" || lower == "nehalem" || lower == "generic") {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return core + " (this CPU has AVX-512: OPENBLAS_CORETYPE=SkylakeX selects OpenBLAS's AVX-512 kernels)";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return core + " (this CPU has AVX2: OPENBLAS_CORETYPE=Haswell selects OpenBLAS's AVX2 kernels)";
  }
  return core;
}

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

model::ModelConfig BenchModelConfig() {
  model::ModelConfig c = model::DemoDenseConfig();
  c.vocab_size = 32000;
  c.hidden_size = 1024;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 8;
  c.head_dim = 64;
  c.intermediate_size = 1728;
  return c;
}

// GFLOP/s of torch::mm on [m, k] x [k, n] (the best of `rounds` after a warm-up); with
// `linear`, the second operand is an [n, k] matrix transposed, as nn.Linear's weight is.
double GemmGflops(int64_t m, int64_t k, int64_t n, int rounds, bool linear = false) {
  torch::NoGradGuard no_grad;
  const torch::Tensor a = torch::randn({m, k}), b = linear ? torch::randn({n, k}).t() : torch::randn({k, n});
  torch::Tensor c = torch::mm(a, b);
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto start = Clock::now();
    c = torch::mm(a, b);
    best = std::min(best, Seconds(start));
  }
  return 2.0 * static_cast<double>(m * k * n) / best / 1e9;
}

// FLOPs of one decoded token at context `context`: 2 per matmul weight (every projection
// and the LM head; the embedding lookup is none) plus attention's two products.
double FlopsPerToken(const model::ModelConfig& c, int64_t context) {
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double q = static_cast<double>(c.num_attention_heads) * d, kv = static_cast<double>(c.kv_heads()) * d;
  const double per_layer = h * q + 2 * h * kv + q * h + 3 * h * static_cast<double>(c.intermediate_size);
  const double weights = per_layer * static_cast<double>(c.num_hidden_layers) + h * static_cast<double>(c.vocab_size);
  const double attention = 4.0 * q * static_cast<double>(context) * static_cast<double>(c.num_hidden_layers);
  return 2 * weights + attention;
}

}  // namespace

Result<std::string> RunDecodeBench(const DecodeBenchOptions& o, bool& targets_met) {
  const model::ModelConfig config = o.small_model ? model::DemoDenseConfig() : BenchModelConfig();
  torch::manual_seed(1);
  auto model = std::make_shared<model::TransformerImpl>(config);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  const int64_t max_sequence = o.prompt_tokens + o.steps + 2;
  FW_ASSIGN_OR_RETURN(auto engine, rollout::Engine::Create(model, {.max_batch = o.concurrent, .max_sequence = max_sequence,
                                                                   .share_prefixes = false}, 1));
  std::mt19937_64 rng(3);
  for (int64_t i = 0; i < o.concurrent; ++i) {
    rollout::GenerationRequest r;
    for (int64_t t = 0; t < o.prompt_tokens; ++t) r.prompt.push_back(static_cast<int32_t>(rng() % config.vocab_size));
    r.params.max_tokens = o.steps + 1;
    r.params.seed = static_cast<uint64_t>(i);
    FW_RETURN_IF_ERROR(engine->Submit(std::move(r)).status());
  }
  engine->Step();  // admission: every prompt prefilled
  std::vector<double> steps;
  while (engine->active() == static_cast<size_t>(o.concurrent)) {
    const auto start = Clock::now();
    const auto finished = engine->Step();
    if (finished.empty()) steps.push_back(Seconds(start));
  }
  while (engine->active() > 0) engine->Step();
  const double step = Median(steps);
  // The model alone: one forward of `concurrent` one-token rows (no cache: the projections
  // and the LM head, attention over one token), as the step's matmul work.
  std::vector<double> forwards;
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor tokens = torch::randint(config.vocab_size, {o.concurrent, 1}, torch::kLong);
    for (int i = 0; i < 6; ++i) {
      const auto start = Clock::now();
      (void)model->forward(tokens);
      if (i > 0) forwards.push_back(Seconds(start));
    }
  }
  const double forward = Median(forwards);
  const double tokens_per_second = step > 0 ? static_cast<double>(o.concurrent) / step : 0;
  const double flops = FlopsPerToken(config, o.prompt_tokens + o.steps / 2);
  const double achieved = tokens_per_second * flops / 1e9;
  const double square = GemmGflops(2048, 2048, 2048, 3);
  const double shaped = GemmGflops(o.concurrent, config.hidden_size, config.intermediate_size, 20);
  const double shaped_linear = GemmGflops(o.concurrent, config.hidden_size, config.intermediate_size, 20, true);
  const double fraction = square > 0 ? achieved / square : 0;
  targets_met = fraction >= 0.5;
  std::ostringstream report;
  char line[512];
  std::snprintf(line, sizeof line,
                "### Decode throughput\n\nmodel: %.1fM parameters (hidden %lld, %lld layers, vocabulary %lld, fp32, "
                "random weights), %lld sequences decoding together after %lld-token prompts; median of %zu steps\n\n",
                static_cast<double>(parameters) / 1e6, static_cast<long long>(config.hidden_size),
                static_cast<long long>(config.num_hidden_layers), static_cast<long long>(config.vocab_size),
                static_cast<long long>(o.concurrent), static_cast<long long>(o.prompt_tokens), steps.size());
  report << line << "| figure | measured |\n|---|---|\n| BLAS kernels | " << BlasKernels() << " |\n";
  std::snprintf(line, sizeof line, "| decode step | %.1f ms: %.0f tokens/s |\n"
                "| the model's forward alone (%lld one-token rows, no cache) | %.1f ms |\n| FLOPs per token | %.3f GFLOP |\n"
                "| achieved | %.1f GFLOP/s |\n| OpenBLAS GEMM 2048^3 (torch::mm) | %.1f GFLOP/s: fraction **%.2f** (target >= 0.5) |\n"
                "| OpenBLAS GEMM at the step's MLP shape (%lld x %lld x %lld) | %.1f GFLOP/s: fraction %.2f |\n"
                "| the same, weight transposed as nn.Linear holds it | %.1f GFLOP/s: fraction %.2f |\n",
                step * 1e3, tokens_per_second, static_cast<long long>(o.concurrent), forward * 1e3, flops / 1e9,
                achieved, square, fraction,
                static_cast<long long>(o.concurrent), static_cast<long long>(config.hidden_size),
                static_cast<long long>(config.intermediate_size), shaped, shaped > 0 ? achieved / shaped : 0.0,
                shaped_linear, shaped_linear > 0 ? achieved / shaped_linear : 0.0);
  report << line << "\nCheck: decode within half the GEMM floor: " << (targets_met ? "yes" : "NO")
         << (o.check_timing ? "" : " (not enforced)") << "\n";
  if (o.check_timing && !targets_met) return Status::Mismatch("decode throughput is under half the GEMM floor\n" + report.str());
  return report.str();
}

}  // namespace flywheel::bench
