// The lane model's forecast for GPT-2-large-shaped models on one H200-class GPU under a 16 GiB budget: every step on
// the host (today's engine) against the placement the lane model chooses (lane_plan.h), simulated with the real
// scheduler. Prints a markdown table for benchmarks/RESULTS.md.
//
// Build and run (torch-free, from the repository root):
//   mkdir -p build && g++ -std=c++20 -O2 -Icsrc benchmarks/bench_lanes.cpp csrc/core/*.cpp -pthread -o build/bench_lanes
//   build/bench_lanes
//
// The shape: 36 layers of d = 1280 (19.7M parameters each) as one shard each, the embeddings (wte, wpe: 65.6M) as
// shard 0, the final norm and the head tied to wte as the last shard; bf16 compute with AdamW (lanes.h's bytes).
// Unit times: plain PyTorch's 0.210 s forward and backward of the same flops on the H200 (RESULTS.md, P1: the XL
// shape at batch 4 x 1024 is a GPT-2-large step at batch 8 x 1024), split by flops (a layer's parameters and its
// attention, the head's matmul), backward 2x forward, and a spilled shard's backward recomputes its forward.
// Rates: PCIe 55 GB/s each way (measured there), device memory 3 TB/s for a step, the host's step traffic at 50,
// 100 and 150 GB/s. Room for homes and device steps: 16 GiB less 2 GiB of working set and, per model, one
// micro-batch's saved shard inputs (37 x 8 x 1024 x 1280 bf16); both placements run in it (simulation_in_room: what
// the placement holds for the run leaves the arena that keeps weights between visits and takes device steps' states).
#include <cstdio>
#include <vector>

#include "core/lane_plan.h"

using namespace hydra::core;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;
constexpr int kLayers = 36;
constexpr int64_t kD = 1280, kVocab = 50257, kContext = 1024, kBatch = 8, kSteps = 8;
constexpr double kStepSeconds = 0.210;  // forward + backward, no recompute

TaskShape gpt2_large() {
  const int64_t layer = 12 * kD * kD + 13 * kD;
  const int64_t wte = kVocab * kD, embeddings = wte + kContext * kD, final_norm = 2 * kD;
  // Forward flops a token: 2 a parameter, and a layer's attention 2 x context x d.
  const double layer_flops = 2.0 * layer + 2.0 * kContext * kD, head_flops = 2.0 * wte;
  const double forward_per_flop = kStepSeconds / 3 / (kLayers * layer_flops + head_flops);
  TaskShape task;
  const double forward = layer_flops * forward_per_flop;
  // The lookup and its scatter into wte's gradient: memory-bound, taken as 1% of a layer.
  task.shards.push_back(ShardShape{0.01 * forward, 0.02 * forward, embeddings, embeddings, embeddings, -1});
  for (int l = 0; l < kLayers; ++l) {
    task.shards.push_back(ShardShape{forward, 3 * forward, layer, layer, layer, -1});
  }
  const double head = head_flops * forward_per_flop;
  task.shards.push_back(ShardShape{head, 2 * head, wte + final_norm, wte + final_norm, final_norm, 0});
  task.micro_batches = kSteps;
  return task;
}

struct Shares {
  double resident = 0, device = 0, host = 0;
};

Shares shares(const std::vector<TaskShape>& tasks, const Placement& placement) {
  Shares s;
  double total = 0;
  for (size_t t = 0; t < tasks.size(); ++t)
    for (size_t i = 0; i < tasks[t].shards.size(); ++i) {
      const auto p = static_cast<double>(tasks[t].shards[i].params);
      total += p;
      const StepPlace place = placement[t][i];
      (place == StepPlace::kResident ? s.resident : place == StepPlace::kDevice ? s.device : s.host) += p;
    }
  return Shares{s.resident / total, s.device / total, s.host / total};
}

double tokens_per_second(int models, double makespan) {
  return static_cast<double>(models * kSteps * kBatch * kContext) / makespan;
}

}  // namespace

int main() {
  const StepBytes bytes;
  std::printf("| K | host GB/s | placement | steps resident / device / host (of parameters) | makespan s | "
              "four-lane bound s | makespan / bound | busy: compute / in / out / host | tokens/s | vs FSDP2 12.7k |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (int models : {1, 4, 12}) {
    const std::vector<TaskShape> tasks(static_cast<size_t>(models), gpt2_large());
    const double activations = 37.0 * kBatch * kContext * kD * 2;
    const auto room = static_cast<int64_t>(16 * kGiB - 2 * kGiB - models * activations);
    for (double host_gbs : {50.0, 100.0, 150.0}) {
      const LaneRates rates{55e9, 55e9, host_gbs * 1e9, 3e12};
      const Placement host = host_placement(tasks);
      const LanePlan plan = plan_lanes(tasks, rates, bytes, 1, room);
      struct Row {
        const char* name;
        Placement placement;
        LaneBound bound;
        SimulationResult run;
      };
      const Row rows[] = {
          {"host", host, lane_bound(tasks, host, rates, bytes, 1),
           simulate(simulation_in_room(tasks, host, rates, bytes, 1, room))},
          {"auto", plan.placement, plan.bound, plan.run},
      };
      for (const Row& row : rows) {
        const Shares s = shares(tasks, row.placement);
        const double m = row.run.makespan;
        const double compute = row.bound.compute;  // one device: the lane's total
        const double tokens = tokens_per_second(models, m);
        std::printf("| %d | %.0f | %s%s | %.2f / %.2f / %.2f | %.2f | %.2f | %.3f | %.2f / %.2f / %.2f / %.2f | "
                    "%.1fk | %.2fx |\n",
                    models, host_gbs, row.name,
                    row.name[0] == 'a' ? (plan.headroom < 1 ? " (headroom)" : "") : "", s.resident, s.device, s.host,
                    m, row.bound.bound(), m / row.bound.bound(), compute / m, row.run.transfer_seconds / m,
                    row.run.gradient_transfer_seconds / m, row.run.host_seconds / m, tokens / 1e3, tokens / 12.7e3);
      }
    }
  }
  return 0;
}
