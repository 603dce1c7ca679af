// Scalar fp16 conversions (see kvpool/kernels/numeric.h).
#include "kvpool/kernels/numeric.h"

#include <cmath>

namespace kvpool {

uint16_t Fp64ToFp16(double x, RoundMode mode) {
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (std::isinf(x)) return static_cast<uint16_t>(sign | 0x7c00u);
  if (x == 0.0) return sign;
  const bool neg = sign != 0;
  const double a = std::fabs(x);
  // Quantum of the fp16 grid around `a`: 2^(e-10) for a in [2^e, 2^(e+1)), e >= -14;
  // 2^-24 in the subnormal range.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1) -> a in [2^(e-1), 2^e)
  int exp2 = e - 1;   // a in [2^exp2, 2^(exp2+1))
  if (exp2 < -14) exp2 = -14;
  const int q_exp = exp2 - 10;
  // m = a / 2^q_exp is exact in fp64 (power-of-two scaling, no underflow: q_exp >= -24).
  const double m = std::ldexp(a, -q_exp);
  double r;
  // Rounding of the magnitude: toward +inf for the value means up for positives, down
  // (truncate) for negatives.
  switch (mode) {
    case RoundMode::kNearestEven:
      r = std::nearbyint(m);  // default FP environment: ties to even
      break;
    case RoundMode::kDown:
      r = neg ? std::ceil(m) : std::floor(m);
      break;
    case RoundMode::kUp:
    default:
      r = neg ? std::floor(m) : std::ceil(m);
      break;
  }
  // r * 2^q_exp is the rounded magnitude; r <= 2048 (may carry into the next binade).
  double mag = std::ldexp(r, q_exp);
  if (mag > 65504.0) {
    const bool away = mode == RoundMode::kNearestEven || (mode == RoundMode::kUp && !neg) ||
                      (mode == RoundMode::kDown && neg);
    // Nearest: values below 65520 round to 65504; ldexp above already rounded at the 2^5
    // quantum so 65520 exactly ties to even (65536 -> inf), matching IEEE.
    return static_cast<uint16_t>(sign | (away ? 0x7c00u : 0x7bffu));
  }
  if (mag == 0.0) return sign;
  // Encode mag (exactly representable now).
  int e2;
  std::frexp(mag, &e2);
  int be = e2 - 1;  // mag in [2^be, 2^(be+1))
  uint16_t bits;
  if (be < -14) {
    bits = static_cast<uint16_t>(std::ldexp(mag, 24));  // subnormal: mag / 2^-24
  } else {
    const uint32_t mant = static_cast<uint32_t>(std::ldexp(mag, 10 - be)) - 1024u;
    bits = static_cast<uint16_t>(((be + 15) << 10) | mant);
  }
  return static_cast<uint16_t>(sign | bits);
}

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) ? 1u : 0u;
  const uint32_t ex = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float v;
  if (ex == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (ex == 31) {
    if (mant == 0) {
      v = INFINITY;
    } else {
      return BitsToFloat((sign << 31) | 0x7fc00000u | (mant << 13));
    }
  } else {
    v = std::ldexp(static_cast<float>(mant + 1024u), static_cast<int>(ex) - 25);
  }
  return sign ? -v : v;
}

}  // namespace kvpool
