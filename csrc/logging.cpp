#include "logging.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "llama.h"

namespace specdec {
namespace {

std::atomic<bool> g_verbose{false};
thread_local std::string t_recent_errors;

void log_callback(ggml_log_level level, const char* text, void* /*user_data*/) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::string line(text);
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
        // Keep the buffer bounded: a failing load can log many lines.
        if (!line.empty() && t_recent_errors.size() < 2000) {
            if (!t_recent_errors.empty()) t_recent_errors += "; ";
            t_recent_errors += line;
        }
    }
    if (g_verbose.load(std::memory_order_relaxed)) std::fputs(text, stderr);
}

}  // namespace

void install_log_handler(bool verbose) {
    static std::once_flag once;
    g_verbose.store(verbose);
    std::call_once(once, [] { llama_backend_init(); });
    // Set every time: importing llama_cpp installs its own callback over ours.
    llama_log_set(log_callback, nullptr);
}

void clear_recent_errors() { t_recent_errors.clear(); }

std::string recent_errors() { return t_recent_errors; }

}  // namespace specdec
