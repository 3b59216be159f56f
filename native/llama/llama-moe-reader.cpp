#include "llama-moe-reader.h"

#include <algorithm>

llama_moe_reader::llama_moe_reader(const llama_moe_model_files & files) : files(files) {
    thread      = std::thread([this]() { run(); });
    drop_thread = std::thread([this]() { run_drops(); });
}

llama_moe_reader::~llama_moe_reader() {
    {
        std::lock_guard<std::mutex> lock(mutex);
        stopping = true;
    }
    work.notify_all();
    dropping.notify_all();
    thread.join();
    drop_thread.join();
}

// ranges of one file that follow each other, in the file and in its mapping, are read as one (the
// huge pages inside experts apart from the small ones around them)
static void moe_merge(std::vector<llama_moe_file_range> & ranges) {
    std::sort(ranges.begin(), ranges.end(), [](const llama_moe_file_range & a, const llama_moe_file_range & b) {
        return a.file != b.file ? a.file < b.file : a.offset < b.offset;
    });
    std::vector<llama_moe_file_range> merged;
    for (const auto & r : ranges) {
        auto * last = merged.empty() ? nullptr : &merged.back();
        if (last && last->file == r.file && last->huge == r.huge && last->offset + last->size == r.offset &&
                (const char *) last->mapped + last->size == (const char *) r.mapped) {
            last->size += r.size;
        } else {
            merged.push_back(r);
        }
    }
    ranges.swap(merged);
}

uint64_t llama_moe_reader::queue(std::vector<llama_moe_file_range> ranges, uint64_t after_drop) {
    if (ranges.empty()) {
        return 0;
    }
    files.split_huge(ranges);
    moe_merge(ranges);
    uint64_t ticket;
    {
        std::lock_guard<std::mutex> lock(mutex);
        ticket = ++n_queued;
        batches.push_back({ ticket, std::move(ranges), after_drop });
    }
    work.notify_one();
    return ticket;
}

uint64_t llama_moe_reader::drop(std::vector<llama_moe_file_range> ranges) {
    if (ranges.empty()) {
        return 0;
    }
    uint64_t n;
    {
        std::lock_guard<std::mutex> lock(mutex);
        drops.insert(drops.end(), ranges.begin(), ranges.end());
        n = ++n_drops;
    }
    dropping.notify_one();
    return n;
}

uint64_t llama_moe_reader::dropped() {
    std::lock_guard<std::mutex> lock(mutex);
    return n_dropped;
}

uint64_t llama_moe_reader::last_drop() {
    std::lock_guard<std::mutex> lock(mutex);
    return n_drops;
}

void llama_moe_reader::wait_drops() {
    std::unique_lock<std::mutex> lock(mutex);
    completed.wait(lock, [&]() { return n_dropped == n_drops; });
}

// every drop queued, in one go; then the batches waiting for them may start
void llama_moe_reader::run_drops() {
    std::vector<llama_moe_file_range> taken;
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
        dropping.wait(lock, [&]() { return stopping || !drops.empty(); });
        if (stopping) {
            return;
        }
        taken.clear();
        taken.swap(drops);
        const uint64_t n = n_drops;
        lock.unlock();
        for (const auto & r : taken) {
            files.drop(r);
        }
        lock.lock();
        n_dropped = n;
        work.notify_one();
        completed.notify_all();
    }
}

bool llama_moe_reader::wait(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mutex);
    completed.wait(lock, [&]() { return n_done >= ticket || failed; });
    return !failed;
}

bool llama_moe_reader::done(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex);
    return n_done >= ticket || failed;
}

uint64_t llama_moe_reader::last() {
    std::lock_guard<std::mutex> lock(mutex);
    return n_queued;
}

// (under the lock) the ranges the window lets start now, in the order queued
void llama_moe_reader::start_window(std::vector<llama_moe_file_range> & to_start) {
    for (auto & b : batches) {
        if (b.after_drop > n_dropped) {
            return;
        }
        while (b.n_started < b.ranges.size() && (in_flight < window || in_flight == 0)) {
            to_start.push_back(b.ranges[b.n_started++]);
            in_flight += to_start.back().size;
        }
    }
}

// start what the window allows, map the oldest range started, repeat; a batch whose ranges are all
// mapped is done (after a check that the files did not change: its pages might be another file's)
void llama_moe_reader::run() {
    std::vector<llama_moe_file_range> to_start;
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
        work.wait(lock, [&]() { return stopping || (!batches.empty() && batches.front().after_drop <= n_dropped); });
        if (stopping) {
            return;
        }
        to_start.clear();
        start_window(to_start);
        batch & front = batches.front(); // (a deque keeps references to the elements it keeps)
        const llama_moe_file_range range = front.ranges[front.n_mapped];
        lock.unlock();
        for (const auto & r : to_start) {
            files.start(r);
        }
        bool ok = files.map(range);
        const bool last_range = front.n_mapped + 1 == front.ranges.size(); // only this thread moves n_mapped
        if (last_range) {
            ok = ok && files.unchanged();
        }
        lock.lock();
        in_flight -= range.size;
        front.n_mapped++;
        failed = failed || !ok;
        if (last_range) {
            n_done = front.ticket;
            batches.pop_front();
            completed.notify_all();
        } else if (failed) {
            completed.notify_all();
        }
    }
}
