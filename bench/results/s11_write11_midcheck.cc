// Host check of the session-11 CodeThresholdBf16 shortcut: for every positive finite fp16 s and
// level j, the fp64 bit pattern of (j + 1/2)·s minus 2^28 is the midpoint between
// A = fp32-round-up(beta_j·s) and its fp32 predecessor, and bit 29 of that pattern is A's
// fp32 significand lsb.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
static float HalfToFloat(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) return std::ldexp(float(m), -24);
  return std::ldexp(float(m | 1024), e - 25);
}
static float RoundUpToFloat(double x) {
  float f = float(x);
  if (double(f) < x) f = std::nextafter(f, INFINITY);
  return f;
}
template <class T, class F> static T Bits(F f) { T t; std::memcpy(&t, &f, sizeof t); return t; }
int main() {
  long bad = 0, n = 0;
  for (uint32_t h = 1; h < 0x7c00; ++h) {
    const float s = HalfToFloat(uint16_t(h));
    for (int j = 0; j < 3; ++j) {
      const double beta = j == 0 ? 0.5 - 0x1p-26 : (j == 1 ? 1.5 - 0x1p-24 : 2.5 - 0x1p-23);
      // old
      const float a_hi = RoundUpToFloat(beta * double(s));
      const float a_lo = Bits<float>(Bits<int32_t>(a_hi) - 1);
      const double mid_old = 0.5 * (double(a_hi) + double(a_lo));
      const bool tie_old = (Bits<int32_t>(a_hi) & 1) == 0;
      // new
      const double w = j == 0 ? 0.5 : (j == 1 ? 1.5 : 2.5);
      const int64_t ab = Bits<int64_t>(double(s) * w);
      const double mid_new = Bits<double>(ab - (int64_t(1) << 28));
      const bool tie_new = ((ab >> 29) & 1) == 0;
      ++n;
      if (mid_new != mid_old || tie_new != tie_old) {
        if (bad < 10) std::printf("s=%a j=%d old %a %d new %a %d\n", s, j, mid_old, tie_old, mid_new, tie_new);
        ++bad;
      }
    }
  }
  std::printf("checked %ld (s, j), %ld differ\n", n, bad);
  return bad != 0;
}
