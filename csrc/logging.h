// Routes llama.cpp's log output: silent unless verbose, with recent errors kept for messages.
#pragma once

#include <string>

namespace specdec {

// Installs our log callback (again: another library may have replaced it) and sets verbosity.
void install_log_handler(bool verbose);

// Clears the recent-error buffer of the calling thread.
void clear_recent_errors();

// The error lines llama.cpp logged on the calling thread since the last clear, joined by "; ".
std::string recent_errors();

}  // namespace specdec
