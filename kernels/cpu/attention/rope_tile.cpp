// On-the-fly RoPE for tiles of pre-RoPE keys (see rope_tile.h).
#include "kernels/cpu/attention/rope_tile.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>

#include "common/error.h"
#include "kernels/softmax_acc.h"
#include "kernels/cpu/kvq/kvq_impl.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::cpu::impl {
namespace {

bool same_rope(const rope_config& a, const rope_config& b) {
  return a.head_dim == b.head_dim && a.n_rot == b.n_rot && a.freq_base == b.freq_base && a.scaling == b.scaling &&
         a.scaling_factor == b.scaling_factor;
}

}  // namespace

const rope_table& rope_table_for(const rope_config& cfg) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<rope_table>> tables;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& t : tables)
    if (same_rope(t->cfg, cfg)) return *t;
  auto t = std::make_unique<rope_table>();
  t->cfg = cfg;
  t->n_pair = cfg.n_rot / 2;
  t->theta.resize(t->n_pair);
  for (int i = 0; i < t->n_pair; ++i) t->theta[i] = ref::rope_theta(cfg, 1, i);  // angle per unit position
  t->off_cos.resize((size_t)kRopeTile * t->n_pair);
  t->off_sin.resize((size_t)kRopeTile * t->n_pair);
  for (int j = 0; j < kRopeTile; ++j)
    for (int i = 0; i < t->n_pair; ++i) {
      t->off_cos[(size_t)j * t->n_pair + i] = (float)std::cos(j * t->theta[i]);
      t->off_sin[(size_t)j * t->n_pair + i] = (float)std::sin(j * t->theta[i]);
    }
  t->unit_cos2.resize((size_t)kAttnUnit * cfg.n_rot);
  t->unit_sin2.resize(t->unit_cos2.size());
  t->unit_cos_t_buf.assign((size_t)t->n_pair * kUnitAngleStride + 16, 0.0f);
  t->unit_sin_t_buf.assign(t->unit_cos_t_buf.size(), 0.0f);
  const auto skip_of = [](const std::vector<float>& b) {  // floats are 4-byte aligned
    return (size_t)((64 - reinterpret_cast<uintptr_t>(b.data()) % 64) % 64) / sizeof(float);
  };
  t->unit_cos_t_skip = skip_of(t->unit_cos_t_buf), t->unit_sin_t_skip = skip_of(t->unit_sin_t_buf);
  float* cos_t = t->unit_cos_t_buf.data() + t->unit_cos_t_skip;
  float* sin_t = t->unit_sin_t_buf.data() + t->unit_sin_t_skip;
  for (int j = 0; j < kAttnUnit; ++j)
    for (int i = 0; i < t->n_pair; ++i) {
      const float c = (float)std::cos(j * t->theta[i]), s = (float)std::sin(j * t->theta[i]);
      float* c2 = t->unit_cos2.data() + (size_t)j * cfg.n_rot + 2 * i;
      float* s2 = t->unit_sin2.data() + (size_t)j * cfg.n_rot + 2 * i;
      c2[0] = c2[1] = c;
      s2[0] = -s, s2[1] = s;
      cos_t[(size_t)i * kUnitAngleStride + j] = c;
      sin_t[(size_t)i * kUnitAngleStride + j] = s;
    }
  t->byte_cos.resize((size_t)kPosBytes * 256 * t->n_pair);
  t->byte_sin.resize(t->byte_cos.size());
  for (int l = 0; l < kPosBytes; ++l)
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < t->n_pair; ++i) {
        const double a = (double)((int64_t)b << (8 * l)) * t->theta[i];
        t->byte_cos[((size_t)l * 256 + b) * t->n_pair + i] = std::cos(a);
        t->byte_sin[((size_t)l * 256 + b) * t->n_pair + i] = std::sin(a);
      }
  tables.push_back(std::move(t));
  return *tables.back();
}

void rope_angles(const rope_table& tab, int64_t pos, double* c, double* s) {
  const int np = tab.n_pair;
  if (pos < 0 || pos >= ((int64_t)1 << (8 * kPosBytes))) {
    for (int i = 0; i < np; ++i) c[i] = std::cos((double)pos * tab.theta[i]), s[i] = std::sin((double)pos * tab.theta[i]);
    return;
  }
  for (int i = 0; i < np; ++i) c[i] = 1.0, s[i] = 0.0;
  for (int l = 0; l < kPosBytes; ++l) {
    const int b = (int)((pos >> (8 * l)) & 0xff);
    if (b == 0) continue;
    const double* bc = tab.byte_cos.data() + ((size_t)l * 256 + b) * np;
    const double* bs = tab.byte_sin.data() + ((size_t)l * 256 + b) * np;
    for (int i = 0; i < np; ++i) {
      const double ci = c[i] * bc[i] - s[i] * bs[i];
      s[i] = s[i] * bc[i] + c[i] * bs[i];
      c[i] = ci;
    }
  }
}

namespace {
void rotate_token(isa v, float* k /*[n_kvh, hd]*/, int n_kvh, int hd, int n_rot, float* cos2, float* sin2) {
  for (int h = 0; h < n_kvh; ++h) {
    float* x = k + (size_t)h * hd;
    if (v == isa::isa_avx2 && n_rot % 8 == 0) {
      impl::avx2::rope_rotate(x, cos2, sin2, n_rot);
    } else {
      for (int i = 0; i < n_rot; i += 2) {
        const float x0 = x[i], x1 = x[i + 1];
        x[i] = x0 * cos2[i] + x1 * sin2[i];
        x[i + 1] = x1 * cos2[i + 1] + x0 * sin2[i + 1];
      }
    }
  }
}

// One token's heads rotated by the exact (double) angles of pos, rounded to float once.
void rotate_exact(isa v, float* x /*[n_head, hd]*/, int64_t pos, int n_head, const rope_table& tab) {
  float cos2[kMaxRot], sin2[kMaxRot];
  double dc[kMaxRot / 2], ds[kMaxRot / 2];
  rope_angles(tab, pos, dc, ds);
  for (int i = 0; i < tab.n_pair; ++i) {
    const float c = (float)dc[i], s = (float)ds[i];
    cos2[2 * i] = cos2[2 * i + 1] = c;
    sin2[2 * i] = -s, sin2[2 * i + 1] = s;
  }
  rotate_token(v, x, n_head, tab.cfg.head_dim, tab.cfg.n_rot, cos2, sin2);
}

}  // namespace

void rope_tile(isa v, float* kt /*[nt, n_kvh, hd]*/, const int32_t* pos /*[nt]*/, int nt, int n_kvh,
               const rope_table& tab, rope_cursor& cur) {
  const int np = tab.n_pair, hd = tab.cfg.head_dim, n_rot = tab.cfg.n_rot;
  if (np == 0 || nt == 0) return;
  float cos2[kMaxRot], sin2[kMaxRot];  // [n_rot] interleaved as rope_rotate wants them
  int64_t p0 = pos[0], p_max = pos[0];
  for (int j = 1; j < nt; ++j) p0 = std::min<int64_t>(p0, pos[j]), p_max = std::max<int64_t>(p_max, pos[j]);
  const bool consecutive = pos[0] == p0 && (int64_t)pos[nt - 1] - p0 == nt - 1 && p_max - p0 == nt - 1;
  // Positions spanning less than a tile (SelfExtend's grouped positions floor(p / G), or the
  // turns floor(p / G) - p of post-RoPE keys) still take the offset table, at pos - min.
  const bool in_one_tile = p_max - p0 < kRopeTile;
  if (!in_one_tile) {
    for (int j = 0; j < nt; ++j) rotate_exact(v, kt + (size_t)j * n_kvh * hd, pos[j], n_kvh, tab);
    cur.valid = false;
    return;
  }
  // The base angles are a function of p0 alone (to double precision): a key's rotation must not
  // depend on where the caller's run of tiles started, or a split of the cache across ranks
  // would rotate it differently. The cursor only saves recomputing the same p0.
  if (!cur.valid || cur.next_pos != p0) {
    cur.c.resize(np), cur.s.resize(np);
    rope_angles(tab, p0, cur.c.data(), cur.s.data());
    cur.valid = true;
    cur.next_pos = p0;
  }
  float bc[kMaxRot / 2], bs[kMaxRot / 2];
  for (int i = 0; i < np; ++i) bc[i] = (float)cur.c[i], bs[i] = (float)cur.s[i];
  if (consecutive && v == isa::isa_avx2 && n_rot % 16 == 0) {
    impl::avx2::rope_tile_tokens(kt, nt, n_kvh, hd, n_rot, bc, bs, tab.off_cos.data(), tab.off_sin.data());
    return;
  }
  for (int j = 0; j < nt; ++j) {
    const float* oc = tab.off_cos.data() + (size_t)(pos[j] - p0) * np;
    const float* os = tab.off_sin.data() + (size_t)(pos[j] - p0) * np;
    for (int i = 0; i < np; ++i) {
      const float c = bc[i] * oc[i] - bs[i] * os[i], s = bs[i] * oc[i] + bc[i] * os[i];
      cos2[2 * i] = cos2[2 * i + 1] = c;
      sin2[2 * i] = -s, sin2[2 * i + 1] = s;
    }
    rotate_token(v, kt + (size_t)j * n_kvh * hd, n_kvh, hd, n_rot, cos2, sin2);
  }
}

void rotate_rows(isa v, float* x, const int64_t* turn, int64_t n, int n_head, const rope_table& tab) {
  if (tab.n_pair == 0) return;
  for (int64_t t = 0; t < n; ++t) rotate_exact(v, x + (size_t)t * n_head * tab.cfg.head_dim, turn[t], n_head, tab);
}

std::vector<float> self_extend_queries(const float* q, const int32_t* q_pos, int64_t n_q, int n_head,
                                       const rope_config& cfg) {
  const int hd = cfg.head_dim;
  std::vector<float> out(q, q + (size_t)n_q * n_head * hd);
  std::vector<int64_t> turn((size_t)n_q);
  for (int64_t i = 0; i < n_q; ++i) turn[(size_t)i] = self_extend_query_pos(cfg, q_pos[i]) - q_pos[i];
  rotate_rows(best_isa(), out.data(), turn.data(), n_q, n_head, rope_table_for(cfg));
  return out;
}

}  // namespace xctx::cpu::impl
