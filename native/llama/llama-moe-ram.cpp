#include "llama-moe-ram.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <map>
#include <stdexcept>

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
        llama_moe_cache((int32_t) n_ubatch, /*has_lane =*/ false) {
    std::vector<llama_moe_cache_layer> candidates = llama_moe_find_layers(model, params.n_slots, /*in_ram =*/ true);
    llama_moe_find_in_files(model, candidates, files);
    if (candidates.empty()) {
        throw std::runtime_error("no MoE layer has its expert weights mapped from the model file (load the model with lazy_mode = LLAMA_LAZY_MODE_EXPERTS)");
    }
    moe_check_mapping(candidates);

    layer_of_il.assign(model.layers.size(), -1);
    last_il = (int32_t) model.layers.size() - 1;
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

    if (layers[0].n_slots >= layers[0].n_expert) {
        read_all();
    }
    LLAMA_LOG_INFO("%s: expert cache, RAM tier: %zu layers x %d experts kept in memory (%.1f MiB), the others read from the model file\n",
            __func__, layers.size(), layers[0].n_slots, layers.size()*layers[0].n_slots*layers[0].expert_bytes()/1024.0/1024.0);
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

void llama_moe_ram::observe_matmul(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) {
    record(cl, ids, skip);
    if (skip == cl.skip_late) {
        finish_late_reads(); // the second pass computes what they read
    }
}

// ids: I32 [n_expert_used, n_tokens]; skip: the graph's table, the tier's own or, under a device
// cache, the device's (the experts it holds are neither read nor counted here)
void llama_moe_ram::record(const llama_moe_cache_layer & cl, const ggml_tensor * ids, const ggml_tensor * skip) {
    if (routing.recorded(cl.i)) {
        return; // another matmul of the layer ran first
    }
    drop_transient(); // the layer before has run
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
            drop(cl.i, job.replaced);
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

// before the CPU computes layer cl: every selected expert that is not resident is read in at once;
// those admitted keep their slot, the others are dropped once the layer has run. A graph that runs
// the layer's experts twice (later: the table of the pass after this one): in a ubatch without
// read-ahead the reads run on another thread while this pass (now) computes the resident experts,
// and the pass over skip_late computes the experts read (finish_late_reads); otherwise this pass
// computes them all
void llama_moe_ram::read_misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted,
                                const ggml_tensor * now, const ggml_tensor * later) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<llama_moe_upload> reads = misses(cl, admitted);
    const bool ahead_next = reads_ahead(cl.i + 1);
    if (later) {
        const bool late_reads = later == cl.skip_late && !ahead_next && !reads.empty() && !changed;
        int32_t * first  = (int32_t *) now->data;
        int32_t * second = (int32_t *) later->data;
        std::fill(first, first + cl.n_expert, 0);
        std::fill(second, second + cl.n_expert, 1);
        if (late_reads) {
            for (const auto & job : reads) {
                first[job.expert]  = 1;
                second[job.expert] = 0;
            }
            start_late_reads(reads, (int32_t) admitted.size(), t0);
            return;
        }
    }
    size_t n_bytes = 0;
    const bool ok = !changed && (reads.empty() || read_in(reads, n_bytes));
    auto & c = layer_counters[cl.i];
    c.uploads      += ok ? admitted.size() : 0;
    c.upload_bytes += n_bytes;
    c.upload_us    += moe_us_since(t0);
    if (ok && ahead_next) {
        read_ahead(cl.i + 1);
    }
}

// the selected experts of layer cl that are neither resident nor read ahead; what this layer reads
// (and what the read-ahead brought that no token selected) and does not keep is transient
std::vector<llama_moe_upload> llama_moe_ram::misses(const llama_moe_cache_layer & cl, const std::vector<llama_moe_upload> & admitted) {
    const llama_moe_slots & ls = slots[cl.i];
    const int32_t * ids = routing.row(cl.i);
    std::vector<uint8_t> in(cl.n_expert, 0); // 1: read already, 2: also selected
    for (const auto & job : finish_read_ahead()) {
        in[job.expert] = 1;
    }
    std::vector<uint8_t> kept(cl.n_expert, 0);
    for (const auto & job : admitted) {
        kept[job.expert] = 1;
    }
    std::vector<llama_moe_upload> reads;
    for (int32_t k = 0; k < routing.n(cl.i); ++k) {
        const int32_t e = ids[k];
        if (e < 0 || in[e] == 2 || ls.cached(e)) {
            continue;
        }
        if (in[e] == 0) {
            reads.push_back({ cl.i, e, -1 });
        }
        in[e] = 2;
    }
    for (int32_t e = 0; e < cl.n_expert; ++e) {
        if (in[e] && !kept[e]) {
            transient.push_back({ cl.i, e, -1 });
        }
    }
    return reads;
}

// a ubatch that selects most experts of a layer will select most of the next one's (layer i): read
// them while this layer computes (the last layer runs only the outputs)
bool llama_moe_ram::reads_ahead(int32_t i) const {
    if (i >= n_layers()) {
        return false;
    }
    const auto & next = layers[i];
    const uint32_t rows = next.il == last_il ? ubatch_outs : ubatch_rows;
    return (int64_t) rows*next.n_expert_used >= next.n_expert && next.n_slots < next.n_expert;
}

void llama_moe_ram::start_late_reads(std::vector<llama_moe_upload> & reads, int32_t n_admitted, time_point t0) {
    late_jobs.swap(reads);
    late_admitted = n_admitted;
    late_t0       = t0;
    late.start([this](size_t & n_bytes) { return read_in(late_jobs, n_bytes); });
}

// the second pass of a layer whose misses were read while its first pass ran: wait for the reads
// (a failed one stops the tier, and the second pass computes nothing)
void llama_moe_ram::finish_late_reads() {
    if (!late.running()) {
        return;
    }
    size_t n_bytes = 0;
    const bool ok = late.join(n_bytes);
    const auto & cl = layers[late_jobs[0].i];
    auto & c = layer_counters[cl.i];
    c.uploads      += ok ? late_admitted : 0;
    c.upload_bytes += n_bytes;
    c.upload_us    += moe_us_since(late_t0);
    if (!ok) {
        std::fill((int32_t *) cl.skip_late->data, (int32_t *) cl.skip_late->data + cl.n_expert, 1);
    }
    late_jobs.clear();
}

// start reading the experts of layer i that are not resident, on another thread
void llama_moe_ram::read_ahead(int32_t i) {
    ahead_jobs.clear();
    for (int32_t e = 0; e < layers[i].n_expert; ++e) {
        if (!slots[i].cached(e)) {
            ahead_jobs.push_back({ i, e, -1 });
        }
    }
    if (ahead_jobs.empty()) {
        return;
    }
    ahead.start([this](size_t & n_bytes) { return read_in(ahead_jobs, n_bytes); });
}

// the experts the read-ahead read (after it has finished), counted to their layer
std::vector<llama_moe_upload> llama_moe_ram::finish_read_ahead() {
    if (!ahead.running()) {
        return {};
    }
    size_t n_bytes = 0;
    const bool ok = ahead.join(n_bytes);
    std::vector<llama_moe_upload> jobs;
    jobs.swap(ahead_jobs);
    if (!ok) {
        return {};
    }
    layer_counters[jobs[0].i].upload_bytes += n_bytes;
    return jobs;
}

//
// the model file
//

// read the experts' weights through the page cache, every part of every job at once, and map them;
// false, and the tier stopped, when a file changed or a read failed
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
    auto t0 = std::chrono::steady_clock::now();
    for (const auto & job : staged) {
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

// the expert is read again from the file when used
void llama_moe_ram::drop(int32_t i, int32_t expert) {
    if (layers[i].n_slots >= layers[i].n_expert) {
        return; // every expert of the layer fits: none leaves memory
    }
    for (const auto & part : layers[i].parts) {
        files.drop(moe_range(part, expert));
    }
}

// the tier starts empty: what loading or an earlier process left in memory is released, so that the
// memory holds what the slots say (the whole file at once: the page cache releases a large folio
// only when the range covers it). Done at the first boundary, not at init: a cache built only to be
// asked its layers (and replaced) must not empty a page cache that the next one would read again
void llama_moe_ram::release_unkept() {
    if (layers[0].n_slots >= layers[0].n_expert) {
        return;
    }
    for (const auto & cl : layers) {
        for (int32_t e = 0; e < cl.n_expert; ++e) {
            drop(cl.i, e);
        }
    }
    files.release_all();
}

void llama_moe_ram::drop_transient() {
    for (const auto & job : transient) {
        drop(job.i, job.expert);
    }
    transient.clear();
}

//
// boundary
//

void llama_moe_ram::boundary_begin() {
    finish_late_reads(); // a graph that stopped before a layer's second pass
}

void llama_moe_ram::boundary_end(uint32_t n_tokens, uint32_t n_outputs) {
    if (!released) {
        release_unkept();
        released = true;
    }
    for (const auto & job : finish_read_ahead()) {
        drop(job.i, job.expert); // read for a layer the last ubatch did not reach
    }
    drop_transient();
    ubatch_rows = n_tokens;
    ubatch_outs = n_outputs;
    if (!staged.empty() && !changed) {
        read_staged();
    }
}
