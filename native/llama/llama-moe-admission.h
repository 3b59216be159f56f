#pragma once

#include "llama.h"
#include "llama-moe-layer.h"
#include "llama-moe-slots.h"
#include "llama-moe-upload.h"

#include <cstdint>
#include <vector>

// eager admission (llama_moe_cache_hand_over in llama.h): the handover of the last boundary, which
// the observers follow during the graph after it to start uploads themselves, and the uploads they
// started (llama_moe_cache_admitted) or the margin declined (llama_moe_cache_declined)
class llama_moe_admission {
public:
    void init(const std::vector<llama_moe_cache_layer> & layers);

    // checks and copies h (lane: whether the tier may take a copy-on-miss lane); valid for the next
    // graph only, and not at all when !valid (the cache stopped)
    llama_moe_cache_status hand_over(const llama_moe_cache_handover & h, const std::vector<llama_moe_cache_layer> & layers,
                                     bool lane, bool valid);

    // a boundary: the last handover is spent (before the step callback), nothing admitted or declined yet (after it)
    void invalidate() { handover.valid = false; }
    void reset();

    // during the graph, from the CPU observer of layer cl: its n_ids selected ids (-1: none), the
    // uploads the rule starts, the lane's first, each taking its slot in ls (see llama.h)
    std::vector<llama_moe_upload> admit(const llama_moe_cache_layer & cl, const int32_t * ids, int32_t n_ids, llama_moe_slots & ls);

    const int32_t * admitted(int32_t & n_rows, int32_t & n_lane) const;
    const int32_t * declined() const { return n_declined.data(); }

private:
    // the candidates among layer cl's ids, marked in sel: the lane's n_lane first, by worth, then the
    // others in order
    std::vector<int32_t> candidates(const llama_moe_cache_layer & cl, const int32_t * ids, int32_t n_ids,
                                    const llama_moe_slots & ls, size_t & n_lane);

    // the handover of the last boundary, copied (see llama_moe_cache_hand_over)
    struct handover_copy {
        bool                 valid = false; // for the graph after its boundary only
        std::vector<int32_t> victims;       // [n_layers][n_slots]
        std::vector<double>  victim_worth;  // [n_layers][n_slots]
        std::vector<double>  worth;         // [sum of n_expert]
        std::vector<int32_t> budget;        // [n_layers]
        std::vector<int32_t> lane;          // [sum of n_expert + 1]; empty: no lane
        double               margin = 0.0;
    };

    handover_copy        handover;
    std::vector<uint8_t> selected;        // [sum of n_expert] the observer's scratch
    std::vector<int32_t> rows;            // (i, expert, slot) rows the observers started since the last step,
    int32_t              n_lane_rows = 0; // the lane's first
    std::vector<int32_t> n_declined;      // [n_layers] uploads the margin declined since the last step
};
