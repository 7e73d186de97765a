// Row-wise alpha-entmax on CPU: forward (threshold found while the row is in cache) and
// backward (Jacobian-vector product and d alpha), one row per task of at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "isa_dispatch.h"
#include "row_solvers.h"

namespace entmax_fast_cpu {
namespace {

// Rows per parallel task: enough work per task to amortise the scheduling.
int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

void check_rowwise_args(const at::Tensor& x, const at::Tensor& alpha, const char* x_name) {
  TORCH_CHECK(x.dim() == 2, "entmax_rowwise: ", x_name, " must be 2-D (R, n), got ", x.dim(), "-D");
  TORCH_CHECK(x.device().is_cpu(), "entmax_rowwise: ", x_name, " must be a CPU tensor, got ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "entmax_rowwise: ", x_name,
              " must be floating point, got ", x.scalar_type());
  TORCH_CHECK(alpha.dim() == 1 && alpha.size(0) == x.size(0), "entmax_rowwise: alpha must have shape (",
              x.size(0), ",), got ", alpha.sizes());
  TORCH_CHECK(alpha.device().is_cpu(), "entmax_rowwise: alpha must be a CPU tensor, got ", alpha.device());
}

at::Tensor entmax_rowwise_fwd_cpu(const at::Tensor& x_in, const at::Tensor& alpha_in) {
  check_rowwise_args(x_in, alpha_in, "x");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor alpha = alpha_in.to(at::kDouble).contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t R = x.size(0), n = x.size(1);
  if (R == 0 || n == 0) return out;
  const double* alpha_ptr = alpha.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "entmax_rowwise_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x_ptr = x.const_data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, R, rows_per_task(n), [&](int64_t begin, int64_t end) {
      RowWorkspace work(n);
      std::vector<acc_t> row(std::is_same<acc_t, scalar_t>::value ? 0 : n);
      for (int64_t r = begin; r < end; ++r) {
        const EntmaxParams<acc_t> prm(alpha_ptr[r]);
        if constexpr (std::is_same<acc_t, scalar_t>::value) {
          // acc_t is scalar_t here; the cast only satisfies the branch not taken.
          acc_t* o = reinterpret_cast<acc_t*>(out_ptr + r * n);
          std::copy(x_ptr + r * n, x_ptr + (r + 1) * n, o);
          entmax_row_inplace(o, n, prm, work);
        } else {
          for (int64_t j = 0; j < n; ++j) row[j] = static_cast<acc_t>(x_ptr[r * n + j]);
          entmax_row_inplace(row.data(), n, prm, work);
          for (int64_t j = 0; j < n; ++j) out_ptr[r * n + j] = static_cast<scalar_t>(row[j]);
        }
      }
    });
  });
  return out;
}

// Returns (dx, dalpha); dalpha has shape (R,) in float32 when need_alpha_grad, else (0,).
std::tuple<at::Tensor, at::Tensor> entmax_rowwise_bwd_cpu(const at::Tensor& p_in, const at::Tensor& grad_in,
                                                          const at::Tensor& alpha_in, bool need_alpha_grad) {
  check_rowwise_args(p_in, alpha_in, "p");
  TORCH_CHECK(grad_in.sizes() == p_in.sizes(), "entmax_rowwise_backward: grad must have p's shape ",
              p_in.sizes(), ", got ", grad_in.sizes());
  const at::Tensor p = p_in.contiguous();
  const at::Tensor grad = grad_in.to(p.scalar_type()).contiguous();
  const at::Tensor alpha = alpha_in.to(at::kDouble).contiguous();
  const int64_t R = p.size(0), n = p.size(1);
  at::Tensor dx = at::empty_like(p);
  at::Tensor dalpha = need_alpha_grad ? at::zeros({R}, p.options().dtype(at::kDouble)) : at::empty({0}, p.options());
  if (R == 0 || n == 0) {
    return {dx, need_alpha_grad ? dalpha.to(alpha_in.scalar_type()) : dalpha};
  }
  const double* alpha_ptr = alpha.data_ptr<double>();
  double* dalpha_ptr = need_alpha_grad ? dalpha.data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "entmax_rowwise_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* p_ptr = p.const_data_ptr<scalar_t>();
    const scalar_t* g_ptr = grad.const_data_ptr<scalar_t>();
    scalar_t* dx_ptr = dx.data_ptr<scalar_t>();
    at::parallel_for(0, R, rows_per_task(n), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> s(n), pr(need_alpha_grad ? n : 0), gr(need_alpha_grad ? n : 0);
      for (int64_t r = begin; r < end; ++r) {
        const double a = alpha_ptr[r];
        const AlphaKind kind = alpha_kind(a);
        const acc_t beta = static_cast<acc_t>(2.0 - a);
        const scalar_t* pp = p_ptr + r * n;
        const scalar_t* gg = g_ptr + r * n;
        scalar_t* d = dx_ptr + r * n;
        // The forward's NaN rows (NaN or +inf input) pass NaN on, as torch.softmax's backward.
        if (std::any_of(pp, pp + n, [](scalar_t v) { return std::isnan(static_cast<acc_t>(v)); })) {
          std::fill(d, d + n, std::numeric_limits<scalar_t>::quiet_NaN());
          if (need_alpha_grad) dalpha_ptr[r] = std::numeric_limits<double>::quiet_NaN();
          continue;
        }
        double s_total = 0, sg_total = 0;
        if (kind == AlphaKind::kGeneral && std::is_same<acc_t, scalar_t>::value) {
          // acc_t is scalar_t here; the casts only satisfy the branch not taken.
          std::tie(s_total, sg_total) = general_weights(reinterpret_cast<const acc_t*>(pp),
                                                        reinterpret_cast<const acc_t*>(gg), s.data(), n, 2.0 - a);
        } else {
          for (int64_t j = 0; j < n; ++j) {
            const acc_t pj = static_cast<acc_t>(pp[j]);
            acc_t sj;
            switch (kind) {
              case AlphaKind::kSoftmax: sj = pj; break;
              case AlphaKind::kSparsemax: sj = pj > acc_t(0) ? acc_t(1) : acc_t(0); break;
              case AlphaKind::kEntmax15: sj = std::sqrt(pj); break;
              default: sj = pj > acc_t(0) ? std::pow(pj, beta) : acc_t(0); break;
            }
            s[j] = sj;
            s_total += sj;
            sg_total += static_cast<double>(sj) * static_cast<acc_t>(gg[j]);
          }
        }
        const acc_t delta = s_total > 0 ? static_cast<acc_t>(sg_total / s_total) : acc_t(0);
        for (int64_t j = 0; j < n; ++j) d[j] = static_cast<scalar_t>(s[j] * (static_cast<acc_t>(gg[j]) - delta));
        if (need_alpha_grad) {
          for (int64_t j = 0; j < n; ++j) {
            pr[j] = static_cast<acc_t>(pp[j]);
            gr[j] = static_cast<acc_t>(gg[j]);
          }
          dalpha_ptr[r] = row_alpha_grad(pr.data(), gr.data(), n, a);
        }
      }
    });
  });
  return {dx, need_alpha_grad ? dalpha.to(alpha_in.scalar_type()) : dalpha};
}

}  // namespace

std::string cpu_kernel_isa(std::optional<std::string> request) {
  if (request) {
    TORCH_CHECK(*request == "auto" || *request == "avx2-fma" || *request == "portable",
                "cpu_kernel_isa: request must be 'auto', 'avx2-fma' or 'portable', got '", *request, "'");
    TORCH_CHECK(*request != "avx2-fma" || cpu_has_avx2_fma(),
                "cpu_kernel_isa: request 'avx2-fma' needs a CPU with AVX2 and FMA, which this one lacks");
    const KernelIsa isa = *request == "auto" ? KernelIsa::Auto
                          : *request == "avx2-fma" ? KernelIsa::Avx2
                                                   : KernelIsa::Portable;
    kernel_isa_request().store(static_cast<int>(isa));
  }
  return active_kernel_isa();
}

}  // namespace entmax_fast_cpu

TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def("entmax_rowwise_fwd(Tensor x, Tensor alpha) -> Tensor");
  // Which kernels the General kind (alpha not in {1, 1.5, 2}) runs: returns "avx512",
  // "avx2-fma" or "portable"; a request forces a set ("avx2-fma" where the CPU has it,
  // "portable" anywhere), "auto" restores the best one.
  m.def("cpu_kernel_isa(str? request=None) -> str", &entmax_fast_cpu::cpu_kernel_isa);
  m.def("entmax_rowwise_bwd(Tensor p, Tensor grad, Tensor alpha, bool need_alpha_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("entmax_rowwise_fwd", &entmax_fast_cpu::entmax_rowwise_fwd_cpu);
  m.impl("entmax_rowwise_bwd", &entmax_fast_cpu::entmax_rowwise_bwd_cpu);
}
