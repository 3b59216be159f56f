#include "llama-moe-admission.h"

#include <algorithm>
#include <cmath>

void llama_moe_admission::init(const std::vector<llama_moe_cache_layer> & layers) {
    int64_t n_experts = 0;
    for (const auto & cl : layers) {
        n_experts += cl.n_expert;
    }
    const size_t n_slots_all = layers.size()*layers[0].n_slots;

    handover.victims.assign(n_slots_all, -1);
    handover.victim_worth.assign(n_slots_all, 0.0);
    handover.worth.assign(n_experts, 0.0);
    handover.budget.assign(layers.size(), 0);
    selected.assign(n_experts, 0);
    n_declined.assign(layers.size(), 0);
}

llama_moe_cache_status llama_moe_admission::hand_over(const llama_moe_cache_handover & h, const std::vector<llama_moe_cache_layer> & layers,
                                                      bool lane, bool valid) {
    for (const auto & cl : layers) {
        for (int32_t k = 0; k < cl.n_slots; ++k) {
            const int32_t v = h.victims[cl.i*cl.n_slots + k];
            if (v < -1 || v >= cl.n_slots) {
                return LLAMA_MOE_CACHE_BAD_ROW;
            }
        }
        if (h.budget[cl.i] < 0) {
            return LLAMA_MOE_CACHE_BAD_ROW;
        }
        for (int32_t m = 0; h.lane && m <= cl.n_expert; ++m) {
            if (h.lane[cl.expert_offset + cl.i + m] < 0) {
                return LLAMA_MOE_CACHE_BAD_ROW;
            }
        }
    }
    if (!(h.margin >= 0) || (h.lane && !lane)) {
        return LLAMA_MOE_CACHE_BAD_ROW;
    }
    std::copy(h.victims,      h.victims      + handover.victims.size(),      handover.victims.begin());
    std::copy(h.victim_worth, h.victim_worth + handover.victim_worth.size(), handover.victim_worth.begin());
    std::copy(h.worth,        h.worth        + handover.worth.size(),        handover.worth.begin());
    std::copy(h.budget,       h.budget       + handover.budget.size(),       handover.budget.begin());
    if (h.lane) {
        handover.lane.assign(h.lane, h.lane + handover.worth.size() + layers.size());
    } else {
        handover.lane.clear();
    }
    handover.margin = h.margin;
    handover.valid  = valid;
    return LLAMA_MOE_CACHE_OK;
}

void llama_moe_admission::reset() {
    rows.clear();
    n_lane_rows = 0;
    std::fill(n_declined.begin(), n_declined.end(), 0);
}

std::vector<int32_t> llama_moe_admission::candidates(const llama_moe_cache_layer & cl, const int32_t * ids, int32_t n_ids,
                                                     const llama_moe_slots & ls, size_t & n_lane) {
    const double * worth = handover.worth.data() + cl.expert_offset;
    uint8_t      * sel   = selected.data()       + cl.expert_offset; // 1 selected, 2 a candidate, 3 the lane's

    std::fill(sel, sel + cl.n_expert, 0);
    for (int32_t k = 0; k < n_ids; ++k) {
        if (ids[k] >= 0) {
            sel[ids[k]] = 1;
        }
    }
    // the candidates: the lane's by worth, then the others in order, the ubatch's last token's first
    // (its experts are the next token's likeliest), each token's in router rank
    const int32_t n_used = cl.n_expert_used;
    std::vector<int32_t> order;
    for (int32_t t0 = (n_ids - 1)/n_used*n_used; t0 >= 0; t0 -= n_used) {
        for (int32_t k = t0; k < std::min(t0 + n_used, n_ids); ++k) {
            const int32_t e = ids[k];
            if (e >= 0 && sel[e] == 1 && !ls.cached(e) && worth[e] > -INFINITY) {
                sel[e] = 2;
                order.push_back(e);
            }
        }
    }
    n_lane = 0;
    if (!handover.lane.empty()) {
        n_lane = std::min(order.size(), (size_t) handover.lane[cl.expert_offset + cl.i + order.size()]);
        std::vector<int32_t> by_worth = order;
        std::stable_sort(by_worth.begin(), by_worth.end(), [worth](int32_t a, int32_t b) { return worth[a] > worth[b]; });
        for (size_t k = 0; k < n_lane; ++k) {
            sel[by_worth[k]] = 3;
        }
        std::stable_partition(order.begin(), order.end(), [sel](int32_t e) { return sel[e] == 3; });
        std::copy(by_worth.begin(), by_worth.begin() + n_lane, order.begin());
    }
    return order;
}

// the running graph reads only the slots of the experts it selected, so any other slot that no
// upload is writing may be overwritten now; the tables change at the next boundary, but for the
// lane's copies, which this graph reads (see llama_moe_cache_handover in llama.h)
std::vector<llama_moe_upload> llama_moe_admission::admit(const llama_moe_cache_layer & cl, const int32_t * ids, int32_t n_ids,
                                                         llama_moe_slots & ls) {
    const int32_t i = cl.i;
    int32_t budget = handover.valid ? handover.budget[i] : 0;
    std::vector<llama_moe_upload> started;
    if (budget == 0) {
        return started;
    }
    const int32_t * victims      = handover.victims.data()      + i*cl.n_slots;
    const double  * victim_worth = handover.victim_worth.data() + i*cl.n_slots;
    const double  * worth        = handover.worth.data()        + cl.expert_offset;
    const uint8_t * sel          = selected.data()              + cl.expert_offset;

    size_t n_lane = 0;
    const std::vector<int32_t> order = candidates(cl, ids, n_ids, ls, n_lane);

    // a victim no upload is writing, whose expert (if any) this graph does not read
    auto free_to_overwrite = [&](int32_t v) {
        return v >= 0 && !ls.writing_to(v) && (ls.expert_in(v) < 0 || !sel[ls.expert_in(v)]);
    };
    int32_t next = 0;
    for (size_t k = 0; k < order.size() && budget > 0; ++k) {
        const int32_t e    = order[k];
        const bool    lane = k < n_lane;
        while (next < cl.n_slots && !free_to_overwrite(victims[next])) {
            next++;
        }
        if (next == cl.n_slots) {
            break;
        }
        if (!(worth[e] - (lane ? 0.0 : handover.margin) > victim_worth[next])) {
            n_declined[i] += !lane && worth[e] > victim_worth[next];
            continue;
        }
        const int32_t slot = victims[next++];
        const int32_t replaced = ls.expert_in(slot);
        if (lane) {
            ls.lend(slot);
            rows.insert(rows.begin() + 3*n_lane_rows++, { i, e, slot });
        } else {
            ls.take_over(slot);
            rows.insert(rows.end(), { i, e, slot });
        }
        started.push_back({ i, e, slot, lane, replaced });
        budget--;
    }
    return started;
}

const int32_t * llama_moe_admission::admitted(int32_t & n_rows, int32_t & n_lane) const {
    n_rows = (int32_t) (rows.size()/3);
    n_lane = n_lane_rows;
    return rows.empty() ? nullptr : rows.data();
}
