// The rollout engine inside `flywheel worker` (torch-free interface for tools/): built from
// a model config, it takes the worker's first served version as its weights, follows every
// later swap between two decode steps (WorkerOptions::on_swap), and answers the OpenAI-style
// routes of rollout/openai_api.h (completions, chat completions, streaming, /v1/models,
// /tokenize, /detokenize) on the worker's HTTP server (503 until a version is served).
//
// bf16 (or f16) served weights are computed from an fp32 mirror patched at the words each
// swap wrote (rollout/mirror.h); f32 served weights (a trainer publishing with serving
// dtype F32) are computed from directly, without a copy: the engine's steps then run under
// the worker's shared weights lock, so applies and steps never overlap.
// FP8 versions (trainer::TrainerOptions::fp8_serving: F8_E4M3 projection weights with
// `<name>_scale_inv` block scales) are computed from the fp32 dequantization, kept exact
// across swaps (rollout/mirror.h); the block size is config.json's
// quantization_config.weight_block_size, 128 when it has none.
//
// Served adapters (the training service's LoRA sessions): a version's tensors
// model::kServedAdapterPrefix + "<name>/" + <adapters-only snapshot tensor name> are served
// as LoRA adapter <name> beside the base (requests choose it by `adapter` or `model`;
// /v1/models lists it). The first version loads every such group; a later swap reloads only
// the groups whose tensors it wrote (a base-only delta costs nothing more) and unloads the
// adapters a new layout no longer carries (one still in use by a request in flight is
// retried at each later swap). A group that does not load (malformed, or a name outside
// [A-Za-z0-9._-]{1,64}) is logged and never refuses the version: that adapter's previous
// copy, if any, stays served. The `adapters` given as files are never unloaded by a swap,
// and a served group under one of their names is ignored. Adapters change right after the
// base, between decode steps of their own: a token sampled in between is tagged with the
// new version but computed with an adapter's previous factors.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "sync/worker.h"
#include "transport/http.h"

namespace flywheel::rollout {

struct WorkerEngineOptions {
  std::string model_config;  // config.json (or a directory holding one)
  int64_t max_batch = 32;
  int64_t max_sequence = 1024;
  // Shared prefixes (EngineOptions::share_prefixes, prefix_slots; -1: max_batch / 4).
  bool share_prefixes = true;
  int64_t prefix_slots = -1;
  int64_t prefill_chunk = 256;  // EngineOptions::prefill_chunk
  // Chat answers' reasoning split (tokenizer/answer_parser.h): "", "qwen3" or "deepseek_r1".
  std::string reasoning_parser;
  // "auto": the HF tokenizer.json beside config.json when there is one, else bytes; "byte";
  // "chars:<alphabet>"; or the path of a tokenizer.json (or of the folder holding it, with
  // its tokenizer_config.json and generation_config.json).
  std::string tokenizer = "auto";
  // The name /v1/models lists and answers carry; empty: "flywheel".
  std::string model_name;
  // LoRA adapters loaded at the first version: (name, adapters-only safetensors file).
  std::vector<std::pair<std::string, std::string>> adapters;
  // Set: run the pipeline-RL actor (rollout/actor.h) against this trainer HTTP endpoint.
  std::string trainer;
  std::string trainer_token;
  // Set (the worker's --tls-* flags): the trainer is reached over TLS, verified against
  // ca_file, and this certificate is presented to it.
  transport::TlsOptions trainer_tls;
  std::string worker_id;
  int64_t actor_groups = 8;  // groups claimed at once
  // Runs before the engine takes each version after its first (a seam for fault injection
  // in tests, or an operator's veto): an error refuses that version like any failed swap.
  std::function<Status(uint64_t version)> before_swap;
};

class WorkerEngine {
 public:
  static Result<std::unique_ptr<WorkerEngine>> Create(const WorkerEngineOptions& options);
  ~WorkerEngine();

  // For WorkerOptions::on_swap (runs under the worker's weights lock). An error means the
  // engine did not take the version and still serves the one before, unchanged (the sync
  // worker then restores its weights and keeps advertising the old version). A first version
  // that does not fit the model is refused too: nothing is served until one fits.
  Status OnSwap(const sync::SwapEvent& event);
  // For WorkerOptions::configure_http.
  void Register(transport::HttpServer& server);
  // The engine's counters for /v1/status and /metrics (nothing before the first version):
  // engine_running, engine_waiting, kv_cache_bytes and the prefix cache's. Thread-safe.
  void AddStatus(nlohmann::json& status) const;
  // The worker whose weights the engine serves; call right after sync::Worker::Start
  // (fp32 serving computes from the worker's weights under its shared lock).
  void Attach(const sync::Worker* worker);

  struct Impl;

 private:
  explicit WorkerEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flywheel::rollout
