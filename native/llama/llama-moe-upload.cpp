#include "llama-moe-upload.h"

#include <chrono>
#include <exception>

llama_moe_upload_worker::~llama_moe_upload_worker() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stop = true;
    }
    cv_todo.notify_all();
    if (thread.joinable()) {
        thread.join();
    }
}

void llama_moe_upload_worker::start(int32_t n_layers, copy_fn fn) {
    copy = std::move(fn);
    counters.assign(n_layers, {});
    thread = std::thread([this]() { run(); });
}

void llama_moe_upload_worker::enqueue(const std::vector<llama_moe_upload> & jobs) {
    if (jobs.empty()) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mtx);
        for (const auto & job : jobs) {
            (job.lane ? lane_todo : todo).push_back(job);
            n_lane_left += job.lane;
        }
    }
    cv_todo.notify_one();
}

int64_t llama_moe_upload_worker::wait() {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mtx);
    cv_idle.wait(lock, [this]() { return todo.empty() && lane_todo.empty() && n_busy == 0; });
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

int32_t llama_moe_upload_worker::pending() {
    std::lock_guard<std::mutex> lock(mtx);
    return (int32_t) (todo.size() + lane_todo.size()) + n_busy;
}

bool llama_moe_upload_worker::wait_lane() {
    std::unique_lock<std::mutex> lock(mtx);
    cv_idle.wait(lock, [this]() { return n_lane_left == 0; });
    const bool ok = lane_ok;
    lane_ok = true;
    return ok;
}

void llama_moe_upload_worker::add_counters(int32_t i, llama_moe_cache_counters & c) {
    std::lock_guard<std::mutex> lock(mtx);
    c.uploads      += counters.at(i).uploads;
    c.upload_bytes += counters.at(i).upload_bytes;
    c.upload_us    += counters.at(i).upload_us;
}

void llama_moe_upload_worker::run() {
    llama_moe_upload job;
    while (next(job)) {
        const auto t0 = std::chrono::steady_clock::now();
        size_t n_bytes = 0;
        bool ok = false;
        try {
            ok = !copy_failed && copy(job, n_bytes);
        } catch (const std::exception &) {
            // a failed read: as a changed file
        }
        const int64_t t_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
        done(job, ok, n_bytes, t_us);
    }
}

bool llama_moe_upload_worker::next(llama_moe_upload & job) {
    std::unique_lock<std::mutex> lock(mtx);
    cv_todo.wait(lock, [this]() { return stop || !todo.empty() || !lane_todo.empty(); });
    if (stop) {
        return false;
    }
    auto & queue = lane_todo.empty() ? todo : lane_todo;
    job = queue.front();
    queue.pop_front();
    n_busy++;
    return true;
}

void llama_moe_upload_worker::done(const llama_moe_upload & job, bool ok, size_t n_bytes, int64_t t_us) {
    if (!ok) {
        copy_failed = true; // before the job stops counting as pending: see llama_moe_cache::apply
    }
    {
        std::lock_guard<std::mutex> lock(mtx);
        if (ok) {
            auto & c = counters[job.i];
            c.uploads++;
            c.upload_bytes += n_bytes;
            c.upload_us    += t_us;
        } else {
            todo.clear();
            n_lane_left -= (int32_t) lane_todo.size();
            lane_ok = lane_ok && lane_todo.empty();
            lane_todo.clear();
        }
        if (job.lane) {
            n_lane_left--;
            lane_ok = lane_ok && ok;
        }
        n_busy--;
    }
    cv_idle.notify_all();
}
