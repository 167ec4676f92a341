// One llama_context on shared weights (a llama_model loaded once per file and GPU setting, for
// every context that uses it), the tokens its cache holds, and the vocabulary helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "llama.h"

namespace specdec {

struct ModelParams {
    std::string path;
    int n_gpu_layers = 0;
    int n_ctx = 4096;
    int n_batch = 512;
    int n_threads = 0;  // 0: every core this process may use (usable_cores())
    // Sequences the context holds at once (one per slot), each with room for n_ctx tokens.
    int n_seq = 1;
    // Weights loaded by someone else (llama-cpp-python's Llama), used as they are and never
    // freed here; the owner keeps them alive. Null: load `path`.
    llama_model* borrowed = nullptr;
};

struct ContextDeleter {
    void operator()(llama_context* c) const { llama_free(c); }
};

// The weights of `path` with `n_gpu_layers` offloaded, loaded on first use and shared by every
// caller until the last one lets go. Throws ModelLoadError with the reason.
std::shared_ptr<llama_model> load_weights(const std::string& path, int n_gpu_layers);

class Model {
  public:
    // Throws ModelLoadError with the reason (missing file, not GGUF, llama.cpp's own error).
    explicit Model(const ModelParams& params);

    llama_model* model() const { return model_.get(); }
    llama_context* ctx() const { return ctx_.get(); }
    const llama_vocab* vocab() const { return vocab_; }
    const std::string& path() const { return path_; }

    int n_vocab() const { return llama_vocab_n_tokens(vocab_); }
    // The context of one sequence, as asked for: llama.cpp rounds its cache up (to 256 cells),
    // but a request is bounded by what the user set.
    int n_ctx() const { return n_ctx_; }
    int n_seq() const { return static_cast<int>(held_.size()); }
    // The most tokens one llama_decode takes (llama.cpp caps the asked n_batch at n_ctx).
    int n_batch() const { return static_cast<int>(llama_n_batch(ctx_.get())); }
    void set_threads(int n) { llama_set_n_threads(ctx_.get(), n, n); }
    // Whether some of its layers run on a GPU (asked for, and the build has a GPU backend).
    bool offloaded() const { return offloaded_; }

    std::vector<llama_token> tokenize(const std::string& text, bool add_special,
                                      bool parse_special) const;
    std::string token_piece(llama_token token) const;  // raw bytes, special tokens rendered
    std::string detokenize(const std::vector<llama_token>& tokens) const;
    bool is_eog(llama_token token) const { return llama_vocab_is_eog(vocab_, token); }
    const std::vector<llama_token>& eog_tokens() const { return eog_; }  // every is_eog one
    std::string meta(const std::string& key) const;                      // "" when absent
    std::string description() const;
    // With the model's own template, or `template_name` (one of chat_template_names()).
    std::string apply_chat_template(
        const std::vector<std::pair<std::string, std::string>>& messages,
        bool add_generation_prompt, const std::string& template_name = "") const;

    // The tokens whose keys/values the cache holds for sequence `seq`, by position.
    const std::vector<llama_token>& held(llama_seq_id seq) const {
        return held_[static_cast<size_t>(seq)];
    }
    // Records a successful decode of `batch`, whose tokens follow what the cache held for each
    // row's sequence.
    void note_decoded(const llama_batch& batch);
    // Forgets every cached position >= pos of `seq`. Throws UnsupportedModelError when the
    // model's memory cannot drop a partial sequence (recurrent and hybrid models).
    void forget_from(llama_seq_id seq, llama_pos pos);
    // Forgets what the cache holds for `seq` past its common prefix with tokens[0..limit);
    // returns the prefix's length.
    size_t keep_common_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens,
                              size_t limit);
    // The same, for a decode that must attend exactly as over a fresh cache (the target's): of
    // a prefix whose attention window the cache no longer holds, nothing is kept.
    size_t keep_servable_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens,
                                size_t limit);
    // Length of the common prefix of `seq`'s cache and `tokens`.
    size_t common_prefix(llama_seq_id seq, const std::vector<llama_token>& tokens) const;
    // Of `n` cached tokens of `seq`, how many a decode can go on from: all of them, or none
    // where a sliding-window model's cache has given away part of the window before position n
    // (llama.cpp lets other sequences' tokens take the cells of positions outside a sequence's
    // window, and those may be inside the window of a shorter prefix reused later).
    size_t servable_prefix(llama_seq_id seq, size_t n) const;
    void clear_memory();  // every sequence

  private:
    // Forgets what the cache holds for `seq` from position n on; returns n.
    size_t keep_first(llama_seq_id seq, size_t n);

    std::shared_ptr<llama_model> model_;
    std::unique_ptr<llama_context, ContextDeleter> ctx_;
    const llama_vocab* vocab_ = nullptr;
    std::string path_;
    int n_ctx_;
    bool offloaded_;
    int32_t n_swa_ = 0;  // the attention window of its sliding-window layers (0: none)
    std::vector<llama_token> eog_;
    std::vector<std::vector<llama_token>> held_;  // [seq]
};

// The chat templates llama.cpp knows by name ("chatml", "gemma", "llama3", ...).
std::vector<std::string> chat_template_names();

// Why target and draft cannot be paired, or "" when they can.
std::string vocab_mismatch(const Model& target, const Model& draft);
// FNV-1a over the vocabulary's type and every token's text: two models share it when their
// tokens are the same (a file of token ids written for one is meaningful to the other).
uint64_t vocab_fingerprint(const Model& model);

}  // namespace specdec
