// How many threads a decode gets on a machine the engine may share with other processes.
#pragma once

#include <chrono>
#include <vector>

namespace specdec {

// The cores this process may use: the CPUs of its affinity mask (taskset, a cpuset), at most
// its cgroup's CPU quota (a container's CPU limit), at least 1.
int usable_cores();

// The threads of one llama.cpp decode wait for each other at every barrier (one per graph
// node), so one thread that the kernel deschedules stalls all the others: beside two busy
// processes on two cores, two threads ran 2-10x slower than one. While other processes keep
// this process's CPUs busy the decode gets the ones they leave idle (at least one); alone, all
// of `max`.
class ThreadGovernor {
  public:
    // `enabled` false: always `max` (the user chose the thread count).
    ThreadGovernor(int max, bool enabled);
    // The threads for the next decode. Looks at the machine at most every kInterval (two small
    // reads of /proc; the first look kFirstLook after construction), and moves down at once but
    // up only after two looks agree.
    int threads();
    int current() const { return current_; }

  private:
    struct Sample {
        long long busy = 0, total = 0;  // clock ticks of the allowed CPUs
        long long self = 0;             // clock ticks of this process
        bool ok = false;
    };
    Sample read_sample();
    // Of the allowed CPUs, how many other processes kept busy since the last sample.
    double others_busy(const Sample& now) const;

    static constexpr std::chrono::milliseconds kInterval{500};
    static constexpr std::chrono::milliseconds kFirstLook{100};  // after the first sample
    const int max_;
    const bool enabled_;
    int current_;
    int pending_up_ = 0;  // looks in a row that found room for more threads
    bool looked_ = false;
    std::vector<bool> allowed_;  // [cpu]: in this process's affinity mask
    std::vector<char> buf_;      // the /proc files' text, reused
    int n_allowed_ = 1;
    Sample last_;
    std::chrono::steady_clock::time_point last_look_;
};

}  // namespace specdec
