// The warm-ups before RL: supervised fine-tuning (SFT) on chat examples, then DPO on
// preference pairs, both read from JSONL files named by the run config (sft.dataset,
// dpo.dataset).
//
// With a model directory's tokenizer that has a chat template (model.dir), every example
// goes through the template (data/render.h): the loss covers exactly the assistant tokens
// the template produced (its {% generation %} blocks, else prefix by prefix), a message's
// "weight" 0 leaves its turn out, tool calls and "tools" are rendered as the template
// writes them, and an example longer than the model's context is dropped and counted,
// never cut. Bad lines are skipped, named file:line, and counted (data/dataset.h); a file
// with no usable example stops the run. BOS is prepended unless the template wrote it (as
// the rollout workers do with prompts).
//
// Without a template (the built-in character tokenizer), a sequence is BOS, then every
// message's content as the tokenizer encodes it; an assistant turn (and a DPO answer) ends
// in EOS; a bad line stops the run naming it.
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
// With a chat template: `max_tokens` bounds a sequence (0: no bound); `warn` gets one line
// per skipped or dropped example and a summary.
Result<std::vector<trainer::Datum>> LoadSftDataset(
    const std::string& path, const model::Tokenizer& tokenizer, int64_t max_tokens = 0,
    const std::function<void(const std::string&)>& warn = nullptr);

// DPO preference pairs, one a line, in the OpenAI preference format
//   {"input": {"messages": [...], "tools"?}, "preferred_output": [assistant message],
//    "non_preferred_output": [assistant message]}
// or the short form {"prompt": text, "chosen": text, "rejected": text} (the file's first
// line decides). Returns two datums per pair, chosen then rejected, weighted on the answer
// tokens only (the layout trainer's "dpo" loss expects). Errors as LoadSftDataset's, named
// "dpo.dataset <path>:<line>".
Result<std::vector<trainer::Datum>> LoadDpoDataset(
    const std::string& path, const model::Tokenizer& tokenizer, int64_t max_tokens = 0,
    const std::function<void(const std::string&)>& warn = nullptr);

struct WarmupContext {
  trainer::AdamWParams adam;  // the RL optimizer settings; each warm-up sets its own lr
  std::function<void(const std::string&)> say;  // progress lines ("sft  10/30  loss ...")
  const std::atomic<bool>* stop = nullptr;      // set: end the warm-up early
  int64_t max_tokens = 0;  // the model's context: longer examples are dropped (0: no bound)
  std::function<void(const std::string&)> warn;  // skipped and dropped examples
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
