#pragma once

#include "llama-moe-file.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

// the RAM tier's reads, on one thread of their own: batches of ranges of the model files, in the
// order queued, each range started into the page cache without a copy (readahead(2): the disk works
// on up to `window` bytes ahead of the range being mapped) and then mapped (MADV_POPULATE_READ), so
// that the CPU computes the experts without a page fault; the whole huge pages inside an expert's
// part are read by that mapping's faults, one large folio each (llama_moe_model_files::split_huge).
// The thread mostly sleeps on the disk: it takes little from the compute threads, which only queue a
// batch and, later, wait for its ticket
class llama_moe_reader {
public:
    static constexpr size_t window = 64u << 20;

    explicit llama_moe_reader(const llama_moe_model_files & files);
    ~llama_moe_reader(); // the range being mapped completes; nothing else queued is read

    // queue the ranges (those that touch merged into one request); the ticket of the batch (0: nothing
    // to read)
    uint64_t queue(std::vector<llama_moe_file_range> ranges);

    // wait until every batch up to ticket is read and mapped; false once a read failed or a file changed
    bool wait(uint64_t ticket);
    bool done(uint64_t ticket);
    uint64_t last(); // the last ticket queued

private:
    struct batch {
        uint64_t                          ticket = 0;
        std::vector<llama_moe_file_range> ranges;
        size_t                            n_started = 0;
        size_t                            n_mapped  = 0;
    };

    void run();
    void start_window(std::vector<llama_moe_file_range> & to_start);

    const llama_moe_model_files & files;

    std::mutex              mutex;
    std::condition_variable work;      // a batch queued, or stop
    std::condition_variable completed; // a batch done
    std::deque<batch>       batches;   // queued, not done
    uint64_t                n_queued  = 0;
    uint64_t                n_done    = 0;
    size_t                  in_flight = 0; // bytes started, not mapped
    bool                    failed    = false;
    bool                    stopping  = false;

    std::thread thread; // last: it stops before the members it uses go
};
