// cuda_test_util.cc — see cuda_test_util.h.
#include "cuda_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/paged_decode.h"
#include "kvpool/kernels/numeric.h"

namespace kvpool::cuda::testing {

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

uint16_t ToBf16(double x) { return Fp32ToBf16(static_cast<float>(x)); }
double FromBf16(uint16_t b) { return Bf16ToFp32(b); }
uint16_t ToFp16Nearest(double x) { return Fp64ToFp16(x, RoundMode::kNearestEven); }
double FromFp16(uint16_t h) { return Fp16ToFp32(h); }

std::vector<double> RandomOrthogonal(int d, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> q(size_t(d) * d);  // column-major work: column c at q[c*d ...]
  for (auto& v : q) v = nd(rng);
  for (int c = 0; c < d; ++c) {
    double* col = &q[size_t(c) * d];
    for (int pass = 0; pass < 2; ++pass) {
      for (int p = 0; p < c; ++p) {
        const double* pc = &q[size_t(p) * d];
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += pc[i] * col[i];
        for (int i = 0; i < d; ++i) col[i] -= dot * pc[i];
      }
    }
    double n2 = 0;
    for (int i = 0; i < d; ++i) n2 += col[i] * col[i];
    const double inv = 1.0 / std::sqrt(n2);
    for (int i = 0; i < d; ++i) col[i] *= inv;
  }
  std::vector<double> r(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) r[size_t(i) * d + j] = q[size_t(j) * d + i];
  return r;
}

std::vector<float> ToFloat(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

namespace {

struct SegHost {
  std::vector<int32_t> indptr, indices, last;
  int32_t max_pages = 0;
  DeviceBuffer d_indptr, d_indices, d_last;
};

int Pages(int tokens, int page) { return (tokens + page - 1) / page; }

}  // namespace

DecodeResult RunDecodeCase(const DecodeCase& c) {
  DecodeResult res;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  const int B = c.batch, P = c.page, d = c.d, hkv = c.hkv, hq = c.hq, group = hq / hkv;
  const BlockGeometry geo{1, uint32_t(hkv), uint32_t(d), uint32_t(P)};
  const uint64_t bf16_stride = geo.Bf16LayerBytes(), int2_stride = geo.Int2LayerBytes();
  const int ng = int(geo.GroupsPerRow());

  // ---- page tables ----
  SegHost seg[3];  // sink, history, recent
  const std::vector<int>* lens[3] = {&c.sink_len, &c.hist_len, &c.recent_len};
  int npages[2] = {0, 0};  // bf16, int2
  for (int s = 0; s < 3; ++s) {
    seg[s].indptr.push_back(0);
    for (int b = 0; b < B; ++b) {
      const int L = (*lens[s])[b];
      const int np = Pages(L, P);
      seg[s].max_pages = std::max(seg[s].max_pages, np);
      seg[s].indptr.push_back(seg[s].indptr.back() + np);
      seg[s].last.push_back(np > 0 ? L - (np - 1) * P : 0);
      npages[s == 1 ? 1 : 0] += np;
    }
  }
  std::vector<int32_t> perm_bf(npages[0]), perm_i2(npages[1]);
  std::iota(perm_bf.begin(), perm_bf.end(), 0);
  std::iota(perm_i2.begin(), perm_i2.end(), 0);
  std::shuffle(perm_bf.begin(), perm_bf.end(), rng);
  std::shuffle(perm_i2.begin(), perm_i2.end(), rng);
  int next_bf = 0, next_i2 = 0;
  for (int s = 0; s < 3; ++s) {
    const int n = seg[s].indptr.back();
    for (int i = 0; i < n; ++i)
      seg[s].indices.push_back(
          int32_t((s == 1 ? perm_i2[next_i2++] : perm_bf[next_bf++]) + c.page_id_offset));
  }

  // ---- page contents (host image of every used page) ----
  std::vector<std::vector<uint8_t>> bf_pages(npages[0], std::vector<uint8_t>(bf16_stride));
  std::vector<std::vector<uint8_t>> i2_pages(npages[1], std::vector<uint8_t>(int2_stride));
  for (auto& pg : bf_pages) {
    uint16_t* e = reinterpret_cast<uint16_t*>(pg.data());
    for (size_t i = 0; i < pg.size() / 2; ++i) e[i] = ToBf16(nd(rng));
  }
  for (auto& pg : i2_pages) {
    for (int h = 0; h < hkv; ++h) {
      uint8_t* ch = pg.data() + geo.Int2ChunkOffset(0, h);
      for (uint64_t i = 0; i < geo.Int2KParamsOffset(); ++i) ch[i] = uint8_t(rng());
      uint16_t* par = reinterpret_cast<uint16_t*>(ch + geo.Int2KParamsOffset());
      for (int i = 0; i < 2 * P * ng; ++i) {  // K then V params
        par[2 * i] = ToFp16Nearest(0.02 + 0.6 * ud(rng));
        par[2 * i + 1] = ToFp16Nearest(-1.2 + 1.1 * ud(rng));
      }
    }
  }
  // Poison the slots past each segment's last valid token: the kernel must never use them.
  for (int s = 0; s < 3; ++s) {
    for (int b = 0; b < B; ++b) {
      const int beg = seg[s].indptr[b], end = seg[s].indptr[b + 1];
      if (end == beg) continue;
      const int last_page = seg[s].indices[end - 1] - int32_t(c.page_id_offset);
      for (int slot = seg[s].last[b]; slot < P; ++slot) {
        for (int h = 0; h < hkv; ++h) {
          if (s == 1) {
            uint8_t* ch = i2_pages[last_page].data() + geo.Int2ChunkOffset(0, h);
            uint16_t* kp =
                reinterpret_cast<uint16_t*>(ch + geo.Int2KParamsOffset()) + slot * 2 * ng;
            uint16_t* vp =
                reinterpret_cast<uint16_t*>(ch + geo.Int2VParamsOffset()) + slot * 2 * ng;
            for (int i = 0; i < 2 * ng; ++i) kp[i] = vp[i] = 0x7e00;  // fp16 NaN
          } else {
            uint16_t* ch =
                reinterpret_cast<uint16_t*>(bf_pages[last_page].data() + geo.Bf16ChunkOffset(0, h));
            for (int j = 0; j < d; ++j) ch[slot * d + j] = ch[P * d + slot * d + j] = 0x7fc0;
          }
        }
      }
    }
  }

  // ---- q, rotations ----
  std::vector<uint16_t> q(size_t(B) * hq * d);
  for (auto& v : q) v = ToBf16(c.q_scale * nd(rng));
  if (c.nan_q_request >= 0) q[(size_t(c.nan_q_request) * hq + c.nan_q_head) * d + 3] = 0x7fc0;
  if (c.nan_k_request >= 0 && seg[0].indptr[c.nan_k_request + 1] > seg[0].indptr[c.nan_k_request]) {
    const int page = seg[0].indices[seg[0].indptr[c.nan_k_request]] - int32_t(c.page_id_offset);
    for (int h = 0; h < hkv; ++h)  // token 0, element 5 of K, every KV head
      reinterpret_cast<uint16_t*>(bf_pages[page].data() + geo.Bf16ChunkOffset(0, h))[5] = 0x7fc0;
  }
  const int nrot = c.per_head_rotation ? hkv : 1;
  std::vector<float> rk, rv;
  for (int r = 0; r < nrot; ++r) {
    auto a = ToFloat(RandomOrthogonal(d, rng));
    auto b2 = ToFloat(RandomOrthogonal(d, rng));
    rk.insert(rk.end(), a.begin(), a.end());
    rv.insert(rv.end(), b2.begin(), b2.end());
  }

  // ---- upload ----
  const uint64_t off = uint64_t(c.page_id_offset);
  DeviceBuffer d_bf((off + std::max(npages[0], 1)) * bf16_stride);
  DeviceBuffer d_i2((off + std::max(npages[1], 1)) * int2_stride);
  if (!d_bf.ok() || !d_i2.ok()) {
    res.error = "cudaMalloc of the page pools failed";
    return res;
  }
  for (int i = 0; i < npages[0]; ++i)
    cudaMemcpy(d_bf.as<uint8_t>() + (off + i) * bf16_stride, bf_pages[i].data(), bf16_stride,
               cudaMemcpyHostToDevice);
  for (int i = 0; i < npages[1]; ++i)
    cudaMemcpy(d_i2.as<uint8_t>() + (off + i) * int2_stride, i2_pages[i].data(), int2_stride,
               cudaMemcpyHostToDevice);
  for (auto& s : seg) {
    Upload(s.d_indptr, s.indptr);
    Upload(s.d_indices, s.indices);
    Upload(s.d_last, s.last);
  }
  DeviceBuffer d_q, d_rk, d_rv, d_out(size_t(B) * hq * d * 2), d_lse(size_t(B) * hq * 4);
  Upload(d_q, q);
  Upload(d_rk, rk);
  Upload(d_rv, rv);
  cudaMemset(d_out.get(), 0xff, d_out.bytes());
  cudaMemset(d_lse.get(), 0xff, d_lse.bytes());

  PagedDecodeParams p;
  p.batch = B;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.page_size = P;
  p.sm_scale = float(1.0 / std::sqrt(double(d)));
  p.q = d_q.as<uint16_t>();
  p.rotation_k = c.rotate ? d_rk.as<float>() : nullptr;
  p.rotation_v = c.rotate ? d_rv.as<float>() : nullptr;
  p.rotation_per_head = c.per_head_rotation;
  p.bf16_pool = {d_bf.get(), bf16_stride};
  p.int2_pool = {d_i2.get(), int2_stride};
  SegmentTable* tabs[3] = {&p.sink, &p.history, &p.recent};
  for (int s = 0; s < 3; ++s) {
    tabs[s]->indptr = seg[s].d_indptr.as<int32_t>();
    tabs[s]->indices = seg[s].d_indices.as<int32_t>();
    tabs[s]->last_page_len = seg[s].d_last.as<int32_t>();
    tabs[s]->max_pages = seg[s].max_pages;
  }
  p.out = d_out.as<uint16_t>();
  p.lse = d_lse.as<float>();
  size_t ws = 0;
  KernelStatus st = PagedDecodeWorkspaceBytes(p, &ws);
  if (!st.ok()) {
    res.error = st.message;
    return res;
  }
  DeviceBuffer d_ws(std::max<size_t>(ws, 256));
  cudaMemset(d_ws.get(), 0xff, d_ws.bytes());  // poison the workspace too
  p.workspace = d_ws.get();
  p.workspace_bytes = d_ws.bytes();
  st = LaunchPagedDecode(p, nullptr);
  if (!st.ok()) {
    res.error = st.message;
    return res;
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    res.error = cudaGetErrorString(e);
    return res;
  }
  auto out = Download<uint16_t>(d_out.get(), size_t(B) * hq * d);
  auto lse = Download<float>(d_lse.get(), size_t(B) * hq);

  // ---- float64 reference over the dequantized pages ----
  double num = 0, den = 0;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < hq; ++i) {
      const int kvh = i / group;
      const float* RK = rk.data() + (c.per_head_rotation ? size_t(kvh) * d * d : 0);
      const float* RV = rv.data() + (c.per_head_rotation ? size_t(kvh) * d * d : 0);
      std::vector<double> qr(d, 0.0);
      for (int a = 0; a < d; ++a) {
        const double qa = FromBf16(q[(size_t(b) * hq + i) * d + a]);
        if (c.rotate) {
          for (int j = 0; j < d; ++j) qr[j] += qa * RK[size_t(a) * d + j];
        } else {
          qr[a] = qa;
        }
      }
      std::vector<double> logits;
      std::vector<std::vector<double>> vals;
      for (int s = 0; s < 3; ++s) {
        for (int pi = seg[s].indptr[b]; pi < seg[s].indptr[b + 1]; ++pi) {
          const int page = seg[s].indices[pi] - int32_t(c.page_id_offset);
          const int n = (pi == seg[s].indptr[b + 1] - 1) ? seg[s].last[b] : P;
          for (int t = 0; t < n; ++t) {
            std::vector<double> k(d), v(d);
            if (s == 1) {
              const uint8_t* ch = i2_pages[page].data() + geo.Int2ChunkOffset(0, kvh);
              const uint8_t* kc = ch + t * d / 4;
              const uint8_t* vc = ch + geo.Int2VCodesOffset() + t * d / 4;
              const uint16_t* kp =
                  reinterpret_cast<const uint16_t*>(ch + geo.Int2KParamsOffset()) + t * 2 * ng;
              const uint16_t* vp =
                  reinterpret_cast<const uint16_t*>(ch + geo.Int2VParamsOffset()) + t * 2 * ng;
              for (int j = 0; j < d; ++j) {
                const int byte = j % (d / 4), quarter = j / (d / 4), gi = j / int(geo.GroupSize());
                const int ck = (kc[byte] >> (2 * quarter)) & 3,
                          cv = (vc[byte] >> (2 * quarter)) & 3;
                k[j] = double(
                    float(FromFp16(kp[2 * gi + 1]) + float(ck) * float(FromFp16(kp[2 * gi]))));
                v[j] = double(
                    float(FromFp16(vp[2 * gi + 1]) + float(cv) * float(FromFp16(vp[2 * gi]))));
              }
            } else {
              const uint16_t* ch = reinterpret_cast<const uint16_t*>(bf_pages[page].data() +
                                                                     geo.Bf16ChunkOffset(0, kvh));
              for (int j = 0; j < d; ++j) {
                k[j] = FromBf16(ch[t * d + j]);
                v[j] = FromBf16(ch[P * d + t * d + j]);
              }
            }
            double dot = 0;
            for (int j = 0; j < d; ++j) dot += qr[j] * k[j];
            logits.push_back(dot * double(p.sm_scale));
            vals.push_back(std::move(v));
          }
        }
      }
      std::vector<double> o(d, 0.0), ref(d, 0.0);
      double ref_lse = -INFINITY;
      if (!logits.empty()) {
        const double m = *std::max_element(logits.begin(), logits.end());
        double l = 0;
        for (size_t t = 0; t < logits.size(); ++t) {
          const double w = std::exp(logits[t] - m);
          l += w;
          for (int j = 0; j < d; ++j) o[j] += w * vals[t][j];
        }
        for (int j = 0; j < d; ++j) o[j] /= l;
        ref_lse = m + std::log(l);
      }
      for (int j = 0; j < d; ++j) {
        if (c.rotate) {
          for (int a = 0; a < d; ++a) ref[j] += o[a] * RV[size_t(j) * d + a];
        } else {
          ref[j] = o[j];
        }
      }
      const bool expect_nan = (b == c.nan_q_request && i == c.nan_q_head) ||
                              (b == c.nan_k_request && !seg[0].indices.empty() &&
                               seg[0].indptr[b + 1] > seg[0].indptr[b]);
      if (expect_nan) {
        for (int j = 0; j < d; ++j) {
          ++res.nan_expected;
          const uint16_t g = out[(size_t(b) * hq + i) * d + j];
          if (g == 0xffff)
            ++res.unwritten;  // poison pattern: never written
          else if (!std::isnan(FromBf16(g)))
            ++res.nan_missing;
        }
        if (!std::isnan(lse[size_t(b) * hq + i])) ++res.nan_missing;
        continue;
      }
      for (int j = 0; j < d; ++j) {
        const uint16_t g = out[(size_t(b) * hq + i) * d + j];
        if (g == 0xffff)
          ++res.unwritten;
        else if (std::isnan(FromBf16(g)))
          ++res.nan_leaked;
        const double diff = FromBf16(g) - ref[j];
        num += diff * diff;
        den += ref[j] * ref[j];
      }
      const double gl = lse[size_t(b) * hq + i];
      if (std::isinf(ref_lse) || std::isinf(gl)) {
        if (std::isinf(ref_lse) != std::isinf(gl) || std::isnan(gl)) ++res.lse_inf_mismatch;
      } else {
        res.max_lse_err =
            std::max(res.max_lse_err, std::isnan(gl) ? INFINITY : std::fabs(gl - ref_lse));
      }
    }
  }
  res.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return res;
}

}  // namespace kvpool::cuda::testing
