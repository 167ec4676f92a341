#include "model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "cpu_share.h"
#include "errors.h"
#include "logging.h"
#include "model_file.h"

namespace specdec {
namespace {

std::string with_reason(const std::string& what) {
    std::string reason = recent_errors();
    return reason.empty() ? what : what + ": " + reason;
}

// The same file reached by another name is the same weights.
std::string canonical(const std::string& path) {
    char* real = realpath(path.c_str(), nullptr);
    if (!real) return path;
    std::string out(real);
    free(real);
    return out;
}

}  // namespace

std::shared_ptr<llama_model> load_weights(const std::string& path, int n_gpu_layers) {
    static std::mutex mutex;
    static std::map<std::pair<std::string, int>, std::weak_ptr<llama_model>> loaded;
    check_model_file(path);
    const auto key = std::make_pair(canonical(path), n_gpu_layers);
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = loaded.begin(); it != loaded.end();)
        it = it->second.expired() ? loaded.erase(it) : std::next(it);
    if (auto shared = loaded[key].lock()) return shared;
    clear_recent_errors();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = n_gpu_layers;
    llama_model* raw = llama_model_load_from_file(path.c_str(), mparams);
    if (!raw) throw ModelLoadError(with_reason("failed to load model " + path));
    std::shared_ptr<llama_model> shared(raw, [](llama_model* m) { llama_model_free(m); });
    loaded[key] = shared;
    return shared;
}

std::shared_ptr<llama_model> weights(const ModelParams& params) {
    if (params.borrowed) return std::shared_ptr<llama_model>(params.borrowed, [](llama_model*) {});
    return load_weights(params.path, params.n_gpu_layers);
}

Model::Model(const ModelParams& params)
    : model_(weights(params)),
      path_(params.path),
      n_ctx_(params.n_ctx),
      offloaded_(params.n_gpu_layers != 0 && llama_supports_gpu_offload()),
      held_(static_cast<size_t>(std::max(params.n_seq, 1))) {
    clear_recent_errors();
    vocab_ = llama_model_get_vocab(model_.get());
    for (llama_token t = 0; t < n_vocab(); ++t)
        if (is_eog(t)) eog_.push_back(t);
    n_swa_ = llama_model_n_swa(model_.get());

    llama_context_params cparams = llama_context_default_params();
    const auto n_seq = static_cast<uint32_t>(held_.size());
    cparams.n_ctx = static_cast<uint32_t>(params.n_ctx) * n_seq;
    cparams.n_batch = static_cast<uint32_t>(params.n_batch);
    cparams.n_ubatch = static_cast<uint32_t>(params.n_batch);
    cparams.n_seq_max = n_seq;
    // One cache for all sequences: llama.cpp splits a batch over separate per-sequence caches
    // into equal-sized pieces per sequence, and a step's rows are uneven (each sequence drafts
    // its own K), so separate caches would cost a decode per piece.
    cparams.kv_unified = n_seq > 1;
    const int threads = params.n_threads > 0 ? params.n_threads : usable_cores();
    cparams.n_threads = threads;
    cparams.n_threads_batch = threads;
    cparams.no_perf = true;
    ctx_.reset(llama_init_from_model(model_.get(), cparams));
    if (!ctx_) throw ModelLoadError(with_reason("failed to create a context for " + params.path));
    n_ctx_ = std::min(n_ctx_, static_cast<int>(llama_n_ctx(ctx_.get()) / n_seq));
}

std::vector<llama_token> Model::tokenize(const std::string& text, bool add_special,
                                         bool parse_special) const {
    const int32_t len = static_cast<int32_t>(text.size());
    std::vector<llama_token> tokens(text.size() + 8);
    int32_t n = 0;
    try {
        n = llama_tokenize(vocab_, text.data(), len, tokens.data(),
                           static_cast<int32_t>(tokens.size()), add_special, parse_special);
        if (n < 0) {
            tokens.resize(static_cast<size_t>(-n));
            n = llama_tokenize(vocab_, text.data(), len, tokens.data(),
                               static_cast<int32_t>(tokens.size()), add_special, parse_special);
        }
    } catch (const std::exception& e) {
        // A damaged vocabulary can make llama.cpp's tokenizer throw from inside.
        throw std::runtime_error("the tokenizer of " + path_ + " failed: " + e.what());
    }
    if (n < 0) throw std::runtime_error("tokenization failed");
    tokens.resize(static_cast<size_t>(n));
    return tokens;
}

std::string Model::token_piece(llama_token token) const {
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, true);
    if (n >= 0) return std::string(buf, static_cast<size_t>(n));
    std::string big(static_cast<size_t>(-n), '\0');
    n = llama_token_to_piece(vocab_, token, big.data(), static_cast<int32_t>(big.size()), 0, true);
    big.resize(static_cast<size_t>(std::max(n, 0)));
    return big;
}

std::string Model::detokenize(const std::vector<llama_token>& tokens) const {
    for (llama_token t : tokens) {
        if (t < 0 || t >= n_vocab())
            throw std::invalid_argument("token id " + std::to_string(t) +
                                        " is outside the vocabulary");
    }
    std::string out;
    for (llama_token t : tokens) out += token_piece(t);
    return out;
}

std::string Model::meta(const std::string& key) const {
    char buf[512];
    int32_t n = llama_model_meta_val_str(model_.get(), key.c_str(), buf, sizeof(buf));
    if (n < 0) return "";
    if (static_cast<size_t>(n) < sizeof(buf)) return std::string(buf, static_cast<size_t>(n));
    std::string big(static_cast<size_t>(n) + 1, '\0');
    llama_model_meta_val_str(model_.get(), key.c_str(), big.data(), big.size());
    big.resize(static_cast<size_t>(n));
    return big;
}

std::string Model::description() const {
    char buf[256];
    int32_t n = llama_model_desc(model_.get(), buf, sizeof(buf));
    return n > 0 ? std::string(buf, std::min(static_cast<size_t>(n), sizeof(buf) - 1)) : "";
}

std::vector<std::string> chat_template_names() {
    const int32_t n = llama_chat_builtin_templates(nullptr, 0);
    std::vector<const char*> names(static_cast<size_t>(std::max(n, 0)));
    llama_chat_builtin_templates(names.data(), names.size());
    return {names.begin(), names.end()};
}

std::string Model::apply_chat_template(
    const std::vector<std::pair<std::string, std::string>>& messages, bool add_generation_prompt,
    const std::string& template_name) const {
    if (!template_name.empty()) {
        const auto names = chat_template_names();
        if (std::find(names.begin(), names.end(), template_name) == names.end())
            throw std::invalid_argument("unknown chat template '" + template_name + "'");
    }
    const char* tmpl = template_name.empty() ? llama_model_chat_template(model_.get(), nullptr)
                                             : template_name.c_str();
    if (tmpl == nullptr)
        throw std::invalid_argument(
            "the model has no chat template in its metadata: name one (chat_template=, or "
            "--chat-template NAME|FILE)");
    std::vector<llama_chat_message> chat;
    size_t total = 0;
    for (const auto& [role, content] : messages) {
        chat.push_back({role.c_str(), content.c_str()});
        total += role.size() + content.size();
    }
    std::string buf(2 * total + 1024, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_generation_prompt,
                                          buf.data(), static_cast<int32_t>(buf.size()));
    if (n > static_cast<int32_t>(buf.size())) {
        buf.resize(static_cast<size_t>(n));
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_generation_prompt,
                                      buf.data(), static_cast<int32_t>(buf.size()));
    }
    if (n < 0)
        throw std::invalid_argument("the model's chat template is not supported by llama.cpp");
    buf.resize(static_cast<size_t>(n));
    return buf;
}

void Model::note_decoded(const llama_batch& batch) {
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        auto& held = held_.at(static_cast<size_t>(batch.seq_id[i][0]));
        const auto pos = static_cast<size_t>(batch.pos[i]);
        if (pos > held.size()) throw std::logic_error("a decode left a gap in the cache");
        held.resize(pos);
        held.push_back(batch.token[i]);
    }
}

size_t Model::common_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens) const {
    const auto& held = held_[static_cast<size_t>(seq)];
    const size_t limit = std::min(held.size(), tokens.size());
    size_t common = 0;
    while (common < limit && held[common] == tokens[common]) ++common;
    return common;
}

size_t Model::keep_common_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens,
                                 size_t limit) {
    return keep_first(seq, std::min(common_prefix(seq, tokens), limit));
}

size_t Model::keep_servable_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens,
                                   size_t limit) {
    return keep_first(seq, servable_prefix(seq, std::min(common_prefix(seq, tokens), limit)));
}

size_t Model::keep_first(llama_seq_id seq, size_t n) {
    if (n < held(seq).size()) forget_from(seq, static_cast<llama_pos>(n));
    return n;
}

size_t Model::servable_prefix(llama_seq_id seq, size_t n) const {
    if (n == 0 || n_swa_ <= 0) return n;
    const llama_pos first = llama_memory_seq_pos_min(llama_get_memory(ctx_.get()), seq);
    const llama_pos window_start = std::max<llama_pos>(0, static_cast<llama_pos>(n) - n_swa_);
    return first >= 0 && first <= window_start ? n : 0;
}

void Model::forget_from(llama_seq_id seq, llama_pos pos) {
    auto& held = held_[static_cast<size_t>(seq)];
    if (static_cast<size_t>(pos) < held.size()) held.resize(static_cast<size_t>(pos));
    if (!llama_memory_seq_rm(llama_get_memory(ctx_.get()), seq, pos, -1)) {
        throw UnsupportedModelError(
            "cannot roll back the cache of " + path_ +
            ": its memory cannot remove part of a sequence (recurrent or hybrid architecture); "
            "speculative decoding needs a transformer with a KV cache");
    }
}

void Model::clear_memory() {
    for (auto& held : held_) held.clear();
    llama_memory_clear(llama_get_memory(ctx_.get()), true);
}

std::string vocab_mismatch(const Model& target, const Model& draft) {
    const llama_vocab* tv = target.vocab();
    const llama_vocab* dv = draft.vocab();
    if (llama_vocab_type(tv) != llama_vocab_type(dv))
        return "vocabulary types differ (target " + std::to_string(llama_vocab_type(tv)) +
               ", draft " + std::to_string(llama_vocab_type(dv)) + ")";
    const int nt = target.n_vocab();
    const int nd = draft.n_vocab();
    if (nt != nd)
        return "vocabulary sizes differ (target " + std::to_string(nt) + ", draft " +
               std::to_string(nd) + ")";
    if (llama_vocab_bos(tv) != llama_vocab_bos(dv) || llama_vocab_eos(tv) != llama_vocab_eos(dv) ||
        llama_vocab_get_add_bos(tv) != llama_vocab_get_add_bos(dv) ||
        llama_vocab_get_add_eos(tv) != llama_vocab_get_add_eos(dv))
        return "BOS/EOS tokens or their use differ";
    for (llama_token t = 0; t < nt; ++t) {
        if (std::strcmp(llama_vocab_get_text(tv, t), llama_vocab_get_text(dv, t)) != 0)
            return "token " + std::to_string(t) + " differs: target '" +
                   llama_vocab_get_text(tv, t) + "', draft '" + llama_vocab_get_text(dv, t) + "'";
    }
    return "";
}

uint64_t vocab_fingerprint(const Model& model) {
    uint64_t h = 1469598103934665603ULL;
    const auto mix = [&h](const char* bytes, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            h ^= static_cast<unsigned char>(bytes[i]);
            h *= 1099511628211ULL;
        }
    };
    const int type = llama_vocab_type(model.vocab());
    mix(reinterpret_cast<const char*>(&type), sizeof type);
    for (llama_token t = 0; t < model.n_vocab(); ++t) {
        const char* text = llama_vocab_get_text(model.vocab(), t);
        mix(text, std::strlen(text) + 1);  // its NUL too: "ab","c" is not "a","bc"
    }
    return h;
}

}  // namespace specdec
