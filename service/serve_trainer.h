// `flywheel serve-trainer`: the training service (service/training_service.h) as a process: the
// model from a config.json (+ safetensors) or a preset, the in-process publisher that relays
// and workers subscribe to, and the training API's HTTP port; runs until SIGINT/SIGTERM.
// Torch-free declarations: `flywheel` hands the command over to flywheel-torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace flywheel::service {

struct ServeTrainerOptions {
  std::string model;           // config.json, or a directory with config.json (+ *.safetensors)
  std::string preset;          // "tiny" / "tiny-moe" when no model: the demo's model
  int64_t vocab = 0;           // preset: vocabulary (0: the demo task's characters + BOS/EOS)
  std::string weights;         // initial weights (safetensors file or dir); default: the model dir's
  bool random_init = false;    // ignore the model directory's weights
  std::string state_dir;       // required: versions/, sessions/, config.json
  std::string http = "127.0.0.1:0";            // the training API, /v1/status, /metrics
  std::string listen = "127.0.0.1:0";          // the publisher's data port
  std::string publisher_http = "127.0.0.1:0";  // the publisher's status port
  std::string ready_file;      // {"http","listen","publisher_http","model_config","tokenizer"}
  std::string token;           // the fleet token (relays and workers)
  std::string train_token;     // the training API's token (train + read scopes)
  std::vector<transport::ScopedToken> scoped_tokens;
  transport::TlsOptions tls;
  std::string signing_key;
  int64_t lora_rank = 0;       // > 0: LoRA mode
  double lora_alpha = 0;       // 0: 2 x rank
  std::vector<std::string> lora_targets;  // empty: every projection
  uint64_t seed = 0;
  int threads = 0;
  std::string serving_dtype = "bf16";
  std::string pack_experts = "none";  // LoRA on MoE: none, fp8, int8, int4 (model/packed.h)
  double session_idle_timeout_s = 3600;
  double seq_wait_s = 60;
  int64_t max_batch_tokens = 1 << 18;
  int64_t max_body_mb = 256;
  int64_t keyframe_every = 20;
  int64_t max_sessions_per_token = 8;  // open sessions one identity may hold
  int64_t max_sessions = 64;           // open sessions in all
  double wan_rate_mbit = 0;    // the publisher's shaper (0: off)
  double wan_latency_ms = 0;
};

Status RunServeTrainer(const ServeTrainerOptions& options);

}  // namespace flywheel::service
