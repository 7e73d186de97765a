// Entmax attention on CPU, memory-bounded: the scores of a tile of queries come from one
// GEMM into a per-thread (tile x Lk) buffer, each row's threshold is found while the row is
// in cache, then P.V is a second GEMM. Only (max, mu) per query row is saved; the backward
// recomputes P from them. Nothing of size B*H*Lq*Lk is ever allocated.
//
// Unlike the row-wise kernels, the tasks here call ATen ops (mm_out, addmm_, zero_) on the
// outputs. at::parallel_for runs tasks on pool threads with those threads' own thread-local
// state, not the caller's; under torch.inference_mode() the outputs are inference tensors,
// and an in-place op on one from a thread outside inference mode raises. So every task runs
// under the caller's state (at::wrapPropagateTLSState), as the calling thread's own share does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "row_solvers.h"

namespace entmax_fast_cpu {
namespace {

constexpr int64_t kQueryTile = 64;

struct AttentionShape {
  int64_t B, H, Hk, Lq, Lk, E, Ev, group, n_tiles;
};

AttentionShape check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, const at::Tensor& alpha) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "entmax_attention (cpu): query, key, value must be 4-D (B, H, L, E), got ", q.dim(), "-D, ",
              k.dim(), "-D, ", v.dim(), "-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "entmax_attention (cpu): query, key, value must be CPU tensors");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "entmax_attention (cpu): query, key, value must share one floating dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  AttentionShape s{};
  s.B = q.size(0);
  s.H = q.size(1);
  s.Lq = q.size(2);
  s.E = q.size(3);
  s.Hk = k.size(1);
  s.Lk = k.size(2);
  s.Ev = v.size(3);
  TORCH_CHECK(k.size(0) == s.B && v.size(0) == s.B, "entmax_attention (cpu): batch sizes differ: query ", s.B,
              ", key ", k.size(0), ", value ", v.size(0));
  TORCH_CHECK(k.size(3) == s.E, "entmax_attention (cpu): key must have query's last dim ", s.E, ", got ",
              k.size(3));
  TORCH_CHECK(v.size(1) == s.Hk && v.size(2) == s.Lk, "entmax_attention (cpu): value must have key's heads and ",
              "length (", s.Hk, ", ", s.Lk, "), got (", v.size(1), ", ", v.size(2), ")");
  TORCH_CHECK(s.Hk > 0 && s.H % s.Hk == 0, "entmax_attention (cpu): query heads (", s.H,
              ") must be a multiple of key/value heads (", s.Hk, ")");
  TORCH_CHECK(alpha.dim() == 1 && alpha.size(0) == s.H, "entmax_attention (cpu): alpha must have shape (", s.H,
              ",), got ", alpha.sizes());
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()),
                "entmax_attention (cpu): attn_mask must be bool or floating, got ", m.scalar_type());
    TORCH_CHECK(m.dim() <= 4, "entmax_attention (cpu): attn_mask must broadcast to (", s.B, ", ", s.H, ", ", s.Lq,
                ", ", s.Lk, "), got ", m.sizes());
  }
  s.group = s.H / s.Hk;
  s.n_tiles = (s.Lq + kQueryTile - 1) / kQueryTile;
  return s;
}

// Read access to a mask broadcast to (B, H, Lq, Lk) without materialising it.
template <typename T>
struct MaskView {
  const bool* bool_ptr = nullptr;
  const T* add_ptr = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;

  // Applies the mask of row (b, h, i) to z[0:len] (scores already scaled).
  void apply(T* z, int64_t len, int64_t b, int64_t h, int64_t i) const {
    const int64_t base = b * sb + h * sh + i * sq;
    if (bool_ptr != nullptr) {
      const bool* m = bool_ptr + base;
      for (int64_t j = 0; j < len; ++j)
        if (!m[j * sk]) z[j] = -std::numeric_limits<T>::infinity();
    } else if (add_ptr != nullptr) {
      const T* m = add_ptr + base;
      for (int64_t j = 0; j < len; ++j) z[j] += m[j * sk];
    }
  }
};

template <typename T>
MaskView<T> make_mask_view(const std::optional<at::Tensor>& mask, const AttentionShape& s, at::Tensor& holder) {
  MaskView<T> view;
  if (!mask.has_value()) return view;
  at::Tensor m = *mask;
  if (m.scalar_type() != at::kBool) m = m.to(c10::CppTypeToScalarType<T>::value);
  holder = m.expand({s.B, s.H, s.Lq, s.Lk});
  view.sb = holder.stride(0);
  view.sh = holder.stride(1);
  view.sq = holder.stride(2);
  view.sk = holder.stride(3);
  if (m.scalar_type() == at::kBool) {
    view.bool_ptr = holder.const_data_ptr<bool>();
  } else {
    view.add_ptr = holder.const_data_ptr<T>();
  }
  return view;
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Scores of rows [q0, q0 + tq) against keys [0, kend), scaled and masked; returns a
// contiguous (tq, kend) view of `buffer`. Entries of causal rows past the diagonal are left
// unset: callers only read z[0:row_len).
template <typename T>
at::Tensor masked_scores(at::Tensor& buffer, const at::Tensor& q_bh, const at::Tensor& k_bh, int64_t q0, int64_t tq,
                         int64_t kend, T scale, const MaskView<T>& mask, int64_t b, int64_t h) {
  at::Tensor scores = buffer.view(-1).narrow(0, 0, tq * kend).view({tq, kend});
  at::mm_out(scores, q_bh.narrow(0, q0, tq), k_bh.narrow(0, 0, kend).t());
  T* z = scores.data_ptr<T>();
  for (int64_t i = 0; i < tq; ++i) {
    T* zi = z + i * kend;
    for (int64_t j = 0; j < kend; ++j) zi[j] *= scale;
    mask.apply(zi, kend, b, h, q0 + i);
  }
  return scores;
}

inline int64_t row_length(bool is_causal, int64_t query_index, int64_t kend) {
  // Top-left aligned causal mask: query i sees keys j <= i.
  return is_causal ? std::min(kend, query_index + 1) : kend;
}

template <typename T>
void attention_forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, const double* alpha, double scale_d, bool is_causal,
                            const AttentionShape& s, at::Tensor& out, at::Tensor& stats) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const T scale = static_cast<T>(scale_d);
  double* stats_ptr = stats.data_ptr<double>();
  const int64_t total = s.B * s.H * s.n_tiles;
  at::parallel_for(0, total, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor buffer = at::empty({kQueryTile * s.Lk}, q.options());
    RowWorkspace work(s.Lk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task % s.n_tiles;
      const int64_t h = (task / s.n_tiles) % s.H;
      const int64_t b = task / (s.n_tiles * s.H);
      const int64_t hk = h / s.group;
      const int64_t q0 = tile * kQueryTile;
      const int64_t tq = std::min(kQueryTile, s.Lq - q0);
      const int64_t kend = is_causal ? std::min(s.Lk, q0 + tq) : s.Lk;
      at::Tensor out_tile = out.select(0, b).select(0, h).narrow(0, q0, tq);
      double* st = stats_ptr + ((b * s.H + h) * s.Lq + q0) * 2;
      if (kend == 0) {
        out_tile.zero_();
        for (int64_t i = 0; i < tq; ++i) {
          st[2 * i] = -std::numeric_limits<double>::infinity();
          st[2 * i + 1] = 0.0;
        }
        continue;
      }
      const EntmaxParams<T> prm(alpha[h]);
      at::Tensor scores = masked_scores<T>(buffer, q.select(0, b).select(0, h), k.select(0, b).select(0, hk), q0,
                                           tq, kend, scale, mask_view, b, h);
      T* z = scores.data_ptr<T>();
      for (int64_t i = 0; i < tq; ++i) {
        T* zi = z + i * kend;
        const int64_t len = row_length(is_causal, q0 + i, kend);
        const RowStats<T> rs = entmax_row_inplace(zi, len, prm, work);
        std::fill(zi + len, zi + kend, T(0));
        st[2 * i] = rs.max;
        st[2 * i + 1] = rs.mu;
      }
      at::mm_out(out_tile, scores, v.select(0, b).select(0, hk).narrow(0, 0, kend));
    }
  }));
}

// Returns (out in the input dtype, stats (B, H, Lq, 2) = (row max, mu) in float64).
std::tuple<at::Tensor, at::Tensor> entmax_attention_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                            const at::Tensor& value,
                                                            const std::optional<at::Tensor>& attn_mask,
                                                            const at::Tensor& alpha_in, double scale, bool is_causal) {
  const AttentionShape s = check_attention_args(query, key, value, attn_mask, alpha_in);
  const at::ScalarType ct = compute_type(query.scalar_type());
  // detach: the GEMMs below run on worker threads and must never be recorded by autograd.
  const at::Tensor q = query.detach().to(ct).contiguous();
  const at::Tensor k = key.detach().to(ct).contiguous();
  const at::Tensor v = value.detach().to(ct).contiguous();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor out = at::empty({s.B, s.H, s.Lq, s.Ev}, q.options());
  at::Tensor stats = at::empty({s.B, s.H, s.Lq, 2}, q.options().dtype(at::kDouble));
  if (out.numel() > 0 || stats.numel() > 0) {
    if (s.Lk == 0) {
      out.zero_();
      stats.select(3, 0).fill_(-std::numeric_limits<double>::infinity());
      stats.select(3, 1).zero_();
    } else {
      AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_fwd", [&] {
        attention_forward_impl<scalar_t>(q, k, v, attn_mask, alpha.const_data_ptr<double>(), scale, is_causal, s,
                                         out, stats);
      });
    }
  }
  return {out.to(query.scalar_type()), stats};
}

template <typename T>
void attention_backward_impl(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const std::optional<at::Tensor>& mask, const at::Tensor& stats,
                             const double* alpha, double scale_d, bool is_causal, bool need_alpha_grad,
                             const AttentionShape& s, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                             double* dalpha_part) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const T scale = static_cast<T>(scale_d);
  const double* stats_ptr = stats.const_data_ptr<double>();
  // One task per (batch, key/value head): the query heads of a GQA group accumulate into
  // the same dK/dV, so they stay in one task and no two tasks write the same memory.
  at::parallel_for(0, s.B * s.Hk, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor prob_buffer = at::empty({kQueryTile * s.Lk}, q.options());
    at::Tensor grad_buffer = at::empty({kQueryTile * s.Lk}, q.options());
    std::vector<T> weights(s.Lk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.Hk;
      const int64_t hk = task % s.Hk;
      const at::Tensor k_bh = k.select(0, b).select(0, hk);
      const at::Tensor v_bh = v.select(0, b).select(0, hk);
      at::Tensor dk_bh = dk.select(0, b).select(0, hk);
      at::Tensor dv_bh = dv.select(0, b).select(0, hk);
      for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
        const EntmaxParams<T> prm(alpha[h]);
        const at::Tensor q_bh = q.select(0, b).select(0, h);
        const at::Tensor do_bh = grad_out.select(0, b).select(0, h);
        at::Tensor dq_bh = dq.select(0, b).select(0, h);
        double dalpha_acc = 0;
        for (int64_t tile = 0; tile < s.n_tiles; ++tile) {
          const int64_t q0 = tile * kQueryTile;
          const int64_t tq = std::min(kQueryTile, s.Lq - q0);
          const int64_t kend = is_causal ? std::min(s.Lk, q0 + tq) : s.Lk;
          if (kend == 0) continue;
          const double* st = stats_ptr + ((b * s.H + h) * s.Lq + q0) * 2;
          at::Tensor probs = masked_scores<T>(prob_buffer, q_bh, k_bh, q0, tq, kend, scale, mask_view, b, h);
          at::Tensor dprobs = grad_buffer.view(-1).narrow(0, 0, tq * kend).view({tq, kend});
          const at::Tensor do_tile = do_bh.narrow(0, q0, tq);
          at::mm_out(dprobs, do_tile, v_bh.narrow(0, 0, kend).t());
          T* pz = probs.data_ptr<T>();
          T* gz = dprobs.data_ptr<T>();
          for (int64_t i = 0; i < tq; ++i) {
            T* p = pz + i * kend;
            T* g = gz + i * kend;
            const int64_t len = row_length(is_causal, q0 + i, kend);
            const T zmax = static_cast<T>(st[2 * i]);
            const double mu = st[2 * i + 1];
            if (std::isnan(zmax)) {
              // A NaN row of the forward (NaN or +inf score) passes NaN on to every gradient
              // it touches, as softmax attention's backward does.
              std::fill(p, p + kend, std::numeric_limits<T>::quiet_NaN());
              std::fill(g, g + kend, std::numeric_limits<T>::quiet_NaN());
              if (need_alpha_grad) dalpha_acc = std::numeric_limits<double>::quiet_NaN();
              continue;
            }
            if (!(zmax > -std::numeric_limits<T>::infinity())) {
              std::fill(p, p + kend, T(0));
              std::fill(g, g + kend, T(0));
              continue;
            }
            // p and the Jacobian weights s = p^(2-alpha) from the saved (max, mu), while the
            // scaled, masked scores are still in the row.
            double s_total = 0, sg_total = 0;
            if (prm.kind == AlphaKind::kGeneral) {
              // The forward's kernel at its final mu, renormalised as the forward did, gives the
              // forward's p; scalar pow per entry here cost more than the rest of the backward.
              const double p_total = general_probs(p, len, static_cast<double>(zmax), prm.law(), mu);
              if (p_total > 0) {
                const T inv = static_cast<T>(1.0 / p_total);
                for (int64_t j = 0; j < len; ++j) p[j] *= inv;
              }
              std::tie(s_total, sg_total) = general_weights(p, g, weights.data(), len, 2.0 - prm.alpha);
            } else {
              for (int64_t j = 0; j < len; ++j) {
                const T pj = prm.prob(p[j], zmax, mu);
                weights[j] = prm.jacobian_weight(p[j], zmax, mu, pj);
                p[j] = pj;
                s_total += weights[j];
                sg_total += static_cast<double>(weights[j]) * g[j];
              }
            }
            std::fill(p + len, p + kend, T(0));
            if (need_alpha_grad) dalpha_acc += row_alpha_grad(p, g, len, prm.alpha);
            const T delta = s_total > 0 ? static_cast<T>(sg_total / s_total) : T(0);
            // dZ (docs/attention.md, "Backward"), with the score scale folded in for dQ and dK.
            for (int64_t j = 0; j < len; ++j) g[j] = scale * weights[j] * (g[j] - delta);
            std::fill(g + len, g + kend, T(0));
          }
          dv_bh.narrow(0, 0, kend).addmm_(probs.t(), do_tile);
          at::Tensor dq_tile = dq_bh.narrow(0, q0, tq);
          at::mm_out(dq_tile, dprobs, k_bh.narrow(0, 0, kend));
          dk_bh.narrow(0, 0, kend).addmm_(dprobs.t(), q_bh.narrow(0, q0, tq));
        }
        dalpha_part[b * s.H + h] = dalpha_acc;
      }
    }
  }));
}

// Returns (dq, dk, dv) in the input dtype and dalpha (H,) in float64 ((0,) when not needed).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> entmax_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& stats_in, const at::Tensor& alpha_in,
    double scale, bool is_causal, bool need_alpha_grad) {
  const AttentionShape s = entmax_fast_cpu::check_attention_args(query, key, value, attn_mask, alpha_in);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.B && grad_out.size(1) == s.H && grad_out.size(2) == s.Lq &&
                  grad_out.size(3) == s.Ev,
              "entmax_attention_backward (cpu): grad_out must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", ", s.Ev,
              "), got ", grad_out.sizes());
  TORCH_CHECK(stats_in.dim() == 4 && stats_in.size(0) == s.B && stats_in.size(1) == s.H && stats_in.size(2) == s.Lq &&
                  stats_in.size(3) == 2,
              "entmax_attention_backward (cpu): stats must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", 2), got ",
              stats_in.sizes());
  const at::ScalarType ct = compute_type(query.scalar_type());
  const at::Tensor q = query.detach().to(ct).contiguous();
  const at::Tensor k = key.detach().to(ct).contiguous();
  const at::Tensor v = value.detach().to(ct).contiguous();
  const at::Tensor g = grad_out.detach().to(ct).contiguous();
  const at::Tensor stats = stats_in.detach().to(at::kDouble).contiguous();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor dq = at::zeros_like(q);
  at::Tensor dk = at::zeros_like(k);
  at::Tensor dv = at::zeros_like(v);
  at::Tensor dalpha_part = at::zeros({s.B, s.H}, q.options().dtype(at::kDouble));
  if (s.Lk > 0 && s.Lq > 0 && s.B > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_bwd", [&] {
      attention_backward_impl<scalar_t>(g, q, k, v, attn_mask, stats, alpha.const_data_ptr<double>(), scale,
                                        is_causal, need_alpha_grad, s, dq, dk, dv,
                                        dalpha_part.data_ptr<double>());
    });
  }
  const at::ScalarType out_t = query.scalar_type();
  at::Tensor dalpha = need_alpha_grad ? dalpha_part.sum(0) : at::empty({0}, dalpha_part.options());
  return {dq.to(out_t), dk.to(out_t), dv.to(out_t), dalpha};
}

}  // namespace
}  // namespace entmax_fast_cpu

TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def(
      "entmax_attention_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor alpha, float scale, "
      "bool is_causal) -> (Tensor, Tensor)");
  m.def(
      "entmax_attention_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor stats, Tensor alpha, float scale, bool is_causal, bool need_alpha_grad) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("entmax_attention_fwd", &entmax_fast_cpu::entmax_attention_fwd_cpu);
  m.impl("entmax_attention_bwd", &entmax_fast_cpu::entmax_attention_bwd_cpu);
}
