// pybind11 only: argument conversion, GIL release, callbacks, exception mapping.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "errors.h"
#include "logging.h"
#include "sampling.h"
#include "text_stream.h"

namespace py = pybind11;
using namespace specdec;

namespace {

// Text from the engine is valid UTF-8 except, at worst, a broken tail at the very end.
py::str to_str(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

py::dict stats_dict(const Stats& s) {
    py::dict d;
    d["n_prompt"] = s.n_prompt;
    d["n_prompt_cached"] = s.n_prompt_cached;
    d["n_generated"] = s.n_generated;
    d["n_target_passes"] = s.n_target_passes;
    d["n_drafted"] = s.n_drafted;
    d["n_accepted"] = s.n_accepted;
    d["n_cut"] = s.n_cut;
    d["n_speculative_steps"] = s.n_speculative_steps;
    d["n_fallback_steps"] = s.n_fallback_steps;
    d["fallback_reason"] = s.fallback_reason;
    d["draft_error"] = s.draft_error;
    d["n_look_backs"] = s.n_look_backs;
    d["n_shared_steps"] = s.n_shared_steps;
    d["recalibrated"] = s.recalibrated;
    d["steps_at_k"] = s.steps_at_k;
    d["drafted_by_model"] = s.drafted_by[0];
    d["accepted_by_model"] = s.accepted_by[0];
    d["drafted_by_ngram"] = s.drafted_by[1];
    d["accepted_by_ngram"] = s.accepted_by[1];
    d["n_argmax_drafted"] = s.n_argmax_drafted;
    d["accepted_at"] = s.accepted_at;
    d["proposed_at"] = s.proposed_at;
    d["t_queue"] = s.t_queue;
    d["t_prompt"] = s.t_prompt;
    d["t_first_token"] = s.t_first_token;
    d["t_draft"] = s.t_draft;
    d["t_verify"] = s.t_verify;
    d["t_total"] = s.t_total;
    return d;
}

ModelParams model_params(const std::string& path, int n_gpu_layers, int n_ctx, int n_batch,
                         int n_threads) {
    ModelParams p;
    p.path = path;
    p.n_gpu_layers = n_gpu_layers;
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    p.n_threads = n_threads;
    return p;
}

// A distribution from dense probabilities, its support the nonzero ones (for the maths' tests).
Distribution dense_distribution(const std::vector<float>& probs) {
    Distribution d;
    d.probs = probs;
    for (size_t i = 0; i < probs.size(); ++i)
        if (probs[i] > 0) d.support.push_back(static_cast<int32_t>(i));
    return d;
}

DraftRule parse_draft_rule(const std::string& rule) {
    if (rule == "auto") return DraftRule::kAuto;
    if (rule == "sample") return DraftRule::kSample;
    if (rule == "argmax") return DraftRule::kArgmax;
    throw py::value_error("draft_rule must be 'auto', 'sample' or 'argmax', got '" + rule + "'");
}

void require_calibrated(const AdaptivePolicy& p) {
    if (!p.calibrated()) throw py::value_error("calibrate the policy first");
}

// The call that Ctrl-C cancels, and whether it came: written by the signal handler, so
// lock-free atomics only.
std::atomic<CancelFlag*> g_interruptible{nullptr};
std::atomic<bool> g_sigint_caught{false};

extern "C" void cancel_on_sigint(int /*signum*/) {
    g_sigint_caught.store(true);
    if (CancelFlag* f = g_interruptible.load()) f->requested.store(true);
}

// Python runs signal handlers on its main thread only, and only when that thread runs Python
// code; a decode loop asking it (PyErr_CheckSignals) must take the GIL every time, which stalls
// the loop behind any busy Python thread. So while an engine call runs on the main thread, a C
// handler turns SIGINT into that call's cancel flag (not the engine's: the call may still be
// waiting while another thread's runs), which every decode and the wait read anyway; Python's
// own handler (KeyboardInterrupt by default) runs when the call has returned.
class InterruptGuard {
  public:
    // Needs the GIL. Does nothing off the main thread, or when Python ignores SIGINT.
    explicit InterruptGuard(std::shared_ptr<CancelFlag> flag) : flag_(std::move(flag)) {
        py::module_ threading = py::module_::import("threading");
        if (!threading.attr("current_thread")().is(threading.attr("main_thread")())) return;
        py::module_ signal = py::module_::import("signal");
        const py::object handler = signal.attr("getsignal")(signal.attr("SIGINT"));
        if (handler.is_none() || handler.equal(signal.attr("SIG_IGN")) ||
            handler.equal(signal.attr("SIG_DFL")))
            return;
        previous_flag_ = g_interruptible.exchange(flag_.get());
        previous_caught_ = g_sigint_caught.exchange(false);
        struct sigaction action{};
        action.sa_handler = cancel_on_sigint;
        sigemptyset(&action.sa_mask);
        installed_ = sigaction(SIGINT, &action, &previous_action_) == 0;
    }
    ~InterruptGuard() { restore(); }
    InterruptGuard(const InterruptGuard&) = delete;
    InterruptGuard& operator=(const InterruptGuard&) = delete;

    // Needs the GIL. Puts Python's handler back and, if SIGINT came, runs it: raises what it
    // raises (KeyboardInterrupt by default).
    void deliver() {
        if (!restore()) return;
        PyErr_SetInterrupt();
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }

  private:
    // Returns whether SIGINT came while installed.
    bool restore() {
        if (!installed_) return false;
        installed_ = false;
        sigaction(SIGINT, &previous_action_, nullptr);
        g_interruptible.store(previous_flag_);
        return g_sigint_caught.exchange(previous_caught_);
    }

    std::shared_ptr<CancelFlag> flag_;
    bool installed_ = false;
    struct sigaction previous_action_{};
    CancelFlag* previous_flag_ = nullptr;
    bool previous_caught_ = false;
};

// Runs call(flag) without the GIL, Ctrl-C setting `flag` (one made here if null); returns its
// result.
template <typename Call>
auto interruptible(Call&& call, std::shared_ptr<CancelFlag> flag = nullptr) {
    if (!flag) flag = std::make_shared<CancelFlag>();
    InterruptGuard guard(flag);
    using Result = decltype(call(flag));
    std::optional<Result> result;
    try {
        py::gil_scoped_release release;
        result.emplace(call(flag));
    } catch (...) {
        guard.deliver();  // Ctrl-C, if it came, is why the call unwound
        throw;
    }
    guard.deliver();
    return std::move(*result);
}

// Holds the first Python exception a callback raised while the engine ran, to re-raise once the
// engine has unwound.
struct PendingError {
    std::optional<py::error_already_set> error;
    void capture(py::error_already_set&& e) {
        if (!error) error.emplace(std::move(e));
    }
};

py::dict run_generate(Engine& engine, GenerateRequest request, const py::object& on_text) {
    PendingError pending;
    TextCallback text_cb;
    if (!on_text.is_none()) {
        text_cb = [&](const std::string& text) {
            py::gil_scoped_acquire gil;
            try {
                on_text(to_str(text));
            } catch (py::error_already_set& e) {
                pending.capture(std::move(e));
                throw Cancelled("callback raised");
            }
        };
    }
    GenerationResult result;
    try {
        result = interruptible(
            [&](const std::shared_ptr<CancelFlag>& flag) {
                request.cancel = flag;
                return engine.generate(request, text_cb);
            },
            request.cancel);
    } catch (...) {
        // A callback's exception is the cause of whatever unwound.
        if (pending.error) throw std::move(*pending.error);
        throw;
    }
    if (pending.error) throw std::move(*pending.error);
    py::dict out;
    out["tokens"] = result.tokens;
    out["text"] = to_str(result.text);
    out["finish_reason"] = result.finish_reason;
    out["margins"] = result.margins;
    out["stats"] = stats_dict(result.stats);
    return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "specdec native engine (llama.cpp speculative decoding)";

    py::register_exception<ModelLoadError>(m, "ModelLoadError", PyExc_RuntimeError);
    py::register_exception<VocabMismatchError>(m, "VocabMismatchError", PyExc_ValueError);
    py::register_exception<UnsupportedModelError>(m, "UnsupportedModelError", PyExc_RuntimeError);
    py::register_exception<ContextOverflowError>(m, "ContextOverflowError", PyExc_ValueError);
    py::register_exception<NonFiniteLogitsError>(m, "NonFiniteLogitsError", PyExc_RuntimeError);
    py::register_exception<ReentrantCallError>(m, "ReentrantCallError", PyExc_RuntimeError);

    // The policy alone, for tests of its rules: pure arithmetic on costs and outcomes.
    py::class_<AdaptivePolicy>(m, "AdaptivePolicy")
        .def(py::init([](int max_k) {
                 AdaptivePolicy::Config config;
                 config.max_k = max_k;
                 return AdaptivePolicy(config);
             }),
             py::arg("max_k") = 10)
        .def_readonly_static("LOOK_BACK", &AdaptivePolicy::kLookBack)
        .def(
            "calibrate",
            [](AdaptivePolicy& p, std::vector<double> verify_costs,
               std::vector<double> draft_costs) {
                p.calibrate(std::move(verify_costs), std::move(draft_costs), 0.0);
            },
            py::arg("verify_costs"), py::arg("draft_costs"))
        .def("begin_generation", &AdaptivePolicy::begin_generation, py::arg("look_back") = false,
             py::arg("sampled") = false)
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
        .def("observe_hindsight", &AdaptivePolicy::observe_hindsight, py::arg("chance"))
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
        .def_property_readonly("verify_costs", &AdaptivePolicy::verify_costs)
        .def_property_readonly("draft_costs", &AdaptivePolicy::draft_costs);

    py::class_<CancelFlag, std::shared_ptr<CancelFlag>>(m, "CancelFlag")
        .def(py::init<>())
        .def("cancel", [](CancelFlag& f) { f.requested.store(true); })
        .def_property_readonly("cancelled", [](const CancelFlag& f) { return f.requested.load(); });

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string& target, const std::optional<std::string>& draft,
                         int n_draft, int n_ctx, int n_batch, int n_threads, int n_gpu_layers,
                         int draft_n_gpu_layers, bool ngram, int ngram_min, int ngram_max,
                         bool verbose, uintptr_t target_model, uintptr_t draft_model,
                         int n_parallel) {
                 EngineConfig c;
                 c.target = model_params(target, n_gpu_layers, n_ctx, n_batch, n_threads);
                 c.target.borrowed = reinterpret_cast<llama_model*>(target_model);
                 if (draft) {
                     c.draft = model_params(*draft, draft_n_gpu_layers, n_ctx, n_batch, n_threads);
                     c.draft->borrowed = reinterpret_cast<llama_model*>(draft_model);
                 }
                 c.n_draft = n_draft;
                 c.ngram = ngram;
                 c.ngram_min = ngram_min;
                 c.ngram_max = ngram_max;
                 c.verbose = verbose;
                 c.n_parallel = n_parallel;
                 py::gil_scoped_release release;
                 return std::make_unique<Engine>(c);
             }),
             py::arg("target"), py::arg("draft") = py::none(), py::arg("n_draft") = 4,
             py::arg("n_ctx") = 4096, py::arg("n_batch") = 512, py::arg("n_threads") = 0,
             py::arg("n_gpu_layers") = 0, py::arg("draft_n_gpu_layers") = 0,
             py::arg("ngram") = false, py::arg("ngram_min") = 1, py::arg("ngram_max") = 4,
             py::arg("verbose") = false, py::arg("target_model") = 0, py::arg("draft_model") = 0,
             py::arg("n_parallel") = 1)
        .def(
            "generate",
            [](Engine& e, const std::vector<int32_t>& prompt, int max_tokens, float temperature,
               int top_k, float top_p, float min_p, uint64_t seed,
               const std::vector<std::string>& stop, int n_draft, const py::object& on_text,
               bool adaptive, float draft_p_min, double timeout,
               const std::shared_ptr<CancelFlag>& cancel, bool wrong_residual_for_tests,
               const std::string& draft_rule) {
                GenerateRequest r;
                r.prompt = prompt;
                r.max_tokens = max_tokens;
                r.sampling = {temperature, top_k, top_p, min_p};
                r.seed = seed;
                r.stop = stop;
                r.n_draft = n_draft;
                r.adaptive = adaptive;
                r.draft_p_min = draft_p_min;
                r.timeout = timeout;
                r.cancel = cancel;
                r.wrong_residual_for_tests = wrong_residual_for_tests;
                r.draft_rule = parse_draft_rule(draft_rule);
                return run_generate(e, std::move(r), on_text);
            },
            py::arg("prompt"), py::arg("max_tokens"), py::arg("temperature"), py::arg("top_k"),
            py::arg("top_p"), py::arg("min_p"), py::arg("seed"), py::arg("stop"),
            py::arg("n_draft"), py::arg("on_text") = py::none(), py::arg("adaptive") = false,
            py::arg("draft_p_min") = 0.0f, py::arg("timeout") = 0.0, py::arg("cancel") = nullptr,
            py::arg("wrong_residual_for_tests") = false, py::arg("draft_rule") = "auto")
        .def(
            "calibrate",
            [](Engine& e, const std::vector<int32_t>& context) {
                interruptible([&](std::shared_ptr<CancelFlag> flag) {
                    e.calibrate(context, std::move(flag));
                    return true;
                });
            },
            py::arg("context"))
        .def("policy_state",
             [](const Engine& e) {
                 const AdaptivePolicy p = e.policy();
                 const BatchCosts batch = e.batch_costs();
                 py::dict d;
                 d["calibrated"] = p.calibrated();
                 d["calibration_seconds"] = p.calibration_seconds();
                 d["acceptance"] = p.acceptance();
                 d["expected_rate"] =
                     p.calibrated()
                         ? p.expected_rates(static_cast<int>(p.verify_costs().size()) - 1)
                         : std::vector<double>{};
                 d["verify_costs"] = p.verify_costs();
                 d["draft_costs"] = p.draft_costs();
                 d["batch_verify_costs"] = batch.verify_points();
                 d["batch_draft_costs"] = batch.draft_points();
                 return d;
             })
        .def("set_calibration", &Engine::set_calibration, py::arg("verify_costs"),
             py::arg("draft_costs"), py::call_guard<py::gil_scoped_release>())
        .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
        .def("tokenize",
             [](const Engine& e, const std::string& text, bool add_special, bool parse_special) {
                 return e.target().tokenize(text, add_special, parse_special);
             })
        .def("detokenize",
             [](const Engine& e, const std::vector<int32_t>& tokens) {
                 return to_str(e.target().detokenize(tokens));
             })
        .def("apply_chat_template",
             [](const Engine& e, const std::vector<std::pair<std::string, std::string>>& messages,
                bool add_generation_prompt) {
                 return e.target().apply_chat_template(messages, add_generation_prompt);
             })
        .def(
            "next_token_logits",
            [](Engine& e, const std::vector<int32_t>& context, bool batched) {
                return interruptible([&](std::shared_ptr<CancelFlag> flag) {
                    return e.next_token_logits(context, batched, std::move(flag));
                });
            },
            py::arg("context"), py::arg("batched") = true)
        .def(
            "measure_decode_cost",
            [](Engine& e, const std::vector<int32_t>& context, int max_n, int repeats,
               bool on_draft) {
                return interruptible([&](std::shared_ptr<CancelFlag> flag) {
                    return e.measure_decode_cost(context, max_n, repeats, on_draft,
                                                 std::move(flag));
                });
            },
            py::arg("context"), py::arg("max_n"), py::arg("repeats") = 5,
            py::arg("on_draft") = false)
        .def("model_info",
             [](const Engine& e, bool draft) {
                 const Model* m = draft ? e.draft() : &e.target();
                 py::dict d;
                 if (!m) return d;
                 d["path"] = m->path();
                 d["description"] = m->description();
                 d["architecture"] = m->meta("general.architecture");
                 d["name"] = m->meta("general.name");
                 d["n_params"] = llama_model_n_params(m->model());
                 d["size_bytes"] = llama_model_size(m->model());
                 d["n_layer"] = llama_model_n_layer(m->model());
                 d["n_embd"] = llama_model_n_embd(m->model());
                 d["n_ctx_train"] = llama_model_n_ctx_train(m->model());
                 d["n_ctx"] = m->n_ctx();
                 d["n_vocab"] = m->n_vocab();
                 d["vocab_type"] = static_cast<int>(llama_vocab_type(m->vocab()));
                 d["bos"] = llama_vocab_bos(m->vocab());
                 d["eos"] = llama_vocab_eos(m->vocab());
                 d["has_chat_template"] = llama_model_chat_template(m->model(), nullptr) != nullptr;
                 return d;
             })
        .def_property_readonly("n_draft", &Engine::n_draft)
        .def_property_readonly("has_draft", [](const Engine& e) { return e.draft() != nullptr; })
        .def_property_readonly("n_parallel", &Engine::n_parallel)
        .def_property_readonly("running_on_this_thread", &Engine::running_on_this_thread)
        .def_property_readonly("n_ctx", [](const Engine& e) { return e.target().n_ctx(); });

    m.def("set_log_verbose", &install_log_handler, py::arg("verbose"),
          "Routes llama.cpp's log through specdec: printed when verbose, else kept for errors.");
    m.def("system_info", []() { return std::string(llama_print_system_info()); });
    m.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); });

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
