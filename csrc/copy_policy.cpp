#include "copy_policy.h"

#include <algorithm>

namespace specdec {
namespace {
// Bucket b holds the match lengths from kBucketStart[b] up to the next bucket's start: one per
// length while a token more changes much, then about half a doubling each.
constexpr std::array<int, CopyPolicy::kBuckets> kBucketStart = {1,  2,  3,  4,  6,  8,
                                                                12, 16, 24, 32, 48, 64};
// The rule of succession's prior counts as two tries (one accepted, one not, plus L accepted).
constexpr double kPriorWeight = 2.0;
}  // namespace

int CopyPolicy::bucket(int matched) {
    const auto it = std::upper_bound(kBucketStart.begin(), kBucketStart.end(), matched);
    return std::max(0, static_cast<int>(it - kBucketStart.begin()) - 1);
}

double CopyPolicy::acceptance(int matched) const {
    const auto b = static_cast<size_t>(bucket(matched));
    const double shortest = kBucketStart[b];
    const double prior = (shortest + 1.0) / (shortest + 2.0);
    return (accepts_[b] + kPriorWeight * prior) / (tries_[b] + kPriorWeight);
}

void CopyPolicy::expected_tokens(int match_length, int cap, std::vector<double>& out) const {
    out.assign(1, 1.0);  // the target's own token
    double all_accepted = 1.0;
    for (int j = 1; j <= cap; ++j) {
        all_accepted *= acceptance(match_length + j - 1);
        out.push_back(out.back() + all_accepted);
    }
}

std::array<double, 2 * CopyPolicy::kBuckets> CopyPolicy::evidence() const {
    std::array<double, 2 * kBuckets> out{};
    std::copy(tries_.begin(), tries_.end(), out.begin());
    std::copy(accepts_.begin(), accepts_.end(), out.begin() + kBuckets);
    return out;
}

void CopyPolicy::set_evidence(const std::array<double, 2 * kBuckets>& e) {
    std::copy(e.begin(), e.begin() + kBuckets, tries_.begin());
    std::copy(e.begin() + kBuckets, e.end(), accepts_.begin());
}

void CopyPolicy::observe(int match_length, int k, int n_accepted,
                         const std::vector<double>* chances) {
    // Position j was reached only if every position before it was accepted.
    const int reached = std::min(k, n_accepted + 1);
    for (int j = 0; j < reached; ++j) {
        const auto b = static_cast<size_t>(bucket(match_length + j));
        const bool have_chance = chances && static_cast<size_t>(j) < chances->size();
        tries_[b] += 1.0;
        accepts_[b] += have_chance ? (*chances)[static_cast<size_t>(j)] : (j < n_accepted ? 1 : 0);
    }
}

}  // namespace specdec
