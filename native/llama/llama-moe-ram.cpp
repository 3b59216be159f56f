#include "llama-moe-ram.h"

#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>

#if defined(__linux__)
#include <unistd.h>
#endif

// the uploads' reads and the drops go through the mapping's own bytes: every part of a file must
// be mapped at the same base
static void moe_check_mapping(const std::vector<llama_moe_cache_layer> & candidates) {
    std::map<int32_t, const char *> base;
    for (const auto & cl : candidates) {
        for (const auto & part : cl.parts) {
            const char * b = (const char *) part.exps->data - part.offset;
            if (base.emplace(part.file, b).first->second != b) {
                throw std::runtime_error(format("%s is not mapped where the model file has it", ggml_get_name(part.exps)));
            }
        }
    }
}

// one expert's bytes of part, in the model file and in its mapping
static llama_moe_file_range moe_range(const llama_moe_cache_part & part, int32_t expert) {
    return { part.file, part.offset + expert*part.expert_bytes, part.expert_bytes,
             (const char *) part.exps->data + expert*part.expert_bytes };
}

static int64_t moe_us_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

// no device; the skip tables stay zero (the CPU computes every expert)
llama_moe_ram::llama_moe_ram(const llama_model & model, const llama_moe_cache_params & params, uint32_t n_ubatch) :
        llama_moe_cache((int32_t) n_ubatch, /*has_lane =*/ false), ahead_on(params.read_ahead) {
    std::vector<llama_moe_cache_layer> candidates = llama_moe_find_layers(model, params.n_slots, /*in_ram =*/ true);
    llama_moe_find_in_files(model, candidates, files);
    if (candidates.empty()) {
        throw std::runtime_error("no MoE layer has its expert weights mapped from the model file (load the model with lazy_mode = LLAMA_LAZY_MODE_EXPERTS)");
    }
    moe_check_mapping(candidates);

    layer_of_il.assign(model.layers.size(), -1);
    layers.reserve(candidates.size());
    ggml_context * ctx_host = new_ctx(2*candidates.size() + 1);
    for (auto & candidate : candidates) {
        add_layer(std::move(candidate), ctx_host);
        auto & cl = layers.back();
        if (cl.n_slots < cl.n_expert) {
            cl.skip_late = ggml_new_tensor_1d(ctx_host, GGML_TYPE_I32, cl.n_expert);
            ggml_format_name(cl.skip_late, "moe_cache_skip_late.%d", cl.il);
        }
    }
    ggml_tensor * stock_observed = new_stock_observed(ctx_host, n_ubatch);
    alloc(ctx_host, ggml_backend_cpu_buffer_type());
    init_state(stock_observed);
    predictions.resize(layers.size());
    ahead.resize(layers.size());
    for (const auto & cl : layers) {
        outputs_only.push_back(cl.il == (int32_t) model.layers.size() - 1);
        room = std::max(room, std::min<size_t>(cl.n_expert, (size_t) n_ubatch*cl.n_expert_used)*cl.expert_bytes());
    }
    spare_room = room;
    std::vector<llama_moe_file_range> tensors;
    for (const auto & cl : layers) {
        for (const auto & part : cl.parts) {
            tensors.push_back({ part.file, part.offset, ggml_nbytes(part.exps), part.exps->data });
        }
    }
    files.advise_huge(tensors);
    reader = std::make_unique<llama_moe_reader>(files);

    if (layers[0].n_slots >= layers[0].n_expert) {
        read_all();
    }
    LLAMA_LOG_INFO("%s: expert cache, RAM tier: %zu layers x %d experts kept in memory (%.1f MiB), the others read from the model file%s\n",
            __func__, layers.size(), layers[0].n_slots, layers.size()*layers[0].n_slots*layers[0].expert_bytes()/1024.0/1024.0,
            ahead_on ? ", read ahead by the next layer's router" : "");
}

// when every expert fits, they are all read in and mapped now, as stock's mmap does at load
// (otherwise the first boundary releases what is in memory: release_unkept)
void llama_moe_ram::read_all() {
    std::vector<llama_moe_upload> all;
    for (const auto & cl : layers) {
        for (int32_t e = 0; e < cl.n_expert; ++e) {
            all.push_back({ cl.i, e, -1 });
        }
    }
    size_t n_bytes = 0;
    if (read_in(all, n_bytes)) {
        for (const auto & cl : layers) {
            for (const auto & part : cl.parts) {
                llama_moe_populate(part.exps->data, ggml_nbytes(part.exps)); // what was cached already too
            }
        }
    }
}

//
// graph
//

// the custom op of read_ahead, on one CPU thread: the prediction goes to the tier of the layer
static void moe_predicted(ggml_tensor * dst, const ggml_tensor * ids, int ith, int nth, void * userdata) {
    GGML_UNUSED(dst);
    GGML_UNUSED(nth);
    if (ith == 0) {
        const auto * next = (const llama_moe_cache_layer *) userdata;
        static_cast<llama_moe_ram *>(next->cache)->predicted(*next, ids);
    }
}

// whether t's weights are in the CPU's memory (a device's backend, an RPC server's among them, cannot
// run the custom op that hands the prediction over)
static bool moe_on_cpu(const ggml_tensor * t) {
    if (!t || !t->buffer) {
        return false;
    }
    if (ggml_backend_buffer_is_host(t->buffer)) {
        return true; // the mapped file's buffer among them, whose type names no device
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU; // repacked
}

// the router of cached layer next on the input of the layer before (its normed FFN input, as next
// would see its own: the residual stream changes little from layer to layer), or for the first layer
// on the token embeddings (else its experts would be read only once its own router ran), with the
// bias and the probability function that change its top-k; none where the router is on a device
ggml_tensor * llama_moe_ram::read_ahead(ggml_context * ctx, int32_t i, ggml_tensor * cur) const {
    if (!ahead_on || i >= n_layers()) {
        return nullptr;
    }
    const llama_moe_cache_layer & next = layers[i];
    const llama_moe_router & r = next.router;
    if (next.n_slots >= next.n_expert || !moe_on_cpu(r.gate_inp) || r.gate_inp->ne[0] != cur->ne[0] ||
            r.gate_inp->ne[1] != next.n_expert) {
        return nullptr;
    }
    cur = ggml_reshape_2d(ctx, cur, cur->ne[0], ggml_nrows(cur)); // (build_moe_ffn's input is [n_embd, 1, n_tokens])
    ggml_tensor * probs = ggml_mul_mat(ctx, r.gate_inp, cur); // [n_expert, n_tokens]
    if (r.gate_inp_b) {
        probs = ggml_add(ctx, probs, r.gate_inp_b);
    }
    if (r.probs_b) {
        switch (r.gating) {
            case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX:       probs = ggml_soft_max(ctx, probs); break;
            case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID:       probs = ggml_sigmoid(ctx, probs);  break;
            case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS: probs = ggml_sqrt(ctx, ggml_softplus(ctx, probs)); break;
            default: break; // the logits themselves
        }
        probs = ggml_add(ctx, probs, r.probs_b);
    }
    ggml_tensor * ids = ggml_argsort_top_k(ctx, probs, next.n_expert_used); // [n_used, n_tokens]
    return ggml_map_custom1_inplace(ctx, ids, moe_predicted, 1, const_cast<llama_moe_cache_layer *>(&next));
}

void llama_moe_ram::built(const llama_moe_cache_layer & cl, int64_t n_rows, uint32_t n_tokens, uint32_t n_outputs) const {
    if (n_outputs < n_tokens) {
        outputs_only[cl.i] = n_rows < n_tokens;
    }
}

// (a layer that runs only a prompt's outputs: their predictions alone, the ubatch's last)
void llama_moe_ram::predicted(const llama_moe_cache_layer & next, const ggml_tensor * ids) {
    const int64_t n_used = ids->ne[0];
    int64_t t0 = 0;
    if (outputs_only[next.i] && ubatch_outs < ids->ne[1]) {
        t0 = ids->ne[1] - ubatch_outs;
    }
    auto & p = predictions[next.i];
    p.clear();
    for (int64_t t = t0; t < ids->ne[1]; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids->data + t*ids->nb[1]);
        p.insert(p.end(), row, row + n_used);
    }
    if (next.i == 0 && !changed && !whole_layer_ahead(0)) {
        // (no observer before the first layer's; a prompt reads it whole at its observer, its
        // reads ahead from the embeddings would take the room that the next layer's read-ahead needs)
        read_ahead_of(0);
    }
}

void llama_moe_ram::observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * as, const ggml_tensor * ids, const ggml_tensor * skip) {
    record(cl, ids, skip);
    if (skip == cl.skip_late) {
        finish_late_reads(as); // the second pass computes what they read
    }
}

// ids: I32 [n_expert_used, n_tokens]; skip: the graph's table, the tier's own or, under a device
// cache, the device's (the experts it holds are neither read nor counted here)
void llama_moe_ram::record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) {
    if (routing.recorded(cl.i)) {
        return; // another matmul of the layer ran first
    }
    if (whole_layer_ahead(cl.i)) {
        follow_growth(); // a prompt's activations have grown the process by now: spares within what is left
    }
    retire_transient(/*all =*/ false); // those of the layers before whose reads are done
    if (!changed && !files.unchanged()) {
        fail_reads();
    }
    // the tier's own tables are its to write (below); a device cache's above it skips what the device holds
    const bool own = skip == cl.skip || skip == cl.skip_late;
    routing.record(cl.i, cl.n_expert_used, ids, own ? nullptr : (const int32_t *) skip->data);
    count(cl, nullptr);
    const std::vector<llama_moe_upload> started = admit(cl);
    for (const auto & job : started) {
        if (job.replaced >= 0) {
            retire(cl.i, job.replaced);
        }
    }
    // over its own tables the graph runs the layer's experts twice (the passes' order is the graph's)
    const ggml_tensor * later = !cl.skip_late ? nullptr : skip == cl.skip ? cl.skip_late : skip == cl.skip_late ? cl.skip : nullptr;
    read_misses(cl, started, skip, later);
    if (changed) {
        // the mapping may hold other bytes now, or end early (a read past it is a SIGBUS): the CPU
        // computes no expert from here on, and decode fails (stopped())
        for (const ggml_tensor * t : { skip, later }) {
            if (t) {
                std::fill((int32_t *) t->data, (int32_t *) t->data + cl.n_expert, 1);
            }
        }
    }
}

// before the CPU computes layer cl: every selected expert that is neither resident nor read ahead is
// queued for the reader, then the experts predicted for the next layer; those admitted keep their
// slot, the others become spares once the layer has run. A graph that runs the layer's experts twice
// (later: the table of the pass after this one): this pass (now) computes the experts kept while the
// reader reads, and the pass over skip_late waits for the reads and computes those experts
// (finish_late_reads); otherwise the CPU waits here and this pass computes them all
void llama_moe_ram::read_misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted,
                                const ggml_tensor * now, const ggml_tensor * later) {
    pending p;
    p.i          = cl.i;
    p.n_admitted = (int32_t) admitted.size();
    p.t0         = std::chrono::steady_clock::now();
    p.parts.assign(cl.parts.size(), 0);
    reads demand;
    if (!changed) {
        std::vector<int32_t> experts = misses(cl, p);
        demand = queue_reads(cl.i, std::move(experts));
        p.join(demand);
        for (size_t n : demand.bytes) {
            layer_counters[cl.i].upload_bytes += n;
        }
        note_transient(cl, demand, admitted);
        read_ahead_of(cl.i + 1); // behind this layer's reads
    }
    if (later && later == cl.skip_late && p.ticket > 0 && !changed) { // (a layer kept whole has one pass: no skip_late)
        write_passes(cl, demand, (int32_t *) now->data, (int32_t *) later->data);
        late = p;
        return;
    }
    if (later) {
        std::fill((int32_t *) now->data, (int32_t *) now->data + cl.n_expert, 0);
        std::fill((int32_t *) later->data, (int32_t *) later->data + cl.n_expert, 1);
    }
    finish_reads(p);
}

// the selected experts of layer cl that are neither kept nor read ahead; p waits for the read-ahead's
// batches when a selected expert is in them. The experts read ahead are counted used or wasted
std::vector<int32_t> llama_moe_ram::misses(const llama_moe_cache_layer & cl, pending & p) {
    const llama_moe_slots & ls = slots[cl.i];
    const reads & ah = ahead[cl.i];
    const int32_t * ids = routing.row(cl.i);
    std::vector<uint8_t> in(cl.n_expert, 0); // 1: read ahead, 2: selected
    for (int32_t e : ah.experts) {
        in[e] = 1;
    }
    std::vector<int32_t> out;
    for (int32_t k = 0; k < routing.n(cl.i); ++k) {
        const int32_t e = ids[k];
        if (e < 0 || (in[e] & 2) || ls.cached(e)) {
            continue;
        }
        if (in[e] == 1) {
            p.join(ah);
        } else {
            out.push_back(e);
        }
        in[e] |= 2;
    }
    auto & c = layer_counters[cl.i];
    for (size_t j = 0; j < ah.experts.size(); ++j) {
        if (in[ah.experts[j]] & 2) {
            c.read_ahead_used++;
        } else {
            c.read_ahead_wasted_bytes += ah.bytes[j];
        }
    }
    return out;
}

// the experts read for layer cl that no slot keeps become spares once the layer has run (after their
// batch is done); those read ahead that it did not select, at once if read (the layer does not compute
// them: their room goes to the next layer's read-ahead)
void llama_moe_ram::note_transient(const llama_moe_cache_layer & cl, const reads & demand, const std::vector<llama_moe_upload> & admitted) {
    std::vector<uint8_t> kept(cl.n_expert, 0);
    for (const auto & job : admitted) {
        kept[job.expert] = 1;
    }
    std::vector<uint8_t> selected(cl.n_expert, 0);
    const int32_t * ids = routing.row(cl.i);
    for (int32_t k = 0; k < routing.n(cl.i); ++k) {
        if (ids[k] >= 0) {
            selected[ids[k]] = 1;
        }
    }
    for (const reads * r : { &demand, (const reads *) &ahead[cl.i] }) {
        const bool read = reader->done(r->ticket);
        for (int32_t e : r->experts) {
            if (kept[e]) {
                continue;
            }
            if (!selected[e] && read) {
                retire(cl.i, e);
            } else {
                transient.push_back({ cl.i, e, r->ticket });
            }
        }
    }
    ahead[cl.i] = reads();
}

// queue the experts of layer i that the graph predicted and are not kept (predicted_experts)
void llama_moe_ram::read_ahead_of(int32_t i) {
    if (i >= n_layers()) {
        return;
    }
    std::vector<int32_t> experts = predicted_experts(i);
    predictions[i].clear();
    if (experts.empty()) {
        return;
    }
    ahead[i] = queue_reads(i, std::move(experts));
    auto & c = layer_counters[i];
    c.read_ahead += ahead[i].experts.size();
    for (size_t n : ahead[i].bytes) {
        c.read_ahead_bytes += n;
        c.upload_bytes     += n;
    }
}

// the experts of layer i the graph predicted for a token of the ubatch that are not kept (a prompt's
// tokens leave some experts unpredicted, and mostly unselected: reading them too read 1.2x the bytes
// of a prompt); with no prediction (read-ahead off), in a ubatch that selects most of the layer, all
// of them. The most predicted first, as many as fit beside the reads held already within room
std::vector<int32_t> llama_moe_ram::predicted_experts(int32_t i) const {
    const llama_moe_cache_layer & next = layers[i];
    const bool whole = whole_layer_ahead(i);
    std::vector<int32_t> votes(next.n_expert, 0);
    for (int32_t e : predictions[i]) {
        if (e >= 0 && e < next.n_expert) {
            votes[e]++;
        }
    }
    const bool voted = !predictions[i].empty();
    std::vector<int32_t> out;
    for (int32_t e = 0; e < next.n_expert; ++e) {
        if ((votes[e] > 0 || (whole && !voted)) && !slots[i].cached(e)) {
            out.push_back(e);
        }
    }
    const size_t held = transient_bytes(); // (spares give way)
    const size_t fit = (room - std::min(room, held)) / next.expert_bytes();
    if (out.size() > fit) {
        std::stable_sort(out.begin(), out.end(), [&](int32_t a, int32_t b) { return votes[a] > votes[b]; });
        out.resize(fit);
    }
    return out;
}

// a ubatch that selects most experts of a layer will select most of the next one's (layer i): read
// them all while this layer computes (a layer that runs only the outputs: that many rows)
bool llama_moe_ram::whole_layer_ahead(int32_t i) const {
    const auto & next = layers[i];
    const uint32_t rows = outputs_only[i] ? ubatch_outs : ubatch_rows;
    return (int64_t) rows*next.n_expert_used >= next.n_expert && next.n_slots < next.n_expert;
}

// the first pass computes the experts in memory (kept, or demanded and found there: spares), the
// second the others the layer selected (read now, or read ahead)
void llama_moe_ram::write_passes(const llama_moe_cache_layer & cl, const reads & demand, int32_t * first, int32_t * second) const {
    std::fill(first, first + cl.n_expert, 0);
    std::fill(second, second + cl.n_expert, 1);
    const int32_t * ids = routing.row(cl.i);
    for (int32_t k = 0; k < routing.n(cl.i); ++k) {
        const int32_t e = ids[k];
        if (e >= 0 && !slots[cl.i].cached(e)) {
            first[e]  = 1;
            second[e] = 0;
        }
    }
    for (size_t j = 0; j < demand.experts.size(); ++j) {
        if (demand.bytes[j] == 0) {
            first[demand.experts[j]]  = 0;
            second[demand.experts[j]] = 1;
        }
    }
}

// wait for the reads of layer p.i up to batch ticket (a failed one stops the tier)
bool llama_moe_ram::wait_reads(const pending & p, uint64_t ticket) {
    const auto t = std::chrono::steady_clock::now();
    const bool ok = !changed && reader->wait(ticket);
    layer_counters[p.i].read_wait_us += moe_us_since(t);
    if (!ok) {
        fail_reads();
    }
    return ok;
}

// every read of layer p.i is in: its admissions count
void llama_moe_ram::finish_reads(const pending & p) {
    const bool ok = wait_reads(p, p.ticket);
    auto & c = layer_counters[p.i];
    c.uploads   += ok ? p.n_admitted : 0;
    c.upload_us += moe_us_since(p.t0);
}

// the second pass of a layer whose misses were read while its first pass ran (a failed read: the
// second pass computes nothing)
void llama_moe_ram::finish_late_reads(const ggml_tensor * as) {
    if (late.i < 0) {
        return;
    }
    const auto & cl = layers[late.i];
    // the matmul of one part waits for that part's reads (those queued before them are read first);
    // with no part named (a graph that stopped before the second pass), or the last matmul, for all
    size_t k = 0;
    while (k < cl.parts.size() && cl.parts[k].exps != as) {
        ++k;
    }
    const bool last = k == cl.parts.size() || ++late.n_waited == (int32_t) cl.parts.size();
    if (last) {
        const pending p = late;
        late = pending();
        finish_reads(p);
    } else {
        wait_reads(late, late.parts[k]);
    }
    if (changed) {
        std::fill((int32_t *) cl.skip_late->data, (int32_t *) cl.skip_late->data + cl.n_expert, 1);
    }
}

//
// the model file
//

// the experts of layer i queued for the reader, with the bytes each needs from the file (an expert
// whose pages are all in the page cache needs none: the matmul maps them)
llama_moe_ram::reads llama_moe_ram::queue_reads(int32_t i, std::vector<int32_t> experts) {
    for (int32_t e : experts) {
        unretire(i, e); // (a spare is read from memory: its bytes are held still, as the others')
    }
    reclaim(experts.size()*layers[i].expert_bytes());
    const auto & parts = layers[i].parts;
    reads r;
    r.parts.assign(parts.size(), 0);
    std::vector<int32_t> to_read;
    // a ubatch that reads whole layers (a prompt) reads once the drops before it gave their memory
    // back; a decode token's few reads start at once, beside its few drops, but for an expert being
    // dropped, read whole after its drop
    uint64_t after_drop = whole_layer_ahead(i) ? reader->last_drop() : 0;
    for (int32_t e : experts) {
        size_t n = 0;
        const uint64_t drop = drop_of(i, e);
        after_drop = std::max(after_drop, drop);
        for (const auto & part : parts) {
            const llama_moe_file_range range = moe_range(part, e);
            n += drop ? range.size : files.missing(range);
        }
        if (n > 0) {
            to_read.push_back(e);
        }
        r.bytes.push_back(n);
    }
    // a batch per part, in the parts' order (down last): the second pass's first matmuls compute
    // while the last part is read
    for (size_t k = 0; k < parts.size() && !to_read.empty(); ++k) {
        std::vector<llama_moe_file_range> ranges;
        for (int32_t e : to_read) {
            ranges.push_back(moe_range(parts[k], e));
        }
        r.parts[k] = reader->queue(std::move(ranges), after_drop);
        r.ticket   = std::max(r.ticket, r.parts[k]);
    }
    r.experts = std::move(experts);
    return r;
}

// read the experts' weights into the page cache, every part of every job at once, and map them (on
// this thread); false, and the tier stopped, when a file changed or a read failed
bool llama_moe_ram::read_in(const std::vector<llama_moe_upload> & jobs, size_t & n_bytes) {
    std::vector<llama_moe_file_range> ranges;
    for (const auto & job : jobs) {
        for (const auto & part : layers[job.i].parts) {
            ranges.push_back(moe_range(part, job.expert));
        }
    }
    if (!files.read_in(ranges, n_bytes)) {
        fail_reads();
        return false;
    }
    return true;
}

// the step callback's uploads, one at a time: the bytes and time are the job's
void llama_moe_ram::read_staged() {
    reader->wait_drops(); // (what is in memory is then what the tier says)
    auto t0 = std::chrono::steady_clock::now();
    for (const auto & job : staged) {
        unretire(job.i, job.expert);
        size_t n_bytes = 0;
        const bool ok = read_in({ job }, n_bytes);
        auto & c = layer_counters[job.i];
        c.uploads      += ok;
        c.upload_bytes += n_bytes;
        c.upload_us    += moe_us_since(t0);
        t0 = std::chrono::steady_clock::now();
    }
}

void llama_moe_ram::fail_reads() {
    if (!changed.exchange(true)) {
        LLAMA_LOG_ERROR("%s: the model file changed or could not be read: the RAM tier stops, and every decode fails from now on\n", __func__);
    }
}

// the expert is read again from the file when used: its ranges join those the reader's drop thread
// drops (reclaim queues them), off the compute threads
void llama_moe_ram::drop(int32_t i, int32_t expert, std::vector<llama_moe_file_range> & ranges) {
    if (layers[i].n_slots >= layers[i].n_expert) {
        return; // every expert of the layer fits: none leaves memory
    }
    for (const auto & part : layers[i].parts) {
        ranges.push_back(moe_range(part, expert));
    }
    drops.push_back({ i, expert, 0 });
}

// the number of the expert's last drop, queued and not done (its pages may be in memory still, and
// will not be), or 0
uint64_t llama_moe_ram::drop_of(int32_t i, int32_t expert) {
    const uint64_t done = reader->dropped();
    drops.erase(std::remove_if(drops.begin(), drops.end(), [done](const dropping & d) { return d.drop <= done; }), drops.end());
    uint64_t last = 0;
    for (const auto & d : drops) {
        if (d.i == i && d.expert == expert) {
            last = std::max(last, d.drop);
        }
    }
    return last;
}

// the tier starts empty: what loading or an earlier process left in memory is released, so that the
// memory holds what the slots say (the whole file at once: the page cache releases a large folio
// only when the range covers it). Done at the first boundary, not at init: a cache built only to be
// asked its layers (and replaced) must not empty a page cache that the next one would read again
void llama_moe_ram::release_unkept() {
    if (layers[0].n_slots >= layers[0].n_expert) {
        return;
    }
    reader->wait_drops();
    for (const auto & cl : layers) {
        for (int32_t e = 0; e < cl.n_expert; ++e) {
            for (const auto & part : cl.parts) {
                files.drop(moe_range(part, e));
            }
        }
    }
    files.release_all();
    spares.clear();
    spare_bytes = 0;
}

// an expert no slot keeps and no read uses any more: spare while room allows
void llama_moe_ram::retire(int32_t i, int32_t expert) {
    if (layers[i].n_slots >= layers[i].n_expert || slots[i].cached(expert)) {
        return;
    }
    unretire(i, expert); // (the newest again)
    spares.emplace_back(i, expert);
    spare_bytes += layers[i].expert_bytes();
    reclaim(0);
}

// the expert is read (or kept) again: no longer spare
void llama_moe_ram::unretire(int32_t i, int32_t expert) {
    const auto it = std::find(spares.begin(), spares.end(), std::make_pair(i, expert));
    if (it != spares.end()) {
        spares.erase(it);
        spare_bytes -= layers[i].expert_bytes();
    }
}

// drop spares, oldest first, until they, the reads held and need bytes more fit in spare_room (the
// room less what the process grew by)
void llama_moe_ram::reclaim(size_t need) {
    const size_t held = transient_bytes() + need;
    std::vector<llama_moe_file_range> ranges;
    while (!spares.empty() && spare_bytes + held > spare_room) {
        // the oldest, the first layer's last: its misses are read ahead from the embeddings alone
        auto it = std::find_if(spares.begin(), spares.end(), [](const std::pair<int32_t, int32_t> & s) { return s.first != 0; });
        if (it == spares.end()) {
            it = spares.begin();
        }
        const auto [i, e] = *it;
        spares.erase(it);
        spare_bytes -= layers[i].expert_bytes();
        if (!slots[i].cached(e)) { // (a boundary's upload may have given it a slot since)
            drop(i, e, ranges);
        }
    }
    const uint64_t n = reader->drop(std::move(ranges));
    for (auto it = drops.rbegin(); it != drops.rend() && it->drop == 0; ++it) {
        it->drop = n;
    }
}

// the process's resident anonymous memory (Linux; 0 elsewhere: the spares keep the whole room)
static size_t moe_anon_bytes() {
#if defined(__linux__)
    static const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    size_t size = 0, resident = 0, shared = 0;
    FILE * f = fopen("/proc/self/statm", "r");
    const bool ok = f && fscanf(f, "%zu %zu %zu", &size, &resident, &shared) == 3;
    if (f) {
        fclose(f);
    }
    return ok && resident > shared ? (resident - shared)*page : 0;
#else
    return 0;
#endif
}

// at a boundary: the spares keep the room less what the process's anonymous memory grew by since
// the first boundary (the sizing counted the memory the process held then)
void llama_moe_ram::follow_growth() {
    const size_t anon = moe_anon_bytes();
    if (!released) {
        anon_at_sizing = anon;
    }
    const size_t grown = anon > anon_at_sizing ? anon - anon_at_sizing : 0;
    spare_room = room > grown ? room - grown : 0;
    reclaim(0);
}

// the bytes of the experts read without a slot that are not dropped yet
size_t llama_moe_ram::transient_bytes() const {
    size_t held = 0;
    for (const auto & t : transient) {
        held += layers[t.i].expert_bytes();
    }
    return held;
}

// all: every one (the reader idle); else those whose batch is done
void llama_moe_ram::retire_transient(bool all) {
    std::vector<transient_read> later;
    std::vector<transient_read> done;
    for (const auto & t : transient) {
        (all || reader->done(t.ticket) ? done : later).push_back(t);
    }
    transient.swap(later);
    for (const auto & t : done) {
        retire(t.i, t.expert);
    }
}

//
// boundary
//

void llama_moe_ram::boundary_begin() {
    finish_late_reads(nullptr); // a graph that stopped before a layer's second pass
    reader->wait(reader->last());
}

void llama_moe_ram::boundary_end(uint32_t n_tokens, uint32_t n_outputs) {
    follow_growth();
    if (!released) {
        release_unkept();
        released = true;
    }
    for (int32_t i = 0; i < n_layers(); ++i) {
        for (int32_t e : ahead[i].experts) {
            retire(i, e); // read ahead for a layer the last ubatch did not reach
        }
        ahead[i] = reads();
        predictions[i].clear();
    }
    retire_transient(/*all =*/ true);
    ubatch_rows = n_tokens;
    ubatch_outs = n_outputs;
    if (whole_layer_ahead(0)) {
        // a prompt: its reads take the room, and its activations grow the process first (a larger
        // ubatch than any before touches more of the compute buffers); spares wait for its first layer
        spare_room = 0;
        reclaim(0);
    }
    if (!staged.empty() && !changed) {
        read_staged();
    }
}
