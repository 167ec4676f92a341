// Checks of a GGUF file made before llama.cpp loads it: llama.cpp aborts the process (rather
// than failing the load) on some malformed hyper-parameters.
#pragma once

#include <string>

namespace specdec {

// Throws ModelLoadError naming the problem: a file that cannot be opened, is empty, is not GGUF,
// has an unreadable header, or a hyper-parameter out of range (naming the key).
void check_model_file(const std::string& path);

}  // namespace specdec
