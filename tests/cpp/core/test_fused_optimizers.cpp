// The fused optimizer kernels against a double-precision transcription of the update formulas, plus the
// properties the op layer relies on: exact bf16 rounding, slicing independence, optional buffers.
#include "ops/kernels/fused_optimizers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace hydra::kernels {
namespace {

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
float float_from_bits(uint32_t u) { return std::bit_cast<float>(u); }

std::vector<float> normal(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

TEST(Bf16, EveryFiniteBf16SurvivesRoundTrip) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16_rne(f), b) << "bf16 bits " << b;
  }
}

TEST(Bf16, TiesRoundToEven) {
  // Exactly halfway between two bf16 values: the one with an even last mantissa bit wins.
  EXPECT_EQ(float_to_bf16_rne(float_from_bits(0x3F808000u)), 0x3F80);  // even neighbour is below
  EXPECT_EQ(float_to_bf16_rne(float_from_bits(0x3F818000u)), 0x3F82);  // even neighbour is above
  EXPECT_EQ(float_to_bf16_rne(float_from_bits(0xBF818000u)), 0xBF82);
  // One float ulp either side of a tie is no longer a tie.
  EXPECT_EQ(float_to_bf16_rne(float_from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(float_to_bf16_rne(float_from_bits(0x3F817FFFu)), 0x3F81);
}

TEST(Bf16, OverflowInfinityAndNan) {
  EXPECT_EQ(float_to_bf16_rne(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to +inf
  EXPECT_EQ(float_to_bf16_rne(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16_rne(-std::numeric_limits<float>::infinity()), 0xFF80);
  // A NaN whose payload lives only in the low 16 bits would otherwise round to infinity.
  const uint16_t nan = float_to_bf16_rne(float_from_bits(0x7F800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
  EXPECT_EQ(nan, 0x7FC0);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16_rne(-std::numeric_limits<float>::quiet_NaN()))));
}

struct AdamCase {
  bool decoupled;
  bool bf16_grad;
  double beta1;
  double grad_scale;
};

class AdamVsReference : public ::testing::TestWithParam<AdamCase> {};

TEST_P(AdamVsReference, MatchesDoublePrecisionFormulaOverSteps) {
  const AdamCase c = GetParam();
  const size_t n = 1003;  // not a multiple of any vector width, so the scalar tail runs too
  AdamHyper h{1e-2, c.beta1, 0.999, 1e-8, 0.05, 0, c.grad_scale, c.decoupled};
  std::vector<float> p = normal(n, 1), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> rp(p.begin(), p.end()), rm(n, 0.0), rv(n, 0.0);
  std::vector<uint16_t> shadow(n), grad_bits(n);
  for (int step = 1; step <= 10; ++step) {
    std::vector<float> g = normal(n, 100 + step);
    if (c.bf16_grad) {
      for (size_t i = 0; i < n; ++i) grad_bits[i] = float_to_bf16_rne(g[i]);
      for (size_t i = 0; i < n; ++i) g[i] = bf16_to_float(grad_bits[i]);  // the reference sees the rounded grad
    }
    h.step = step;
    if (c.bf16_grad) {
      adam_step(p.data(), grad_bits.data(), m.data(), v.data(), shadow.data(), 0, n, h);
    } else {
      adam_step(p.data(), g.data(), m.data(), v.data(), shadow.data(), 0, n, h);
    }
    const double bc1 = 1.0 - std::pow(h.beta1, step), bc2 = 1.0 - std::pow(h.beta2, step);
    for (size_t i = 0; i < n; ++i) {
      double gi = g[i] * h.grad_scale;
      if (h.decoupled) rp[i] *= 1.0 - h.lr * h.weight_decay;
      else gi += h.weight_decay * rp[i];
      rm[i] = h.beta1 * rm[i] + (1.0 - h.beta1) * gi;
      rv[i] = h.beta2 * rv[i] + (1.0 - h.beta2) * gi * gi;
      rp[i] -= (h.lr / bc1) * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + h.eps);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], rp[i], 2e-6 * (1.0 + std::abs(rp[i]))) << "param " << i;
    ASSERT_NEAR(m[i], rm[i], 2e-6 * (1.0 + std::abs(rm[i]))) << "exp_avg " << i;
    ASSERT_NEAR(v[i], rv[i], 2e-6 * (1.0 + std::abs(rv[i]))) << "exp_avg_sq " << i;
    ASSERT_EQ(shadow[i], float_to_bf16_rne(p[i])) << "shadow " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, AdamVsReference,
                         ::testing::Values(AdamCase{true, false, 0.9, 1.0}, AdamCase{false, false, 0.9, 1.0},
                                           AdamCase{true, true, 0.9, 0.5}, AdamCase{false, true, 0.9, 1.0},
                                           // beta1 <= 0.5 takes lerp's other branch
                                           AdamCase{true, false, 0.3, 0.25}));

struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
  bool bf16_grad;
};

class SgdVsReference : public ::testing::TestWithParam<SgdCase> {};

TEST_P(SgdVsReference, MatchesDoublePrecisionFormulaOverSteps) {
  const SgdCase c = GetParam();
  const size_t n = 517;
  SgdHyper h{0.05, c.momentum, c.dampening, c.weight_decay, c.nesterov, true, 0.75};
  std::vector<float> p = normal(n, 2);
  std::vector<double> rp(p.begin(), p.end()), rbuf(n, 0.0);
  // With momentum == 0 the kernel must not touch the buffer, so none is passed.
  std::vector<float> buf(n, 123.0f);
  float* buf_ptr = c.momentum != 0.0 ? buf.data() : nullptr;
  std::vector<uint16_t> grad_bits(n);
  for (int step = 0; step < 10; ++step) {
    std::vector<float> g = normal(n, 200 + step);
    h.first_step = step == 0;
    if (c.bf16_grad) {
      for (size_t i = 0; i < n; ++i) grad_bits[i] = float_to_bf16_rne(g[i]);
      for (size_t i = 0; i < n; ++i) g[i] = bf16_to_float(grad_bits[i]);
      sgd_step(p.data(), grad_bits.data(), buf_ptr, nullptr, 0, n, h);
    } else {
      sgd_step(p.data(), g.data(), buf_ptr, nullptr, 0, n, h);
    }
    for (size_t i = 0; i < n; ++i) {
      double d = g[i] * h.grad_scale + h.weight_decay * rp[i];
      if (h.momentum != 0.0) {
        rbuf[i] = h.first_step ? d : rbuf[i] * h.momentum + (1.0 - h.dampening) * d;
        d = h.nesterov ? d + h.momentum * rbuf[i] : rbuf[i];
      }
      rp[i] -= h.lr * d;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], rp[i], 1e-5 * (1.0 + std::abs(rp[i]))) << "param " << i;
    if (c.momentum != 0.0) ASSERT_NEAR(buf[i], rbuf[i], 1e-5 * (1.0 + std::abs(rbuf[i]))) << "buffer " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, SgdVsReference,
                         ::testing::Values(SgdCase{0.0, 0.0, 0.0, false, false}, SgdCase{0.0, 0.0, 1e-2, false, true},
                                           SgdCase{0.9, 0.0, 1e-3, false, false}, SgdCase{0.9, 0.1, 0.0, false, true},
                                           SgdCase{0.9, 0.0, 1e-3, true, false}));

TEST(Slicing, AnySplitOfTheRangeGivesIdenticalBits) {
  const int64_t n = 4099;
  const std::vector<float> p0 = normal(n, 3), g = normal(n, 4), m0 = normal(n, 5, 0.1f);
  std::vector<float> v0 = normal(n, 6, 0.01f);
  for (auto& x : v0) x = x * x;
  const AdamHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 1.0, true};

  std::vector<float> p1 = p0, m1 = m0, v1 = v0, p2 = p0, m2 = m0, v2 = v0;
  std::vector<uint16_t> s1(n), s2(n);
  adam_step(p1.data(), g.data(), m1.data(), v1.data(), s1.data(), 0, n, h);
  const int64_t cuts[] = {0, 1, 13, 64, 777, 2048, 4098, n};
  for (size_t k = 0; k + 1 < std::size(cuts); ++k) {
    adam_step(p2.data(), g.data(), m2.data(), v2.data(), s2.data(), cuts[k], cuts[k + 1], h);
  }
  EXPECT_EQ(std::memcmp(p1.data(), p2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v1.data(), v2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(s1.data(), s2.data(), n * sizeof(uint16_t)), 0);
}

TEST(Slicing, ElementsOutsideTheRangeAreUntouched) {
  const int64_t n = 300;
  const std::vector<float> p0 = normal(n, 7), g = normal(n, 8);
  std::vector<float> p = p0, buf(n, 0.0f);
  std::vector<uint16_t> shadow(n, 0xABCD);
  const SgdHyper h{0.1, 0.9, 0.0, 0.0, false, true, 1.0};
  sgd_step(p.data(), g.data(), buf.data(), shadow.data(), 100, 200, h);
  for (int64_t i = 0; i < n; ++i) {
    const bool inside = i >= 100 && i < 200;
    EXPECT_EQ(p[i] != p0[i], inside) << i;
    EXPECT_EQ(shadow[i] != 0xABCD, inside) << i;
    EXPECT_EQ(buf[i] != 0.0f, inside) << i;
  }
}

TEST(Shadow, NullShadowGivesTheSameUpdate) {
  const int64_t n = 257;
  const std::vector<float> p0 = normal(n, 9), g = normal(n, 10);
  const AdamHyper h{1e-2, 0.9, 0.99, 1e-8, 0.0, 1, 1.0, false};
  std::vector<float> pa = p0, ma(n, 0.0f), va(n, 0.0f), pb = p0, mb(n, 0.0f), vb(n, 0.0f);
  std::vector<uint16_t> shadow(n);
  adam_step(pa.data(), g.data(), ma.data(), va.data(), nullptr, 0, n, h);
  adam_step(pb.data(), g.data(), mb.data(), vb.data(), shadow.data(), 0, n, h);
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), n * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(pa.data(), p0.data(), n * sizeof(float)), 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(shadow[i], float_to_bf16_rne(pb[i]));
}

TEST(WeightDecay, ZeroDecaySkipsTheTermLikeTorch) {
  // Adding 0 * p would turn an infinite parameter into NaN; torch leaves the gradient alone instead.
  float p[1] = {std::numeric_limits<float>::infinity()}, g[1] = {1.0f}, m[1] = {0.0f}, v[1] = {0.0f};
  adam_step(p, g, m, v, nullptr, 0, 1, AdamHyper{1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, false});
  EXPECT_EQ(m[0], 0.1f * 1.0f);
  float q[1] = {std::numeric_limits<float>::infinity()};
  sgd_step(q, g, nullptr, nullptr, 0, 1, SgdHyper{0.1, 0.0, 0.0, 0.0, false, true, 1.0});
  EXPECT_TRUE(std::isinf(q[0]));
}

}  // namespace
}  // namespace hydra::kernels
