#include "model_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <unordered_set>

#include "errors.h"
#include "gguf.h"
#include "llama.h"

namespace specdec {
namespace {

// llama.cpp keeps per-layer hyper-parameters in arrays of this size and asserts on more.
constexpr double kMaxLayers = 512;
constexpr double kMaxExperts = 1024;

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

// The largest value of a numeric key stored as a scalar or as a per-layer array.
std::optional<double> largest(const gguf_context* g, const std::string& key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return number(g, key);
    const size_t n = gguf_get_arr_n(g, id);
    const void* data = gguf_get_arr_data(g, id);
    std::optional<double> top;
    for (size_t i = 0; i < n; ++i) {
        double v;
        switch (gguf_get_arr_type(g, id)) {
            case GGUF_TYPE_UINT32:
                v = static_cast<const uint32_t*>(data)[i];
                break;
            case GGUF_TYPE_INT32:
                v = static_cast<const int32_t*>(data)[i];
                break;
            default:
                return std::nullopt;
        }
        top = top ? std::max(*top, v) : v;
    }
    return top;
}

std::string string_value(const gguf_context* g, const std::string& key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) return "";
    return gguf_get_val_str(g, id);
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

[[noreturn]] void malformed(const std::string& path, const std::string& what) {
    throw ModelLoadError("malformed model " + path + ": " + what);
}

// Mixture-of-experts counts: llama.cpp asserts on a routing it cannot do.
void check_experts(const gguf_context* g, const std::string& path, const std::string& arch) {
    const double n_expert = number(g, arch + ".expert_count").value_or(0);
    const double n_used = largest(g, arch + ".expert_used_count").value_or(0);
    if (!(n_expert >= 0 && n_expert <= kMaxExperts))
        malformed(path, arch + ".expert_count is " + format(n_expert) + " (must be 0 to 1024)");
    if (n_used > n_expert)
        malformed(path, arch + ".expert_used_count is " + format(n_used) + " but " + arch +
                            ".expert_count is " + format(n_expert));
    if (n_expert > 0 && n_used < 1)
        malformed(path, arch + ".expert_used_count must be >= 1 with experts");
    const double groups = number(g, arch + ".expert_group_count").value_or(0);
    if (n_expert > 0 && groups >= n_expert)
        malformed(path, arch + ".expert_group_count must be below " + arch + ".expert_count");
}

void check_rope_scaling(const gguf_context* g, const std::string& path, const std::string& arch) {
    const std::string key = arch + ".rope.scaling.type";
    if (gguf_find_key(g, key.c_str()) < 0) return;
    const std::string type = string_value(g, key);
    for (const char* known : {"none", "linear", "yarn", "longrope"})
        if (type == known) return;
    malformed(path, key + " is '" + type + "' (must be none, linear, yarn or longrope)");
}

// Speculative decoding compares vocabularies token by token, so a model needs one, and
// llama.cpp asserts on one whose token strings repeat, or whose WordPiece vocabulary has
// byte tokens.
void check_vocabulary(const gguf_context* g, const std::string& path) {
    const std::string model = string_value(g, "tokenizer.ggml.model");
    if (model.empty() || model == "none" || model == "no_vocab")
        malformed(path, "no tokenizer (tokenizer.ggml.model is '" + model + "')");
    const int64_t tokens = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (tokens < 0 || gguf_get_kv_type(g, tokens) != GGUF_TYPE_ARRAY ||
        gguf_get_arr_type(g, tokens) != GGUF_TYPE_STRING)
        malformed(path, "no token list (tokenizer.ggml.tokens)");
    const size_t n = gguf_get_arr_n(g, tokens);
    std::unordered_set<std::string> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i)
        if (!seen.insert(gguf_get_arr_str(g, tokens, i)).second)
            malformed(path, "token " + std::to_string(i) + " repeats an earlier token's text '" +
                                gguf_get_arr_str(g, tokens, i) + "'");
    const int64_t types = gguf_find_key(g, "tokenizer.ggml.token_type");
    if (model == "bert" && types >= 0 && gguf_get_kv_type(g, types) == GGUF_TYPE_ARRAY &&
        gguf_get_arr_type(g, types) == GGUF_TYPE_INT32) {
        const auto* t = static_cast<const int32_t*>(gguf_get_arr_data(g, types));
        for (size_t i = 0; i < gguf_get_arr_n(g, types); ++i)
            if (t[i] == LLAMA_TOKEN_TYPE_BYTE)
                malformed(path, "a WordPiece ('bert') vocabulary with byte tokens");
    }
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
    check_experts(g.get(), path, arch);
    check_rope_scaling(g.get(), path, arch);
    check_vocabulary(g.get(), path);
}

}  // namespace specdec
