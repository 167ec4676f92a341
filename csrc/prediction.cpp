#include "prediction.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace specdec {

Prediction::Prediction(std::vector<llama_token> tokens, int ngram_min, int ngram_max)
    : tokens_(std::move(tokens)), ngram_min_(ngram_min), ngram_max_(ngram_max) {
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 16)
        throw std::invalid_argument("need 1 <= ngram_min <= ngram_max <= 16");
    keys_.resize(static_cast<size_t>(ngram_max - ngram_min + 1));
    for (int n = ngram_min; n <= ngram_max; ++n) {
        auto& keys = keys_[static_cast<size_t>(n - ngram_min)];
        for (size_t p = static_cast<size_t>(n); p < tokens_.size(); ++p)
            keys.emplace_back(hash_tokens(&tokens_[p - static_cast<size_t>(n)], n),
                              static_cast<uint32_t>(p));
        std::sort(keys.begin(), keys.end());
    }
}

void Prediction::follow(const std::vector<llama_token>& seq, size_t output_start) {
    read_ = std::max(read_, output_start);
    for (; read_ < seq.size(); ++read_) {
        const bool kept = at_ >= 0 && static_cast<size_t>(at_) < tokens_.size() &&
                          tokens_[static_cast<size_t>(at_)] == seq[read_];
        at_ = kept ? at_ + 1 : -1;
        if (kept) last_ = at_;
    }
}

long Prediction::find(const std::vector<llama_token>& seq, int n, long after) const {
    const auto& keys = keys_[static_cast<size_t>(n - ngram_min_)];
    const uint64_t h = hash_tokens(&seq[seq.size() - static_cast<size_t>(n)], n);
    const auto first = std::lower_bound(keys.begin(), keys.end(), std::make_pair(h, uint32_t{0}));
    if (first == keys.end() || first->first != h) return -1;
    auto next =
        std::lower_bound(first, keys.end(), std::make_pair(h, static_cast<uint32_t>(after)));
    if (next == keys.end() || next->first != h) next = first;
    for (const uint32_t p : {next->second, first->second}) {
        // A hash collision must not become a draft.
        if (std::equal(seq.end() - n, seq.end(), tokens_.begin() + static_cast<long>(p) - n))
            return p;
    }
    return -1;
}

NgramMatch Prediction::match(const std::vector<llama_token>& seq, size_t output_start) {
    follow(seq, output_start);
    const long output = static_cast<long>(seq.size() - std::min(seq.size(), output_start));
    if (at_ >= 0) {
        // The whole output so far is the prediction's beginning, or it found its place again.
        if (static_cast<size_t>(at_) >= tokens_.size()) return {};
        const int length =
            matched_length(tokens_.data(), at_, seq.data(), static_cast<long>(seq.size()), 0);
        return {at_, static_cast<int>(std::min<long>(length, output))};
    }
    for (int n = std::min<long>(ngram_max_, output); n >= ngram_min_; --n) {
        const long p = find(seq, n, last_);
        if (p < 0 || static_cast<size_t>(p) >= tokens_.size()) continue;
        at_ = p;  // followed from here on
        const int length =
            matched_length(tokens_.data(), p, seq.data(), static_cast<long>(seq.size()), n);
        return {p, static_cast<int>(std::min<long>(length, output))};
    }
    return {};
}

void Prediction::copy(NgramMatch m, int k, Draft& out) const {
    out.start_copy(DraftSource::kPrediction);
    if (!m.found()) return;
    const size_t end =
        std::min(tokens_.size(), static_cast<size_t>(m.from) + static_cast<size_t>(k));
    out.tokens.assign(tokens_.begin() + m.from, tokens_.begin() + static_cast<long>(end));
    out.q.assign(out.tokens.size(), nullptr);
}

size_t Prediction::tokens_in(const std::vector<llama_token>& output) const {
    return common_subsequence(tokens_, output);
}

size_t common_subsequence(const std::vector<llama_token>& a, const std::vector<llama_token>& b) {
    if (a.empty() || b.empty()) return 0;
    // Where each token stands in a, sorted by token.
    std::vector<std::pair<llama_token, uint32_t>> at(a.size());
    for (size_t i = 0; i < a.size(); ++i) at[i] = {a[i], static_cast<uint32_t>(i)};
    std::sort(at.begin(), at.end());
    const size_t words = (a.size() + 63) / 64;
    const auto set_bits = [&](size_t from, size_t to, uint64_t* bits) {
        for (size_t i = from; i < to; ++i)
            bits[at[i].second / 64] |= uint64_t{1} << (at[i].second % 64);
    };
    // Each distinct token: its positions, at[begin, end). One in more places than a bit vector
    // has words gets its bits built once (`mask`: their offset in masks, else -1), so that a
    // repetitive prediction costs what a varied one does: O(|a| |b| / 64).
    struct Run {
        llama_token token;
        size_t begin, end;
        long mask;
    };
    std::vector<Run> runs;
    std::vector<uint64_t> masks;
    for (size_t begin = 0, end = 0; begin < at.size(); begin = end) {
        while (end < at.size() && at[end].first == at[begin].first) ++end;
        long mask = -1;
        if (end - begin > words) {
            mask = static_cast<long>(masks.size());
            masks.resize(masks.size() + words, 0);
            set_bits(begin, end, masks.data() + mask);
        }
        runs.push_back({at[begin].first, begin, end, mask});
    }
    // Bit i of v is 0 once a[i] is matched in a longest common subsequence so far.
    std::vector<uint64_t> v(words, ~uint64_t{0}), u(words);
    for (const llama_token c : b) {
        const auto run = std::lower_bound(runs.begin(), runs.end(), c,
                                          [](const Run& r, llama_token t) { return r.token < t; });
        if (run == runs.end() || run->token != c) continue;  // no bits: v stays as it is
        const uint64_t* bits = run->mask >= 0 ? masks.data() + run->mask : u.data();
        if (run->mask < 0) {
            std::fill(u.begin(), u.end(), 0);
            set_bits(run->begin, run->end, u.data());
        }
        // v = (v + (v & bits)) | (v - (v & bits)), carries across words; v & bits is a subset
        // of v, so the subtraction never borrows: it is v without those bits.
        uint64_t carry = 0;
        for (size_t w = 0; w < words; ++w) {
            const uint64_t x = v[w], y = x & bits[w];
            const uint64_t sum = x + y, total = sum + carry;
            carry = static_cast<uint64_t>(sum < x) | static_cast<uint64_t>(total < sum);
            v[w] = total | (x & ~y);
        }
    }
    size_t unmatched = 0;
    for (size_t i = 0; i < a.size(); ++i) unmatched += (v[i / 64] >> (i % 64)) & 1;
    return a.size() - unmatched;
}

}  // namespace specdec
