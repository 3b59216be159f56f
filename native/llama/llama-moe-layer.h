#pragma once

#include "llama-graph.h"

#include "ggml.h"

#include <cstdint>
#include <vector>

struct llama_model;
class llama_moe_cache;
class llama_moe_model_files;

// one per-expert tensor of a cached layer (a weight, a bias or a scale) and its device slots
struct llama_moe_cache_part {
    ggml_tensor * exps = nullptr; // host [..., n_expert]: the model's tensor
    ggml_tensor * bank = nullptr; // device [..., n_layers*n_slots + 1]: see llama_moe_cache_layer (nullptr: the RAM tier)
    size_t expert_bytes = 0;      // of one expert: the stride of the last dimension

    // where uploads read it: -1 the tensor itself (plain buffer), else the index of a model file
    // and the tensor's offset in it (repacked buffer, or mapped for the RAM tier)
    int32_t file   = -1;
    size_t  offset = 0;
};

// the router of a cached layer, for the RAM tier's read-ahead: the graph applies it to the input of
// the cached layer before, to predict which experts this one selects
struct llama_moe_router {
    ggml_tensor * gate_inp   = nullptr; // [n_embd, n_expert]
    ggml_tensor * gate_inp_b = nullptr; // [n_expert] or nullptr
    ggml_tensor * probs_b    = nullptr; // the selection bias (DeepSeek V3's exp_probs_b) or nullptr
    int32_t       gating     = 0;       // llama_expert_gating_func_type, applied before probs_b
};

// one cached MoE layer: the experts stay in host memory, n_slots of them are mirrored on the
// device of the layer's router (see llama_moe_cache_init in llama.h), or kept in memory by the
// RAM tier; fixed once the cache is built
struct llama_moe_cache_layer {
    int32_t il            = -1;
    int32_t n_expert      = 0;
    int32_t n_expert_used = 0;
    int32_t n_slots       = 0;

    llm_moe_experts  exps;   // the model's experts, as build_moe_ffn gets them
    llama_moe_router router; // its router
    llm_moe_experts  bank;   // their device slots: the graph runs the same expert FFN over them

    // every tensor of exps that bank holds: all but the down bias, which build_moe_ffn adds after
    // the device and host halves are merged (the RAM tier: the weights it reads in)
    std::vector<llama_moe_cache_part> parts;

    // device slots: one bank per expert layout (the parts' types and shapes) and device, shared by
    // the layers with that layout; this layer's slots start at bank_slot0, and the bank's last slot
    // stays zero for the experts that are not cached (one zero slot per bank, not per layer)
    int32_t bank_slot0 = 0;
    int32_t zero_slot  = 0;

    ggml_tensor * slot_of = nullptr; // device I32 [1, n_expert]: bank slot of each expert, zero_slot when not cached
                                     // (a view of its device's table, which is written in one go)
    ggml_tensor * skip    = nullptr; // host   I32 [n_expert]: 1 when the expert runs from a slot
    ggml_tensor * skip_late = nullptr; // the RAM tier's second CPU pass (nullptr: one pass): host I32
                                       // [n_expert], 0 for the experts read while the first pass ran

    int32_t table        = 0; // index of its device's table
    int32_t table_offset = 0; // of its experts in that table

    int64_t expert_offset = 0; // of its experts in the handover's worth

    // for the observer (its userdata is the layer)
    llama_moe_cache * cache = nullptr;
    int32_t           i     = 0; // index in the cache's layers

    // MUL_MAT_IDs of its expert FFN (gate_up or up and gate, then down)
    int32_t n_matmuls() const { return exps.gate_up || !exps.gate ? 2 : 3; }

    bool   reads_file()   const;
    size_t expert_bytes() const; // one expert's parts

    // the device half of a build_moe_ffn call given call's experts: the banks of the tensors it
    // passes; false when they are not this layer's (another call in the layer, e.g. GroveMoE's chunk
    // experts) or include a tensor the cache does not hold
    bool device_experts(const llm_moe_experts & call, llm_moe_experts & dev) const;
};

// the members of llm_moe_experts that a cache banks: every per-expert tensor build_moe_experts reads
// but the down bias, which build_moe_ffn adds to the merged halves (a slot left zero then gives a
// zero row under every activation build_moe_experts applies, and the host half a zero row for the
// experts it skips)
extern ggml_tensor * llm_moe_experts::* const llama_moe_banked[10];

// a tensor in the mapping of a model file (best: never read up front, LLAMA_LAZY_MODE_EXPERTS); the RAM
// tier drops its pages, which in any other buffer would lose its data
bool llama_moe_is_mapped(const ggml_tensor * t);

// the MoE layers a cache of n_slots per layer can hold: those whose experts (every banked part) are
// in host memory, in a buffer whose MUL_MAT_ID can skip experts, with a router on a device; for the
// RAM tier (in_ram), those whose expert weights are mapped, unread. The parts read from the model
// files are left to find (file 0: llama_moe_find_in_files)
std::vector<llama_moe_cache_layer> llama_moe_find_layers(const llama_model & model, int32_t n_slots, bool in_ram);

// opens the model files into files and finds the offsets of the candidates' parts that are read from
// them; the layers whose experts cannot all be found (no file, a file that does not match the model)
// are dropped, with one logged line
void llama_moe_find_in_files(const llama_model & model, std::vector<llama_moe_cache_layer> & candidates, llama_moe_model_files & files);
