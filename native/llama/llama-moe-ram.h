#pragma once

#include "llama-moe-cache.h"
#include "llama-moe-file.h"
#include "llama-moe-reader.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

// the RAM tier (llama_moe_cache_params.in_ram), for models larger than RAM: the slots are the experts
// kept in host memory, over experts the loader left mapped and unread (LLAMA_LAZY_MODE_EXPERTS).
// Before a layer's CPU matmuls run, its observer queues every selected expert that is not resident
// for reading from the model file, then the experts the next layer's router, applied early to this
// layer's input (the first layer's: to the token embeddings), predicts (read_ahead); a reader thread
// reads them into the page cache and maps them while the CPU computes the experts kept. An expert that
// loses its slot, or was read for one layer without one, is spare: it stays in memory while the room
// beyond the slots has space (a decode token that selects it again reads nothing), and is dropped (its
// pages unmapped, then released from the page cache, on the reader's drop thread) when a read needs
// the space, oldest first but the first layer's last, or before a prompt. The CPU computes
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

    ggml_tensor * read_ahead(ggml_context * ctx, int32_t next, ggml_tensor * cur) const override;

    void built(const llama_moe_cache_layer & cl, int64_t n_rows, uint32_t n_tokens, uint32_t n_outputs) const override;

    // the graph's prediction of layer next's selections, ids I32 [n_used, n_tokens] (on the CPU, before
    // the observer of the layer before next runs; for the first layer, from the token embeddings, before
    // any: in decode its reads start here)
    void predicted(const llama_moe_cache_layer & next, const ggml_tensor * ids);

    bool stopped() const override { return changed; }

protected:
    void observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip) override;
    void boundary_begin() override;
    void boundary_end(uint32_t n_tokens, uint32_t n_outputs) override;
    bool file_changed() const override { return changed; }
    void evicted(int32_t i, int32_t expert) override { retire(i, expert); }

private:
    using time_point = std::chrono::steady_clock::time_point;

    // experts of one layer on their way in, a batch of the reader per part (the matmul that computes
    // a part waits for its own: parts), the last of them (ticket), and the bytes each expert took from
    // the file (0: resident already)
    struct reads {
        std::vector<int32_t>  experts;
        std::vector<size_t>   bytes;
        std::vector<uint64_t> parts; // [part] its batch; 0: nothing to read
        uint64_t              ticket = 0;
    };

    // an expert read for one layer without a slot
    struct transient_read {
        int32_t  i      = -1;
        int32_t  expert = -1;
        uint64_t ticket = 0;
    };

    // the reads of a layer the CPU waits for in its second pass, each matmul for its part's (or all of
    // them before its only pass)
    struct pending {
        int32_t               i      = -1; // the layer; -1: none
        uint64_t              ticket = 0;
        std::vector<uint64_t> parts;       // [part] the last batch holding its reads
        int32_t               n_waited   = 0; // the second pass's matmuls that waited
        int32_t               n_admitted = 0;
        time_point            t0;

        // wait for r's reads too, each part for r's batch of it (r read nothing: no parts)
        void join(const reads & r) {
            for (size_t k = 0; k < r.parts.size(); ++k) {
                parts[k] = std::max(parts[k], r.parts[k]);
            }
            ticket = std::max(ticket, r.ticket);
        }
    };

    void read_all();

    // during the graph: layer cl's misses queued, the next layer's predicted experts queued after
    // them, the tables of its two passes
    void read_misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted,
                     const ggml_tensor * now, const ggml_tensor * later);
    std::vector<int32_t> misses(const llama_moe_cache_layer & cl, pending & p);
    void note_transient(const llama_moe_cache_layer & cl, const reads & demand, const std::vector<llama_moe_upload> & admitted);
    void read_ahead_of(int32_t i);
    std::vector<int32_t> predicted_experts(int32_t i) const;
    bool whole_layer_ahead(int32_t i) const;
    void write_passes(const llama_moe_cache_layer & cl, const reads & demand, int32_t * first, int32_t * second) const;
    bool wait_reads(const pending & p, uint64_t ticket);
    void finish_reads(const pending & p);
    void finish_late_reads(const ggml_tensor * as);

    // the model file: reads queued to the reader, drops
    reads queue_reads(int32_t i, std::vector<int32_t> experts);
    bool read_in(const std::vector<llama_moe_upload> & jobs, size_t & n_bytes);
    void read_staged();
    void fail_reads();
    void drop(int32_t i, int32_t expert, std::vector<llama_moe_file_range> & ranges);
    uint64_t drop_of(int32_t i, int32_t expert);
    void retire(int32_t i, int32_t expert);
    void unretire(int32_t i, int32_t expert);
    void reclaim(size_t need);
    size_t transient_bytes() const;
    void   follow_growth();
    void retire_transient(bool all);
    void release_unkept();

    llama_moe_model_files files;
    std::atomic<bool>     changed{false}; // a model file changed or could not be read: the tier stops
    const bool            ahead_on;       // llama_moe_cache_params.read_ahead

    // experts whose drop is queued to the reader (drop: its number; 0 until reclaim queues it), not
    // known done
    struct dropping {
        int32_t  i      = -1;
        int32_t  expert = -1;
        uint64_t drop   = 0;
    };
    std::vector<dropping> drops;

    // experts read for one layer of one ubatch without a slot, each a spare once its layer has run and
    // its batch is done
    std::vector<transient_read> transient;

    // experts in memory that no slot keeps and no read of this ubatch uses (a slot's victim, or read
    // for a layer without a slot), oldest first, within room beside the reads in flight (reclaim)
    std::deque<std::pair<int32_t, int32_t>> spares;
    size_t                                  spare_bytes = 0;

    // what the spares may hold: the room, less what the process's anonymous memory grew by since the
    // first boundary (a context's outputs, a chat's logits): follow_growth
    size_t spare_room     = 0;
    size_t anon_at_sizing = 0;

    bool     released    = false; // release_unkept ran
    uint32_t ubatch_rows = 0;     // tokens of the ubatch
    uint32_t ubatch_outs = 0;     // its outputs

    // [n_layers] 1: the layer runs only a ubatch's outputs, as the graphs built show (a graph whose
    // every token is an output shows nothing); before any does, the model's last layer alone.
    // Mutable: the graph, which holds the tier as const, tells it a fact of the model (built)
    mutable std::vector<uint8_t> outputs_only;

    // the bytes of experts read beyond the slots that the tier holds at once, read-ahead included: one
    // layer's reads for a full ubatch, what the sizing leaves for them (moecache.live.ramtier.plan_ram)
    size_t room = 0;

    std::vector<std::vector<int32_t>> predictions; // [n_layers] the graph's prediction in this ubatch (ids)
    std::vector<reads>                ahead;       // [n_layers] experts read ahead for the layer

    pending late; // a layer's reads, waited for by its second pass

    std::unique_ptr<llama_moe_reader> reader; // last: its thread stops before the members it uses go
};
