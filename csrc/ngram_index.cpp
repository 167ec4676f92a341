#include "ngram_index.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace specdec {
namespace {
// A map entry's bytes in libstdc++: a node (next, key, value) with the allocator's overhead,
// and a bucket pointer.
constexpr size_t kEntryBytes = 32;
constexpr size_t kBucketBytes = 8;
}  // namespace

SharedNgramIndex::SharedNgramIndex(int ngram_min, int ngram_max, size_t budget_bytes)
    : ngram_min_(ngram_min), ngram_max_(ngram_max), budget_(budget_bytes) {
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16");
    by_length_.resize(static_cast<size_t>(ngram_max - ngram_min + 1));
}

size_t SharedNgramIndex::bytes() const {
    size_t total = tokens_.capacity() * sizeof(llama_token);
    for (const auto& map : by_length_)
        total += map.size() * kEntryBytes + map.bucket_count() * kBucketBytes;
    return total;
}

void SharedNgramIndex::add(const std::vector<llama_token>& prompt,
                           const std::vector<llama_token>& output) {
    if (output.empty() || budget_ == 0) return;
    const size_t context = std::min(prompt.size(), static_cast<size_t>(ngram_max_));
    const size_t begin = tokens_.size();
    tokens_.insert(tokens_.end(), prompt.end() - static_cast<long>(context), prompt.end());
    tokens_.insert(tokens_.end(), output.begin(), output.end());
    tokens_.push_back(kBoundary);
    index_from(begin);
    while (!tokens_.empty() &&
           (bytes() > budget_ || tokens_.size() >= std::numeric_limits<uint32_t>::max()))
        forget_older_half();
}

// Position p continues the n-gram tokens_[p-n, p) of its own output; later positions overwrite
// earlier ones, so a lookup finds the most recent occurrence. `begin` starts an output.
void SharedNgramIndex::index_from(size_t begin) {
    size_t output_start = begin;
    for (size_t p = begin; p < tokens_.size(); ++p) {
        if (tokens_[p] == kBoundary) {
            output_start = p + 1;
            continue;
        }
        for (int n = ngram_min_; n <= ngram_max_ && output_start + static_cast<size_t>(n) <= p;
             ++n) {
            by_length_[static_cast<size_t>(n - ngram_min_)][hash_tokens(&tokens_[p - n], n)] =
                static_cast<uint32_t>(p);
        }
    }
}

// The older half goes (whole outputs where it can), and the maps are built again from the rest.
void SharedNgramIndex::forget_older_half() {
    const auto half = tokens_.begin() + static_cast<long>(tokens_.size() / 2);
    const auto boundary = std::find(half, tokens_.end(), kBoundary);
    // Whole outputs, unless the last one holds more than half of it all: then its older part.
    const bool whole = boundary != tokens_.end() && boundary + 1 != tokens_.end();
    tokens_.erase(tokens_.begin(), whole ? boundary + 1 : half);
    tokens_.shrink_to_fit();
    for (auto& map : by_length_) std::unordered_map<uint64_t, uint32_t>().swap(map);
    index_from(0);
}

NgramMatch SharedNgramIndex::match(const std::vector<llama_token>& text) const {
    const long end = static_cast<long>(text.size());
    for (int n = ngram_max_; n >= ngram_min_; --n) {
        if (n > end) continue;
        const auto& map = by_length_[static_cast<size_t>(n - ngram_min_)];
        const auto it = map.find(hash_tokens(&text[static_cast<size_t>(end - n)], n));
        if (it == map.end()) continue;
        const long p = it->second;
        // A hash collision must not become a draft.
        if (!std::equal(text.end() - n, text.end(), tokens_.begin() + p - n)) continue;
        return {p, matched_length(tokens_.data(), p, text.data(), end, n)};
    }
    return {};
}

void SharedNgramIndex::propose(NgramMatch m, int k, Draft& out) const {
    out.tokens.clear();
    out.q.clear();
    out.source = DraftSource::kIndex;
    out.caught_up = 0;
    out.t_catch_up = 0.0;
    if (!m.found()) return;
    for (size_t p = static_cast<size_t>(m.from);
         p < tokens_.size() && tokens_[p] != kBoundary && static_cast<int>(out.tokens.size()) < k;
         ++p) {
        out.tokens.push_back(tokens_[p]);
        out.q.push_back(nullptr);
    }
}

}  // namespace specdec
