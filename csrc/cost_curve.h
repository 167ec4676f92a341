// The cost curve the adaptive policy starts from, estimated from timed decodes.
#pragma once

#include <vector>

namespace specdec {

// One sweep of timings, in seconds: target decodes of n = 1..m tokens, and draft decodes of 1
// and 2 tokens, each timed right after the target's decode of the same size (so that both
// models are timed over the same spell of the machine's load).
struct CostSweep {
    std::vector<double> verify;  // [n-1]
    std::vector<double> draft;   // [n-1] for n = 1, 2; empty when there is no draft model
};

struct CostCurve {
    std::vector<double> verify;  // [n-1]: seconds for a target decode of n tokens
    std::vector<double> draft;   // [n-1]: seconds for a draft decode of n = 1, 2 tokens
};

// The middle sample (the upper one of an even count). Throws std::invalid_argument when empty.
double median(std::vector<double> samples);

// Each cost is the fastest of its timings times one factor for all: how much slower than their
// fastest the target's timings typically were. Fastest timings give the curve's shape and the
// draft's cost next to the target's: other work on the machine only ever adds time, and adds
// it unevenly, so medians of a few timings on a busy machine can make a model drafting for
// itself look cheaper than itself (docs/adaptive.md, "Calibrating on a busy machine"). The
// common factor keeps those ratios and makes the costs typical ones, like those the policy
// tracks from its steps while it runs. Without draft timings the draft costs nothing (an
// n-gram drafter). Throws std::invalid_argument for no sweeps, sweeps of different shapes,
// and timings that are not finite, not positive (target) or negative (draft).
CostCurve estimate_costs(const std::vector<CostSweep>& sweeps);

// Whether more sweeps are unlikely to change the estimates: leaving the last sweep out moves
// no fastest timing by more than `tolerance` (relative). Never with fewer than two sweeps.
bool costs_settled(const std::vector<CostSweep>& sweeps, double tolerance);

}  // namespace specdec
