// The same attention as one_call.cpp written on Eigen alone, the baseline of
// scripts/compile_time.sh: grouped-query heads, top-left causal, a stable softmax.
#include <cmath>
#include <limits>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

using Tensor4 = Eigen::Tensor<float, 4, Eigen::RowMajor>;
using Rows = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<Rows>;
using ConstMap = Eigen::Map<const Rows>;

Tensor4 attention(const Tensor4& q, const Tensor4& k, const Tensor4& v) {  // (B, H, L, D)
  const Eigen::Index batch = q.dimension(0), heads = q.dimension(1), lq = q.dimension(2),
                     dim = q.dimension(3), kv_heads = k.dimension(1), lk = k.dimension(2),
                     dv = v.dimension(3);
  Tensor4 out(batch, heads, lq, dv);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const Eigen::Index g = h / (heads / kv_heads);
      const ConstMap qh(q.data() + (b * heads + h) * lq * dim, lq, dim);
      const ConstMap kh(k.data() + (b * kv_heads + g) * lk * dim, lk, dim);
      const ConstMap vh(v.data() + (b * kv_heads + g) * lk * dv, lk, dv);
      Rows s = scale * (qh * kh.transpose());
      for (Eigen::Index i = 0; i < lq; ++i) {
        s.row(i)
            .tail(lk - std::min(lk, i + 1))
            .setConstant(-std::numeric_limits<float>::infinity());
        const float m = s.row(i).maxCoeff();
        s.row(i) = (s.row(i).array() - m).exp().matrix();
        s.row(i) /= s.row(i).sum();
      }
      Map(out.data() + (b * heads + h) * lq * dv, lq, dv).noalias() = s * vh;
    }
  }
  return out;
}

int main() {
  Tensor4 q(2, 8, 128, 64), k(2, 2, 128, 64), v(2, 2, 128, 64);
  q.setRandom();
  k.setRandom();
  v.setRandom();
  const Tensor4 out = attention(q, k, v);
  return out.dimension(3) == 64 ? 0 : 1;
}
