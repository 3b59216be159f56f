#include "llama-moe-cache.h"

#include "llama-context.h"

#include <string>

//
// the C API of the expert cache (llama.h): each call but init names the tier whose cache it addresses
//

const char * llama_moe_cache_version(void) {
    static const std::string version = std::to_string(LLAMA_MOE_CACHE_VERSION);
    return version.c_str();
}

struct llama_moe_cache_params llama_moe_cache_default_params(void) {
    return { /*.n_slots =*/ 0, /*.max_batch =*/ 32, /*.in_ram =*/ false, /*.read_ahead =*/ true };
}

int32_t llama_moe_cache_init(struct llama_context * ctx, struct llama_moe_cache_params params) {
    return ctx->moe_cache_init(params);
}

int32_t llama_moe_cache_n_layers(const struct llama_context * ctx, enum llama_moe_cache_tier tier) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->n_layers() : 0;
}

bool llama_moe_cache_layer_info(const struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t i, struct llama_moe_cache_layer_info * info) {
    if (i < 0 || i >= llama_moe_cache_n_layers(ctx, tier)) {
        return false;
    }
    ctx->get_moe_cache(tier)->layer_info(i, *info);
    return true;
}

size_t llama_moe_cache_device_bytes(const struct llama_context * ctx, enum llama_moe_cache_tier tier) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->device_bytes() : 0;
}

void llama_moe_cache_set_step_callback(struct llama_context * ctx, enum llama_moe_cache_tier tier, llama_moe_cache_step_callback cb, void * user_data) {
    if (llama_moe_cache * cache = ctx->get_moe_cache(tier)) {
        cache->set_step_callback(cb, user_data);
    }
}

const int32_t * llama_moe_cache_observed(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_cols, int32_t * stride) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->observed(*n_cols, *stride) : nullptr;
}

const int32_t * llama_moe_cache_observed_stock(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_cols, int32_t * stride) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->observed_stock(*n_cols, *stride) : nullptr;
}

int32_t llama_moe_cache_apply(struct llama_context * ctx, enum llama_moe_cache_tier tier, const int32_t * publish, int32_t n_publish,
                              const int32_t * evict, int32_t n_evict, const int32_t * upload, int32_t n_upload) {
    llama_moe_cache * cache = ctx->get_moe_cache(tier);
    if (!cache) {
        return LLAMA_MOE_CACHE_BAD_ROW;
    }
    return cache->apply(publish, n_publish, evict, n_evict, upload, n_upload);
}

int32_t llama_moe_cache_hand_over(struct llama_context * ctx, enum llama_moe_cache_tier tier, const struct llama_moe_cache_handover * handover) {
    llama_moe_cache * cache = ctx->get_moe_cache(tier);
    if (!cache || !handover) {
        return LLAMA_MOE_CACHE_BAD_ROW;
    }
    return cache->hand_over(*handover);
}

const int32_t * llama_moe_cache_admitted(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_rows, int32_t * n_lane) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    if (!cache) {
        *n_rows = 0;
        *n_lane = 0;
        return nullptr;
    }
    return cache->admitted(*n_rows, *n_lane);
}

const int32_t * llama_moe_cache_declined(struct llama_context * ctx, enum llama_moe_cache_tier tier) {
    const llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->declined_uploads() : nullptr;
}

int64_t llama_moe_cache_wait_uploads(struct llama_context * ctx, enum llama_moe_cache_tier tier) {
    llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->wait_uploads() : 0;
}

int32_t llama_moe_cache_uploads_pending(struct llama_context * ctx, enum llama_moe_cache_tier tier) {
    llama_moe_cache * cache = ctx->get_moe_cache(tier);
    return cache ? cache->uploads_pending() : 0;
}

bool llama_moe_cache_get_counters(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t i, struct llama_moe_cache_counters * counters) {
    if (i < 0 || i >= llama_moe_cache_n_layers(ctx, tier)) {
        return false;
    }
    *counters = ctx->get_moe_cache(tier)->counters(i);
    return true;
}

void llama_moe_cache_set_upload_delay_us(struct llama_context * ctx, int64_t delay_us) {
    if (llama_moe_cache * cache = ctx->get_moe_cache(LLAMA_MOE_CACHE_TIER_DEVICE)) {
        cache->set_upload_delay_us(delay_us);
    }
}

//
// context callback
//

static llama_moe_cache_context_callback g_context_cb      = nullptr;
static void *                           g_context_cb_data = nullptr;

void llama_moe_cache_set_context_callback(llama_moe_cache_context_callback cb, void * user_data) {
    g_context_cb      = cb;
    g_context_cb_data = user_data;
}

void llama_moe_cache_context_created(llama_context * ctx) {
    if (g_context_cb) {
        g_context_cb(ctx, g_context_cb_data);
    }
}
