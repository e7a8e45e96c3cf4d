// The warm-ups before RL: supervised fine-tuning (SFT) on chat examples, then DPO on
// preference pairs, both read from JSONL files named by the run config (sft.dataset,
// dpo.dataset). A sequence is rendered as BOS, then every message's content as the task's
// tokenizer encodes it; an assistant turn (and a DPO answer) ends in EOS.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/tokenizer.h"
#include "pipeline/run_config.h"
#include "trainer/training_client.h"

namespace flywheel::rl {

// SFT examples, one JSON object a line, in the OpenAI chat format:
//   {"messages": [{"role": "system"|"user"|"assistant", "content": text, "weight": w}, ...]}
// Assistant messages weigh 1 unless "weight" (a number >= 0) says otherwise, the others 0;
// a datum's weights[i] is the loss weight of predicting its target_tokens[i]. Blank lines are
// skipped. Fails with NotFound when the file cannot be read, and InvalidArgument naming
// "sft.dataset <path>:<line>" for a line that is not an object, has no messages, an unknown
// role, a bad weight, text the tokenizer refuses, or no weighted token; or when the file
// holds no example.
Result<std::vector<trainer::Datum>> LoadSftDataset(const std::string& path,
                                                   const model::Tokenizer& tokenizer);

// DPO preference pairs, one a line: {"prompt": text, "chosen": text, "rejected": text}.
// Returns two datums per pair, chosen then rejected, weighted on the answer tokens only
// (the layout trainer's "dpo" loss expects). Errors as LoadSftDataset's, named
// "dpo.dataset <path>:<line>".
Result<std::vector<trainer::Datum>> LoadDpoDataset(const std::string& path,
                                                   const model::Tokenizer& tokenizer);

struct WarmupContext {
  trainer::AdamWParams adam;  // the RL optimizer settings; each warm-up sets its own lr
  std::function<void(const std::string&)> say;  // progress lines ("sft  10/30  loss ...")
  const std::atomic<bool>* stop = nullptr;      // set: end the warm-up early
};

// config.sft.steps optimizer steps of cross-entropy on batches of config.sft.batch_size
// examples drawn (with replacement, seeded by run.seed) from config.sft.dataset. A line
// every 10 steps and at the last. REQUIRES: config.sft.steps > 0.
Status RunSft(trainer::TrainingClient& client, const pipeline::RunConfig& config,
              const model::Tokenizer& tokenizer, const WarmupContext& context);

// config.dpo.steps steps of DPO (beta config.dpo.beta) against the policy as it is before
// the first step (the reference logprobs are computed once), on batches of
// config.dpo.batch_size pairs. REQUIRES: config.dpo.steps > 0.
Status RunDpo(trainer::TrainingClient& client, const pipeline::RunConfig& config,
              const model::Tokenizer& tokenizer, const WarmupContext& context);

}  // namespace flywheel::rl
