#pragma once

#include "llama.h"
#include "llama-moe-admission.h"
#include "llama-moe-layer.h"
#include "llama-moe-routing.h"
#include "llama-moe-slots.h"
#include "llama-moe-upload.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <memory>
#include <vector>

// the largest ubatch the expert cache accepts
#define LLAMA_MOE_CACHE_MAX_BATCH 512

struct llama_context;
struct llama_model;

// the expert cache of one tier (llama_moe_cache_tier in llama.h), as the context, the graph and the
// C API see it: created by the context, observed by the CPU matmuls of the graph, handed over to
// the step callback between two graphs, and asked for its stats. Its two implementations,
// llama_moe_device (slots on a device) and llama_moe_ram (experts kept in host memory), differ in
// where the slots are and how an expert gets into one; they share the bookkeeping the step
// callback reads and writes, kept here: the cached layers and their slots, the routing the
// observers recorded, eager admission, the uploads the callback stages and the counters
class llama_moe_cache {
public:
    // the cache of the tier params.in_ram names; throws std::runtime_error when nothing can be cached
    // (the reason is the message)
    static std::unique_ptr<llama_moe_cache> create(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch);

    virtual ~llama_moe_cache() = default;

    //
    // the graph
    //

    int32_t n_layers() const { return (int32_t) layers.size(); }

    // the cached layer for model layer il, or nullptr
    const llama_moe_cache_layer * layer(int32_t il) const;

    // whether a ubatch runs the split graph: up to max_batch tokens, each an output (decode,
    // speculative verification); a prompt runs the stock graph, which copies out its selections.
    // The RAM tier observes every ubatch
    virtual bool splits(uint32_t n_tokens, uint32_t n_outputs) const = 0;

    // where the stock graph copies the selections of layer cl, [n_expert_used, n_tokens]
    ggml_tensor * stock_ids(ggml_context * ctx, const llama_moe_cache_layer & cl, int64_t n_tokens) const;

    // the RAM tier's read-ahead: the ops that apply the router of cached layer next to cur, the input
    // of the cached layer before next (next 0: the token embeddings), and hand its top-k to the tier,
    // which the graph runs before that layer's experts; nullptr for none
    virtual ggml_tensor * read_ahead(ggml_context * ctx, int32_t next, ggml_tensor * cur) const {
        GGML_UNUSED(ctx);
        GGML_UNUSED(next);
        GGML_UNUSED(cur);
        return nullptr;
    }

    // the graph being built runs n_rows of a ubatch of n_tokens, n_outputs of them outputs, through
    // layer cl's experts: whether the layer runs every token or only the outputs is the
    // architecture's (the last layer of most runs only the outputs, of some every token)
    virtual void built(const llama_moe_cache_layer & cl, int64_t n_rows, uint32_t n_tokens, uint32_t n_outputs) const {
        GGML_UNUSED(cl);
        GGML_UNUSED(n_rows);
        GGML_UNUSED(n_tokens);
        GGML_UNUSED(n_outputs);
    }

    // the CPU observer of the host part of a split layer (ggml_mul_mat_id_skip), with the
    // llama_moe_cache_layer as userdata: the first of the layer's matmuls to run records the
    // selected ids and starts eager admissions (the RAM tier: reads the missing experts in; under a
    // device cache it runs first, on the experts the device does not hold); the last one waits for the
    // layer's lane copies, which the device half reads once the CPU half is done; as: the matmul's experts
    static void observe(const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip, void * userdata);

    // the first matmul of layer cl to run: records its ids, skip the graph's table (the tier's own, or
    // the device cache's above the RAM tier), and starts what the layer's selections call for
    virtual void record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) = 0;

    //
    // the context
    //

    // a device cache: the layers of the RAM tier ram (nullptr: none) serve the CPU half of its layers
    virtual void set_below(const llama_moe_cache * ram) { GGML_UNUSED(ram); }

    // decode boundary before a ubatch: the previous graph has completed and the next one is not
    // started; the step callback runs here
    void step(llama_context * ctx, uint32_t n_tokens, uint32_t n_outputs);

    // the last graph's output is not the model's: the RAM tier could not read an expert (the model
    // file changed, shrank or failed), or a copy the device's lane needed failed
    virtual bool stopped() const = 0;

    //
    // the C API in llama.h
    //

    void   layer_info(int32_t i, struct llama_moe_cache_layer_info & info) const;
    virtual size_t device_bytes() const { return 0; }
    void   set_step_callback(llama_moe_cache_step_callback cb, void * user_data);

    const int32_t * observed      (int32_t & n_cols, int32_t & stride) const { return routing.observed(n_cols, stride); }
    const int32_t * observed_stock(int32_t & n_cols, int32_t & stride) const { return routing.observed_stock(n_cols, stride); }
    const int32_t * admitted      (int32_t & n_rows, int32_t & n_lane) const { return admission.admitted(n_rows, n_lane); }
    const int32_t * declined_uploads() const { return admission.declined(); }

    llama_moe_cache_status apply(const int32_t * publish, int32_t n_publish, const int32_t * evict, int32_t n_evict,
                                 const int32_t * upload, int32_t n_upload);
    llama_moe_cache_status hand_over(const llama_moe_cache_handover & handover);

    virtual int64_t wait_uploads()    { return 0; }
    virtual int32_t uploads_pending() { return 0; }
    virtual llama_moe_cache_counters counters(int32_t i) { return layer_counters.at(i); } // after the uploads

    virtual void set_upload_delay_us(int64_t delay_us) { GGML_UNUSED(delay_us); }

protected:
    // has_lane: whether the tier takes a handover's copy-on-miss lane
    llama_moe_cache(int32_t max_batch, bool has_lane) : max_batch(max_batch), has_lane(has_lane) {}

    // one CPU matmul of layer cl is about to run (see observe)
    virtual void observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip) = 0;

    // the tier's part of a boundary: before the step callback, and after it (the tables written and
    // the staged uploads started)
    virtual void boundary_begin() = 0;
    virtual void boundary_end(uint32_t n_tokens, uint32_t n_outputs) = 0;

    // a model file the cache reads changed: nothing is uploaded any more, no expert runs from a slot
    virtual bool file_changed() const = 0;

    // the step callback evicted expert from layer i (it may still be in its slot)
    virtual void evicted(int32_t i, int32_t expert) { GGML_UNUSED(i); GGML_UNUSED(expert); }

    // building: a context for n_tensors tensors, a buffer for its tensors (zeroed)
    ggml_context *        new_ctx(size_t n_tensors);
    ggml_backend_buffer_t alloc(ggml_context * ctx, ggml_backend_buffer_type_t buft);

    // cl becomes cached layer n_layers(), with a skip table in ctx_host (layer_of_il sized already)
    void add_layer(llama_moe_cache_layer && cl, ggml_context * ctx_host);

    // the stock graph's copy of the selections, in ctx_host, then every slot empty, nothing
    // observed, no handover
    ggml_tensor * new_stock_observed(ggml_context * ctx_host, uint32_t n_ubatch);
    void          init_state(ggml_tensor * stock_observed);

    // layer cl's selections, recorded: counted as hits and misses (hits: served[id] != 0, or
    // without served, the experts in its slots), then eager admission's uploads
    void count(const llama_moe_cache_layer & cl, const int32_t * served);
    std::vector<llama_moe_upload> admit(const llama_moe_cache_layer & cl);

    const int32_t max_batch;
    const bool    has_lane;

    std::vector<llama_moe_cache_layer> layers;
    std::vector<int32_t>               layer_of_il; // model layer -> index in layers, -1 if not cached
    std::vector<llama_moe_slots>       slots;       // [n_layers]

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    llama_moe_routing                     routing;
    llama_moe_admission                   admission;
    std::vector<llama_moe_cache_counters> layer_counters; // [n_layers]

    std::vector<llama_moe_upload> staged; // queued by apply, started after the tables are written

    llama_moe_cache_step_callback step_cb      = nullptr;
    void *                        step_cb_data = nullptr;
    bool                          in_step      = false;
    bool                          cleared      = false; // the tables were cleared after file_changed
};

// testing only (exported for the moecache tests, not part of llama.h): the device cache sleeps after each part
// (up, gate, down) of each upload, so that uploads outlast a graph. The tests that prove that no
// graph reads a slot an upload is writing need uploads slower than a graph, which a small model
// on the CPU or the RPC test device never has; it costs one branch per part otherwise.
extern "C" LLAMA_API void llama_moe_cache_set_upload_delay_us(struct llama_context * ctx, int64_t delay_us);

// called by llama_init_from_model for every new context
void llama_moe_cache_context_created(llama_context * ctx);
