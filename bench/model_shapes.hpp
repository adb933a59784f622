// bench/model_shapes.hpp — the matrix parameters of model-shaped benchmark workloads.
//
// Presets describe transformer blocks by their weight matrices (out x in, i.e. rows = fan-out):
// attention q, k, v, o as separate d x d matrices and an MLP (up/down, or gate/up/down for
// gated MLPs). Embeddings, norms and the LM head are not matrix-optimizer work and are left out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dion3::bench {

struct MatrixShape {
  std::string name;  // e.g. "layers.3.mlp.up"
  int64_t rows = 0;  // out features
  int64_t cols = 0;  // in features
};

struct ModelPreset {
  std::string name;
  int layers = 0;
  int64_t d_model = 0;
  int64_t d_mlp = 0;
  bool gated_mlp = false;  // gate/up/down (Llama) instead of up/down (GPT)
  std::string description;
};

const std::vector<ModelPreset>& model_presets();
// Throws std::invalid_argument listing the known names.
const ModelPreset& find_preset(const std::string& name);
// The matrices of the first `layers` blocks (layers <= 0: all of the preset's layers).
std::vector<MatrixShape> model_matrices(const ModelPreset& preset, int layers);
// "1024x4096,4096x1024:8" -> matrices; ":N" repeats a shape N times. Throws std::invalid_argument.
std::vector<MatrixShape> parse_shapes(const std::string& list);
// Total number of weights.
int64_t total_elements(const std::vector<MatrixShape>& shapes);

}  // namespace dion3::bench
