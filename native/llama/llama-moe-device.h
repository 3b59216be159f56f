#pragma once

#include "llama-moe-cache.h"
#include "llama-moe-file.h"
#include "llama-moe-upload.h"

#include <atomic>
#include <cstdint>
#include <vector>

// the device tier: n_slots experts of each cached layer mirrored in banks on the device of the
// layer's router, copied there by the upload worker (from the host tensors, or from the model files
// for repacked experts and for experts mapped and unread), and the slot and skip tables that the
// split graph reads, rewritten only between two graphs but for the copy-on-miss lane's entries
class llama_moe_device : public llama_moe_cache {
public:
    llama_moe_device(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch);

    bool splits(uint32_t n_tokens, uint32_t n_outputs) const override {
        return n_tokens <= (uint32_t) max_batch && n_outputs == n_tokens;
    }

    void record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) override;

    void set_below(const llama_moe_cache * ram) override;
    bool stopped() const override { return lane_failed; }

    size_t  device_bytes() const override { return device_size; }
    int64_t wait_uploads() override { return worker.wait(); }
    int32_t uploads_pending() override { return worker.pending(); }
    llama_moe_cache_counters counters(int32_t i) override; // waits for the uploads first

    void set_upload_delay_us(int64_t delay_us) override { upload_delay_us = delay_us; }

protected:
    void observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip) override;
    void boundary_begin() override;
    void boundary_end(uint32_t n_tokens, uint32_t n_outputs) override;
    bool file_changed() const override { return worker.failed(); }

private:
    // the slot_of tables of the layers cached on one device, in one tensor: one write per boundary
    struct slot_table {
        ggml_tensor *        slot_of = nullptr; // device I32 [1, sum of n_expert]
        std::vector<int32_t> bank;              // what slot_of is written
        bool                 dirty = true;
    };

    // the slots and the slot table of the layers whose routers are in buft, and their skip tables
    void place(ggml_backend_buffer_type_t buft, std::vector<llama_moe_cache_layer> & group, ggml_context * ctx_host);

    // the tables only change here, between two graphs
    void flush_tables();

    // a lane copy of expert into slot: the CPU skips it from now on, and this graph's device half
    // reads the slot
    void lend(const llama_moe_cache_layer & cl, int32_t expert, int32_t slot);

    // the upload worker's job: copy the expert's parts into its slot; false when a model file it reads changed
    bool upload(const llama_moe_upload & job, size_t & n_bytes);

    std::vector<slot_table> tables;      // one per device
    size_t                  device_size = 0;
    std::vector<int32_t>    n_calls;     // [n_layers] observer calls since the last boundary
    std::vector<const llama_moe_cache_layer *> below; // [n_layers] the RAM tier's layer under each (set_below)
    std::atomic<bool>       lane_failed{false}; // in the last graph

    llama_moe_model_files   files;       // read by the upload worker only
    ggml_backend_buffer_ptr staging;     // the worker's buffer for reads from a file (moe_staging_buffer)
    std::atomic<int64_t>    upload_delay_us{0}; // see llama_moe_cache_set_upload_delay_us

    // last: its thread stops before the members it uses go
    llama_moe_upload_worker worker;
};
