#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

// the slots of one cached MoE layer: which expert the slot tables map to which slot, and which
// slots an upload is writing (or has written, not published yet). The tables the graph reads are
// rebuilt from here at each boundary (llama_moe_device::flush_tables), so a change made while a
// graph runs (eager admission) takes effect from the next graph on.
class llama_moe_slots {
public:
    llama_moe_slots(int32_t n_expert, int32_t n_slots) :
        slot_of_expert(n_expert, -1), expert_of_slot(n_slots, -1), writing(n_slots, false) {}

    int32_t n_slots()  const { return (int32_t) expert_of_slot.size(); }
    int32_t n_expert() const { return (int32_t) slot_of_expert.size(); }

    // the slot that expert e runs from, -1 when it runs on the CPU
    int32_t slot_of(int32_t e) const { return slot_of_expert[e]; }
    bool    cached (int32_t e) const { return slot_of(e) >= 0; }

    // the expert the tables map to slot s, -1 when none
    int32_t expert_in(int32_t s) const { return expert_of_slot[s]; }

    // an upload is writing slot s, or has written it and it is not published yet: not to be
    // overwritten
    bool writing_to(int32_t s) const { return writing[s]; }

    // the upload into s is complete: e runs from s
    void publish(int32_t e, int32_t s) {
        assert(0 <= e && e < n_expert() && 0 <= s && s < n_slots());
        slot_of_expert[e] = s;
        expert_of_slot[s] = e;
        writing[s]        = false;
        dirty             = true;
    }

    // e runs on the CPU; s forgets e if it still holds it
    void evict(int32_t e, int32_t s) {
        assert(0 <= e && e < n_expert() && 0 <= s && s < n_slots());
        slot_of_expert[e] = -1;
        if (expert_of_slot[s] == e) {
            expert_of_slot[s] = -1;
        }
        dirty = true;
    }

    void start_upload(int32_t s) {
        writing[s] = true;
    }

    // eager admission: the expert in s (if any) runs on the CPU, and an upload into s starts
    void take_over(int32_t s) {
        const int32_t e = expert_of_slot[s];
        if (e >= 0) {
            slot_of_expert[e] = -1;
            expert_of_slot[s] = -1;
            dirty = true;
        }
        writing[s] = true;
    }

    // the copy-on-miss lane: take_over(s), and the running graph's tables map the copied expert to s
    // already (written apart): rebuilt at the next boundary from what is published
    void lend(int32_t s) {
        take_over(s);
        dirty = true;
    }

    // every expert runs on the CPU (uploads under way still count as writing)
    void clear() {
        std::fill(slot_of_expert.begin(), slot_of_expert.end(), -1);
        std::fill(expert_of_slot.begin(), expert_of_slot.end(), -1);
        dirty = true;
    }

    // whether the mapping changed since the last call
    bool take_dirty() {
        const bool was = dirty;
        dirty = false;
        return was;
    }

private:
    std::vector<int32_t> slot_of_expert; // [n_expert]
    std::vector<int32_t> expert_of_slot; // [n_slots]
    std::vector<bool>    writing;        // [n_slots]

    bool dirty = true; // the tables have never been written
};
