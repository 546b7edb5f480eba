// attn/mla.hpp: the absorbed projections of DeepSeek's multi-head latent attention (MLA),
// around the latent cache (attn/latent_cache.hpp).
//
//   q_nope    (B, H, Lq, P)      the queries without rotary embedding (P: qk_nope_head_dim, 128)
//   q_rope    (B, H, Lq, R)      their rotary part, turned at the tokens' positions (R: 64)
//   w_uk      (H, P, C)          per head the keys' up-projection: k_nope[h] = c w_uk[h]^T
//   w_uv      (H, C, Dv)         per head the values' up-projection: v[h] = c w_uv[h]
//   q_latent  (B, H, Lq, C + R)  [q_nope[h] w_uk[h] ; q_rope]: LatentCache::attend's queries
//   o_latent  (B, H, Lq, C)      LatentCache::attend's output, sum_j p_j c_j
//   out       (B, H, Lq, Dv)     o_latent[h] w_uv[h]: each head's output, before o_proj
//
// In a DeepSeek checkpoint's config: C = kv_lora_rank, R = qk_rope_head_dim,
// P = qk_nope_head_dim, Dv = v_head_dim, H = num_attention_heads.
//
// Why it is exact: head h's score with token j is
//   q_nope k_nope_j^T + q_rope k_rope_j^T = (q_nope w_uk[h]) c_j^T + q_rope k_rope_j^T
//                                          = [q_nope w_uk[h] ; q_rope] . [c_j ; k_rope_j]
// and its output sum_j p_j v_j = (sum_j p_j c_j) w_uv[h]. So the cache keeps c_j and k_rope_j
// once for every head, and the heads' keys and values (H (P + R + Dv) values per token) are
// never formed: the up-projections move to the queries and the output (FlashInfer's and
// vLLM's "matrix absorption"). The softmax is the same, with the un-absorbed heads' scale
// (1 / sqrt(P + R)).
//
// DeepSeek's checkpoints hold both up-projections in kv_b_proj, a (H (P + Dv), C) weight
// (PyTorch's out x in: per head P rows of keys, then Dv rows of values);
// mla_weights_from_kv_b_proj splits it into w_uk and w_uv.
//
// Cost: one GEMM per head, (B Lq, P) x (P, C) and (B Lq, C) x (C, Dv), on attn's packed GEMM
// for float (kernels/gemm.hpp; Eigen's for double), the heads in parallel. Extra memory: the
// rows of one head gathered, B Lq (P + C) or B Lq (C + Dv) scalars per thread.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/checks.hpp"
#include "attn/config.hpp"
#include "attn/kernels/dispatch.hpp"
#include "attn/kernels/item_loop.hpp"
#include "attn/plan.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// MLA's up-projections per head, in attn's in x out convention.
template <class T>
struct MlaWeights {
  Tensor<T, 3> w_uk;  // (H, P, C): k_nope[h] = c w_uk[h]^T, q_latent[h] = q_nope[h] w_uk[h]
  Tensor<T, 3> w_uv;  // (H, C, Dv): v[h] = c w_uv[h], out[h] = o_latent[h] w_uv[h]
};

namespace detail {

/// Per-head matrices (H, rows, cols) as the (1, H, rows, cols) view the overlap checks read.
template <class T>
HeadsView<const T> head_matrices(const TensorMap<const T, 3>& w) {  // (H, rows, cols)
  const Index heads = w.dimension(0), rows = w.dimension(1), cols = w.dimension(2);
  return {w.data(), 1, heads, rows, cols, heads * rows * cols, rows * cols, cols};
}

/// Throws if `name` is a packed or paged view: the projections take padded (B, H, L, D) views.
template <class T>
void refuse_packed(const char* function, const char* name,
                   const HeadsView<T>& x) {  // (B, H, L, D)
  if (x.row_offsets != nullptr || x.pages != nullptr) {
    throw_invalid_argument(function, std::string(name) +
                                         " is a packed or paged view: pass padded (B, H, L, D) "
                                         "views (the rows of a sequence past its length are "
                                         "projected too, harmlessly)");
  }
}

/// to.head(b, h) = from.head(b, h) w[h] for every (b, h): per head one GEMM of the B Lq rows
/// gathered, (B Lq, K) x (K, N), the heads in parallel. Shapes checked by the caller.
template <class T>
void project_heads(const HeadsView<const T>& from,  // (B, H, L, K)
                   const TensorMap<const T, 3>& w,  // (H, K, N)
                   const HeadsView<T>& to) {        // (B, H, L, N)
  const Index batch = from.batch, heads = from.heads, length = from.length;
  const Index k = from.dim, n = to.dim, rows = batch * length;
  if (rows == 0 || heads == 0 || n == 0)
    return;
  const LoopPlan plan = plan_gemm<T>(rows * heads, n, k);
  struct Rows {
    std::vector<T> a, c;  // (B L, K), (B L, N)
  };
  for_each_item(
      heads, plan.parallel,
      [&] {
        return Rows{std::vector<T>(static_cast<std::size_t>(rows * k)),
                    std::vector<T>(static_cast<std::size_t>(rows * n))};
      },
      [&](Index h, Rows& scratch) {
        for (Index b = 0; b < batch; ++b) {
          Eigen::Map<Matrix<T>>(scratch.a.data() + b * length * k, length, k) = from.head(b, h);
        }
        gemm(plan.isa, rows, n, k, scratch.a.data(), k, w.data() + h * k * n, n, scratch.c.data(),
             n, static_cast<const T*>(nullptr), false, false);
        for (Index b = 0; b < batch; ++b)
          to.head(b, h) = Eigen::Map<const Matrix<T>>(scratch.c.data() + b * length * n, length, n);
      });
}

}  // namespace detail

/// q_latent (B, H, Lq, C + R) = [q_nope[h] w_uk[h] ; q_rope]: the queries of
/// LatentCache::attend from the un-absorbed ones, q_nope (B, H, Lq, P) and q_rope (B, H, Lq,
/// R) (turned by the rotary embedding already), w_uk (H, P, C). Any strided views; q_rope
/// may already be q_latent's last R columns (then it is left in place). Throws, writing
/// nothing, on shapes that disagree, packed views, or a q_latent overlapping another argument.
template <class T>
void mla_absorb_queries_into(const HeadsView<const T>& q_nope,                      // (B, H, Lq, P)
                             const detail::identity_t<HeadsView<const T>>& q_rope,  // (B, H, Lq, R)
                             const detail::identity_t<TensorMap<const T, 3>>& w_uk,  // (H, P, C)
                             const detail::identity_t<HeadsView<T>>& q_latent) {     // (.., C + R)
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "mla_absorb_queries: T must be float or double");
  constexpr const char* function = "mla_absorb_queries";
  for (const auto& [name, view] : {std::pair{"q_nope", q_nope}, std::pair{"q_rope", q_rope},
                                   std::pair{"q_latent", HeadsView<const T>(q_latent)}})
    detail::refuse_packed(function, name, view);
  const Index heads = w_uk.dimension(0), nope = w_uk.dimension(1), latent = w_uk.dimension(2);
  const auto shapes = [&] {
    return "q_nope is " +
           detail::shape_string({q_nope.batch, q_nope.heads, q_nope.length, q_nope.dim}) +
           ", q_rope is " +
           detail::shape_string({q_rope.batch, q_rope.heads, q_rope.length, q_rope.dim}) +
           ", w_uk is " + detail::shape_string({heads, nope, latent}) + " (H, P, C)";
  };
  if (q_rope.batch != q_nope.batch || q_rope.heads != q_nope.heads ||
      q_rope.length != q_nope.length) {
    detail::throw_invalid_argument(function,
                                   shapes() + ": q_nope and q_rope must have one (B, H, Lq)");
  }
  if (heads != q_nope.heads || nope != q_nope.dim) {
    detail::throw_invalid_argument(function,
                                   shapes() + ": w_uk must be (H, P, C) with q_nope's H and P");
  }
  detail::check_shape(function, "q_latent", q_latent.shape(),
                      {q_nope.batch, q_nope.heads, q_nope.length, latent + q_rope.dim},
                      "(B, H, Lq, C + R)");
  // q_rope may be q_latent's own rotary columns; nothing else may share q_latent's memory.
  HeadsView<const T> rope_columns = q_latent;
  rope_columns.data = q_latent.data == nullptr ? nullptr : q_latent.data + latent;
  rope_columns.dim = q_rope.dim;
  const bool rope_in_place = q_rope.data == rope_columns.data &&
                             q_rope.batch_stride == rope_columns.batch_stride &&
                             q_rope.head_stride == rope_columns.head_stride &&
                             q_rope.row_stride == rope_columns.row_stride;
  const HeadsView<const T> written = q_latent;
  const char* overlapped = detail::views_may_overlap(written, q_nope)                     ? "q_nope"
                           : !rope_in_place && detail::views_may_overlap(written, q_rope) ? "q_rope"
                           : detail::byte_ranges_overlap(written, detail::head_matrices(w_uk))
                               ? "w_uk"
                               : nullptr;
  if (overlapped != nullptr) {
    detail::throw_invalid_argument(function, std::string("q_latent overlaps ") + overlapped +
                                                 ": it must share no element with the inputs "
                                                 "(q_rope may be its own last R columns)");
  }
  HeadsView<T> latent_part = q_latent;
  latent_part.dim = latent;
  detail::project_heads(q_nope, w_uk, latent_part);
  if (rope_in_place || q_rope.dim == 0)
    return;
  for (Index b = 0; b < q_nope.batch; ++b) {
    for (Index h = 0; h < q_nope.heads; ++h)
      q_latent.head(b, h).rightCols(q_rope.dim) = q_rope.head(b, h);
  }
}

/// mla_absorb_queries_into() on rank-4 tensors: returns q_latent (B, H, Lq, C + R).
template <class T>
Tensor<T, 4> mla_absorb_queries(const Tensor<T, 4>& q_nope,  // (B, H, Lq, P)
                                const Tensor<T, 4>& q_rope,  // (B, H, Lq, R)
                                const Tensor<T, 3>& w_uk) {  // (H, P, C)
  Tensor<T, 4> q_latent(q_nope.dimension(0), q_nope.dimension(1), q_nope.dimension(2),
                        w_uk.dimension(2) + q_rope.dimension(3));
  mla_absorb_queries_into<T>(
      bhld_view(q_nope), bhld_view(q_rope),
      TensorMap<const T, 3>(w_uk.data(), w_uk.dimension(0), w_uk.dimension(1), w_uk.dimension(2)),
      bhld_view(q_latent));
  return q_latent;
}

/// out (B, H, Lq, Dv) = o_latent[h] w_uv[h]: the heads' outputs from LatentCache::attend's
/// o_latent (B, H, Lq, C), w_uv (H, C, Dv). Any strided views; throws, writing nothing, on
/// shapes that disagree, packed views, or an out overlapping an input.
template <class T>
void mla_project_output_into(const HeadsView<const T>& o_latent,  // (B, H, Lq, C)
                             const detail::identity_t<TensorMap<const T, 3>>& w_uv,  // (H, C, Dv)
                             const detail::identity_t<HeadsView<T>>& out) {  // (B, H, Lq, Dv)
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "mla_project_output: T must be float or double");
  constexpr const char* function = "mla_project_output";
  detail::refuse_packed(function, "o_latent", o_latent);
  detail::refuse_packed(function, "out", out);
  const Index heads = w_uv.dimension(0), latent = w_uv.dimension(1), value = w_uv.dimension(2);
  if (heads != o_latent.heads || latent != o_latent.dim) {
    detail::throw_invalid_argument(
        function,
        "o_latent is " +
            detail::shape_string({o_latent.batch, o_latent.heads, o_latent.length, o_latent.dim}) +
            " and w_uv is " + detail::shape_string({heads, latent, value}) +
            " (H, C, Dv): w_uv must have o_latent's H and C");
  }
  detail::check_shape(function, "out", out.shape(),
                      {o_latent.batch, o_latent.heads, o_latent.length, value}, "(B, H, Lq, Dv)");
  const char* overlapped =
      detail::views_may_overlap(HeadsView<const T>(out), o_latent) ? "o_latent"
      : detail::byte_ranges_overlap(HeadsView<const T>(out), detail::head_matrices(w_uv)) ? "w_uv"
                                                                                          : nullptr;
  if (overlapped != nullptr) {
    detail::throw_invalid_argument(function, std::string("out overlaps ") + overlapped +
                                                 ": it must share no element with the inputs");
  }
  detail::project_heads(o_latent, w_uv, out);
}

/// mla_project_output_into() on rank-4 tensors: returns out (B, H, Lq, Dv).
template <class T>
Tensor<T, 4> mla_project_output(const Tensor<T, 4>& o_latent,  // (B, H, Lq, C)
                                const Tensor<T, 3>& w_uv) {    // (H, C, Dv)
  Tensor<T, 4> out(o_latent.dimension(0), o_latent.dimension(1), o_latent.dimension(2),
                   w_uv.dimension(2));
  mla_project_output_into<T>(
      bhld_view(o_latent),
      TensorMap<const T, 3>(w_uv.data(), w_uv.dimension(0), w_uv.dimension(1), w_uv.dimension(2)),
      bhld_view(out));
  return out;
}

/// w_uk (H, P, C) and w_uv (H, C, Dv) from DeepSeek's kv_b_proj weight (H (P + Dv), C), PyTorch's
/// out x in: rows [h (P + Dv), h (P + Dv) + P) are head h's w_uk[h], the next Dv rows its
/// w_uv[h] transposed.
template <class T>
MlaWeights<T> mla_weights_from_kv_b_proj(const Matrix<T>& kv_b_proj,  // (H (P + Dv), C)
                                         Index heads, Index nope_dim, Index value_dim) {
  constexpr const char* function = "mla_weights_from_kv_b_proj";
  if (heads < 1 || nope_dim < 1 || value_dim < 1 ||
      kv_b_proj.rows() != heads * (nope_dim + value_dim) || kv_b_proj.cols() < 1) {
    detail::throw_invalid_argument(
        function, "kv_b_proj is " + detail::shape_string({kv_b_proj.rows(), kv_b_proj.cols()}) +
                      " with H = " + std::to_string(heads) + ", P = " + std::to_string(nope_dim) +
                      ", Dv = " + std::to_string(value_dim) +
                      ": it must be (H (P + Dv), C), H, P, Dv and C positive");
  }
  const Index latent = kv_b_proj.cols();
  MlaWeights<T> w{Tensor<T, 3>(heads, nope_dim, latent), Tensor<T, 3>(heads, latent, value_dim)};
  for (Index h = 0; h < heads; ++h) {
    const Index first = h * (nope_dim + value_dim);
    Eigen::Map<Matrix<T>>(w.w_uk.data() + h * nope_dim * latent, nope_dim, latent) =
        kv_b_proj.middleRows(first, nope_dim);
    Eigen::Map<Matrix<T>>(w.w_uv.data() + h * latent * value_dim, latent, value_dim) =
        kv_b_proj.middleRows(first + nope_dim, value_dim).transpose();
  }
  return w;
}

}  // namespace attn
