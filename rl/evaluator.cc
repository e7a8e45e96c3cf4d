#include "rl/evaluator.h"

#include <algorithm>

namespace flywheel::rl {

Evaluator::Evaluator(const model::ModelConfig& config, std::vector<pipeline::Problem> problems,
                     std::shared_ptr<const model::Tokenizer> tokenizer, int64_t max_tokens)
    : problems_(std::move(problems)), tokenizer_(std::move(tokenizer)), max_tokens_(max_tokens) {
  model_ = std::make_shared<model::TransformerImpl>(config);
  for (auto& p : model_->parameters()) p.set_requires_grad(false);
}

void Evaluator::CopyServedWeights(model::TransformerImpl& policy) {
  torch::NoGradGuard no_grad;
  auto source = policy.named_parameters();
  for (auto& item : model_->named_parameters()) {
    item.value().copy_(source[item.key()].to(torch::kBFloat16).to(torch::kFloat32));
  }
}

Result<double> Evaluator::Accuracy(model::TransformerImpl& policy) {
  CopyServedWeights(policy);
  if (!engine_) {
    int64_t longest = 0;
    for (const auto& p : problems_) longest = std::max<int64_t>(longest, p.prompt.size());
    FW_ASSIGN_OR_RETURN(engine_, rollout::Engine::Create(model_, {64, longest + max_tokens_ + 2}, 1));
  }
  std::vector<rollout::GenerationRequest> requests;
  for (const auto& problem : problems_) {
    FW_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, tokenizer_->Encode(problem.prompt));
    prompt.insert(prompt.begin(), tokenizer_->bos());
    rollout::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = max_tokens_;
    params.stop_tokens = {tokenizer_->eos()};
    requests.push_back({std::move(prompt), params, ""});
  }
  FW_ASSIGN_OR_RETURN(std::vector<rollout::GenerationResult> results,
                      engine_->Generate(std::move(requests)));
  size_t correct = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    std::vector<int32_t> ids = results[i].tokens;
    if (!ids.empty() && ids.back() == tokenizer_->eos()) ids.pop_back();
    Result<std::string> text = tokenizer_->Decode(ids);
    if (text.ok() && *text == problems_[i].answer) ++correct;
  }
  return problems_.empty() ? 0.0 : static_cast<double>(correct) / problems_.size();
}

}  // namespace flywheel::rl
