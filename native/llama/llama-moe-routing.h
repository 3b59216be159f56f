#pragma once

#include "ggml.h"

#include <cstdint>
#include <vector>

// the experts each cached layer selected in the last ubatch, as the step callback reads them
// (llama_moe_cache_observed, llama_moe_cache_observed_stock): what the observers recorded in a
// ubatch the cache split, or what the stock graph copied out of a prompt. One row per cached
// layer, n_used_max ids per token, -1 where nothing was selected
class llama_moe_routing {
public:
    // stock: host I32 [n_ubatch*n_used_max, n_layers], where the stock graph copies its selections
    void init(int32_t n_layers, int32_t max_batch, int32_t n_used_max, ggml_tensor * stock);

    int32_t n_used_max() const { return used_max; }

    // layer i's selections ids I32 [n_expert_used, n_tokens] (the last layer of a ubatch may run fewer
    // tokens), -1 for the experts with hidden[id] != 0 (hidden: nullptr for none)
    void record(int32_t i, int32_t n_expert_used, const ggml_tensor * ids, const int32_t * hidden);

    bool            recorded(int32_t i) const { return n_ids[i] > 0; } // since the last boundary
    const int32_t * row     (int32_t i) const { return ids.data() + i*stride; }
    int32_t         n       (int32_t i) const { return n_ids[i]; }

    // a boundary: nothing recorded, and the next ubatch is a stock one of n_stock_tokens tokens
    // (0: the cache splits it)
    void next_ubatch(int32_t n_stock_tokens);

    const int32_t * observed      (int32_t & n_cols, int32_t & n_stride) const;
    const int32_t * observed_stock(int32_t & n_cols, int32_t & n_stride) const;

    // where the stock graph copies the selections of layer i, [n_expert_used, n_tokens]
    ggml_tensor * stock_ids(ggml_context * ctx, int32_t i, int32_t n_expert_used, int64_t n_tokens) const;

private:
    int32_t              used_max = 0; // of all cached layers
    int32_t              stride   = 0; // max_batch*n_used_max
    std::vector<int32_t> ids;          // [n_layers][stride], n_used_max per token
    std::vector<int32_t> n_ids;        // [n_layers] ids written since the last boundary

    ggml_tensor * stock          = nullptr; // -1 where not written
    int32_t       n_stock_tokens = 0;       // tokens of the last ubatch, 0 if it split
};
