// Structured output: a grammar every generated token must keep valid (a JSON schema, a Lark
// grammar, a regular expression), checked by llguidance through its C API. The library is
// loaded at run time from the llguidance Python wheel: nothing of it is linked or vendored.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.h"

namespace specdec {

// A grammar that does not compile or that llguidance refuses (past its size and time limits),
// or llguidance missing: the request's fault, reported before it takes a slot.
struct ConstraintError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// Loads llguidance's C API from the shared library at `path`; later calls do nothing. Throws
// ConstraintError when the library or one of its functions is missing.
void load_constraint_library(const std::string& path);

// Whether a grammar sees the token as special: it is written by name (<tool_call>), never by
// its bytes.
bool grammar_special(const Model& model, llama_token token);

class Constraint;

// The target's vocabulary as llguidance sees it: each token's bytes (control tokens marked as
// special), and llama.cpp's tokenizer. Built once per engine, on the first constrained
// request (about a second for 50k tokens).
class ConstraintVocab {
  public:
    explicit ConstraintVocab(const Model& target);
    ~ConstraintVocab();
    ConstraintVocab(const ConstraintVocab&) = delete;
    ConstraintVocab& operator=(const ConstraintVocab&) = delete;

    // `kind`: "json_schema", "json_object" (any JSON object; `text` ignored), "lark" or "regex".
    // Throws ConstraintError with llguidance's message for a grammar it refuses.
    std::unique_ptr<Constraint> compile(const std::string& kind, const std::string& text) const;

  private:
    struct Tokenizer;
    std::unique_ptr<Tokenizer> tokenizer_;
    int n_vocab_;
};

// One request's place in its grammar. The scheduler thread only, off the GIL.
class Constraint {
  public:
    ~Constraint();
    Constraint(const Constraint&) = delete;
    Constraint& operator=(const Constraint&) = delete;

    // Sets the logits of the tokens the grammar forbids next to -inf.
    void mask(float* logits);
    // The same for another model's `n` logits over this vocabulary (a draft model's): tokens
    // past the grammar's vocabulary are forbidden too. False when it allows none of the `n`.
    bool mask(float* logits, int n);
    // Advances the grammar by `token`, which it must allow.
    void consume(llama_token token);
    // Takes back the last `n` tokens consumed (a draft's, once it is proposed).
    void rollback(size_t n);
    // How many of `tokens`, from the first, the grammar allows from here (none consumed).
    size_t valid_prefix(const std::vector<llama_token>& tokens);
    // Replaces `out` with the tokens the grammar forces from here (at most `max`; often none):
    // the canonical tokenization of the bytes it allows alone.
    void forced_tokens(std::vector<llama_token>& out, size_t max);
    // How many of `tokens`, from the first, are each the only token the grammar allows at its
    // place (none consumed in the end): their verdict is certain without the target's logits.
    size_t sole_prefix(const std::vector<llama_token>& tokens);

  private:
    friend class ConstraintVocab;
    Constraint(void* matcher, int n_vocab);
    // Throws ConstraintError for a matcher in its error state, with its message.
    void check(int32_t status);
    void compute_mask();
    bool mask_allows_only(llama_token token) const;
    void* matcher_;  // LlgMatcher*
    int n_vocab_;
    std::vector<uint32_t> mask_;  // one bit per token, as llguidance writes it
};

}  // namespace specdec
