// memopt/detail/optimizer_state.hpp — not API. The key of a parameter in a LibTorch
// optimizer's state map: a string of the TensorImpl address in LibTorch 1.x, the address
// itself in 2.x. Written against the map's key type, so both compile.
#pragma once

#include <sstream>
#include <string>
#include <type_traits>

#include <torch/torch.h>

namespace memopt::detail {

/// state.find(optimizer_state_key(state, p)) finds p's state in either LibTorch.
template <class StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, const torch::Tensor& p) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // the pointer as LibTorch's own key prints it
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace memopt::detail
