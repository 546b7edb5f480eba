// A consumer of attn/safetensors.hpp through attn::safetensors (find_package with the
// safetensors component, or add_subdirectory): writes two tensors and metadata into an
// in-memory .safetensors file, reads them back (converted and viewed in place) and checks
// that a malformed header is rejected with a SafetensorsError. Exits non-zero on any
// difference.
#include <attn/safetensors.hpp>

#include <cstdint>
#include <iostream>
#include <vector>

int main() {
  attn::Matrix<float> w(2, 3);  // (2, 3)
  w << 1.0f, -2.0f, 0.5f,       //
      4.0f, 0.25f, -8.0f;
  attn::Vector<double> b(2);  // (2)
  b << 3.0, -1.5;
  const std::vector<std::uint8_t> bytes = attn::safetensors_bytes(
      {attn::safetensors_tensor("w", w), attn::safetensors_tensor("b", b)}, {{"format", "pt"}});
  const attn::SafetensorsFile file = attn::SafetensorsFile::from_bytes(bytes);
  const attn::Tensor<double, 2> wd = file.read<double, 2>("w");
  const attn::TensorMap<const double, 1> bv = file.view<double, 1>("b");
  if (file.metadata().at("format") != "pt" || wd(1, 2) != -8.0 || wd(0, 2) != 0.5 ||
      bv(1) != -1.5) {
    std::cerr << "safetensors_consumer: the tensors did not read back\n";
    return 1;
  }
  std::vector<std::uint8_t> bad = bytes;
  bad[8] = '[';  // the header is no longer a JSON object
  try {
    (void)attn::SafetensorsFile::from_bytes(bad);
    std::cerr << "safetensors_consumer: a malformed header was accepted\n";
    return 1;
  } catch (const attn::SafetensorsError& e) {
    std::cout << "safetensors_consumer: ok (" << e.what() << ")\n";
  }
  return 0;
}
