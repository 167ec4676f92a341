// How far to trust a copy: the K of an n-gram draft, chosen from the length of the match it
// continues.
#pragma once

#include <array>
#include <vector>

namespace specdec {

// A copied span is accepted token after token while the text keeps repeating its source, and the
// longer the match so far, the likelier the next token repeats too. So the evidence is kept by
// match length: a draft that continues an L-token match drafts its j-th token with L + j - 1
// tokens matched (if the ones before it are accepted), and each drafted token teaches the
// estimate of its length's bucket whether it was accepted. Before any evidence a bucket's
// estimate is Laplace's rule of succession, (L + 1) / (L + 2) at its shortest length L:
// optimistic, and corrected by the request's own first copies.
//
// K then maximises expected committed tokens per second, E[tokens](K) / t_verify(K + 1); a
// lookup costs nothing next to a decode. One policy per request: what one text copies says
// little about the next.
class CopyPolicy {
  public:
    static constexpr int kBuckets = 12;

    // Expected committed tokens of a step drafting k = 0..cap tokens that continue a match of
    // `match_length` tokens, into `out`.
    void expected_tokens(int match_length, int cap, std::vector<double>& out) const;
    // Learns from a step that drafted k tokens after a match of `match_length` and had
    // n_accepted of them accepted. `chances` (sampling): each reached position's chance of
    // acceptance, learnt instead of the accept/reject draw; null when greedy.
    void observe(int match_length, int k, int n_accepted, const std::vector<double>* chances);
    // The estimate for the next token after `matched` matched tokens.
    double acceptance(int matched) const;
    // The evidence by bucket (tries, then accepts), to keep it across runs.
    std::array<double, 2 * kBuckets> evidence() const;
    void set_evidence(const std::array<double, 2 * kBuckets>& e);

  private:
    static int bucket(int matched);
    std::array<double, kBuckets> tries_{};
    std::array<double, kBuckets> accepts_{};
};

}  // namespace specdec
