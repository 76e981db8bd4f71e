// What the layer oracle's files share (layer_reference.cc, layer_rope.cc): its errors, the
// config's derived sizes and check, float32 rounding, and the rotation of one head.
#ifndef FLASHCTE_SRC_REFERENCE_LAYER_COMMON_H_
#define FLASHCTE_SRC_REFERENCE_LAYER_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "src/reference/layer_reference.h"

namespace flashcte::reference::layer_detail {

// "<field>: <rule>".
Status error(const std::string& field, const std::string& rule);
double to_f32(double x);
int64_t head_dim_of(const LayerConfig& c);
int64_t rotary_dim_of(const LayerConfig& c);
// Every field of the config against LAYER.md's rules.
Status check_config(const LayerConfig& c);
// x' = x*cos + rotate_half(x)*sin over the first cos.size() channels (R5).
void rotate(const std::vector<double>& cos, const std::vector<double>& sin, DType dtype, double* x);

}  // namespace flashcte::reference::layer_detail

#endif  // FLASHCTE_SRC_REFERENCE_LAYER_COMMON_H_
