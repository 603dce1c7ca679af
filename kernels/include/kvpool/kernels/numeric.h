// kvpool/kernels/numeric.h — scalar conversions between fp32 and the 16-bit storage types.
//
// bf16 is the top half of an IEEE binary32 (docs/BLOCK_FORMAT.md); fp16 is IEEE binary16. The
// quantizer stores its per-group (scale, min) pairs in fp16 with *directed* rounding
// (FORMAT.md §2.3: min toward −∞, scale toward +∞), which is why the fp16 conversion takes a
// rounding mode.
//
//   uint16_t mn16 = kvpool::Fp32ToFp16(mn, kvpool::RoundMode::kDown);
//   float back = kvpool::Fp16ToFp32(mn16);   // back <= mn, exact when mn is representable
//
// All functions are pure, header-declared, thread-safe and never fail; out-of-range inputs
// follow IEEE 754 rules (documented per function).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvpool {

// Bit casts (memcpy, no aliasing issues).
inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16, round to nearest, ties to even. Infinities and zeros keep their sign; a NaN
// stays a NaN (quiet bit forced, payload's top bits kept). Finite values whose rounding
// exceeds the bf16 range become ±inf (IEEE behaviour).
inline uint16_t Fp32ToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

// bf16 -> fp32 (exact).
inline float Bf16ToFp32(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// IEEE rounding directions used by the fp16 conversion.
enum class RoundMode {
  kNearestEven,  // round to nearest, ties to even (IEEE default)
  kDown,         // toward −∞ (used for the stored group minimum, FORMAT.md §2.3)
  kUp,           // toward +∞ (used for the stored group scale, FORMAT.md §2.3)
};

// fp64 -> fp16 with the given rounding direction, correctly rounded (one rounding from the
// exact value). Subnormal fp16 results are produced (smallest 2^-24). Overflow follows IEEE:
// a finite value beyond the fp16 range becomes ±inf when the rounding direction points away
// from zero for that sign (nearest always; kUp for positives; kDown for negatives) and
// ±65504 otherwise. NaN -> 0x7e00 (sign kept); ±inf -> ±inf; ±0 -> ±0.
uint16_t Fp64ToFp16(double x, RoundMode mode);

// fp32 -> fp16 (fp32 widens to fp64 exactly, so this is also correctly rounded).
inline uint16_t Fp32ToFp16(float x, RoundMode mode) {
  return Fp64ToFp16(static_cast<double>(x), mode);
}

// fp16 -> fp32 (exact; subnormals, infinities and NaN preserved).
float Fp16ToFp32(uint16_t h);

// True when the fp16 bit pattern is ±inf or NaN.
inline bool Fp16IsNonFinite(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }

// Largest finite fp16 value.
inline constexpr float kFp16Max = 65504.0f;

}  // namespace kvpool
