// bench/model_shapes.cpp — model presets (GPT small, GPT 1B, Llama 7B) and the --shapes parser.
#include "model_shapes.hpp"

#include <stdexcept>

namespace dion3::bench {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      {"gpt-small", 12, 768, 4 * 768, false, "GPT-2 small: 12 layers, d=768, MLP 4d"},
      {"gpt-1b", 16, 2048, 4 * 2048, false, "GPT 1B: 16 layers, d=2048, MLP 4d"},
      {"llama-7b", 32, 4096, 11008, true, "Llama 7B: 32 layers, d=4096, gated MLP 11008"},
  };
  return presets;
}

const ModelPreset& find_preset(const std::string& name) {
  std::string known;
  for (const auto& p : model_presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw std::invalid_argument("unknown model '" + name + "' (known: " + known + ")");
}

std::vector<MatrixShape> model_matrices(const ModelPreset& p, int layers) {
  if (layers <= 0) layers = p.layers;
  const int64_t d = p.d_model, h = p.d_mlp;
  std::vector<MatrixShape> out;
  for (int l = 0; l < layers; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    for (const char* a : {"attn.q", "attn.k", "attn.v", "attn.o"}) out.push_back({pre + a, d, d});
    if (p.gated_mlp) {
      out.push_back({pre + "mlp.gate", h, d});
      out.push_back({pre + "mlp.up", h, d});
    } else {
      out.push_back({pre + "mlp.up", h, d});
    }
    out.push_back({pre + "mlp.down", d, h});
  }
  return out;
}

namespace {

int64_t parse_positive(const std::string& s, const std::string& item) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || s.empty() || v <= 0)
    throw std::invalid_argument("bad shape '" + item + "': expected ROWSxCOLS or ROWSxCOLS:COUNT with positive integers");
  return v;
}

}  // namespace

std::vector<MatrixShape> parse_shapes(const std::string& list) {
  std::vector<MatrixShape> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    int64_t count = 1;
    std::string dims = item;
    if (auto colon = item.find(':'); colon != std::string::npos) {
      count = parse_positive(item.substr(colon + 1), item);
      dims = item.substr(0, colon);
    }
    auto x = dims.find('x');
    if (x == std::string::npos) parse_positive("", item);  // throws with the usage message
    int64_t rows = parse_positive(dims.substr(0, x), item);
    int64_t cols = parse_positive(dims.substr(x + 1), item);
    for (int64_t i = 0; i < count; ++i)
      out.push_back({"m" + std::to_string(out.size()) + "." + std::to_string(rows) + "x" + std::to_string(cols),
                     rows, cols});
  }
  if (out.empty()) throw std::invalid_argument("--shapes needs at least one ROWSxCOLS");
  return out;
}

int64_t total_elements(const std::vector<MatrixShape>& shapes) {
  int64_t n = 0;
  for (const auto& s : shapes) n += s.rows * s.cols;
  return n;
}

}  // namespace dion3::bench
