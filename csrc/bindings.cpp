// pybind11 only: argument conversion, GIL release, callbacks, exception mapping.
#include <pthread.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "constraint.h"
#include "engine.h"
#include "errors.h"
#include "logging.h"
#include "sampling.h"
#include "text_stream.h"

namespace py = pybind11;
using namespace specdec;

#ifdef SPECDEC_TEST_HOOKS
void bind_testing(py::module_ m);  // bindings_testing.cpp
#endif

namespace {

// Native calls running without the GIL, process-wide. A call that returns while the interpreter
// is finalizing must not take the GIL back: Python ends such a thread with pthread_exit, whose
// unwinding through C++ frames (noexcept destructors among them) aborts the process. At exit,
// specdec closes its decoders and waits here until every call has come back (drain_native_calls).
std::atomic<int> g_native_calls{0};
// The thread that drained them: the one that goes on to finalize the interpreter.
std::atomic<std::thread::id> g_exiting_thread{};

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
}

// A thread outliving the interpreter parks instead of taking the GIL (the process is exiting:
// nothing waits for that thread). Not the finalizing thread itself: it holds the GIL anyway.
void park_if_finalizing() {
    if (interpreter_finalizing() && std::this_thread::get_id() != g_exiting_thread.load())
        while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

// py::gil_scoped_release, counted (from before the GIL goes until after it is back).
class WithoutGil {
  public:
    WithoutGil() {
        g_native_calls.fetch_add(1);
        release_.emplace();
    }
    ~WithoutGil() {
        park_if_finalizing();
        release_.reset();
        g_native_calls.fetch_sub(1);
    }
    WithoutGil(const WithoutGil&) = delete;
    WithoutGil& operator=(const WithoutGil&) = delete;

  private:
    std::optional<py::gil_scoped_release> release_;
};

// Waits (without the GIL) until no native call runs, or `timeout_s` passes; true when none runs.
bool drain_native_calls(double timeout_s) {
    g_exiting_thread.store(std::this_thread::get_id());
    py::gil_scoped_release release;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (g_native_calls.load() > 0) {
        if (std::chrono::steady_clock::now() >= until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
}

// Text from the engine is valid UTF-8 except, at worst, a broken tail at the very end.
py::str to_str(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

// The rate check's view for 1..n sequences decoding together (tokens per second; 0: unmeasured).
py::list measured_rates(const RateCheck& check, int n) {
    py::list out;
    for (int i = 1; i <= n; ++i) {
        const RateCheck::View v = check.view(i);
        py::dict d;
        d["speculating"] = v.speculating;
        d["target_only"] = v.plain;
        d["holding"] = v.holding;
        d["last_hold"] = v.last_hold;
        out.append(d);
    }
    return out;
}

py::dict stats_dict(const Stats& s) {
    py::dict d;
    s.visit([&](const char* name, const auto& value) { d[name] = value; });
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

const char* draft_rule_name(DraftRule rule) {
    switch (rule) {
        case DraftRule::kAuto:
            return "auto";
        case DraftRule::kSample:
            return "sample";
        case DraftRule::kArgmax:
            return "argmax";
    }
    return "auto";
}

NgramUse parse_ngram_use(const std::string& use) {
    if (use == "off") return NgramUse::kOff;
    if (use == "auto") return NgramUse::kUnderAuto;
    if (use == "on") return NgramUse::kAlways;
    throw py::value_error("ngram must be 'off', 'auto' or 'on', got '" + use + "'");
}

DraftRule parse_draft_rule(const std::string& rule) {
    if (rule == "auto") return DraftRule::kAuto;
    if (rule == "sample") return DraftRule::kSample;
    if (rule == "argmax") return DraftRule::kArgmax;
    throw py::value_error("draft_rule must be 'auto', 'sample' or 'argmax', got '" + rule + "'");
}

// The call that Ctrl-C cancels, and whether it came: written by the signal handler, so
// lock-free atomics only.
std::atomic<CancelFlag*> g_interruptible{nullptr};
std::atomic<bool> g_sigint_caught{false};

extern "C" void cancel_on_sigint(int /*signum*/) {
    g_sigint_caught.store(true);
    if (CancelFlag* f = g_interruptible.load()) f->requested.store(true);
    // And Python's own handler, should a callback's Python code be running (or blocked in a
    // wait that the signal interrupts): it raises there, as it would without the engine.
    PyErr_SetInterruptEx(SIGINT);
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
        WithoutGil release;
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

py::list logprob_tuples(const std::vector<TokenLogprob>& logprobs) {
    py::list out;
    for (const auto& t : logprobs) out.append(py::make_tuple(t.token, t.logprob, t.top));
    return out;
}

py::dict run_generate(Engine& engine, GenerateRequest request, const py::object& on_text,
                      const py::object& on_start, const py::object& on_logprobs) {
    PendingError pending;
    // Runs a callback's Python work (its arguments' conversion too) under the GIL; what it
    // raises is re-raised once the engine unwinds.
    const auto with_gil = [&](const auto& python_work) {
        park_if_finalizing();
        py::gil_scoped_acquire gil;
        try {
            python_work();
        } catch (py::error_already_set& e) {
            pending.capture(std::move(e));
            throw Cancelled("callback raised");
        }
    };
    TextCallback text_cb;
    if (!on_text.is_none() || !on_logprobs.is_none())
        text_cb = [&](const std::string& text, const std::vector<TokenLogprob>& logprobs) {
            with_gil([&] {
                // A piece's logprobs first: a caller pairs them with the text that follows.
                if (!on_logprobs.is_none() && !logprobs.empty())
                    on_logprobs(logprob_tuples(logprobs));
                if (!on_text.is_none() && !text.empty()) on_text(to_str(text));
            });
        };
    StartCallback start_cb;
    if (!on_start.is_none()) start_cb = [&] { with_gil([&] { on_start(); }); };
    GenerationResult result;
    auto own_flag = std::make_shared<CancelFlag>();
    own_flag->outer = request.cancel;
    try {
        result = interruptible(
            [&](const std::shared_ptr<CancelFlag>& flag) {
                request.cancel = flag;
                return engine.generate(request, text_cb, start_cb);
            },
            own_flag);
    } catch (...) {
        // A callback's exception is the cause of whatever unwound.
        if (pending.error) throw std::move(*pending.error);
        throw;
    }
    if (pending.error) throw std::move(*pending.error);
    py::dict out;
    out["tokens"] = result.tokens;
    out["text"] = to_str(result.text);
    out["finish_reason"] = finish_reason_name(result.finish_reason);
    out["margins"] = result.margins;
    out["stop_margin"] = result.stop_margin;
    out["logprobs"] = logprob_tuples(result.logprobs);
    out["prompt_logprobs"] = logprob_tuples(result.prompt_logprobs);
    out["stop_logprob"] = logprob_tuples(result.stop_logprob);
    out["stats"] = stats_dict(result.stats);
    return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    // A forked child has none of its parent's other threads, nor their calls.
    pthread_atfork(nullptr, nullptr, [] { g_native_calls.store(0); });
    m.doc() = "specdec native engine (llama.cpp speculative decoding)";

    py::register_exception<ModelLoadError>(m, "ModelLoadError", PyExc_RuntimeError);
    py::register_exception<VocabMismatchError>(m, "VocabMismatchError", PyExc_ValueError);
    py::register_exception<UnsupportedModelError>(m, "UnsupportedModelError", PyExc_RuntimeError);
    py::register_exception<ContextOverflowError>(m, "ContextOverflowError", PyExc_ValueError);
    py::register_exception<NonFiniteLogitsError>(m, "NonFiniteLogitsError", PyExc_RuntimeError);
    py::register_exception<ReentrantCallError>(m, "ReentrantCallError", PyExc_RuntimeError);
    py::register_exception<FileError>(m, "FileError", PyExc_OSError);

    py::class_<CancelFlag, std::shared_ptr<CancelFlag>>(m, "CancelFlag")
        .def(py::init<>())
        .def("cancel", [](CancelFlag& f) { f.requested.store(true); })
        .def_property_readonly("cancelled", [](const CancelFlag& f) { return f.is_set(); });

    // One generation's settings, checked by the Python API; the engine checks them again.
    py::class_<GenerateRequest>(m, "Request")
        .def(py::init<>())
        .def_readwrite("prompt", &GenerateRequest::prompt)
        .def_readwrite("max_tokens", &GenerateRequest::max_tokens)
        .def_property(
            "temperature", [](const GenerateRequest& r) { return r.sampling.temperature; },
            [](GenerateRequest& r, float v) { r.sampling.temperature = v; })
        .def_property(
            "top_k", [](const GenerateRequest& r) { return r.sampling.top_k; },
            [](GenerateRequest& r, int v) { r.sampling.top_k = v; })
        .def_property(
            "top_p", [](const GenerateRequest& r) { return r.sampling.top_p; },
            [](GenerateRequest& r, float v) { r.sampling.top_p = v; })
        .def_property(
            "min_p", [](const GenerateRequest& r) { return r.sampling.min_p; },
            [](GenerateRequest& r, float v) { r.sampling.min_p = v; })
        .def_readwrite("seed", &GenerateRequest::seed)
        .def_readwrite("stop", &GenerateRequest::stop)
        .def_readwrite("n_draft", &GenerateRequest::n_draft)
        .def_readwrite("adaptive", &GenerateRequest::adaptive)
        .def_readwrite("draft_p_min", &GenerateRequest::draft_p_min)
        .def_readwrite("constraint_kind", &GenerateRequest::constraint_kind)
        .def_readwrite("constraint", &GenerateRequest::constraint)
        .def_readwrite("logprobs", &GenerateRequest::logprobs)
        .def_readwrite("logit_bias", &GenerateRequest::logit_bias)
        .def_readwrite("presence_penalty", &GenerateRequest::presence_penalty)
        .def_readwrite("frequency_penalty", &GenerateRequest::frequency_penalty)
        .def_readwrite("repeat_penalty", &GenerateRequest::repeat_penalty)
        .def_readwrite("repeat_last_n", &GenerateRequest::repeat_last_n)
        .def_readwrite("ngram_index", &GenerateRequest::ngram_index)
        .def_readwrite("prediction", &GenerateRequest::prediction)
        .def_readwrite("ignore_eos", &GenerateRequest::ignore_eos)
        .def_readwrite("prompt_logprobs", &GenerateRequest::prompt_logprobs)
        .def_property(
            "draft_rule",
            [](const GenerateRequest& r) { return std::string(draft_rule_name(r.draft_rule)); },
            [](GenerateRequest& r, const std::string& v) { r.draft_rule = parse_draft_rule(v); })
        .def_readwrite("timeout", &GenerateRequest::timeout)
        .def_readwrite("cancel", &GenerateRequest::cancel);

    py::class_<Engine>(m, "Engine")
        .def(py::init([](const std::string& target, const std::optional<std::string>& draft,
                         int n_draft, int n_ctx, int n_batch, int n_threads, int n_gpu_layers,
                         int draft_n_gpu_layers, const std::string& ngram, int ngram_min,
                         int ngram_max, bool verbose, uintptr_t target_model, uintptr_t draft_model,
                         int n_parallel, size_t ngram_index_bytes) {
                 EngineConfig c;
                 c.target = model_params(target, n_gpu_layers, n_ctx, n_batch, n_threads);
                 c.target.borrowed = reinterpret_cast<llama_model*>(target_model);
                 if (draft) {
                     c.draft = model_params(*draft, draft_n_gpu_layers, n_ctx, n_batch, n_threads);
                     c.draft->borrowed = reinterpret_cast<llama_model*>(draft_model);
                 }
                 c.n_draft = n_draft;
                 c.ngram = parse_ngram_use(ngram);
                 c.ngram_min = ngram_min;
                 c.ngram_max = ngram_max;
                 c.ngram_index_bytes = ngram_index_bytes;
                 c.verbose = verbose;
                 c.n_parallel = n_parallel;
                 WithoutGil release;
                 return std::make_unique<Engine>(c);
             }),
             py::arg("target"), py::arg("draft") = py::none(), py::arg("n_draft") = 4,
             py::arg("n_ctx") = 4096, py::arg("n_batch") = 512, py::arg("n_threads") = 0,
             py::arg("n_gpu_layers") = 0, py::arg("draft_n_gpu_layers") = 0,
             py::arg("ngram") = "off", py::arg("ngram_min") = 1, py::arg("ngram_max") = 4,
             py::arg("verbose") = false, py::arg("target_model") = 0, py::arg("draft_model") = 0,
             py::arg("n_parallel") = 1, py::arg("ngram_index_bytes") = 0)
        .def(
            "generate",
            [](Engine& e, GenerateRequest request, const py::object& on_text,
               const py::object& on_start, const py::object& on_logprobs) {
                return run_generate(e, std::move(request), on_text, on_start, on_logprobs);
            },
            py::arg("request"), py::arg("on_text") = py::none(), py::arg("on_start") = py::none(),
            py::arg("on_logprobs") = py::none())
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
                 const auto [p, batch] = e.costs();
                 py::dict d;
                 d["calibrated"] = p.calibrated();
                 d["drafting_can_pay"] = p.calibrated() && p.can_ever_pay();
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
                 d["measured_rates"] = measured_rates(e.rate_check(), e.n_parallel());
                 return d;
             })
        .def("set_rate_check", &Engine::set_rate_check, py::arg("on"), py::arg("under_load") = true)
        .def("set_grammar_drafts", &Engine::set_grammar_drafts, py::arg("on"))
        .def(
            "grammar_special",
            [](const Engine& e, int token) { return grammar_special(e.target(), token); },
            py::arg("token"))
        .def("set_calibration", &Engine::set_calibration, py::arg("verify_costs"),
             py::arg("draft_costs"), py::arg("batch_verify_costs") = py::list(),
             py::arg("batch_draft_costs") = py::list(), py::call_guard<WithoutGil>())
        .def("shutdown", &Engine::shutdown, py::call_guard<WithoutGil>())
        // The vocabulary is read-only once loaded, and a long text takes a while: these let
        // other threads (the scheduler's callbacks, a server's event loop) run meanwhile.
        .def("tokenize",
             [](const Engine& e, const std::string& text, bool add_special, bool parse_special) {
                 WithoutGil unlocked;
                 return e.target().tokenize(text, add_special, parse_special);
             })
        .def("token_bytes",
             [](const Engine& e, const std::vector<int32_t>& tokens) {
                 std::vector<std::string> pieces;
                 {
                     WithoutGil unlocked;
                     e.check_tokens(tokens);
                     pieces.reserve(tokens.size());
                     for (int32_t t : tokens) pieces.push_back(e.target().token_piece(t));
                 }
                 std::vector<py::bytes> out;
                 out.reserve(pieces.size());
                 for (const auto& piece : pieces) out.emplace_back(piece);
                 return out;
             })
        .def("detokenize",
             [](const Engine& e, const std::vector<int32_t>& tokens) {
                 std::string text;
                 {
                     WithoutGil unlocked;
                     text = e.target().detokenize(tokens);
                 }
                 return to_str(text);
             })
        .def(
            "apply_chat_template",
            [](const Engine& e, const std::vector<std::pair<std::string, std::string>>& messages,
               bool add_generation_prompt, const std::string& template_name) {
                return e.target().apply_chat_template(messages, add_generation_prompt,
                                                      template_name);
            },
            py::arg("messages"), py::arg("add_generation_prompt"), py::arg("template_name") = "")
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
                 d["add_bos"] = llama_vocab_get_add_bos(m->vocab());
                 d["add_eos"] = llama_vocab_get_add_eos(m->vocab());
                 const char* chat_template = llama_model_chat_template(m->model(), nullptr);
                 d["has_chat_template"] = chat_template != nullptr;
                 // Its text, for the tool-call formats that need the template rendered.
                 d["chat_template"] = to_str(chat_template ? chat_template : "");
                 // Some GGUFs (Hermes 2 Pro, Hermes 3) keep the one that takes tools apart.
                 const char* tool_use = llama_model_chat_template(m->model(), "tool_use");
                 d["chat_template_tool_use"] = to_str(tool_use ? tool_use : "");
                 return d;
             })
        .def_property_readonly("n_draft", &Engine::n_draft)
        .def_property_readonly("has_draft", [](const Engine& e) { return e.draft() != nullptr; })
        .def_property_readonly("n_parallel", &Engine::n_parallel)
        .def_property_readonly("n_threads_now", &Engine::n_threads_now)
        .def_property_readonly("ngram_index_tokens", &Engine::ngram_index_tokens)
        .def_property_readonly("ngram_index_bytes", &Engine::ngram_index_bytes)
        .def("save_ngram_index", &Engine::save_ngram_index, py::arg("path"),
             py::call_guard<WithoutGil>())
        .def("load_ngram_index", &Engine::load_ngram_index, py::arg("path"),
             py::call_guard<WithoutGil>())
        .def_property_readonly("running_on_this_thread", &Engine::running_on_this_thread)
        .def_property_readonly("n_ctx", [](const Engine& e) { return e.target().n_ctx(); });

    m.attr("MAX_DRAFT") = Engine::kMaxDraft;
    m.attr("MAX_PARALLEL") = Engine::kMaxParallel;
    m.def("set_log_verbose", &install_log_handler, py::arg("verbose"),
          "Routes llama.cpp's log through specdec: printed when verbose, else kept for errors.");
    m.def("chat_template_names", &chat_template_names,
          "The chat templates llama.cpp knows by name.");
    m.def("system_info", []() { return std::string(llama_print_system_info()); });
    m.def("load_constraint_library", &load_constraint_library, py::arg("path"),
          "Loads llguidance's C API from its shared library (structured output).");
    m.attr("MAX_TOP_LOGPROBS") = kMaxTopLogprobs;
    m.def("drain_native_calls", &drain_native_calls, py::arg("timeout_s"),
          "Waits until no call into the engine runs without the GIL; False after timeout_s.");
    m.def("supports_gpu_offload", []() { return llama_supports_gpu_offload(); });
    m.def("check_request_values", &Engine::check_request_values, py::arg("request"),
          "ValueError for values no model could accept (the prompt is not checked).");

#ifdef SPECDEC_TEST_HOOKS
    bind_testing(m.def_submodule("testing", "Test hooks: the maths and rules alone. Not API."));
#endif
}
