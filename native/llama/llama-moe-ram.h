#pragma once

#include "llama-moe-cache.h"
#include "llama-moe-file.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

// the RAM tier (llama_moe_cache_params.in_ram), for models larger than RAM: the slots are the experts
// kept in host memory, over experts the loader left mapped and unread (LLAMA_LAZY_MODE_EXPERTS).
// Before a layer's CPU matmuls run, its observer reads every selected expert that is not resident
// from the model file, all at once; an expert that loses its slot, or was read for one layer
// without one, is dropped (its pages unmapped, then released from the page cache). The CPU computes
// every expert through the mapping with stock's kernels; no device, no upload worker
class llama_moe_ram : public llama_moe_cache {
public:
    llama_moe_ram(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch);

    bool splits(uint32_t n_tokens, uint32_t n_outputs) const override {
        GGML_UNUSED(n_tokens);
        GGML_UNUSED(n_outputs);
        return true; // every ubatch is observed
    }

    void record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) override;

    bool stopped() const override { return changed; }

protected:
    void observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) override;
    void boundary_begin() override;
    void boundary_end(uint32_t n_tokens, uint32_t n_outputs) override;
    bool file_changed() const override { return changed; }
    void evicted(int32_t i, int32_t expert) override { drop(i, expert); }

private:
    using time_point = std::chrono::steady_clock::time_point;

    void read_all();

    // during the graph: layer cl's misses read in, the tables of its two passes
    void read_misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted,
                     const ggml_tensor * now, const ggml_tensor * later);
    std::vector<llama_moe_upload> misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted);
    bool reads_ahead(int32_t i) const;
    void start_late_reads(std::vector<llama_moe_upload> & reads, int32_t n_admitted, time_point t0);
    void finish_late_reads();
    void read_ahead(int32_t i);
    std::vector<llama_moe_upload> finish_read_ahead();

    // read the experts in from the model file (all at once), drop them from memory
    bool read_in(const std::vector<llama_moe_upload> & jobs, size_t & n_bytes);
    void read_staged();
    void fail_reads();
    void drop(int32_t i, int32_t expert);
    void drop_transient();
    void release_unkept();

    llama_moe_model_files files;
    std::atomic<bool>     changed{false}; // a model file changed or could not be read: the tier stops

    std::vector<llama_moe_upload> transient; // experts read for one layer of one ubatch without a slot

    bool     released    = false; // release_unkept ran
    int32_t  last_il     = -1;    // the model's last layer, which runs only the outputs
    uint32_t ubatch_rows = 0;     // tokens of the ubatch
    uint32_t ubatch_outs = 0;     // its outputs

    // the read-ahead: in a ubatch that selects most experts of a layer (a prompt), the next layer's
    // experts are read while this one computes
    std::vector<llama_moe_upload> ahead_jobs;

    // the reads of a layer's misses while its first pass computes the resident experts (a layer with
    // skip_late, in a ubatch without read-ahead); the second pass joins them
    std::vector<llama_moe_upload> late_jobs;
    int32_t                       late_admitted = 0;
    time_point                    late_t0;

    // last: their threads stop before the members they use go
    llama_moe_read_thread ahead;
    llama_moe_read_thread late;
};
