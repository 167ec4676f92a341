#include "model_file.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>

#include "errors.h"
#include "gguf.h"

namespace specdec {
namespace {

// llama.cpp keeps per-layer hyper-parameters in arrays of this size and asserts on more.
constexpr double kMaxLayers = 512;

void check_magic(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ModelLoadError("cannot open model file: " + path);
    char magic[4] = {0, 0, 0, 0};
    in.read(magic, 4);
    if (in.gcount() == 0) throw ModelLoadError("model file is empty: " + path);
    if (in.gcount() < 4 || std::memcmp(magic, "GGUF", 4) != 0)
        throw ModelLoadError("not a GGUF file (bad magic): " + path);
}

struct GgufDeleter {
    void operator()(gguf_context* c) const { gguf_free(c); }
};
using Gguf = std::unique_ptr<gguf_context, GgufDeleter>;

// The value of a scalar numeric key, whatever its stored type; nullopt when absent or not a
// number (llama.cpp reports a wrong type itself; the typed getters would assert on it).
std::optional<double> number(const gguf_context* g, const std::string& key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return std::nullopt;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:
            return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8:
            return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16:
            return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16:
            return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32:
            return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:
            return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64:
            return static_cast<double>(gguf_get_val_u64(g, id));
        case GGUF_TYPE_INT64:
            return static_cast<double>(gguf_get_val_i64(g, id));
        case GGUF_TYPE_FLOAT32:
            return gguf_get_val_f32(g, id);
        case GGUF_TYPE_FLOAT64:
            return gguf_get_val_f64(g, id);
        default:
            return std::nullopt;
    }
}

std::string format(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    return std::to_string(v);
}

// Requires lo <= value <= hi for a key that is present.
void check_range(const gguf_context* g, const std::string& path, const std::string& key, double lo,
                 double hi, const char* rule) {
    const std::optional<double> v = number(g, key);
    if (!v) return;
    if (!(std::isfinite(*v) && *v >= lo && *v <= hi))
        throw ModelLoadError("malformed model " + path + ": " + key + " is " + format(*v) +
                             " (must be " + rule + ")");
}

}  // namespace

void check_model_file(const std::string& path) {
    check_magic(path);
    gguf_init_params params{};
    params.no_alloc = true;
    params.ctx = nullptr;
    Gguf g(gguf_init_from_file(path.c_str(), params));
    if (!g)
        throw ModelLoadError("cannot read the GGUF header of " + path + " (truncated or damaged)");
    const int64_t arch_id = gguf_find_key(g.get(), "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(g.get(), arch_id) != GGUF_TYPE_STRING)
        throw ModelLoadError("malformed model " + path + ": no general.architecture");
    const std::string arch = gguf_get_val_str(g.get(), arch_id);
    const double big = 1e12;
    check_range(g.get(), path, arch + ".block_count", 1, kMaxLayers, "1 to 512");
    check_range(g.get(), path, arch + ".embedding_length", 1, big, ">= 1");
    check_range(g.get(), path, arch + ".context_length", 1, big, ">= 1");
    check_range(g.get(), path, arch + ".attention.head_count", 1, big, ">= 1");
    // An epsilon is added to a norm before dividing by it: a small number, never negative.
    for (const char* eps : {".attention.layer_norm_rms_epsilon", ".attention.layer_norm_epsilon"})
        check_range(g.get(), path, arch + eps, 0.0, 1.0, "a finite number in [0, 1]");
}

}  // namespace specdec
