// A memory plan (issue 36): what a run will hold in memory, by role and by term, before
// anything starts, against this machine's available memory. `flywheel plan` prints it;
// `flywheel train` / `flywheel demo` refuse a run whose plan does not fit, with the plan in
// the message, instead of being killed half-way. Torch-free arithmetic on the model config.
//
// The terms (bytes; P parameters, T trainable ones, s the serving dtype's bytes per weight):
//   trainer   weights 4P (fp32 masters), gradients 4T, AdamW moments 8T, the held-out
//             evaluator's private copy 4P (it scores the served, rounded policy), a KL
//             reference 4P (kl_coef > 0), the published serving snapshot and the keyframe
//             encoded from it 2sP, activations of one training batch at the context (below),
//             and the runtime (libtorch, OpenBLAS, the services: kTrainerRuntimeBytes)
//   worker    the serving copy sP, its fp32 compute mirror 4P, a keyframe arriving while it
//             joins (its artifact and the decoded copy: up to 2sP), the KV cache (max_batch + prefix slots) x context x layers x 2 x
//             kv_heads x head_dim x 4, the runtime (kWorkerRuntimeBytes)
//   relay     the keyframe it caches sP (an upper bound: it holds it compressed) and the
//             torch-free runtime (kRelayRuntimeBytes)
// Measured against peak RSS (getrusage) on the demo model and a 100M-parameter config:
// docs/BENCHMARKS.md, "Memory plan".
// Activations per training sequence of C tokens, fp32, what autograd keeps for backward:
//   per layer and token  (12 h + 2 (q + 2 kv) + 4 i_active) x 4 bytes, plus the attention
//   probabilities heads x C x 4 (twice: the softmax and its input); the logits' log-softmax
//   C x vocab x 4 x 3 (logits, log-probabilities, their gradient).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace flywheel::model {

// Parameters of `config`'s transformer as the model builds it (embeddings, attention with
// its biases and q/k norms, dense or MoE MLPs with the router, norms, the head unless tied).
int64_t ParameterCount(const ModelConfig& config);
// Parameters of rank-`rank` LoRA adapters on every attention and MLP projection.
int64_t LoraParameterCount(const ModelConfig& config, int64_t rank);

struct PlanInputs {
  ModelConfig model;
  int64_t context = 0;            // tokens per sequence (prompt + completion)
  int64_t lora_rank = 0;          // 0: full fine-tuning
  int64_t train_sequences = 1;    // sequences in one training forward (a step's batch)
  int64_t workers = 1;            // rollout workers on this machine (0: none)
  int64_t relays = 0;             // relays on this machine
  int64_t worker_max_batch = 32;  // sequences decoded together per worker
  int64_t prefix_slots = -1;      // -1: the engine's default (max_batch / 4, at least 1)
  double serving_bytes_per_weight = 2;  // bf16 2, fp8 ~1.0 (with its block scales)
  bool reference = false;         // a KL reference copy (kl_coef > 0)
  bool trainer = true;            // the trainer runs on this machine
};

struct PlanTerm {
  std::string role;  // "trainer", "worker", "relay"
  std::string name;  // "weights (fp32)", ...
  uint64_t bytes = 0;
};

struct MemoryPlan {
  std::vector<PlanTerm> terms;  // per process of each role (a worker's once)
  uint64_t trainer_bytes = 0;   // the trainer process
  uint64_t worker_bytes = 0;    // one worker process
  uint64_t relay_bytes = 0;     // one relay process
  uint64_t total_bytes = 0;     // every process of the run on this machine
  uint64_t available_bytes = 0; // this machine's MemAvailable (0: unknown)
  int64_t workers = 0, relays = 0;
  bool trainer = true;
  bool fits() const { return available_bytes == 0 || total_bytes <= available_bytes; }
  // The table `flywheel plan` prints, the largest term of each role named.
  std::string Table() const;
  std::string Json() const;
};

// The processes without their model (libtorch, OpenBLAS, threads, the trainer's services),
// measured on Debian 12's libtorch (CPU) as the peak RSS of each role on a model of 0.6M
// parameters, less the plan's model terms.
inline constexpr uint64_t kTrainerRuntimeBytes = 180ull << 20;
inline constexpr uint64_t kWorkerRuntimeBytes = 175ull << 20;
inline constexpr uint64_t kRelayRuntimeBytes = 14ull << 20;

// REQUIRES: inputs.model validates; context >= 1.
MemoryPlan PlanMemory(const PlanInputs& inputs);

// A worker's KV cache: (max_batch + prefix slots; -1: the engine's default) x context x
// layers x 2 x kv_heads x head_dim x 4 bytes.
uint64_t KvCacheBytes(const ModelConfig& config, int64_t max_batch, int64_t prefix_slots, int64_t context);

// MemAvailable of /proc/meminfo in bytes; 0 when unknown.
uint64_t AvailableMemory();

}  // namespace flywheel::model
