#pragma once

#include "llama.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

// an expert on its way into a slot: what an upload copies to the device (the device tier) or reads
// into memory (the RAM tier)
struct llama_moe_upload {
    int32_t i      = 0;  // cached layer
    int32_t expert = 0;
    int32_t slot   = -1; // -1: the RAM tier's expert read for one layer of one ubatch, in no slot
    bool    lane   = false; // a copy-on-miss lane copy: the running graph reads it

    int32_t replaced = -1; // eager admission: the expert the slot held, -1 when none
};

// the device tier's upload worker: a thread that copies experts into their slots, off the decode
// thread, in the order they were started, but for the copy-on-miss lane's, which go first. Once a
// copy fails (a model file it reads changed) no other one runs
class llama_moe_upload_worker {
public:
    // copies one expert into its slot, adding the bytes copied; false when what it reads changed
    using copy_fn = std::function<bool(const llama_moe_upload & job, size_t & n_bytes)>;

    ~llama_moe_upload_worker();

    // starts the thread, for the uploads of n_layers cached layers
    void start(int32_t n_layers, copy_fn copy);

    void    enqueue(const std::vector<llama_moe_upload> & jobs);
    int64_t wait();    // until every started upload is complete; returns the microseconds waited
    int32_t pending(); // started uploads not complete yet
    bool    failed() const { return copy_failed; }

    // until the lane's copies are complete; false when one failed since the last call
    bool wait_lane();

    // adds layer i's completed uploads, their bytes and time to c
    void add_counters(int32_t i, llama_moe_cache_counters & c);

private:
    void run();
    bool next(llama_moe_upload & job); // false: stop
    void done(const llama_moe_upload & job, bool ok, size_t n_bytes, int64_t t_us);

    copy_fn copy;

    std::thread                   thread;
    std::mutex                    mtx;
    std::condition_variable       cv_todo;
    std::condition_variable       cv_idle;
    std::deque<llama_moe_upload>  todo;
    std::deque<llama_moe_upload>  lane_todo;        // the lane's copies: before any other
    int32_t                       n_busy      = 0;
    int32_t                       n_lane_left = 0;  // lane copies started and not complete
    bool                          lane_ok     = true; // no lane copy failed since wait_lane
    bool                          stop        = false;
    std::atomic<bool>             copy_failed{false};

    std::vector<llama_moe_cache_counters> counters; // [n_layers] uploads, upload_bytes, upload_us; under mtx
};
