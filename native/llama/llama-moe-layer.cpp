#include "llama-moe-layer.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-moe-file.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <stdexcept>

ggml_tensor * llm_moe_experts::* const llama_moe_banked[10] = {
    &llm_moe_experts::up,   &llm_moe_experts::gate,   &llm_moe_experts::gate_up,   &llm_moe_experts::down,
    &llm_moe_experts::up_b, &llm_moe_experts::gate_b, &llm_moe_experts::gate_up_b,
    &llm_moe_experts::up_s, &llm_moe_experts::gate_s, &llm_moe_experts::down_s,
};

// the per-expert tensors the RAM tier reads in: the weights (biases and scales stay loaded)
static ggml_tensor * llm_moe_experts::* const moe_weights[] = {
    &llm_moe_experts::up, &llm_moe_experts::gate, &llm_moe_experts::gate_up, &llm_moe_experts::down,
};

// the routed experts of layer l, as the model builders pass them to build_moe_ffn
static llm_moe_experts moe_experts_of(const llama_layer & l) {
    llm_moe_experts exps;
    exps.up        = l.ffn_up_exps;
    exps.gate      = l.ffn_gate_exps;
    exps.gate_up   = l.ffn_gate_up_exps;
    exps.down      = l.ffn_down_exps;
    exps.up_b      = l.ffn_up_exps_b;
    exps.gate_b    = l.ffn_gate_exps_b;
    exps.gate_up_b = l.ffn_gate_up_exps_b;
    exps.down_b    = l.ffn_down_exps_b;
    exps.up_s      = l.ffn_up_exps_s;
    exps.gate_s    = l.ffn_gate_exps_s;
    exps.down_s    = l.ffn_down_exps_s;
    return exps;
}

// uploads copy raw expert slices from a host buffer with the standard layout (repacking CPU
// buffer types do not report themselves as host buffers)
static bool moe_is_plain_host(const ggml_tensor * t) {
    return t->buffer && t->data && ggml_backend_buffer_is_host(t->buffer);
}

// the CPU backend's repacked buffer, whose MUL_MAT_ID honours the skip table; the standard
// layout of its experts is only in the model file
static bool moe_is_repacked(const ggml_tensor * t) {
    return t->buffer && strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "CPU_REPACK") == 0;
}

bool llama_moe_is_mapped(const ggml_tensor * t) {
    return t->buffer && strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "CPU_Mapped") == 0;
}

// routed experts (down, and up or gate_up) and a router on a device (for the RAM tier, anywhere)
static bool moe_layer_supported(const llama_model & model, size_t il, bool in_ram) {
    const auto & l = model.layers[il];
    if (!l.ffn_down_exps || !(l.ffn_up_exps || l.ffn_gate_up_exps) || !l.ffn_gate_inp) {
        return false; // a dense layer
    }
    // a router on the CPU has no device to cache on
    return in_ram || (l.ffn_gate_inp->buffer && !ggml_backend_buffer_is_host(l.ffn_gate_inp->buffer));
}

// the parts of candidate cl, each with where uploads read it; false when one cannot be cached
// (lazy: experts mapped and unread, e.g. for a RAM tier: a device cache's uploads read them from the file)
static bool moe_find_parts(llama_moe_cache_layer & cl, bool in_ram, bool lazy) {
    bool on_host = true;
    for (auto member : llama_moe_banked) {
        ggml_tensor * t = cl.exps.*member;
        const bool weight = std::find(std::begin(moe_weights), std::end(moe_weights), member) != std::end(moe_weights);
        if (!t || (in_ram && !weight)) {
            continue;
        }
        // the last dimension indexes the experts: weights [n_in, n_out, n_expert], biases
        // [n_out, n_expert], scales [n_expert]
        const int dim = ggml_n_dims(t) - 1;
        if (t->ne[dim] != cl.n_expert || !ggml_is_contiguous(t)) {
            on_host = false; // not a per-expert tensor this cache knows how to slice
        }
        llama_moe_cache_part part;
        part.exps         = t;
        part.expert_bytes = t->nb[dim];
        if (in_ram) {
            part.file = 0;
            on_host = on_host && llama_moe_is_mapped(t);
        } else if (moe_is_repacked(t) || (lazy && llama_moe_is_mapped(t))) {
            part.file = 0; // resolved by llama_moe_find_in_files
        } else if (!moe_is_plain_host(t)) {
            on_host = false; // on a device already, or in a buffer that cannot skip experts
        }
        cl.parts.push_back(part);
    }
    return on_host;
}

std::vector<llama_moe_cache_layer> llama_moe_find_layers(const llama_model & model, int32_t n_slots, bool in_ram) {
    std::vector<llama_moe_cache_layer> candidates;
    for (size_t il = 0; il < model.layers.size(); ++il) {
        if (!moe_layer_supported(model, il, in_ram)) {
            continue;
        }
        llama_moe_cache_layer cl;
        cl.il            = (int32_t) il;
        cl.exps          = moe_experts_of(model.layers[il]);
        cl.router        = { model.layers[il].ffn_gate_inp, model.layers[il].ffn_gate_inp_b, model.layers[il].ffn_exp_probs_b,
                             (int32_t) model.hparams.expert_gating_func };
        cl.n_expert      = (int32_t) cl.exps.down->ne[2];
        cl.n_expert_used = (int32_t) model.hparams.n_expert_used(il);
        cl.n_slots       = n_slots;
        if (moe_find_parts(cl, in_ram, model.lazy_experts)) {
            candidates.push_back(std::move(cl));
        }
    }
    return candidates;
}

void llama_moe_find_in_files(const llama_model & model, std::vector<llama_moe_cache_layer> & candidates, llama_moe_model_files & files) {
    auto reads_file = [](const llama_moe_cache_layer & cl) { return cl.reads_file(); };
    const auto n_need = std::count_if(candidates.begin(), candidates.end(), reads_file);
    if (n_need == 0) {
        return;
    }
    try {
        if (model.paths.empty()) {
            throw std::runtime_error("the model was not loaded from a file");
        }
        std::vector<const ggml_tensor *> tensors;
        for (const auto & cl : candidates) {
            for (const auto & part : cl.parts) {
                tensors.push_back(part.exps);
            }
        }
        const auto where = files.open(model.paths, tensors);
        for (auto & cl : candidates) {
            for (auto & part : cl.parts) {
                if (part.file < 0) {
                    continue;
                }
                const auto it = where.find(ggml_get_name(part.exps));
                if (it == where.end()) {
                    throw std::runtime_error(format("%s is not in the model files", ggml_get_name(part.exps)));
                }
                part.file   = it->second.file;
                part.offset = it->second.offset;
            }
        }
    } catch (const std::exception & err) {
        LLAMA_LOG_WARN("%s: %d layers whose experts are read from the model file are not cached: %s\n", __func__, (int) n_need, err.what());
        files.clear();
        candidates.erase(std::remove_if(candidates.begin(), candidates.end(), reads_file), candidates.end());
    }
}

bool llama_moe_cache_layer::reads_file() const {
    return std::any_of(parts.begin(), parts.end(), [](const llama_moe_cache_part & part) { return part.file >= 0; });
}

size_t llama_moe_cache_layer::expert_bytes() const {
    size_t n = 0;
    for (const auto & part : parts) {
        n += part.expert_bytes;
    }
    return n;
}

bool llama_moe_cache_layer::device_experts(const llm_moe_experts & call, llm_moe_experts & dev) const {
    if (call.down != exps.down) {
        return false;
    }
    dev = llm_moe_experts();
    for (auto member : llama_moe_banked) {
        if (call.*member) {
            if (call.*member != exps.*member) {
                return false;
            }
            dev.*member = bank.*member;
        }
    }
    return true;
}
