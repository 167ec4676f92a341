#include "ngram_drafter.h"

#include <algorithm>
#include <stdexcept>

namespace specdec {
uint64_t hash_tokens(const llama_token* tokens, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; ++i) {
        h ^= static_cast<uint32_t>(tokens[i]);
        h *= 1099511628211ull;
    }
    return h;
}

int matched_length(const llama_token* a, long a_end, const llama_token* b, long b_end, int known) {
    int length = known;
    while (length < NgramDrafter::kMaxMatchLength && a_end - length - 1 >= 0 &&
           b_end - length - 1 >= 0 && a[a_end - length - 1] == b[b_end - length - 1])
        ++length;
    return length;
}

NgramDrafter::NgramDrafter(int ngram_min, int ngram_max)
    : ngram_min_(ngram_min), ngram_max_(ngram_max) {
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16");
    by_length_.resize(static_cast<size_t>(ngram_max - ngram_min + 1));
}

void NgramDrafter::index_up_to(const std::vector<llama_token>& tokens, size_t end) {
    // Position p continues the n-gram tokens[p-n, p); later positions overwrite earlier ones,
    // so a lookup finds the most recent occurrence.
    for (size_t p = std::max<size_t>(indexed_, 1); p < end; ++p) {
        for (int n = ngram_min_; n <= ngram_max_ && static_cast<size_t>(n) <= p; ++n) {
            by_length_[static_cast<size_t>(n - ngram_min_)][hash_tokens(&tokens[p - n], n)] =
                static_cast<uint32_t>(p);
        }
    }
    indexed_ = std::max(indexed_, end);
}

long NgramDrafter::find_continuation(const std::vector<llama_token>& tokens, int n) const {
    const size_t len = tokens.size();
    if (static_cast<size_t>(n) > len) return -1;
    const auto& map = by_length_[static_cast<size_t>(n - ngram_min_)];
    const auto it = map.find(hash_tokens(&tokens[len - n], n));
    if (it == map.end()) return -1;
    const size_t p = it->second;
    // A hash collision must not become a draft.
    if (!std::equal(tokens.end() - n, tokens.end(), tokens.begin() + static_cast<long>(p) - n))
        return -1;
    return static_cast<long>(p);
}

NgramMatch NgramDrafter::match(const std::vector<llama_token>& committed) {
    // Continuations must lie before the last token, or the suffix would match itself.
    index_up_to(committed, committed.size());
    for (int n = ngram_max_; n >= ngram_min_; --n) {
        const long p = find_continuation(committed, n);
        if (p < 0) continue;
        // The key's length is a floor: the occurrence may match further back.
        const long end = static_cast<long>(committed.size());
        return {p, matched_length(committed.data(), p, committed.data(), end, n)};
    }
    return {};
}

void NgramDrafter::propose(const std::vector<llama_token>& committed, int k, Draft& out) {
    propose(committed, match(committed), k, out);
}

void NgramDrafter::propose(const std::vector<llama_token>& committed, NgramMatch m, int k,
                           Draft& out) {
    out.start_copy(DraftSource::kNgram);
    if (!m.found()) return;
    // Past the end of the committed text, the continuation runs on into the draft itself:
    // a repeating pattern keeps repeating.
    const size_t len = committed.size();
    for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
        const size_t src = static_cast<size_t>(m.from) + j;
        out.tokens.push_back(src < len ? committed[src] : out.tokens[src - len]);
        out.q.push_back(nullptr);
    }
}

}  // namespace specdec
