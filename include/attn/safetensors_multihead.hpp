// attn/safetensors_multihead.hpp: MultiHeadAttention weights (and any state dict) loaded
// from and saved to .safetensors files (attn/safetensors.hpp, the file format alone).
//
// A module's tensors are those named `prefix` + a state_dict name (in_proj_weight,
// out_proj.weight, ..., attn/multihead.hpp), as torch.save(module.state_dict()) names them
// inside a model, e.g. prefix "layers.0.self_attn.". The prefix is matched literally: end
// it with "." (prefix "attn" would also take "attn2.in_proj_weight"). The configuration
// (embed_dim, num_heads, ...) is not in the file: the module is built first.
//
// Needs nlohmann/json like attn/safetensors.hpp (CMake: attn::safetensors).
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/multihead.hpp"
#include "attn/safetensors.hpp"

namespace attn {

/// The tensors to write for a state_dict, each named prefix + its name (not owned: `state`
/// must outlive the write).
template <class T>
std::vector<SafetensorsTensor> safetensors_tensors(const StateDict<T>& state,
                                                   const std::string& prefix = "") {
  std::vector<SafetensorsTensor> tensors;
  tensors.reserve(state.size());
  for (const auto& [name, t] : state) {
    Index count = 1;
    for (const Index d : t.shape)
      count *= d;
    if (count != static_cast<Index>(t.data.size())) {
      detail::safetensors_fail("safetensors_tensors: ",
                               "tensor " + detail::json_quote(prefix + name) + ": shape " +
                                   detail::list_string(t.shape) + " but " +
                                   std::to_string(t.data.size()) + " values");
    }
    tensors.push_back({prefix + name, dtype_of<T>(), t.shape, t.data.data()});
  }
  return tensors;
}
template <class T>
std::vector<SafetensorsTensor> safetensors_tensors(StateDict<T>&& state,
                                                   const std::string& prefix = "") = delete;

/// Every tensor of `file` whose name starts with `prefix`, the prefix removed, converted to
/// T (any dtype, like SafetensorsFile::read).
template <class T>
StateDict<T> read_state_dict(const SafetensorsFile& file, const std::string& prefix = "") {
  StateDict<T> state;
  for (const TensorEntry& e : file.entries()) {
    if (e.name.compare(0, prefix.size(), prefix) == 0)
      state[e.name.substr(prefix.size())] = {e.shape, file.read_values<T>(e.name)};
  }
  return state;
}

/// Loads `module`'s weights from the tensors of `file` under `prefix`, strictly: exactly the
/// names of its state_dict must be there under the prefix (tensors outside it are ignored),
/// each of the shape its configuration gives; any dtype is converted to T. Throws
/// SafetensorsError naming the prefix and the missing, unexpected or misshapen tensor; the
/// module is unchanged then.
template <class T>
void load_safetensors(MultiHeadAttention<T>& module, const SafetensorsFile& file,
                      const std::string& prefix = "") {
  const StateDict<T> state = read_state_dict<T>(file, prefix);
  try {
    module.load_state_dict(state);
  } catch (const std::invalid_argument& e) {
    detail::safetensors_fail(
        file.path().empty() ? "" : file.path() + ": ",
        "load_safetensors: prefix " + detail::json_quote(prefix) + ": " + e.what());
  }
}

/// Writes `module`'s state_dict to `path`, each tensor named prefix + its state_dict name,
/// in T's dtype; load_safetensors reads it back bit for bit.
template <class T>
void save_safetensors(const std::string& path, const MultiHeadAttention<T>& module,
                      const std::string& prefix = "",
                      const std::map<std::string, std::string>& metadata = {}) {
  const StateDict<T> state = module.state_dict();
  save_safetensors(path, safetensors_tensors(state, prefix), metadata);
}

}  // namespace attn
