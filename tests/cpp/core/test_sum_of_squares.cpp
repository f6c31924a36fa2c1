// The sum-of-squares kernel behind clipping's gradient norm: accurate where a float32 sum is not, and the
// same bits however the buffer is split.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "ops/kernels/bfloat16.h"
#include "ops/kernels/sum_of_squares.h"

namespace {

using hydra::kernels::float_to_bf16_rne;
using hydra::kernels::sum_of_squares;

// Every square is exact in double (a float has 24 bits); long double sums them with 11 more bits to spare.
template <typename T, typename Widen>
double reference(const std::vector<T>& values, Widen widen) {
  long double total = 0;
  for (const T v : values) total += static_cast<long double>(widen(v)) * widen(v);
  return static_cast<double>(total);
}

TEST(SumOfSquares, MatchesAWiderSumOverMillionsOfValuesOfEitherType) {
  const int64_t n = 3'000'017;  // not a multiple of the lanes
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> f(n);
  std::vector<uint16_t> b(n);
  for (int64_t i = 0; i < n; ++i) {
    f[i] = normal(rng);
    b[i] = float_to_bf16_rne(f[i]);
  }
  const double want_f = reference(f, [](float v) { return static_cast<double>(v); });
  const double want_b = reference(b, [](uint16_t v) { return static_cast<double>(hydra::kernels::bf16_to_float(v)); });
  EXPECT_NEAR(sum_of_squares(f.data(), n), want_f, 1e-13 * want_f);
  EXPECT_NEAR(sum_of_squares(b.data(), n), want_b, 1e-13 * want_b);
  // A float32 running sum of the same squares is off by far more: what the kernel is for.
  float naive = 0.0f;
  for (const float v : f) naive += v * v;
  EXPECT_GT(std::abs(naive - want_f), 1e-4 * want_f);
}

TEST(SumOfSquares, ConstantValuesSumExactly) {
  // 0.1f squared in double, times n: exact while the total needs no more than 53 bits.
  std::vector<float> f(20'000'000, 0.1f);
  const double square = static_cast<double>(0.1f) * static_cast<double>(0.1f);
  EXPECT_NEAR(sum_of_squares(f.data(), static_cast<int64_t>(f.size())), square * f.size(), 1e-9 * square * f.size());
}

TEST(SumOfSquares, EmptyShortAndNonFinite) {
  const std::vector<float> three = {1.0f, -2.0f, 3.0f};
  EXPECT_EQ(sum_of_squares(three.data(), 0), 0.0);
  EXPECT_EQ(sum_of_squares(three.data(), 3), 14.0);
  std::vector<float> with_inf(100, 1.0f);
  with_inf[57] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(sum_of_squares(with_inf.data(), 100), std::numeric_limits<double>::infinity());
  std::vector<uint16_t> with_nan(100, float_to_bf16_rne(1.0f));
  with_nan[99] = float_to_bf16_rne(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(sum_of_squares(with_nan.data(), 100)));
}

}  // namespace
