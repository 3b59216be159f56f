#include "llama-moe-cache.h"

#include "llama-impl.h"
#include "llama-moe-device.h"
#include "llama-moe-ram.h"

#include <algorithm>
#include <stdexcept>

static void moe_check_params(const llama_moe_cache_params & params) {
    if (params.n_slots <= 0) {
        throw std::runtime_error(format("n_slots = %d, expected > 0", params.n_slots));
    }
#if !defined(__linux__)
    if (params.in_ram) {
        throw std::runtime_error("the RAM tier runs on Linux only (pread, mincore, madvise, posix_fadvise)");
    }
#endif
    if (!params.in_ram && (params.max_batch < 1 || params.max_batch > LLAMA_MOE_CACHE_MAX_BATCH)) {
        throw std::runtime_error(format("max_batch = %d, expected 1..%d", params.max_batch, LLAMA_MOE_CACHE_MAX_BATCH));
    }
}

std::unique_ptr<llama_moe_cache> llama_moe_cache::create(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch) {
    moe_check_params(params);
    if (params.in_ram) {
        return std::make_unique<llama_moe_ram>(model, params, n_ubatch);
    }
    return std::make_unique<llama_moe_device>(model, params, n_ubatch);
}

//
// the graph
//

const llama_moe_cache_layer * llama_moe_cache::layer(int32_t il) const {
    if (il < 0 || il >= (int32_t) layer_of_il.size() || layer_of_il[il] < 0) {
        return nullptr;
    }
    return &layers[layer_of_il[il]];
}

ggml_tensor * llama_moe_cache::stock_ids(ggml_context * ctx, const llama_moe_cache_layer & cl, int64_t n_tokens) const {
    return routing.stock_ids(ctx, cl.i, cl.n_expert_used, n_tokens);
}

void llama_moe_cache::observe(const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip, void * userdata) {
    const auto * cl = (const llama_moe_cache_layer *) userdata;
    cl->cache->observe_matmul(*cl, as, ids, skip);
}

void llama_moe_cache::count(const llama_moe_cache_layer & cl, const int32_t * served) {
    const llama_moe_slots & ls = slots[cl.i];
    const int32_t * row = routing.row(cl.i);
    uint64_t hits = 0, lookups = 0;
    for (int32_t k = 0; k < routing.n(cl.i); ++k) {
        const int32_t id = row[k];
        if (id >= 0) {
            lookups++;
            hits += served ? served[id] != 0 : ls.cached(id);
        }
    }
    layer_counters[cl.i].hits   += hits;
    layer_counters[cl.i].misses += lookups - hits;
}

std::vector<llama_moe_upload> llama_moe_cache::admit(const llama_moe_cache_layer & cl) {
    if (file_changed()) {
        return {};
    }
    return admission.admit(cl, routing.row(cl.i), routing.n(cl.i), slots[cl.i]);
}

//
// building
//

ggml_context * llama_moe_cache::new_ctx(size_t n_tensors) {
    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead()*n_tensors,
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    if (!ctx) {
        throw std::runtime_error("failed to create a ggml context");
    }
    ctxs.emplace_back(ctx);
    return ctx;
}

ggml_backend_buffer_t llama_moe_cache::alloc(ggml_context * ctx, ggml_backend_buffer_type_t buft) {
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        throw std::runtime_error(format("failed to allocate the expert cache on %s", ggml_backend_buft_name(buft)));
    }
    ggml_backend_buffer_clear(buf, 0); // the zero slots must hold zeros
    bufs.emplace_back(buf);
    return buf;
}

void llama_moe_cache::add_layer(llama_moe_cache_layer && cl, ggml_context * ctx_host) {
    cl.skip = ggml_new_tensor_1d(ctx_host, GGML_TYPE_I32, cl.n_expert);
    ggml_format_name(cl.skip, "moe_cache_skip.%d", cl.il);

    cl.cache = this;
    cl.i     = n_layers();
    layer_of_il[cl.il] = cl.i;
    layers.push_back(std::move(cl));
}

static int32_t moe_n_used_max(const std::vector<llama_moe_cache_layer> & layers) {
    int32_t n = 0;
    for (const auto & cl : layers) {
        n = std::max(n, cl.n_expert_used);
    }
    return n;
}

ggml_tensor * llama_moe_cache::new_stock_observed(ggml_context * ctx_host, uint32_t n_ubatch) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx_host, GGML_TYPE_I32, (int64_t) n_ubatch*moe_n_used_max(layers), n_layers());
    ggml_set_name(t, "moe_cache_stock_observed");
    return t;
}

void llama_moe_cache::init_state(ggml_tensor * stock_observed) {
    int64_t n_experts = 0;
    for (auto & cl : layers) {
        cl.expert_offset = n_experts;
        n_experts += cl.n_expert;
        slots.emplace_back(cl.n_expert, cl.n_slots);
    }
    routing.init(n_layers(), max_batch, moe_n_used_max(layers), stock_observed);
    admission.init(layers);
    layer_counters.assign(layers.size(), {});
}

//
// boundary
//

void llama_moe_cache::step(llama_context * ctx, uint32_t n_tokens, uint32_t n_outputs) {
    boundary_begin();
    admission.invalidate(); // a handover is for the graph after its boundary only
    if (step_cb) {
        in_step = true;
        step_cb(ctx, step_cb_data);
        in_step = false;
    }
    admission.reset();
    routing.next_ubatch(splits(n_tokens, n_outputs) ? 0 : (int32_t) n_tokens);
    if (file_changed() && !cleared) {
        // a slot may hold bytes of the changed file: no expert runs from a slot any more
        for (auto & ls : slots) {
            ls.clear();
        }
        staged.clear();
        cleared = true;
    }
    boundary_end(n_tokens, n_outputs);
    staged.clear();
}

static bool moe_valid_rows(const std::vector<llama_moe_cache_layer> & layers, const int32_t * rows, int32_t n) {
    if (n < 0 || (n > 0 && !rows)) {
        return false;
    }
    for (int32_t r = 0; r < n; ++r) {
        const int32_t i = rows[3*r], expert = rows[3*r + 1], slot = rows[3*r + 2];
        if (i < 0 || i >= (int32_t) layers.size() || expert < 0 || expert >= layers[i].n_expert || slot < 0 || slot >= layers[i].n_slots) {
            return false;
        }
    }
    return true;
}

llama_moe_cache_status llama_moe_cache::apply(const int32_t * publish, int32_t n_publish, const int32_t * evict, int32_t n_evict,
                                              const int32_t * upload, int32_t n_upload) {
    if (file_changed()) {
        return LLAMA_MOE_CACHE_FILE_CHANGED;
    }
    if (!in_step || !moe_valid_rows(layers, publish, n_publish) || !moe_valid_rows(layers, evict, n_evict) ||
            !moe_valid_rows(layers, upload, n_upload)) {
        return LLAMA_MOE_CACHE_BAD_ROW;
    }
    for (int32_t r = 0; r < n_publish; ++r) {
        slots[publish[3*r]].publish(publish[3*r + 1], publish[3*r + 2]);
    }
    for (int32_t r = 0; r < n_evict; ++r) {
        slots[evict[3*r]].evict(evict[3*r + 1], evict[3*r + 2]);
        if (!slots[evict[3*r]].cached(evict[3*r + 1])) {
            evicted(evict[3*r], evict[3*r + 1]);
        }
    }
    for (int32_t r = 0; r < n_upload; ++r) {
        staged.push_back({ upload[3*r], upload[3*r + 1], upload[3*r + 2] });
        slots[upload[3*r]].start_upload(upload[3*r + 2]);
    }
    return LLAMA_MOE_CACHE_OK;
}

llama_moe_cache_status llama_moe_cache::hand_over(const llama_moe_cache_handover & h) {
    if (!in_step || !h.victims || !h.victim_worth || !h.worth || !h.budget) {
        return LLAMA_MOE_CACHE_BAD_ROW;
    }
    // (the RAM tier computes every expert on the CPU: no lane)
    return admission.hand_over(h, layers, has_lane, !file_changed());
}

//
// what the step callback reads
//

void llama_moe_cache::layer_info(int32_t i, struct llama_moe_cache_layer_info & info) const {
    const auto & cl = layers.at(i);
    info.il            = cl.il;
    info.n_expert      = cl.n_expert;
    info.n_expert_used = cl.n_expert_used;
    info.n_slots       = cl.n_slots;
    info.expert_bytes  = cl.expert_bytes();
    info.device        = cl.parts[0].bank ? ggml_backend_buffer_name(cl.parts[0].bank->buffer) : "RAM"; // the RAM tier has no bank
    info.from_file     = cl.reads_file();
}

void llama_moe_cache::set_step_callback(llama_moe_cache_step_callback cb, void * user_data) {
    step_cb      = cb;
    step_cb_data = user_data;
}
