// The README's one-call example, as a user's translation unit (scripts/compile_time.sh):
// compiled against the headers alone (attn::attn) and against attn::compiled.
#include <attn/attn.hpp>

int main() {
  attn::Tensor<float, 4> q(2, 8, 128, 64), k(2, 2, 128, 64), v(2, 2, 128, 64);  // (B, H, L, D)
  q.setRandom();
  k.setRandom();
  v.setRandom();
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;  // PyTorch's is_causal
  attn::Tensor<float, 4> out = attn::scaled_dot_product_attention(q, k, v, options);
  return out.dimension(3) == 64 ? 0 : 1;
}
