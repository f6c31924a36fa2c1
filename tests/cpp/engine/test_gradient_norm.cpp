// Clipping's gradient norm on the host: accurate over millions of elements, the same for any thread count,
// and what clip_and_step reports.
#include <ATen/Parallel.h>

#include "device_engine_helpers.h"
#include "engine/gradient_norm.h"

namespace {

using namespace engine_test;
using hydra::engine::squared_norm;

// 0.1f squared, exactly, times n.
double exact_sum(int64_t n) { return static_cast<double>(0.1f) * static_cast<double>(0.1f) * static_cast<double>(n); }

TEST(GradientNorm, HostBuffersOfMillionsOfElementsSumAccurately) {
  // ATen's float32 norm of these 3M values, on one thread, is 0.09% high; 20M, 2% low.
  const int64_t n = 3'000'000;
  const at::Tensor fp32 = at::full({n}, 0.1f);
  EXPECT_NEAR(squared_norm(fp32), exact_sum(n), 1e-12 * exact_sum(n));
  const at::Tensor bf16 = at::full({n}, 1.0f).to(at::kBFloat16);
  EXPECT_EQ(squared_norm(bf16), static_cast<double>(n));
}

TEST(GradientNorm, TheSameBitsForAnyThreadCount) {
  const at::Tensor grad = at::randn({5'000'001}, at::TensorOptions().dtype(at::kFloat));
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const double one = squared_norm(grad);
  at::set_num_threads(std::max(2, threads));
  const double more = squared_norm(grad);
  at::set_num_threads(threads);
  EXPECT_EQ(one, more);
}

TEST(GradientNorm, OtherLayoutsGoThroughATen) {
  const at::Tensor grad = at::full({1000, 2}, 0.5f).t();  // not contiguous
  EXPECT_NEAR(squared_norm(grad), 500.0, 1e-4);
  EXPECT_NEAR(squared_norm(at::full({100}, 2.0, at::kDouble)), 400.0, 1e-9);
}

TEST(DeviceEngine, ClipAndStepReportsTheNormOfMillionsOfGradientsAccurately) {
  const int64_t n = 3'000'000;
  auto store = make_store({{param({n}, 0.0)}, {param({10}, 1.0)}});
  DeviceEngine engine(kCpu, DeviceEngine::min_spilled_bytes(*store) * 4);
  const int m = engine.add_model(store);
  auto write = [](ShardStore& s, int shard) {
    for (const ParamEntry& e : s.layout(shard)) e.param.mutable_grad().fill_(shard == 0 ? 0.1f : 0.0f);
  };
  run_step(engine, m, *store, /*micro_batches=*/1, /*check_values=*/false, /*step=*/false, 1.0, /*keep=*/true, write);
  const double norm = engine.clip_and_step(m, /*max_norm=*/1e9)->value();
  EXPECT_NEAR(norm, std::sqrt(exact_sum(n)), 1e-12 * std::sqrt(exact_sum(n)));
  engine.synchronize(m);
}

}  // namespace
