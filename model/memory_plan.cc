#include "model/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace flywheel::model {
namespace {

// A projection in -> out, and its rank-r adapters (A [r, in], B [out, r]).
int64_t Proj(int64_t in, int64_t out, bool bias) { return in * out + (bias ? out : 0); }
int64_t Lora(int64_t in, int64_t out, int64_t rank) { return rank * (in + out); }

std::string Bytes(uint64_t bytes) {
  char text[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  } else {
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1ull << 20));
  }
  return text;
}

// Activations autograd keeps for one training batch (see the header).
uint64_t Activations(const ModelConfig& c, int64_t sequences, int64_t context) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.kv_heads() * c.head_dim;
  uint64_t per_token = 0;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const int64_t inter = c.IsMoeLayer(layer) ? c.num_experts_per_tok * c.moe_intermediate_size : c.intermediate_size;
    per_token += static_cast<uint64_t>(12 * h + 2 * (q + 2 * kv) + 4 * inter + 2 * c.num_attention_heads * context) * 4;
  }
  const uint64_t logits = static_cast<uint64_t>(c.vocab_size) * 4 * 3;
  return static_cast<uint64_t>(sequences) * static_cast<uint64_t>(context) * (per_token + logits);
}

}  // namespace

int64_t ParameterCount(const ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.kv_heads() * c.head_dim;
  int64_t total = c.vocab_size * h + h;  // embeddings, final norm
  if (!c.tie_word_embeddings) total += c.vocab_size * h;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    total += Proj(h, q, c.attention_bias) + 2 * Proj(h, kv, c.attention_bias) + Proj(q, h, false);
    if (c.qk_norm) total += 2 * c.head_dim;
    total += 2 * h;  // input and post-attention norms
    if (c.IsMoeLayer(layer)) {
      total += h * c.num_experts + c.num_experts * 3 * h * c.moe_intermediate_size;
    } else {
      total += 3 * h * c.intermediate_size;
    }
  }
  return total;
}

int64_t LoraParameterCount(const ModelConfig& c, int64_t rank) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.kv_heads() * c.head_dim;
  int64_t total = 0;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    total += Lora(h, q, rank) + 2 * Lora(h, kv, rank) + Lora(q, h, rank);
    const int64_t mlps = c.IsMoeLayer(layer) ? c.num_experts : 1;
    const int64_t inter = c.IsMoeLayer(layer) ? c.moe_intermediate_size : c.intermediate_size;
    total += mlps * (2 * Lora(h, inter, rank) + Lora(inter, h, rank));
  }
  return total;
}

uint64_t KvCacheBytes(const ModelConfig& c, int64_t max_batch, int64_t prefix_slots, int64_t context) {
  const int64_t prefix = prefix_slots >= 0 ? prefix_slots : std::max<int64_t>(1, max_batch / 4);
  return static_cast<uint64_t>(max_batch + prefix) * static_cast<uint64_t>(context) *
         static_cast<uint64_t>(c.num_hidden_layers * 2 * c.kv_heads() * c.head_dim) * 4;
}

MemoryPlan PlanMemory(const PlanInputs& in) {
  const ModelConfig& c = in.model;
  const uint64_t p = static_cast<uint64_t>(ParameterCount(c));
  const uint64_t t = in.lora_rank > 0 ? static_cast<uint64_t>(LoraParameterCount(c, in.lora_rank)) : p;
  const uint64_t serving = static_cast<uint64_t>(static_cast<double>(p) * in.serving_bytes_per_weight);
  MemoryPlan plan;
  plan.workers = in.workers;
  plan.relays = in.relays;
  plan.trainer = in.trainer;
  auto add = [&](const std::string& role, const std::string& name, uint64_t bytes, uint64_t& sum) {
    plan.terms.push_back({role, name, bytes});
    sum += bytes;
  };
  if (in.trainer) {
    add("trainer", "weights (fp32 masters)", 4 * (p + (in.lora_rank > 0 ? t : 0)), plan.trainer_bytes);
    add("trainer", in.lora_rank > 0 ? "gradients (LoRA adapters)" : "gradients", 4 * t, plan.trainer_bytes);
    add("trainer", "AdamW moments", 8 * t, plan.trainer_bytes);
    add("trainer", "held-out evaluator's copy (fp32)", 4 * p, plan.trainer_bytes);
    if (in.reference) add("trainer", "KL reference (fp32)", 4 * p, plan.trainer_bytes);
    add("trainer", "serving snapshot + its keyframe", 2 * serving, plan.trainer_bytes);
    add("trainer", "activations (" + std::to_string(in.train_sequences) + " x " + std::to_string(in.context) + " tokens)",
        Activations(c, in.train_sequences, in.context), plan.trainer_bytes);
    add("trainer", "runtime (libtorch, OpenBLAS, services)", kTrainerRuntimeBytes, plan.trainer_bytes);
  }
  if (in.workers > 0) {
    const int64_t prefix = in.prefix_slots >= 0 ? in.prefix_slots : std::max<int64_t>(1, in.worker_max_batch / 4);
    const uint64_t kv = KvCacheBytes(c, in.worker_max_batch, in.prefix_slots, in.context);
    add("worker", "serving copy", serving, plan.worker_bytes);
    add("worker", "fp32 compute mirror", 4 * p, plan.worker_bytes);
    add("worker", "keyframe arriving (its artifact and the decoded copy)", 2 * serving, plan.worker_bytes);
    add("worker", "KV cache (" + std::to_string(in.worker_max_batch + prefix) + " slots x " + std::to_string(in.context) + ")",
        kv, plan.worker_bytes);
    add("worker", "runtime (libtorch, OpenBLAS)", kWorkerRuntimeBytes, plan.worker_bytes);
  }
  if (in.relays > 0) {
    add("relay", "cached keyframe (uncompressed bound)", serving, plan.relay_bytes);
    add("relay", "runtime", kRelayRuntimeBytes, plan.relay_bytes);
  }
  plan.total_bytes = plan.trainer_bytes + static_cast<uint64_t>(in.workers) * plan.worker_bytes +
                     static_cast<uint64_t>(in.relays) * plan.relay_bytes;
  plan.available_bytes = AvailableMemory();
  return plan;
}

std::string MemoryPlan::Table() const {
  std::ostringstream out;
  std::string role;
  for (const PlanTerm& term : terms) {
    if (term.role != role) {
      role = term.role;
      const uint64_t sum = role == "trainer" ? trainer_bytes : role == "worker" ? worker_bytes : relay_bytes;
      const int64_t count = role == "trainer" ? 1 : role == "worker" ? workers : relays;
      out << role << (count > 1 ? " (each of " + std::to_string(count) + ")" : "") << ": " << Bytes(sum) << "\n";
    }
    out << "  " << term.name << ": " << Bytes(term.bytes) << "\n";
  }
  out << "total on this machine: " << Bytes(total_bytes);
  if (available_bytes > 0) {
    out << " of " << Bytes(available_bytes) << " available (" << (fits() ? "fits" : "does NOT fit") << ")";
  }
  out << "\n";
  return out.str();
}

std::string MemoryPlan::Json() const {
  nlohmann::json list = nlohmann::json::array();
  for (const PlanTerm& term : terms) list.push_back({{"role", term.role}, {"name", term.name}, {"bytes", term.bytes}});
  return nlohmann::json{{"terms", list},
                        {"trainer_bytes", trainer_bytes},
                        {"worker_bytes", worker_bytes},
                        {"relay_bytes", relay_bytes},
                        {"workers", workers},
                        {"relays", relays},
                        {"total_bytes", total_bytes},
                        {"available_bytes", available_bytes},
                        {"fits", fits()}}
      .dump(2);
}

uint64_t AvailableMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

}  // namespace flywheel::model
