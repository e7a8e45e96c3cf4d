// A tiny byte-vocabulary model taught to answer one prompt with one text (greedy decoding
// then writes it), for tests of how answers are parsed: reasoning, tool calls.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "tests/model/tiny_models.h"

namespace flywheel::testing {

// The ChatML template the taught prompt is rendered with (without tools in the prompt).
inline const char* kTaughtTemplate =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
// The prompt of the user message "w?" through kTaughtTemplate.
inline const char* kTaughtPrompt = "<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n";
// The answer taught (followed by "<|im_end|>"): reasoning, content and two tool calls.
inline const char* kTaughtAnswer =
    "<think>cold?</think>\n\nLook:\n<tool_call>{\"name\": \"w\", \"arguments\": {\"c\": 1}}"
    "</tool_call>\n<tool_call>{\"name\": \"t\"}</tool_call>";

// 400 Adam steps on kTaughtPrompt + kTaughtAnswer + "<|im_end|>" (about 5 s on 2 cores).
inline std::shared_ptr<model::TransformerImpl> TaughtModel() {
  torch::manual_seed(4);
  model::ModelConfig config = TinyConfig({.vocab = 260});
  config.hidden_size = 64;
  config.intermediate_size = 128;
  config.max_position_embeddings = 256;
  auto model = std::make_shared<model::TransformerImpl>(config);
  std::vector<int64_t> ids;
  for (unsigned char ch : std::string(kTaughtPrompt) + kTaughtAnswer + "<|im_end|>") ids.push_back(ch);
  torch::Tensor tokens = torch::tensor(ids).view({1, -1});
  const int64_t n = tokens.size(1) - 1;
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(3e-3));
  for (int step = 0; step < 400; ++step) {
    torch::Tensor logits = model->forward(tokens.narrow(1, 0, n)).logits[0];
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits, tokens[0].narrow(0, 1, n));
    adam.zero_grad();
    loss.backward();
    adam.step();
  }
  return model;
}

}  // namespace flywheel::testing
