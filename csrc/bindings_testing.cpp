// Test hooks, built only with SPECDEC_TEST_HOOKS (the test suite's build): the sampling maths,
// the cost estimates, the text stream and the adaptive policy on their own, and a deliberately
// wrong acceptance rule for the distribution tests to catch. Not part of the API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cost_curve.h"
#include "generation.h"
#include "ngram_index.h"
#include "policy.h"
#include "prediction.h"
#include "rate_check.h"
#include "sampling.h"
#include "text_stream.h"

namespace py = pybind11;
using namespace specdec;

namespace {

// A distribution from dense probabilities, its support the nonzero ones (for the maths' tests).
Distribution dense_distribution(const std::vector<float>& probs) {
    Distribution d;
    d.probs = probs;
    for (size_t i = 0; i < probs.size(); ++i)
        if (probs[i] > 0) d.support.push_back(static_cast<int32_t>(i));
    return d;
}

void require_calibrated(const AdaptivePolicy& p) {
    if (!p.calibrated()) throw py::value_error("calibrate the policy first");
}

}  // namespace

void bind_testing(py::module_ m) {
    m.def(
        "plan_batch",
        [](const std::vector<std::vector<double>>& expected, const std::vector<int>& caps,
           int other_rows, std::vector<std::pair<int, double>> verify,
           std::vector<std::pair<int, double>> draft) {
            if (expected.size() != caps.size())
                throw py::value_error("need one list of expected tokens per cap");
            std::vector<int> k, trial;
            plan_batch(expected, caps, other_rows, BatchCosts(std::move(verify), std::move(draft)),
                       k, trial);
            return k;
        },
        py::arg("expected"), py::arg("caps"), py::arg("other_rows"), py::arg("verify"),
        py::arg("draft"), "Each sequence's K for a batch; see csrc/policy.h.");
    m.def(
        "observe_batch_costs",
        [](std::vector<std::pair<int, double>> verify, std::vector<std::pair<int, double>> draft,
           const std::vector<std::pair<int, double>>& decodes) {
            BatchCosts costs(std::move(verify), std::move(draft));
            for (const auto& [rows, seconds] : decodes) costs.observe_verify(rows, seconds);
            return costs.verify_points();
        },
        py::arg("verify"), py::arg("draft"), py::arg("decodes"),
        "The verify points after the (rows, seconds) decodes; see BatchCosts::observe_verify.");
    m.def(
        "set_stale_penalties", [](bool on) { stale_penalties_for_tests.store(on); }, py::arg("on"),
        "Test builds only: penalties that miss the step's own verdicts.");
    m.def(
        "set_gpu_timing", [](bool on) { gpu_timing_for_tests.store(on); }, py::arg("on"),
        "Test builds only: treat decodes as a GPU's (each shape timed after two untimed decodes; "
        "no recalibration after a request).");
    m.def(
        "decodes", []() { return decodes_for_tests.load(); },
        "Test builds only: llama_decode calls the engines have made so far.");
    m.def(
        "verdicts_without_logits", []() { return verdicts_without_logits_for_tests.load(); },
        "Test builds only: drafted tokens accepted without reading the target's logits (those "
        "the grammar allowed alone).");
    m.def(
        "set_wrong_residual", [](bool on) { wrong_residual_for_tests.store(on); }, py::arg("on"),
        "While on, a rejected draft resamples from p instead of norm(max(0, p - q)): a wrong "
        "rule, for the distribution tests to show that they catch it.");
    // The policy alone, for tests of its rules: pure arithmetic on costs and outcomes.
    py::class_<AdaptivePolicy>(m, "AdaptivePolicy")
        .def(py::init([](int max_k) {
                 AdaptivePolicy::Config config;
                 config.max_k = max_k;
                 return AdaptivePolicy(config);
             }),
             py::arg("max_k") = 10)
        .def(
            "calibrate",
            [](AdaptivePolicy& p, std::vector<double> verify_costs,
               std::vector<double> draft_costs) {
                p.calibrate(std::move(verify_costs), std::move(draft_costs), 0.0);
            },
            py::arg("verify_costs"), py::arg("draft_costs"))
        .def("begin_generation", &AdaptivePolicy::begin_generation)
        .def("end_generation", &AdaptivePolicy::end_generation, py::arg("counts") = true)
        .def(
            "choose",
            [](AdaptivePolicy& p, int cap) {
                require_calibrated(p);
                std::string why;
                const int k = p.choose(cap, &why);
                return py::make_tuple(k, why);
            },
            py::arg("cap"))
        .def(
            "observe",
            [](AdaptivePolicy& p, int k, int n_accepted, double t_draft, double t_verify,
               int caught_up, double t_catch_up,
               const std::optional<std::vector<double>>& accept_chance) {
                require_calibrated(p);
                if (k < 0 || k > p.max_k() || n_accepted < 0 || n_accepted > k)
                    throw py::value_error("need 0 <= n_accepted <= k <= max_k");
                if (caught_up < 0 || t_catch_up < 0.0 || t_catch_up > t_draft)
                    throw py::value_error("need caught_up >= 0 and 0 <= t_catch_up <= t_draft");
                StepOutcome step{k, n_accepted, t_draft, t_verify, caught_up, t_catch_up};
                step.t_decode = t_verify;  // a made-up step has no acceptance to take off
                if (accept_chance) {
                    const auto reached = static_cast<size_t>(std::min(k, n_accepted + 1));
                    if (accept_chance->size() != reached)
                        throw py::value_error("need one accept_chance per position reached, " +
                                              std::to_string(reached));
                    for (double c : *accept_chance)
                        if (!(c >= 0.0 && c <= 1.0))
                            throw py::value_error("accept_chance values must be in [0, 1]");
                    step.accept_chance = &*accept_chance;
                }
                p.observe(step);
            },
            py::arg("k"), py::arg("n_accepted"), py::arg("t_draft"), py::arg("t_verify"),
            py::arg("caught_up") = 0, py::arg("t_catch_up") = 0.0,
            py::arg("accept_chance") = py::none())
        .def("acceptance", &AdaptivePolicy::acceptance)
        .def(
            "expected_rates",
            [](const AdaptivePolicy& p, int cap) {
                require_calibrated(p);
                if (cap < 0 || cap >= static_cast<int>(p.verify_costs().size()))
                    throw py::value_error("need 0 <= cap < len(verify_costs)");
                return p.expected_rates(cap);
            },
            py::arg("cap"))
        .def("can_ever_pay", &AdaptivePolicy::can_ever_pay)
        .def("cost_verdict",
             [](const AdaptivePolicy& p) {
                 switch (p.cost_verdict()) {
                     case AdaptivePolicy::CostVerdict::kAgree:
                         return "agree";
                     case AdaptivePolicy::CostVerdict::kDisagree:
                         return "disagree";
                     case AdaptivePolicy::CostVerdict::kUnjudged:
                         break;
                 }
                 return "unjudged";
             })
        .def_property_readonly("verify_costs", &AdaptivePolicy::verify_costs)
        .def_property_readonly("draft_costs", &AdaptivePolicy::draft_costs);

    // The rate check alone: its decisions from the step rates a test makes up.
    py::class_<RateCheck>(m, "RateCheck")
        .def(py::init<int>(), py::arg("max_sequences"))
        .def("hold_plain", &RateCheck::hold_plain, py::arg("n"), py::arg("modelled_plain"))
        .def("observe", &RateCheck::observe, py::arg("n"), py::arg("tokens"), py::arg("seconds"),
             py::arg("drafted"))
        .def("drafting_won", &RateCheck::drafting_won, py::arg("n"), py::arg("modelled_plain"))
        .def("view", [](const RateCheck& c, int n) {
            const RateCheck::View v = c.view(n);
            return py::make_tuple(v.speculating, v.plain, v.holding, v.last_hold);
        });

    // The shared n-gram index alone: what it drafts after the outputs a test adds.
    py::class_<SharedNgramIndex>(m, "SharedNgramIndex")
        .def(py::init<int, int, size_t>(), py::arg("ngram_min"), py::arg("ngram_max"),
             py::arg("budget_bytes"))
        .def("add", &SharedNgramIndex::add, py::arg("prompt"), py::arg("output"))
        .def(
            "draft",
            [](const SharedNgramIndex& index, const std::vector<llama_token>& text, int k) {
                Draft draft;
                index.propose(index.match(text), k, draft);
                return draft.tokens;
            },
            py::arg("text"), py::arg("k"),
            "What a copy from the index drafts after `text`, at most k tokens.");

    // A request's prediction alone: what it drafts as the output grows (called once per step,
    // as a generation does: it follows the output from one call to the next).
    py::class_<Prediction>(m, "Prediction")
        .def(py::init<std::vector<llama_token>, int, int>(), py::arg("tokens"),
             py::arg("ngram_min"), py::arg("ngram_max"))
        .def(
            "draft",
            [](Prediction& prediction, const std::vector<llama_token>& seq, size_t output_start,
               int k) {
                if (output_start > seq.size())
                    throw py::value_error("output_start is past the sequence");
                if (k < 0) throw py::value_error("k must be >= 0");
                Draft draft;
                prediction.copy(prediction.match(seq, output_start), k, draft);
                return draft.tokens;
            },
            py::arg("seq"), py::arg("output_start"), py::arg("k"),
            "What a copy of the prediction drafts after `seq` (prompt + output), at most k.");

    m.def("common_subsequence", &common_subsequence, py::arg("a"), py::arg("b"),
          "The length of a's and b's longest common subsequence.");

    // The calibration's estimates from timed sweeps, exposed for unit tests.
    m.def(
        "estimate_costs",
        [](const std::vector<std::vector<double>>& verify,
           const std::vector<std::vector<double>>& draft, double tolerance) {
            if (!draft.empty() && draft.size() != verify.size())
                throw py::value_error("need one list of draft timings per sweep, or none");
            std::vector<CostSweep> sweeps;
            for (size_t s = 0; s < verify.size(); ++s)
                sweeps.push_back(
                    CostSweep{verify[s], draft.empty() ? std::vector<double>{} : draft[s]});
            CostCurve curve = estimate_costs(sweeps);
            return py::make_tuple(curve.verify, curve.draft, costs_settled(sweeps, tolerance));
        },
        py::arg("verify"), py::arg("draft"), py::arg("tolerance") = 0.05,
        "(verify costs, draft costs, settled) from sweeps of timings; see csrc/cost_curve.h.");

    // The sampling maths, exposed for unit tests.
    m.def("distribution", [](const std::vector<float>& logits, float temperature, int top_k,
                             float top_p, float min_p) {
        SamplingParams p{temperature, top_k, top_p, min_p};
        validate(p);
        if (p.greedy()) throw std::invalid_argument("distribution needs temperature > 0");
        SamplingWorkspace ws;
        Distribution d;
        make_distribution(logits.data(), static_cast<int>(logits.size()), p, ws, d);
        return d.probs;
    });
    m.def("acceptance_probability", &acceptance_probability);
    m.def("acceptance_chance", [](const std::vector<float>& p, const std::vector<float>& q) {
        if (p.size() != q.size()) throw py::value_error("p and q need the same length");
        return acceptance_chance(dense_distribution(p), dense_distribution(q));
    });
    m.def("sample_residual_counts",
          [](const std::vector<float>& p, const std::vector<float>& q, int n, uint64_t seed) {
              // Draws n samples from norm(max(0, p - q)) and counts them per id.
              const Distribution dp = dense_distribution(p), dq = dense_distribution(q);
              Rng rng(seed);
              std::vector<int> counts(p.size(), 0);
              for (int i = 0; i < n; ++i)
                  ++counts[static_cast<size_t>(sample_residual(dp, dq, rng))];
              return counts;
          });
    m.def("utf8_stream",
          [](const std::vector<py::bytes>& pieces, const std::vector<std::string>& stop) {
              // Feeds pieces through the text stream; returns the chunks it emitted and the flush.
              TextStream ts(stop);
              std::vector<py::bytes> out;
              for (const auto& piece : pieces) out.emplace_back(ts.push(std::string(piece)));
              out.emplace_back(ts.flush());
              return py::make_tuple(out, ts.stopped());
          });
}
