#include "constraint.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>

namespace specdec {

namespace {

// llguidance's C API (its llguidance.h), as far as this file uses it. The structs are laid out
// as the library reads them; LlgConstraintInit has no size field, so it is passed inside a
// zeroed buffer larger than any version of it.
struct ParserLimits {
    size_t max_items_in_row;
    uint64_t initial_lexer_fuel;
    uint64_t step_lexer_fuel;
    size_t step_max_items;
    size_t max_lexer_states;
    size_t max_grammar_size;
    bool precompute_large_lexemes;
    bool verbose_errors;
};

struct ConstraintInit {
    const void* tokenizer;
    uint32_t log_buffer_level;
    uint32_t log_stderr_level;
    bool ff_tokens_ok;
    bool backtrack_ok;
    ParserLimits limits;
};

union PaddedConstraintInit {
    ConstraintInit init;
    unsigned char bytes[512];
};

using TokenizeFn = size_t (*)(const void* user_data, const uint8_t* bytes, size_t bytes_len,
                              uint32_t* output_tokens, size_t output_tokens_len);

struct TokenizerInitV2 {
    size_t struct_size;
    uint32_t vocab_size;
    uint32_t tok_eos;
    const uint32_t* token_lens;
    const uint8_t* token_bytes;
    const char* tokenizer_json;
    bool tokenize_assumes_string;
    TokenizeFn tokenize_fn;
    bool use_approximate_greedy_tokenize_fn;
    const void* tokenize_user_data;
    const char* const* slices;
    const uint32_t* tok_eos_extra;
    uint32_t tok_eos_extra_count;
};

struct Api {
    void* (*new_tokenizer_v2)(const TokenizerInitV2*, char*, size_t);
    void (*free_tokenizer)(void*);
    void (*constraint_init_set_defaults)(ConstraintInit*, const void*);
    void* (*new_matcher)(const ConstraintInit*, const char*, const char*);
    void (*free_matcher)(void*);
    const char* (*matcher_get_error)(void*);
    bool (*matcher_is_error)(const void*);
    int32_t (*matcher_compute_mask_into)(void*, uint32_t*, size_t);
    size_t (*matcher_get_mask_byte_size)(const void*);
    int32_t (*matcher_consume_token)(void*, uint32_t);
    int32_t (*matcher_validate_tokens)(void*, const uint32_t*, size_t);
    int32_t (*matcher_compute_ff_tokens)(void*, uint32_t*, size_t);
    int32_t (*matcher_rollback)(void*, size_t);
};

std::mutex api_mutex;
Api api{};
bool api_loaded = false;

template <typename F>
void bind(void* lib, const char* name, F& fn) {
    void* symbol = dlsym(lib, name);
    if (!symbol)
        throw ConstraintError(std::string("the llguidance library has no ") + name +
                              ": upgrade it (pip install -U llguidance)");
    fn = reinterpret_cast<F>(symbol);
}

const Api& loaded_api() {
    std::lock_guard<std::mutex> lock(api_mutex);
    if (!api_loaded)
        throw ConstraintError(
            "structured output needs llguidance: pip install llguidance (then restart)");
    return api;
}

// Grammars past these bounds are refused rather than compiled: a request must not hold the
// engine for seconds or gigabytes. llguidance's defaults, with the grammar smaller.
constexpr size_t kMaxGrammarSize = 200000;  // symbols in productions (a megabyte of JSON)

// llguidance's tokenize callback: llama.cpp's tokenizer on raw bytes, nothing added.
size_t tokenize(const void* user_data, const uint8_t* bytes, size_t bytes_len, uint32_t* out,
                size_t out_len) {
    const auto* vocab = static_cast<const llama_vocab*>(user_data);
    const auto n_out = static_cast<int32_t>(std::min<size_t>(out_len, INT32_MAX));
    const int32_t n =
        llama_tokenize(vocab, reinterpret_cast<const char*>(bytes), static_cast<int32_t>(bytes_len),
                       reinterpret_cast<llama_token*>(out), n_out, false, false);
    return n < 0 ? static_cast<size_t>(-static_cast<int64_t>(n)) : static_cast<size_t>(n);
}

// A token's bytes as llguidance expects them: special ones behind a 0xFF byte, which marks them.
std::string llguidance_bytes(const Model& model, llama_token token) {
    std::string piece = model.token_piece(token);
    if (grammar_special(model, token)) piece.insert(piece.begin(), '\xff');
    return piece;
}

// Whether llama.cpp's tokenizer gives back exactly the bytes it was given. A SentencePiece
// vocabulary that adds a space prefix does not ("a" -> " a"), and llguidance, which tokenizes
// the bytes a grammar forces, would then see tokens that do not spell them.
bool tokenizes_exactly(const Model& model) {
    for (const std::string probe : {"a", "ab", "1", "{\"", "x y"}) {
        std::string spelt;
        for (llama_token t : model.tokenize(probe, false, false)) spelt += model.token_piece(t);
        if (spelt != probe) return false;
    }
    return true;
}

}  // namespace

// Control tokens, and user-defined ones that look like them (<...>).
bool grammar_special(const Model& model, llama_token token) {
    if (token < 0 || token >= model.n_vocab()) return false;
    const std::string piece = model.token_piece(token);
    const auto attr = llama_vocab_get_attr(model.vocab(), token);
    const bool looks_special = piece.size() >= 2 && piece.front() == '<' && piece.back() == '>';
    return (attr & LLAMA_TOKEN_ATTR_CONTROL) ||
           ((attr & LLAMA_TOKEN_ATTR_USER_DEFINED) && looks_special);
}

void load_constraint_library(const std::string& path) {
    std::lock_guard<std::mutex> lock(api_mutex);
    if (api_loaded) return;
    // The Python module has loaded this file already: this finds it, and keeps it loaded.
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) throw ConstraintError(std::string("cannot load llguidance: ") + dlerror());
    Api a{};
    bind(lib, "llg_new_tokenizer_v2", a.new_tokenizer_v2);
    bind(lib, "llg_free_tokenizer", a.free_tokenizer);
    bind(lib, "llg_constraint_init_set_defaults", a.constraint_init_set_defaults);
    bind(lib, "llg_new_matcher", a.new_matcher);
    bind(lib, "llg_free_matcher", a.free_matcher);
    bind(lib, "llg_matcher_get_error", a.matcher_get_error);
    bind(lib, "llg_matcher_is_error", a.matcher_is_error);
    bind(lib, "llg_matcher_compute_mask_into", a.matcher_compute_mask_into);
    bind(lib, "llg_matcher_get_mask_byte_size", a.matcher_get_mask_byte_size);
    bind(lib, "llg_matcher_consume_token", a.matcher_consume_token);
    bind(lib, "llg_matcher_validate_tokens", a.matcher_validate_tokens);
    bind(lib, "llg_matcher_compute_ff_tokens", a.matcher_compute_ff_tokens);
    bind(lib, "llg_matcher_rollback", a.matcher_rollback);
    api = a;
    api_loaded = true;
}

struct ConstraintVocab::Tokenizer {
    void* handle = nullptr;  // LlgTokenizer*
    ~Tokenizer() {
        if (handle) api.free_tokenizer(handle);
    }
};

ConstraintVocab::ConstraintVocab(const Model& target)
    : tokenizer_(std::make_unique<Tokenizer>()), n_vocab_(target.n_vocab()) {
    const Api& a = loaded_api();
    std::vector<uint32_t> lens;
    std::string bytes;
    lens.reserve(static_cast<size_t>(n_vocab_));
    for (llama_token t = 0; t < n_vocab_; ++t) {
        const std::string piece = llguidance_bytes(target, t);
        lens.push_back(static_cast<uint32_t>(piece.size()));
        bytes += piece;
    }
    TokenizerInitV2 init{};
    init.struct_size = sizeof(init);
    init.vocab_size = static_cast<uint32_t>(n_vocab_);
    // The end of a turn where the model has one (chat), else end of text.
    llama_token eos = llama_vocab_eot(target.vocab());
    if (eos == LLAMA_TOKEN_NULL) eos = llama_vocab_eos(target.vocab());
    init.tok_eos = static_cast<uint32_t>(eos);
    init.token_lens = lens.data();
    init.token_bytes = reinterpret_cast<const uint8_t*>(bytes.data());
    // Where llama.cpp's tokenizer adds bytes, llguidance's own greedy tokenizer (over the same
    // tokens) stands in: forced tokens may then be spelt less canonically, never wrongly.
    if (tokenizes_exactly(target)) {
        init.tokenize_fn = tokenize;
        init.tokenize_user_data = target.vocab();
        // It reads text: bytes that end inside a character are not spelt back. llguidance then
        // tokenizes the UTF-8 prefix with it and the rest itself.
        init.tokenize_assumes_string = true;
    } else {
        init.use_approximate_greedy_tokenize_fn = true;
    }
    // Every other end-of-generation token ends a match too.
    std::vector<uint32_t> extra;
    for (llama_token t = 0; t < n_vocab_; ++t)
        if (t != eos && target.is_eog(t)) extra.push_back(static_cast<uint32_t>(t));
    init.tok_eos_extra = extra.empty() ? nullptr : extra.data();
    init.tok_eos_extra_count = static_cast<uint32_t>(extra.size());
    char error[1024] = {0};
    tokenizer_->handle = a.new_tokenizer_v2(&init, error, sizeof(error));
    if (!tokenizer_->handle)
        throw ConstraintError(std::string("llguidance cannot use this vocabulary: ") + error);
}

ConstraintVocab::~ConstraintVocab() = default;

std::unique_ptr<Constraint> ConstraintVocab::compile(const std::string& kind,
                                                     const std::string& text) const {
    const Api& a = loaded_api();
    if (kind != "json_schema" && kind != "json_object" && kind != "lark" && kind != "regex")
        throw ConstraintError("unknown constraint kind '" + kind +
                              "' (json_schema, json_object, lark, regex)");
    if (text.find('\0') != std::string::npos)
        throw ConstraintError("the " + kind + " grammar holds a NUL character");
    PaddedConstraintInit init;
    std::memset(&init, 0, sizeof(init));
    a.constraint_init_set_defaults(&init.init, tokenizer_->handle);
    init.init.log_stderr_level = 0;  // errors come back as messages, not as stderr lines
    init.init.limits.max_grammar_size = kMaxGrammarSize;
    void* matcher = a.new_matcher(&init.init, kind.c_str(), text.c_str());
    auto constraint = std::unique_ptr<Constraint>(new Constraint(matcher, n_vocab_));
    if (a.matcher_is_error(matcher)) {
        const char* why = a.matcher_get_error(matcher);
        throw ConstraintError("invalid " + kind + ": " + (why ? why : "llguidance refused it"));
    }
    if (a.matcher_get_mask_byte_size(matcher) != constraint->mask_.size() * sizeof(uint32_t))
        throw ConstraintError("llguidance's token mask does not fit this vocabulary");
    // A grammar with no first token (a schema that only refers to itself, say) is refused now,
    // before the request is answered, rather than at its first step.
    constraint->check(a.matcher_compute_mask_into(matcher, constraint->mask_.data(),
                                                  constraint->mask_.size() * sizeof(uint32_t)));
    return constraint;
}

Constraint::Constraint(void* matcher, int n_vocab)
    : matcher_(matcher), n_vocab_(n_vocab), mask_((static_cast<size_t>(n_vocab) + 31) / 32) {}

Constraint::~Constraint() { api.free_matcher(matcher_); }

// The engine only feeds the matcher tokens its mask allowed, so an error is the grammar's: one
// with no complete match (a rule that only recurses, a schema that refers only to itself), or
// one past llguidance's limits. ConstraintError, with llguidance's first line (the lines after
// it dump its parser's state).
void Constraint::check(int32_t status) {
    if (status >= 0 && !api.matcher_is_error(matcher_)) return;
    const char* why = api.matcher_get_error(matcher_);
    std::string first = why ? why : "no reason given";
    first = first.substr(0, std::min(first.find('\n'), size_t{300}));
    throw ConstraintError("the grammar has no complete match within llguidance's limits (" + first +
                          ")");
}

void Constraint::mask(float* logits) { mask(logits, n_vocab_); }

void Constraint::compute_mask() {
    check(api.matcher_compute_mask_into(matcher_, mask_.data(), mask_.size() * sizeof(uint32_t)));
}

bool Constraint::mask_allows_only(llama_token token) const {
    const auto word = static_cast<size_t>(token) / 32;
    for (size_t w = 0; w < mask_.size(); ++w)
        if (mask_[w] != (w == word ? 1u << (static_cast<uint32_t>(token) % 32) : 0u)) return false;
    return true;
}

bool Constraint::mask(float* logits, int n) {
    compute_mask();
    constexpr float kForbidden = -std::numeric_limits<float>::infinity();
    const int n_known = std::min(n, n_vocab_);
    bool any = false;
    for (size_t w = 0; w < mask_.size(); ++w) {
        const int first = static_cast<int>(w * 32);
        if (first >= n_known) break;
        const int width = std::min(32, n_known - first);
        const uint32_t allowed = width == 32 ? mask_[w] : mask_[w] & ((1u << width) - 1u);
        any = any || allowed != 0u;
        if (allowed == ~0u) continue;
        for (int t = first; t < first + width; ++t)
            if (!(allowed >> (t - first) & 1u)) logits[t] = kForbidden;
    }
    std::fill(logits + n_known, logits + std::max(n, n_known), kForbidden);
    return any;
}

void Constraint::consume(llama_token token) {
    check(api.matcher_consume_token(matcher_, static_cast<uint32_t>(token)));
}

void Constraint::rollback(size_t n) {
    if (n > 0) check(api.matcher_rollback(matcher_, n));
}

size_t Constraint::valid_prefix(const std::vector<llama_token>& tokens) {
    if (tokens.empty()) return 0;
    const int32_t n = api.matcher_validate_tokens(
        matcher_, reinterpret_cast<const uint32_t*>(tokens.data()), tokens.size());
    check(n);
    return static_cast<size_t>(n);
}

void Constraint::forced_tokens(std::vector<llama_token>& out, size_t max) {
    out.resize(max);
    const int32_t n = max == 0 ? 0
                               : api.matcher_compute_ff_tokens(
                                     matcher_, reinterpret_cast<uint32_t*>(out.data()), max);
    check(n);
    out.resize(static_cast<size_t>(n));
}

size_t Constraint::sole_prefix(const std::vector<llama_token>& tokens) {
    size_t n = 0;
    for (; n < tokens.size(); ++n) {
        compute_mask();
        if (!mask_allows_only(tokens[n])) break;
        consume(tokens[n]);
    }
    rollback(n);
    return n;
}

}  // namespace specdec
