#include "cpu_share.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace specdec {
namespace {

std::vector<bool> affinity_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<bool> cpus;
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) {
            cpus.resize(static_cast<size_t>(cpu) + 1, false);
            cpus[static_cast<size_t>(cpu)] = true;
        }
    return cpus;
}

// cgroup v2's cpu.max: "QUOTA PERIOD", or "max PERIOD" for none; 0 when there is none.
int cgroup_cpu_quota() {
    std::ifstream file("/sys/fs/cgroup/cpu.max");
    std::string quota;
    long long period = 0;
    if (!(file >> quota >> period) || quota == "max" || period <= 0) return 0;
    const long long q = std::atoll(quota.c_str());
    return q > 0 ? static_cast<int>((q + period - 1) / period) : 0;
}

// Reads a /proc file whole into `buf` (its capacity, kept between calls: the governor reads
// from the step loop and allocates nothing there once warm); false when unreadable.
bool read_proc(const char* path, std::vector<char>& buf) {
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    size_t size = 0;
    while (true) {
        if (size + 1 >= buf.size()) buf.resize(std::max<size_t>(4096, 2 * buf.size()));
        const ssize_t n = ::read(fd, buf.data() + size, buf.size() - size - 1);
        if (n <= 0) break;
        size += static_cast<size_t>(n);
    }
    ::close(fd);
    buf[size] = '\0';
    return size > 0;
}

// The utime + stime of this process from /proc/self/stat's text, in clock ticks; -1 when
// unreadable. Fields 14 and 15; the command (field 2) may hold spaces: count from its ')'.
long long own_ticks(const char* stat) {
    const char* p = std::strrchr(stat, ')');
    if (p == nullptr) return -1;
    ++p;
    long long ticks = 0;
    for (int field = 3; field <= 15; ++field) {
        char* end = nullptr;
        const long long value = std::strtoll(p, &end, 10);
        if (end == p) {  // not a number (field 3 is the state letter): skip the word
            while (*p == ' ') ++p;
            while (*p != ' ' && *p != '\0') ++p;
        } else {
            p = end;
        }
        if (field == 14 || field == 15) ticks += value;
    }
    return ticks;
}

}  // namespace

int usable_cores() {
    const std::vector<bool> cpus = affinity_cpus();
    int n = static_cast<int>(std::count(cpus.begin(), cpus.end(), true));
    if (n == 0) n = static_cast<int>(std::thread::hardware_concurrency());
    const int quota = cgroup_cpu_quota();
    if (quota > 0) n = std::min(n, quota);
    return std::max(1, n);
}

ThreadGovernor::ThreadGovernor(int max, bool enabled)
    : max_(std::max(1, max)),
      enabled_(enabled),
      current_(max_),
      allowed_(affinity_cpus()),
      last_look_(std::chrono::steady_clock::now()) {
    n_allowed_ = std::max(1, static_cast<int>(std::count(allowed_.begin(), allowed_.end(), true)));
    if (enabled_) last_ = read_sample();
}

ThreadGovernor::Sample ThreadGovernor::read_sample() {
    Sample s;
    if (!read_proc("/proc/stat", buf_)) return s;
    // "cpuN user nice system idle iowait irq softirq steal ..." per CPU, after the "cpu " total.
    for (const char* line = buf_.data(); std::strncmp(line, "cpu", 3) == 0;) {
        const char* p = line + 3;
        char* end = nullptr;
        const long long cpu = std::strtoll(p, &end, 10);
        // The total's line is "cpu  ..." (no number right after "cpu"): skipped.
        if (*p >= '0' && *p <= '9' && static_cast<size_t>(cpu) < allowed_.size() &&
            allowed_[static_cast<size_t>(cpu)]) {
            long long v[8] = {};  // user nice system idle iowait irq softirq steal
            p = end;
            for (long long& x : v) {
                x = std::strtoll(p, &end, 10);
                p = end;
            }
            const long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
            s.busy += busy;
            s.total += busy + v[3] + v[4];
        }
        const char* next = std::strchr(line, '\n');
        if (next == nullptr) break;
        line = next + 1;
    }
    if (!read_proc("/proc/self/stat", buf_)) return s;
    s.self = own_ticks(buf_.data());
    s.ok = s.total > 0 && s.self >= 0;
    return s;
}

double ThreadGovernor::others_busy(const Sample& now) const {
    const long long total = now.total - last_.total;
    if (total <= 0) return 0.0;
    const double others = static_cast<double>(now.busy - last_.busy - (now.self - last_.self));
    // total counts the ticks of every allowed CPU: per CPU, the interval is total / n ticks.
    return std::max(0.0, others * n_allowed_ / static_cast<double>(total));
}

int ThreadGovernor::threads() {
    if (!enabled_) return max_;
    const auto now_time = std::chrono::steady_clock::now();
    if (now_time - last_look_ < (looked_ ? kInterval : kFirstLook)) return current_;
    last_look_ = now_time;
    looked_ = true;
    const Sample now = read_sample();
    if (!now.ok || !last_.ok) {
        last_ = now;
        return current_;
    }
    const double others = others_busy(now);
    last_ = now;
    // A core counts as taken when others used most of it (0.6: a 30 % background task does
    // not cost a thread).
    const int free_cores = n_allowed_ - static_cast<int>(std::floor(others + 0.4));
    const int fit = std::clamp(free_cores, 1, max_);
    if (fit < current_) {
        current_ = fit;
        pending_up_ = 0;
    } else if (fit > current_) {
        // Our own fewer threads leave room that looks free: move up once two looks agree.
        if (++pending_up_ >= 2) {
            current_ = fit;
            pending_up_ = 0;
        }
    } else {
        pending_up_ = 0;
    }
    return current_;
}

}  // namespace specdec
