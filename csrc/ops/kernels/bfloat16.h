// bfloat16 as raw bits, free of torch: the conversions the host kernels need, rounding as c10::BFloat16 does.
#pragma once

#include <bit>
#include <cstdint>

#include "ops/kernels/multiversion.h"

namespace hydra::kernels {

// The same rounding as c10::BFloat16's float constructor: round to nearest, ties to even; every NaN
// becomes the canonical quiet NaN 0x7FC0 (torch's scalar conversion does this too).
inline uint16_t float_to_bf16_rne(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t rounding_bias = ((bits >> 16) & 1u) + 0x7FFFu;
  const auto rounded = static_cast<uint16_t>((bits + rounding_bias) >> 16);
  return value != value ? uint16_t{0x7FC0} : rounded;
}

HYDRA_ALWAYS_INLINE float bf16_to_float(uint16_t value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value) << 16);
}

// A float32 or bfloat16 (raw bits) element as float, so one template loop reads either.
HYDRA_ALWAYS_INLINE float as_float(float value) { return value; }
HYDRA_ALWAYS_INLINE float as_float(uint16_t value_bf16) { return bf16_to_float(value_bf16); }

}  // namespace hydra::kernels
