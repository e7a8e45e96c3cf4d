#include "rl/evaluator.h"

#include <algorithm>
#include <map>

#include "model/fp8.h"
#include "pipeline/coordinator.h"

namespace flywheel::rl {

Evaluator::Evaluator(const model::ModelConfig& config, std::vector<pipeline::Problem> problems,
                     std::shared_ptr<const model::Tokenizer> tokenizer, int64_t max_tokens,
                     int64_t fp8_block)
    : problems_(std::move(problems)),
      tokenizer_(std::move(tokenizer)),
      max_tokens_(max_tokens),
      fp8_block_(fp8_block) {
  model_ = std::make_shared<model::TransformerImpl>(config);
  for (auto& p : model_->parameters()) p.set_requires_grad(false);
}

Status Evaluator::CopyServedWeights(model::TransformerImpl& policy) {
  if (fp8_block_ > 0) {
    // Exactly what an FP8 worker holds: the snapshot's bytes, dequantized.
    FW_ASSIGN_OR_RETURN(OwnedCheckpoint served,
                        model::SnapshotWeightsFp8(policy, {.block = fp8_block_}));
    return model::LoadFp8Weights(*model_, served.view(), "the served FP8 policy", fp8_block_);
  }
  torch::NoGradGuard no_grad;
  auto source = policy.named_parameters();
  std::map<std::string, const model::PackedWeight*> packed;
  for (const auto& [name, weight] : policy.PackedWeights()) packed[name] = weight;
  for (auto& item : model_->named_parameters()) {
    auto it = packed.find(item.key());
    const torch::Tensor value =
        it != packed.end() ? it->second->Dequantize() : source[item.key()];
    item.value().copy_(value.to(torch::kBFloat16).to(torch::kFloat32));
  }
  return Status::Ok();
}

Result<double> Evaluator::Accuracy(model::TransformerImpl& policy) {
  if (!engine_) {
    int64_t longest = 0;
    for (const auto& p : problems_) longest = std::max<int64_t>(longest, p.prompt.size());
    FW_ASSIGN_OR_RETURN(engine_, rollout::Engine::Create(model_, {64, longest + max_tokens_ + 2}, 1));
  }
  // Through Swap: the engine must know its weights changed, or it would reuse the prompts'
  // keys and values the last evaluation's weights computed (shared prefixes).
  FW_RETURN_IF_ERROR(engine_->Swap(engine_->version(), [&] { return CopyServedWeights(policy); }));
  std::vector<rollout::GenerationRequest> requests;
  for (const auto& problem : problems_) {
    FW_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, tokenizer_->Encode(problem.prompt));
    if (prompt.empty() || prompt.front() != tokenizer_->bos()) prompt.insert(prompt.begin(), tokenizer_->bos());
    rollout::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = max_tokens_;
    params.stop_tokens = {tokenizer_->eos()};
    requests.push_back({std::move(prompt), params, ""});
  }
  FW_ASSIGN_OR_RETURN(std::vector<rollout::GenerationResult> results,
                      engine_->Generate(std::move(requests)));
  double score = 0;
  std::vector<std::future<grading::Outcome>> outcomes;
  last_ungraded_ = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    std::vector<int32_t> ids = results[i].tokens;
    if (!ids.empty() && ids.back() == tokenizer_->eos()) ids.pop_back();
    Result<std::string> text = tokenizer_->Decode(ids);
    if (grader_ == nullptr) {
      if (text.ok() && *text == problems_[i].answer) score += 1;
    } else if (!text.ok()) {
      ++last_ungraded_;  // a special token mid-answer: scores 0
    } else {
      outcomes.push_back(grader_->Submit(pipeline::GradingSample(
          problems_[i], "eval/" + std::to_string(i), std::move(*text), static_cast<int64_t>(ids.size()))));
    }
  }
  for (std::future<grading::Outcome>& future : outcomes) {
    const grading::Outcome outcome = future.get();
    if (outcome.kind == grading::OutcomeKind::kFailed) {
      return Status::Unavailable("held-out evaluation: " + outcome.reason);
    }
    if (outcome.kind == grading::OutcomeKind::kReward) {
      score += outcome.reward;
    } else {
      ++last_ungraded_;
    }
  }
  return problems_.empty() ? 0.0 : score / static_cast<double>(problems_.size());
}

}  // namespace flywheel::rl
