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
// batch and, later, wait for its ticket. A second thread drops the experts the tier lets go (their
// pages unmapped and released from the page cache: the kernel's work per page, off the compute
// threads); a batch starts once the drops its queue call names are done
class llama_moe_reader {
public:
    static constexpr size_t window = 64u << 20;

    explicit llama_moe_reader(const llama_moe_model_files & files);
    ~llama_moe_reader(); // the range being mapped completes; nothing else queued is read

    // queue the ranges (those that touch merged into one request), to start once drop after_drop is done
    // (0: at once); the ticket of the batch (0: nothing to read)
    uint64_t queue(std::vector<llama_moe_file_range> ranges, uint64_t after_drop);

    // queue the ranges to drop (llama_moe_model_files::drop); the drop's number, done once dropped()
    // reaches it (0: nothing to drop)
    uint64_t drop(std::vector<llama_moe_file_range> ranges);
    uint64_t dropped();
    uint64_t last_drop();  // the last drop queued
    void     wait_drops(); // every drop queued is done

    // wait until every batch up to ticket is read and mapped; false once a read failed or a file changed
    bool wait(uint64_t ticket);
    bool done(uint64_t ticket);
    uint64_t last(); // the last ticket queued

private:
    struct batch {
        uint64_t                          ticket = 0;
        std::vector<llama_moe_file_range> ranges;
        uint64_t                          after_drop = 0;
        size_t                            n_started = 0;
        size_t                            n_mapped  = 0;
    };

    void run();
    void run_drops();
    void start_window(std::vector<llama_moe_file_range> & to_start);

    const llama_moe_model_files & files;

    std::mutex              mutex;
    std::condition_variable work;      // a batch queued, drops done, or stop
    std::condition_variable completed; // a batch done, or drops
    std::condition_variable dropping;  // drops queued, or stop
    std::deque<batch>       batches;   // queued, not done
    uint64_t                n_queued  = 0;
    uint64_t                n_done    = 0;
    size_t                  in_flight = 0; // bytes started, not mapped
    bool                    failed    = false;
    bool                    stopping  = false;

    std::vector<llama_moe_file_range> drops; // queued, not taken
    uint64_t                          n_drops   = 0;
    uint64_t                          n_dropped = 0;

    std::thread thread; // last: they stop before the members they use go
    std::thread drop_thread;
};
