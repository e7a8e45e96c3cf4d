// Held-out evaluation of the policy as the workers serve it.
#pragma once

#include <memory>
#include <vector>

#include "base/status.h"
#include "grading/grader.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "pipeline/task.h"
#include "rollout/engine.h"

namespace flywheel::rl {

// Greedy exact-match accuracy on a fixed list of held-out problems. The policy's weights
// are rounded to bf16 first (into a private copy of the model), or with `fp8_block` > 0
// its projection weights quantized to FP8 in those blocks (model/fp8.h) and the rest to
// bf16, because that is what the workers hold: the number is the served policy's accuracy,
// not the fp32 master's.
// Not thread-safe; one Accuracy call at a time.
class Evaluator {
 public:
  // `config` must be the policy's; `max_tokens` bounds each answer (EOS ends it earlier).
  Evaluator(const model::ModelConfig& config, std::vector<pipeline::Problem> problems,
            std::shared_ptr<const model::Tokenizer> tokenizer, int64_t max_tokens,
            int64_t fp8_block = 0);

  // The held-out score: the mean reward of the greedy answers (EOS stripped) by the grader
  // (SetGrader; an ungraded answer scores 0), or without one the fraction that equal the
  // expected answer exactly; 0 for no problems. Fails when the engine cannot be built, a
  // prompt cannot be encoded, or the grader has failed for good.
  Result<double> Accuracy(model::TransformerImpl& policy);
  // REQUIRES: outlives this evaluator's Accuracy calls.
  void SetGrader(grading::AsyncGrader* grader) { grader_ = grader; }
  // Answers the grader left ungraded at the last Accuracy call.
  size_t last_ungraded() const { return last_ungraded_; }

 private:
  Status CopyServedWeights(model::TransformerImpl& policy);

  std::vector<pipeline::Problem> problems_;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  int64_t max_tokens_;
  int64_t fp8_block_;
  grading::AsyncGrader* grader_ = nullptr;
  size_t last_ungraded_ = 0;
  std::shared_ptr<model::TransformerImpl> model_;
  std::unique_ptr<rollout::Engine> engine_;  // built on the first Accuracy call
};

}  // namespace flywheel::rl
