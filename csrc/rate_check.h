// Measured, not modelled: whether `auto`'s steps commit tokens faster than the target alone
// does, judged by the wall clock.
#pragma once

#include <vector>

namespace specdec {

// The adaptive policies choose K from a cost model; this checks their choice against what the
// steps actually commit per second. For each number of sequences decoding together it keeps
// two measured rates (committed tokens per second of whole steps, drafting included): that of
// the steps where the policies drafted ("speculating": their probes included, and a draft's
// catching up after steps without it) and that of target-only steps (where nothing drafted:
// the policies' own fallbacks, and steps held by this check). A drafting step pays only if it
// commits tokens faster than target-only steps do. When drafting steps fall below target-only
// beyond the noise, every step is held at target-only for a while, then the policies get
// another try; holds double while the tries keep losing. (Judging all of the policies' steps
// together instead, where they seldom draft, compares target-only with itself and holds on
// noise, blocking the rare copies that pay most.) Under load (several sequences) drafting must
// show that it pays: such a lane starts held, and a try is judged on all of its steps and must
// beat target-only, since a hold there costs nothing and a drafting row nearly a full row.
//
// Target-only's rate is measured, not modelled: when the policies draft all the time it is
// learnt by an occasional step of K = 0, taken only where the measured speculating rate is
// within kExploreBelow of the model's target-only rate (where drafting is clearly ahead, a
// step without it would only cost). Until it is measured, the model's stands in: a hold it
// starts measures it at once.
class RateCheck {
  public:
    // Between steps of up to `max_sequences` sequences decoding together.
    explicit RateCheck(int max_sequences);

    // Before a step of `n` sequences, all adaptive: whether it must decode the target alone.
    // `modelled_plain`: tokens per second the cost model expects of such a step without
    // drafts (0: no model).
    bool hold_plain(int n, double modelled_plain);
    // After that step: the tokens it committed, its seconds (drafting, decoding, acceptance),
    // and whether any sequence drafted.
    void observe(int n, int tokens, double seconds, bool drafted);
    // New text starts for `n` sequences: a hold under way ends (the doubling is kept: a try
    // that loses again holds twice as long).
    void new_text(int n);
    // Whether drafting has won for `n` sequences as measured: no hold, no try under way, and
    // its rate judged as judge() does (under load ahead of target-only's). Asked instead of
    // hold_plain before a step that also reads a prompt: such a step is not observed, so it
    // is no place for a try, and it neither counts down a hold.
    bool drafting_won(int n, double modelled_plain) const;

    // What the check knows for n sequences (for tests and policy_state()).
    struct View {
        double speculating = 0.0;  // tokens per second; 0 while unmeasured
        double plain = 0.0;
        bool holding = false;
        int last_hold = 0;  // steps: the last hold's length (0: none yet)
    };
    View view(int n) const;

  private:
    struct Lane {
        double spec_tokens = 0.0, spec_seconds = 0.0, spec_weight = 0.0;
        double plain_tokens = 0.0, plain_seconds = 0.0;
        int plain_samples = 0;
        int steps_since_plain = 0;    // steps since a plain step was measured
        int steps_since_explore = 0;  // steps since a plain step was taken to measure it
        int hold_left = 0;            // steps of the hold under way
        int hold = 0;                 // the last hold's length (the next doubles it)
        bool skip_next = false;       // the first step after a hold pays its catch-up
        bool retrying = false;        // after a hold, until the policies win or lose again
        bool forced = false;          // this step is target-only by the check's choice
        bool under_load = false;      // several sequences: drafting must win, not only not lose
        double spec_rate() const;
        double plain_rate() const;
        bool plain_known() const;
    };
    Lane* lane(int n);
    // Where a lane's drafting stands against target-only, as judge() and drafting_won() see
    // it: too few steps to tell, losing (a hold is due), or holding its own.
    enum class Standing { kUnjudged, kLosing, kHolding };
    static Standing standing(const Lane& l, double modelled_plain);
    // Whether the policies' steps lose to target-only: if so, a hold starts.
    void judge(Lane& l, double modelled_plain);
    void start_hold(Lane& l);
    std::vector<Lane> lanes_;  // [n - 1]
};

}  // namespace specdec
