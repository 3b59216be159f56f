#include "llama-moe-routing.h"

#include <algorithm>

void llama_moe_routing::init(int32_t n_layers, int32_t max_batch, int32_t n_used_max, ggml_tensor * stock_observed) {
    used_max = n_used_max;
    stride   = max_batch*n_used_max;
    ids.assign((size_t) n_layers*stride, -1);
    n_ids.assign(n_layers, 0);
    stock = stock_observed;
    std::fill((int32_t *) stock->data, (int32_t *) stock->data + ggml_nelements(stock), -1);
}

void llama_moe_routing::record(int32_t i, int32_t n_expert_used, const ggml_tensor * selected, const int32_t * hidden) {
    const int32_t n_tokens = (int32_t) selected->ne[1];
    GGML_ASSERT(n_tokens*used_max <= stride);
    int32_t * out = ids.data() + i*stride;
    for (int32_t t = 0; t < n_tokens; ++t) {
        for (int32_t k = 0; k < n_expert_used; ++k) {
            const int32_t id = *(const int32_t *) ((const char *) selected->data + t*selected->nb[1] + k*selected->nb[0]);
            out[t*used_max + k] = !hidden || !hidden[id] ? id : -1;
        }
    }
    n_ids[i] = n_tokens*used_max;
}

// -1 where nothing was selected: the next ubatch may write fewer ids (fewer tokens; the last
// layer of a stock ubatch writes only its outputs' ids)
void llama_moe_routing::next_ubatch(int32_t n_tokens_stock) {
    for (size_t i = 0; i < n_ids.size(); ++i) {
        int32_t * out = ids.data() + i*stride;
        std::fill(out, out + n_ids[i], -1);
        n_ids[i] = 0;

        int32_t * stock_row = (int32_t *) ((char *) stock->data + i*stock->nb[1]);
        std::fill(stock_row, stock_row + n_stock_tokens*used_max, -1);
    }
    n_stock_tokens = n_tokens_stock;
}

const int32_t * llama_moe_routing::observed(int32_t & n_cols, int32_t & n_stride) const {
    const int32_t n_max = *std::max_element(n_ids.begin(), n_ids.end());
    if (n_max == 0) {
        return nullptr;
    }
    n_cols   = n_max;
    n_stride = stride;
    return ids.data();
}

const int32_t * llama_moe_routing::observed_stock(int32_t & n_cols, int32_t & n_stride) const {
    if (n_stock_tokens == 0) {
        return nullptr;
    }
    n_cols   = n_stock_tokens*used_max;
    n_stride = (int32_t) stock->ne[0];
    return (const int32_t *) stock->data;
}

ggml_tensor * llama_moe_routing::stock_ids(ggml_context * ctx, int32_t i, int32_t n_expert_used, int64_t n_tokens) const {
    GGML_ASSERT(n_tokens*used_max <= stock->ne[0]);
    return ggml_view_2d(ctx, stock, n_expert_used, n_tokens, used_max*sizeof(int32_t), i*stock->nb[1]);
}
