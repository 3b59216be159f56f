#include "llama-moe-device.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <map>
#include <stdexcept>
#include <thread>

// the upload worker's buffer for the experts it reads from the model files: in the device's host
// buffer type where it has one (pinned memory on CUDA, from which the copy to the device is one DMA;
// from pageable memory the driver first copies through a pinned buffer of its own on a CPU core:
// 9.9-12.5 GB/s against 42-45 on one H200), else in host memory
static ggml_backend_buffer_t moe_staging_buffer(ggml_backend_buffer_type_t device_buft, const std::vector<llama_moe_cache_layer> & layers) {
    size_t size = 0;
    for (const auto & cl : layers) {
        for (const auto & part : cl.parts) {
            size = part.file >= 0 ? std::max(size, part.expert_bytes) : size;
        }
    }
    if (size == 0) {
        return nullptr;
    }
    ggml_backend_dev_t         dev  = ggml_backend_buft_get_device(device_buft);
    ggml_backend_buffer_type_t host = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (host) {
        if (ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(host, size)) {
            return buf;
        }
        LLAMA_LOG_WARN("%s: cannot allocate %zu bytes of %s: uploads are staged in pageable memory\n",
                __func__, size, ggml_backend_buft_name(host));
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (!buf) {
        throw std::runtime_error(format("cannot allocate %zu bytes for the uploads from the model files", size));
    }
    return buf;
}

llama_moe_device::llama_moe_device(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch) :
        llama_moe_cache(params.max_batch, /*has_lane =*/ true) {
    std::vector<llama_moe_cache_layer> candidates = llama_moe_find_layers(model, params.n_slots, /*in_ram =*/ false);
    llama_moe_find_in_files(model, candidates, files);

    // the slots of a layer live next to its router; group the layers by that buffer type
    std::map<ggml_backend_buffer_type_t, std::vector<llama_moe_cache_layer>> by_buft;
    for (const auto & cl : candidates) {
        by_buft[ggml_backend_buffer_get_type(model.layers[cl.il].ffn_gate_inp->buffer)].push_back(cl);
    }
    if (by_buft.empty()) {
        throw std::runtime_error("no MoE layer has its experts in host memory and its router on a device");
    }

    layer_of_il.assign(model.layers.size(), -1);
    layers.reserve(candidates.size());
    tables.reserve(by_buft.size());

    ggml_context * ctx_host = new_ctx(candidates.size() + 1);
    for (auto & [buft, group] : by_buft) {
        place(buft, group, ctx_host);
    }
    ggml_tensor * stock_observed = new_stock_observed(ctx_host, n_ubatch);
    alloc(ctx_host, ggml_backend_cpu_buffer_type());
    staging.reset(moe_staging_buffer(by_buft.begin()->first, layers));

    init_state(stock_observed);
    n_calls.assign(layers.size(), 0);
    below.assign(layers.size(), nullptr);
    flush_tables();

    worker.start(n_layers(), [this](const llama_moe_upload & job, size_t & n_bytes) { return upload(job, n_bytes); });

    LLAMA_LOG_INFO("%s: expert cache: %zu layers x %d slots, %.1f MiB on the device(s)\n",
            __func__, layers.size(), params.n_slots, device_size/1024.0/1024.0);
}

// the layers whose parts have the same types and shapes share a bank of each part
static void moe_make_banks(ggml_context * ctx_dev, std::vector<llama_moe_cache_layer> & group) {
    auto layout = [](const llama_moe_cache_layer & cl) {
        std::vector<int64_t> key;
        for (auto member : llama_moe_banked) {
            const ggml_tensor * t = cl.exps.*member;
            key.push_back(t ? t->type : -1);
            for (int d = 0; t && d < ggml_n_dims(t) - 1; ++d) {
                key.push_back(t->ne[d]);
            }
        }
        return key;
    };
    std::map<std::vector<int64_t>, std::vector<llama_moe_cache_layer *>> by_layout;
    for (auto & cl : group) {
        by_layout[layout(cl)].push_back(&cl);
    }
    for (auto & [key, members] : by_layout) {
        const int32_t n_slots = members[0]->n_slots;
        const int64_t n_bank  = (int64_t) members.size()*n_slots + 1;
        if (n_bank > INT32_MAX) {
            throw std::runtime_error(format("%zu layers x %d slots exceed the int32 slot ids of a bank", members.size(), n_slots));
        }
        for (size_t p = 0; p < members[0]->parts.size(); ++p) {
            const ggml_tensor * t = members[0]->parts[p].exps;
            int64_t ne[GGML_MAX_DIMS];
            std::copy(t->ne, t->ne + GGML_MAX_DIMS, ne);
            ne[ggml_n_dims(t) - 1] = n_bank;
            ggml_tensor * bank = ggml_new_tensor(ctx_dev, t->type, ggml_n_dims(t), ne);
            ggml_format_name(bank, "moe_cache.%s", ggml_get_name(t));
            for (auto * cl : members) {
                cl->parts[p].bank = bank;
            }
        }
        for (size_t j = 0; j < members.size(); ++j) {
            auto & cl = *members[j];
            size_t p = 0; // the parts are the banked members present, in order
            for (auto member : llama_moe_banked) {
                if (cl.exps.*member) {
                    cl.bank.*member = cl.parts[p++].bank;
                }
            }
            cl.bank_slot0 = (int32_t) j*n_slots;
            cl.zero_slot  = (int32_t) (n_bank - 1);
        }
    }
}

void llama_moe_device::place(ggml_backend_buffer_type_t buft, std::vector<llama_moe_cache_layer> & group, ggml_context * ctx_host) {
    ggml_context * ctx_dev = new_ctx((std::size(llama_moe_banked) + 1)*group.size() + 1);

    int64_t n_table = 0;
    for (const auto & cl : group) {
        n_table += cl.n_expert;
    }
    slot_table & table = tables.emplace_back();
    table.slot_of = ggml_new_tensor_2d(ctx_dev, GGML_TYPE_I32, 1, n_table);
    ggml_format_name(table.slot_of, "moe_cache_slot_of.%zu", tables.size() - 1);
    table.bank.assign(n_table, 0);

    moe_make_banks(ctx_dev, group);

    int64_t offset = 0;
    for (auto & cl : group) {
        cl.slot_of = ggml_view_2d(ctx_dev, table.slot_of, 1, cl.n_expert, table.slot_of->nb[1], offset*table.slot_of->nb[1]);
        ggml_format_name(cl.slot_of, "moe_cache_slot_of.%d", cl.il);
        cl.table        = (int32_t) tables.size() - 1;
        cl.table_offset = (int32_t) offset;
        offset += cl.n_expert;
        add_layer(std::move(cl), ctx_host);
    }
    // the slots are weights to the scheduler: it runs every op reading them where they are, so the
    // device half never runs on the CPU over a copy taken before a lane copy wrote its slot
    ggml_backend_buffer_t buf = alloc(ctx_dev, buft);
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    device_size += ggml_backend_buffer_get_size(buf);
}

void llama_moe_device::set_below(const llama_moe_cache * ram) {
    below.assign(layers.size(), nullptr);
    for (const auto & cl : layers) {
        below[cl.i] = ram ? ram->layer(cl.il) : nullptr;
    }
}

//
// graph
//

void llama_moe_device::observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip) {
    GGML_UNUSED(as);
    if (const llama_moe_cache_layer * ram = below[cl.i]) {
        // the RAM tier first: the experts it reads in are then in memory for the device's uploads
        ram->cache->record(*ram, ids, skip);
    }
    record(cl, ids, skip);
    if (++n_calls[cl.i] == cl.n_matmuls() && !worker.wait_lane()) {
        // the scheduler starts the layer's device half once the CPU half returns, so the lane's
        // copies must be complete by then. A copy that failed leaves an expert the CPU skipped
        // uncomputed: the graph's output is not the model's (stopped())
        lane_failed = true;
    }
}

// ids: I32 [n_expert_used, n_tokens] (the last layer of a ubatch may run fewer tokens); skip: the
// layer's skip table, 1 for the experts that run from a slot (hits)
void llama_moe_device::record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) {
    if (routing.recorded(cl.i)) {
        return; // another matmul of the layer ran first
    }
    routing.record(cl.i, cl.n_expert_used, ids, nullptr);
    count(cl, (const int32_t *) skip->data);
    const std::vector<llama_moe_upload> started = admit(cl);
    for (const auto & job : started) {
        if (job.lane) {
            lend(cl, job.expert, job.slot);
        }
    }
    worker.enqueue(started);
}

// its entry in the slot table is written now: the device half runs after the CPU half (see observe_matmul)
void llama_moe_device::lend(const llama_moe_cache_layer & cl, int32_t expert, int32_t slot) {
    ((int32_t *) cl.skip->data)[expert] = 1;
    auto & table = tables[cl.table];
    const int32_t at = cl.table_offset + expert;
    table.bank[at] = cl.bank_slot0 + slot;
    ggml_backend_tensor_set(table.slot_of, &table.bank[at], at*sizeof(int32_t), sizeof(int32_t));
    layer_counters[cl.i].lane++;
}

//
// boundary
//

void llama_moe_device::boundary_begin() {
    lane_failed = false;
    std::fill(n_calls.begin(), n_calls.end(), 0);
}

void llama_moe_device::boundary_end(uint32_t n_tokens, uint32_t n_outputs) {
    GGML_UNUSED(n_tokens);
    GGML_UNUSED(n_outputs);
    flush_tables();
    worker.enqueue(staged);
}

void llama_moe_device::flush_tables() {
    for (const auto & cl : layers) {
        if (!slots[cl.i].take_dirty()) {
            continue;
        }
        int32_t * skip = (int32_t *) cl.skip->data;
        int32_t * bank = tables[cl.table].bank.data() + cl.table_offset;
        for (int32_t e = 0; e < cl.n_expert; ++e) {
            const int32_t s = slots[cl.i].slot_of(e);
            skip[e] = s >= 0;
            bank[e] = s >= 0 ? cl.bank_slot0 + s : cl.zero_slot;
        }
        tables[cl.table].dirty = true;
    }
    for (auto & table : tables) {
        if (table.dirty) {
            ggml_backend_tensor_set(table.slot_of, table.bank.data(), 0, ggml_nbytes(table.slot_of));
            table.dirty = false;
        }
    }
}

llama_moe_cache_counters llama_moe_device::counters(int32_t i) {
    worker.wait();
    llama_moe_cache_counters c = layer_counters.at(i);
    worker.add_counters(i, c);
    return c;
}

//
// upload worker
//

bool llama_moe_device::upload(const llama_moe_upload & job, size_t & n_bytes) {
    const auto & cl = layers[job.i];
    for (const auto & part : cl.parts) {
        const size_t size = part.expert_bytes;
        const void * data = (const char *) part.exps->data + job.expert*size;
        if (part.file >= 0) {
            const size_t offset = part.offset + job.expert*size;
            data = files.read(part.file, offset, size, ggml_backend_buffer_get_base(staging.get()));
            if (!data) {
                return false;
            }
            if (llama_moe_is_mapped(part.exps)) {
                // experts mapped and unread: what the read brought into the page cache leaves it again
                // (the pages a RAM tier keeps stay: they are mapped)
                files.release(part.file, offset, size);
            }
        }
        ggml_backend_tensor_set(part.bank, data, (size_t) (cl.bank_slot0 + job.slot)*size, size);
        n_bytes += size;
        if (upload_delay_us > 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(upload_delay_us.load()));
        }
    }
    return true;
}
