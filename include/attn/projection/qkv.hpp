// attn/projection/qkv.hpp: the Q/K/V projection of attention (one weight buffer, the fused or
// separate form as its layout) and its result; the backward is in
// attn/projection/qkv_backward.hpp (attn/projection.hpp includes both).
//
// Shape legend: B batch, Lq / Lk query and key lengths, N = B*L rows, E (Eq, Ek, Ev) input
// widths, Dq / Dk / Dv projected widths of q, k and v.
//
// Weight layouts: ours (in, out), applied as x * W (attn/projection/linear.hpp); PyTorch's
// state_dict names and (out, in) layouts: in_proj_weight (Dq + Dk + Dv, E) for the fused
// form, q_proj_weight (Dq, Eq), k_proj_weight (Dk, Ek), v_proj_weight (Dv, Ev) for the
// separate one, in_proj_bias (Dq + Dk + Dv) for both.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/init.hpp"
#include "attn/projection/linear.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// The result of a QKV projection: q (B, Lq, Dq), k (B, Lk, Dk), v (B, Lk, Dv) as three
/// blocks of one buffer. Self-attention with fused weights writes the buffer as one GEMM's
/// (B*S, Dq + Dk + Dv) rows, q, k and v its column blocks; otherwise the three blocks are
/// contiguous (rows, width) matrices one after another. Either way the accessors are
/// zero-copy views, each a block's offset and row stride.
template <class T>
class QKV {
 public:
  Index batch() const { return batch_; }
  Index q_length() const { return q_length_; }
  Index kv_length() const { return kv_length_; }
  Index q_dim() const { return q_dim_; }
  Index k_dim() const { return k_dim_; }
  Index v_dim() const { return v_dim_; }
  /// Whether q, k and v are column blocks of one GEMM's rows (row stride Dq + Dk + Dv).
  bool is_fused() const { return q_.stride != q_dim_; }

  /// (B*Lq, Dq), (B*Lk, Dk), (B*Lk, Dv) row views.
  ConstRowsMap<T> q() const { return rows(q_, batch_ * q_length_, q_dim_); }
  ConstRowsMap<T> k() const { return rows(k_, batch_ * kv_length_, k_dim_); }
  ConstRowsMap<T> v() const { return rows(v_, batch_ * kv_length_, v_dim_); }

  /// Head views (B, H, L, D) over the (B, L, H, D) memory: what the attention kernels read.
  /// `heads` must divide the width.
  HeadsView<const T> q_heads(Index heads) const {
    return heads_view("QKV::q_heads", q_, q_length_, q_dim_, heads);
  }
  HeadsView<const T> k_heads(Index heads) const {
    return heads_view("QKV::k_heads", k_, kv_length_, k_dim_, heads);
  }
  HeadsView<const T> v_heads(Index heads) const {
    return heads_view("QKV::v_heads", v_, kv_length_, v_dim_, heads);
  }

 private:
  template <class>
  friend class QKVProjection;

  /// Where one of q, k, v lies in buffer_: its first element and its row stride.
  struct Block {
    Index offset = 0;
    Index stride = 0;
  };

  ConstRowsMap<T> rows(const Block& b, Index r, Index c) const {
    return ConstRowsMap<T>(buffer_.data() + b.offset, r, c, Eigen::OuterStride<>(b.stride));
  }
  RowsMap<T> mutable_rows(const Block& b, Index r, Index c) {
    return RowsMap<T>(buffer_.data() + b.offset, r, c, Eigen::OuterStride<>(b.stride));
  }
  HeadsView<const T> heads_view(const char* function, const Block& b, Index length, Index width,
                                Index heads) const {
    if (heads < 1 || width % heads != 0) {
      detail::throw_invalid_argument(
          function,
          "width " + std::to_string(width) + " is not divisible by heads " + std::to_string(heads));
    }
    return {buffer_.data() + b.offset, batch_,        heads,   length, width / heads,
            length * b.stride,         width / heads, b.stride};
  }

  Index batch_ = 0, q_length_ = 0, kv_length_ = 0, q_dim_ = 0, k_dim_ = 0, v_dim_ = 0;
  Vector<T> buffer_;  // the three blocks
  Block q_, k_, v_;
};

/// The gradients of a QKVProjection, named as MultiHeadAttention's state_dict names the
/// parameters (torch.nn.MultiheadAttention's; shapes (out, in) as there), so that each
/// compares one to one with torch's .grad of the same name.
template <class T>
struct QKVProjectionGradients {
  Tensor<T, 3> dx;            ///< self-attention backward(x, ...): (B, S, E), the q, k and v paths
                              ///< summed; empty after the cross-attention backward
  Tensor<T, 3> dx_q;          ///< cross-attention: (B, Lq, Eq); empty after the self-attention one
  Tensor<T, 3> dx_k;          ///< cross-attention: (B, Lk, Ek)
  Tensor<T, 3> dx_v;          ///< cross-attention: (B, Lk, Ev)
  Matrix<T> din_proj_weight;  ///< fused: (Dq + Dk + Dv, E); empty when separate
  Matrix<T> dq_proj_weight;   ///< separate: (Dq, Eq); empty when fused
  Matrix<T> dk_proj_weight;   ///< separate: (Dk, Ek)
  Matrix<T> dv_proj_weight;   ///< separate: (Dv, Ev)
  Vector<T> din_proj_bias;    ///< (Dq + Dk + Dv) in both forms (torch keeps one in_proj_bias
                              ///< even with separate weights); empty without biases
};

/// Q, K and V projections: q = x_q Wq + bq, k = x_k Wk + bk, v = x_v Wv + bv.
///
/// One representation: one weight buffer that holds Wq (Eq, Dq), Wk (Ek, Dk) and Wv (Ev, Dv)
/// as three row-major blocks, and one bias [bq, bk, bv] (Dq + Dk + Dv) (torch keeps one
/// in_proj_bias in both of its forms). Every accessor reads a block the same way; the form
/// is only where the blocks lie in the buffer:
///   fused:    one input width E, the buffer is the (E, Dq + Dk + Dv) matrix [Wq | Wk | Wv]
///             (torch's in_proj_weight, transposed) and the blocks are its column blocks:
///             self-attention is one GEMM, and q, k, v are column blocks of its result;
///   separate: the blocks one after another, each its own matrix (cross-attention from other
///             widths; Dk may differ from Dv and from E): one GEMM per path.
/// Both forms give the same numbers for the same weights (to rounding of the GEMM blocking).
/// Dq and Dk may differ (grouped-query attention: Dq = H*D, Dk = Hkv*D); what must agree is
/// the per-head dim, which the head views check.
template <class T>
class QKVProjection {
 public:
  QKVProjection() = default;

  /// Separate projections (their weights are copied into the one buffer).
  QKVProjection(const Linear<T>& q, const Linear<T>& k, const Linear<T>& v) {
    if (q.has_bias() != k.has_bias() || q.has_bias() != v.has_bias()) {
      detail::throw_invalid_argument("QKVProjection",
                                     "q, k and v must all have a bias or all have none");
    }
    const Linear<T>* parts[3] = {&q, &k, &v};
    Index size = 0;
    for (int p = 0; p < 3; ++p) {
      const Index in = parts[p]->in_features(), out = parts[p]->out_features();
      blocks_[static_cast<std::size_t>(p)] = {size, in, out, out};
      size += in * out;
    }
    weights_.resize(size);
    for (int p = 0; p < 3; ++p)
      block_of(p) = parts[p]->weight();
    if (q.has_bias()) {
      bias_.resize(q_dim() + k_dim() + v_dim());
      bias_ << q.bias(), k.bias(), v.bias();
    }
  }

  /// Fresh projections like PyTorch's MultiheadAttention: xavier_uniform on the stacked
  /// (E, Dq + Dk + Dv) weight (or on each weight when the input widths differ), drawn with
  /// std::mt19937_64(seed); zero biases. kdim/vdim are the key and value input widths.
  /// The fused form is used when kdim == vdim == embed_dim.
  static QKVProjection make(Index embed_dim, Index q_dim, Index k_dim, Index v_dim, bool bias,
                            std::uint64_t seed = 0, Index kdim = 0, Index vdim = 0) {
    if (kdim == 0)
      kdim = embed_dim;
    if (vdim == 0)
      vdim = embed_dim;
    if (embed_dim < 1 || q_dim < 1 || k_dim < 1 || v_dim < 1 || kdim < 1 || vdim < 1) {
      detail::throw_invalid_argument(
          "QKVProjection::make",
          "widths (embed_dim, q_dim, k_dim, v_dim, kdim, vdim) are " +
              detail::shape_string({embed_dim, q_dim, k_dim, v_dim, kdim, vdim}) +
              ": all must be positive");
    }
    std::mt19937_64 engine(seed);
    const auto zeros = [bias](Index n) {
      return bias ? Vector<T>(Vector<T>::Zero(n)) : Vector<T>();
    };
    if (kdim == embed_dim && vdim == embed_dim) {
      return fused(xavier_uniform<T>(embed_dim, q_dim + k_dim + v_dim, engine),
                   zeros(q_dim + k_dim + v_dim), q_dim, k_dim, v_dim);
    }
    Matrix<T> wq = xavier_uniform<T>(embed_dim, q_dim, engine);
    Matrix<T> wk = xavier_uniform<T>(kdim, k_dim, engine);
    Matrix<T> wv = xavier_uniform<T>(vdim, v_dim, engine);
    return QKVProjection(Linear<T>(std::move(wq), zeros(q_dim)),
                         Linear<T>(std::move(wk), zeros(k_dim)),
                         Linear<T>(std::move(wv), zeros(v_dim)));
  }

  /// Fused form from W = [Wq | Wk | Wv] (E, Dq + Dk + Dv) and b = [bq, bk, bv] or empty.
  static QKVProjection fused(Matrix<T> weight, Vector<T> bias, Index q_dim, Index k_dim,
                             Index v_dim) {
    if (q_dim < 1 || k_dim < 1 || v_dim < 1 || q_dim + k_dim + v_dim != weight.cols()) {
      detail::throw_invalid_argument(
          "QKVProjection::fused",
          "weight (E, Dq + Dk + Dv) is " + detail::shape_string({weight.rows(), weight.cols()}) +
              " but (Dq, Dk, Dv) is " + detail::shape_string({q_dim, k_dim, v_dim}) +
              ": need positive widths and Dq + Dk + Dv columns");
    }
    const Linear<T> stacked(std::move(weight), std::move(bias));  // its checks: E, the bias
    const Index e = stacked.in_features(), total = stacked.out_features();
    QKVProjection p;
    p.weights_ = Eigen::Map<const Vector<T>>(stacked.weight().data(), e * total);
    p.bias_ = stacked.bias();
    p.blocks_ = {
        {{0, e, q_dim, total}, {q_dim, e, k_dim, total}, {q_dim + k_dim, e, v_dim, total}}};
    return p;
  }

  /// Fused form from PyTorch's in_proj_weight (Dq + Dk + Dv, E) and in_proj_bias or empty.
  static QKVProjection fused_from_torch(const Eigen::Ref<const Matrix<T>>& in_proj_weight,
                                        const Eigen::Ref<const Vector<T>>& in_proj_bias,
                                        Index q_dim, Index k_dim, Index v_dim) {
    if (in_proj_bias.size() != 0 && in_proj_bias.size() != in_proj_weight.rows()) {
      detail::throw_invalid_argument(
          "QKVProjection::fused_from_torch",
          "in_proj_weight is " +
              detail::shape_string({in_proj_weight.rows(), in_proj_weight.cols()}) +
              " but in_proj_bias is " + detail::shape_string({in_proj_bias.size()}) +
              ": need one bias per weight row");
    }
    return fused(Matrix<T>(in_proj_weight.transpose()), Vector<T>(in_proj_bias), q_dim, k_dim,
                 v_dim);
  }

  /// The separate form of a fused projection (copies the weight blocks).
  QKVProjection separated() const {
    if (!is_fused())
      return *this;
    return QKVProjection(linear(0), linear(1), linear(2));
  }

  /// The fused form of separate projections with one input width (copies the weights).
  QKVProjection fused_form() const {
    if (is_fused())
      return *this;
    if (q_in() != k_in() || q_in() != v_in()) {
      detail::throw_invalid_argument("QKVProjection::fused_form",
                                     "input widths (q, k, v) are " +
                                         detail::shape_string({q_in(), k_in(), v_in()}) +
                                         ": fusing needs one input width");
    }
    Matrix<T> w(q_in(), q_dim() + k_dim() + v_dim());
    w << wq(), wk(), wv();
    return fused(std::move(w), bias_, q_dim(), k_dim(), v_dim());
  }

  /// Whether the blocks are the column blocks of one (E, Dq + Dk + Dv) matrix (the fused
  /// form: their rows lie Dq + Dk + Dv apart).
  bool is_fused() const { return q_dim() > 0 && blocks_[0].stride == q_dim() + k_dim() + v_dim(); }
  bool has_bias() const { return bias_.size() != 0; }
  Index q_dim() const { return blocks_[0].out; }
  Index k_dim() const { return blocks_[1].out; }
  Index v_dim() const { return blocks_[2].out; }
  Index q_in() const { return blocks_[0].in; }
  Index k_in() const { return blocks_[1].in; }
  Index v_in() const { return blocks_[2].in; }

  /// Weight (in, out) views of Wq, Wk, Wv (column blocks of the fused weight when fused).
  ConstRowsMap<T> wq() const { return weight(0); }
  ConstRowsMap<T> wk() const { return weight(1); }
  ConstRowsMap<T> wv() const { return weight(2); }
  /// Bias pointers (null without bias).
  const T* bq() const { return bias_of(0); }
  const T* bk() const { return bias_of(1); }
  const T* bv() const { return bias_of(2); }
  /// [bq, bk, bv] (Dq + Dk + Dv), torch's in_proj_bias; empty without biases.
  const Vector<T>& bias() const { return bias_; }
  /// The fused weight [Wq | Wk | Wv] (E, Dq + Dk + Dv) (valid only when is_fused()).
  ConstRowsMap<T> fused_weight() const {
    const Index total = q_dim() + k_dim() + v_dim();
    return ConstRowsMap<T>(weights_.data(), q_in(), total, Eigen::OuterStride<>(total));
  }

  /// Self-attention: q, k, v from one x (B, S, E). Fused: one GEMM into one buffer.
  QKV<T> operator()(const Tensor<T, 3>& x) const {  // (B, S, E)
    QKV<T> out;
    project_into(x, x, x, out);
    return out;
  }

  /// Cross-attention: q from x_q (B, Lq, Eq), k from x_k (B, Lk, Ek), v from x_v (B, Lk, Ev).
  QKV<T> operator()(const Tensor<T, 3>& x_q,          // (B, Lq, Eq)
                    const Tensor<T, 3>& x_k,          // (B, Lk, Ek)
                    const Tensor<T, 3>& x_v) const {  // (B, Lk, Ev)
    QKV<T> out;
    project_into(x_q, x_k, x_v, out);
    return out;
  }

  /// Same, reusing `out`'s buffers (no allocation when the shapes repeat). The fused
  /// one-GEMM path is taken when the projection is fused and x_q, x_k and x_v are the same
  /// tensor (same data pointer).
  void project_into(const Tensor<T, 3>& x_q,  // (B, Lq, Eq)
                    const Tensor<T, 3>& x_k,  // (B, Lk, Ek)
                    const Tensor<T, 3>& x_v,  // (B, Lk, Ev)
                    QKV<T>& out) const {
    constexpr const char* function = "QKVProjection";
    const auto shapes = [&] {
      return detail::shape3("x_q", x_q.dimension(0), x_q.dimension(1), x_q.dimension(2)) + ", " +
             detail::shape3("x_k", x_k.dimension(0), x_k.dimension(1), x_k.dimension(2)) + ", " +
             detail::shape3("x_v", x_v.dimension(0), x_v.dimension(1), x_v.dimension(2));
    };
    if (q_dim() == 0)
      detail::throw_invalid_argument(function, "the projection is empty");
    if (x_q.dimension(0) != x_k.dimension(0) || x_q.dimension(0) != x_v.dimension(0)) {
      detail::throw_invalid_argument(function, shapes() + ": batch sizes differ");
    }
    if (x_k.dimension(1) != x_v.dimension(1)) {
      detail::throw_invalid_argument(function, shapes() + ": key and value lengths differ");
    }
    if (x_q.dimension(2) != q_in() || x_k.dimension(2) != k_in() || x_v.dimension(2) != v_in()) {
      detail::throw_invalid_argument(function, shapes() + " but the input widths (q, k, v) are " +
                                                   detail::shape_string({q_in(), k_in(), v_in()}));
    }
    const Index batch = x_q.dimension(0);
    out.batch_ = batch;
    out.q_length_ = x_q.dimension(1);
    out.kv_length_ = x_k.dimension(1);
    out.q_dim_ = q_dim();
    out.k_dim_ = k_dim();
    out.v_dim_ = v_dim();
    const bool same_input = x_q.data() == x_k.data() && x_q.data() == x_v.data() &&
                            x_q.dimension(1) == x_k.dimension(1);
    const Index nq = batch * out.q_length_, nk = batch * out.kv_length_;
    if (is_fused() && same_input) {
      // One GEMM: q, k and v are column blocks of its result.
      const Index total = q_dim() + k_dim() + v_dim();
      out.buffer_.resize(nq * total);
      out.q_ = {0, total};
      out.k_ = {q_dim(), total};
      out.v_ = {q_dim() + k_dim(), total};
      detail::linear_into<T>(detail::rows_of(x_q), fused_weight(), bq(),
                             out.mutable_rows(out.q_, nq, total));
      return;
    }
    out.buffer_.resize(nq * q_dim() + nk * (k_dim() + v_dim()));
    out.q_ = {0, q_dim()};
    out.k_ = {nq * q_dim(), k_dim()};
    out.v_ = {nq * q_dim() + nk * k_dim(), v_dim()};
    detail::linear_into<T>(detail::rows_of(x_q), wq(), bq(), out.mutable_rows(out.q_, nq, q_dim()));
    detail::linear_into<T>(detail::rows_of(x_k), wk(), bk(), out.mutable_rows(out.k_, nk, k_dim()));
    detail::linear_into<T>(detail::rows_of(x_v), wv(), bv(), out.mutable_rows(out.v_, nk, v_dim()));
  }

  // The backward (attn/projection/qkv_backward.hpp).

  /// Self-attention backward: from the forward's input x (B, S, E) and the gradients dq
  /// (B, S, Dq), dk (B, S, Dk), dv (B, S, Dv) of the loss with respect to q, k and v: dx
  /// (B, S, E) = dq Wq^T + dk Wk^T + dv Wv^T and the parameter gradients (fused or separate
  /// names, as the projection is). Fused: one GEMM for dx and one for in_proj_weight.
  QKVProjectionGradients<T> backward(const Tensor<T, 3>& x,          // (B, S, E)
                                     const Tensor<T, 3>& dq,         // (B, S, Dq)
                                     const Tensor<T, 3>& dk,         // (B, S, Dk)
                                     const Tensor<T, 3>& dv) const;  // (B, S, Dv)

  /// Cross-attention backward: x_q (B, Lq, Eq), x_k (B, Lk, Ek), x_v (B, Lk, Ev) and dq
  /// (B, Lq, Dq), dk (B, Lk, Dk), dv (B, Lk, Dv) give dx_q, dx_k, dx_v (each input's own;
  /// sum them yourself if two inputs were one tensor) and the parameter gradients.
  QKVProjectionGradients<T> backward(const Tensor<T, 3>& x_q,        // (B, Lq, Eq)
                                     const Tensor<T, 3>& x_k,        // (B, Lk, Ek)
                                     const Tensor<T, 3>& x_v,        // (B, Lk, Ev)
                                     const Tensor<T, 3>& dq,         // (B, Lq, Dq)
                                     const Tensor<T, 3>& dk,         // (B, Lk, Dk)
                                     const Tensor<T, 3>& dv) const;  // (B, Lk, Dv)

  /// The backward on strided rows, for building larger backwards (MultiHeadAttention's):
  /// x_q (Nq, Eq), x_k (Nk, Ek), x_v (Nk, Ev) as the forward read them, dq (Nq, Dq), dk
  /// (Nk, Dk), dv (Nk, Dv) (any strides: e.g. the column blocks of one (N, Dq + Dk + Dv)
  /// buffer). dx_q, dx_k, dx_v receive the input gradients (null: not computed); when two or
  /// three of them have the same data they are one input's gradient and the paths are summed
  /// there (self-attention). The parameter gradients go to `grads` (its dx fields are left
  /// alone): overwritten, or with accumulate added to, as torch's .grad. One GEMM for dx and
  /// one for in_proj_weight when the projection is fused, the three inputs are one, dq, dk
  /// and dv are adjacent column blocks of one buffer and dx is one destination.
  void backward_into(const ConstRowsMap<T>& x_q,  // (Nq, Eq)
                     const ConstRowsMap<T>& x_k,  // (Nk, Ek)
                     const ConstRowsMap<T>& x_v,  // (Nk, Ev)
                     const ConstRowsMap<T>& dq,   // (Nq, Dq)
                     const ConstRowsMap<T>& dk,   // (Nk, Dk)
                     const ConstRowsMap<T>& dv,   // (Nk, Dv)
                     RowsMap<T>* dx_q,            // (Nq, Eq) or null
                     RowsMap<T>* dx_k,            // (Nk, Ek) or null
                     RowsMap<T>* dx_v,            // (Nk, Ev) or null
                     QKVProjectionGradients<T>& grads, bool accumulate = false) const;

 private:
  /// Where one weight lies in weights_: an (in, out) row-major block, rows `stride` apart.
  struct Block {
    Index offset = 0, in = 0, out = 0, stride = 0;
  };

  /// Wq, Wk or Wv (which = 0, 1, 2) as an (in, out) view.
  ConstRowsMap<T> weight(int which) const {
    const Block& b = blocks_[static_cast<std::size_t>(which)];
    return ConstRowsMap<T>(weights_.data() + b.offset, b.in, b.out, Eigen::OuterStride<>(b.stride));
  }
  RowsMap<T> block_of(int which) {
    const Block& b = blocks_[static_cast<std::size_t>(which)];
    return RowsMap<T>(weights_.data() + b.offset, b.in, b.out, Eigen::OuterStride<>(b.stride));
  }
  /// The first column of path `which` in q | k | v (in the bias and the fused weight).
  Index first_column(int which) const {
    return which == 0 ? 0 : which == 1 ? q_dim() : q_dim() + k_dim();
  }
  const T* bias_of(int which) const {
    return has_bias() ? bias_.data() + first_column(which) : nullptr;
  }
  /// Path `which` as a Linear layer of its own (copies).
  Linear<T> linear(int which) const {
    const Index out = blocks_[static_cast<std::size_t>(which)].out;
    return Linear<T>(Matrix<T>(weight(which)),
                     has_bias() ? Vector<T>(bias_.segment(first_column(which), out)) : Vector<T>());
  }
  void check_backward_tensors(const Tensor<T, 3>& x_q, const Tensor<T, 3>& x_k,
                              const Tensor<T, 3>& x_v, const Tensor<T, 3>& dq,
                              const Tensor<T, 3>& dk, const Tensor<T, 3>& dv) const;

  Vector<T> weights_;              // Wq, Wk, Wv: where, blocks_ says
  Vector<T> bias_;                 // (Dq + Dk + Dv) = [bq, bk, bv], or empty
  std::array<Block, 3> blocks_{};  // Wq, Wk, Wv
};

}  // namespace attn
