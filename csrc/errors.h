// Error types the engine throws; bindings.cpp maps each to a Python exception.
#pragma once

#include <stdexcept>
#include <string>

namespace specdec {

// A model file that cannot be loaded (missing, not GGUF, truncated, unsupported architecture).
struct ModelLoadError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Target and draft cannot be paired: their vocabularies differ.
struct VocabMismatchError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The model's memory cannot do what speculation needs (e.g. partial rollback of recurrent state).
struct UnsupportedModelError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A request that does not fit the context window.
struct ContextOverflowError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A model produced NaN or infinite logits: its file or the backend computing it is broken.
struct NonFiniteLogitsError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The engine was called again from the thread it is already running on (e.g. from a callback):
// waiting for itself would never end.
struct ReentrantCallError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A call was stopped: its cancel flag (Ctrl-C sets it), shutdown, or a callback that raised.
struct Cancelled : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A file the engine reads or writes (the shared n-gram index's) cannot be: an OSError.
struct FileError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A request ran past its deadline.
struct TimedOut : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace specdec
