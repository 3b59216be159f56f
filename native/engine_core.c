/* The cache engine's per-step bookkeeping in one compact piece of code: a decode step runs it
 * with cold CPU caches, where every distinct numpy kernel costs several microseconds.
 * moecache/core/engine.py documents the rules. */

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>

#include "engine_core.h"

static inline void count(mc_engine *g, mc_counter counter, int64_t layer, int64_t n) {
    g->counts[counter * g->n_layers + layer] += n;
}

static inline int64_t id_at(const void *ids, int wide, int64_t i) {
    return wide ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i];
}

/* An observation (L, n): hit mask, hits and misses per layer, the used table (a new all-zero
 * table, kept as g->used for the boundary's choice; each expert once), usage, counters,
 * prefetch hits, any_miss; with a miss planner's table, a decode graph's lane copies per layer,
 * declined uploads, modelled time and link time, taken into the link's averages. Without
 * lookups (a prompt the stock graph ran, which read no slot): no hit, miss or prefetch hit, no
 * usage (the profile stays uses per decode step) and nothing for the planner.
 * Returns 1 (nothing changed, obs->bad_id = the offending id) if an id is outside [-1, E), 2
 * (nothing changed, obs->bad_id = the layer) if a copy's layer is outside [0, L). */
int mc_observe(mc_engine *g, mc_observation *obs) {
    const int64_t L = g->n_layers, E = g->n_expert, n = obs->n, total = L * n;
    const void *ids = obs->ids;
    const int wide = obs->wide, lookups = obs->lookups;
    int64_t lowest = 0, highest = 0;
    for (int64_t i = 0; i < total; i++) {
        int64_t id = id_at(ids, wide, i);
        if (i == 0 || id < lowest) lowest = id;
        if (i == 0 || id > highest) highest = id;
    }
    if (lowest < -1 || highest >= E) {
        obs->bad_id = lowest < -1 ? lowest : highest;
        return 1;
    }
    const int planned = obs->graph_table && lookups;
    for (int64_t i = 0; planned && i < obs->n_writes + obs->n_uploads; i++) {
        const int32_t l = i < obs->n_writes ? obs->writes[3 * i] : obs->uploads[3 * (i - obs->n_writes)];
        if (l < 0 || l >= L) {
            obs->bad_id = l;
            return 2;
        }
    }
    g->used = obs->used;
    int any_miss = 0;
    double graph_ms = 0.0, link_bytes = 0.0;
    if (planned) {
        for (int64_t l = 0; l < L; l++) obs->lane[l] = 0;
        for (int64_t i = 0; i < obs->n_writes; i++) {
            const int32_t l = obs->writes[3 * i];
            obs->lane[l] += i < obs->n_lane;
            link_bytes += obs->link->copy_bytes[l];
        }
        for (int64_t i = 0; i < obs->n_uploads; i++) link_bytes += obs->link->copy_bytes[obs->uploads[3 * i]];
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t n_hit = 0, looked_up = 0;
        for (int64_t j = 0; j < n; j++) {
            int64_t id = id_at(ids, wide, l * n + j);
            if (id < 0) {
                obs->hit[l * n + j] = 0;
                continue;
            }
            int64_t key = l * E + id;
            looked_up += lookups;
            int is_hit = lookups && g->expert_slot[key] >= 0;
            obs->hit[l * n + j] = (uint8_t)is_hit;
            n_hit += is_hit;
            if (g->used[key]) continue;  /* a multi-token step repeats it */
            g->used[key] = 1;
            g->usage[key] += lookups;
            if (g->track_prefetch && g->prefetched[key] && is_hit) {
                count(g, MC_PREFETCH_HITS, l, 1);
                g->prefetched[key] = 0;
            }
        }
        obs->counts[l] = n_hit;
        obs->counts[L + l] = looked_up - n_hit;
        if (planned) {
            const int64_t gn = obs->graph_n, lane = obs->lane[l], cpu = looked_up - n_hit - lane;
            if (graph_ms < 0 || n_hit >= gn || lane >= gn || cpu < 0 || cpu >= gn)
                graph_ms = -1.0;
            else
                graph_ms += obs->graph_table[((obs->graph_group[l] * gn + n_hit) * gn + lane) * gn + cpu];
            count(g, MC_LANE_MISSES, l, lane);
            if (obs->declined) count(g, MC_DECLINED, l, obs->declined[l]);
        }
        any_miss |= looked_up != n_hit;
        count(g, MC_HITS, l, n_hit);
        count(g, MC_MISSES, l, looked_up - n_hit);
    }
    obs->any_miss = any_miss;
    obs->graph_ms = planned ? graph_ms : -1.0;
    obs->link_ms = planned ? link_bytes / obs->link->bytes_per_ms : 0.0;
    if (planned && graph_ms >= 0) mc_link_update(obs->link, graph_ms, obs->link_ms);
    return 0;
}

/* A decode graph's modelled time and link time into the link's decayed averages. */
void mc_link_update(mc_link *link, double graph_ms, double link_ms) {
    link->link_ms = link->decay * link->link_ms + (1 - link->decay) * link_ms;
    link->graph_ms = link->decay * link->graph_ms + (1 - link->decay) * graph_ms;
    link->busy = link->graph_ms == 0 ? 1.0 : fmin(1.0, link->link_ms / link->graph_ms);
}

/* Publish the first `ready` due uploads (n job rows of layer, expert, slot); the others are
 * late, and counted so once: one still late at a later boundary is the same upload. Returns how
 * many were published. */
int64_t mc_publish(mc_engine *g, const int32_t *jobs, int64_t n, int64_t ready) {
    const int64_t E = g->n_expert, K = g->n_slots;
    if (ready < 0) ready = 0;
    if (ready > n) ready = n;
    for (int64_t i = 0; i < ready; i++) {
        const int32_t *job = jobs + 3 * i;
        g->expert_slot[job[0] * E + job[1]] = job[2];
        g->in_flight[job[0] * K + job[2]] = 0;
        g->late[job[0] * K + job[2]] = 0;
    }
    for (int64_t i = ready; i < n; i++) {
        const int32_t *job = jobs + 3 * i;
        if (!g->late[job[0] * K + job[2]]) count(g, MC_LATE, job[0], 1);
        g->late[job[0] * K + job[2]] = 1;
    }
    return ready;
}

/* The wanted ids of an observation or a prediction (L, n), row-major: id >= 0, not resident nor
 * on its way, first occurrence in its row; with cap, at most cap[l] per layer. Lists them as
 * c's candidates and returns how many, or -1 if an id is >= E. */
int64_t mc_candidates(mc_engine *g, const void *ids, int wide, int64_t n, const int64_t *cap,
                      mc_choice *c) {
    const int64_t L = g->n_layers, E = g->n_expert;
    int64_t *cand_layer = c->cand_layer, *cand_expert = c->cand_expert;
    int64_t m = 0;
    c->n_cand = 0;
    for (int64_t l = 0; l < L; l++) {
        int64_t first = m, taken = 0;
        for (int64_t j = 0; j < n; j++) {
            int64_t id = id_at(ids, wide, l * n + j);
            if (id < 0) continue;
            if (id >= E) {
                for (int64_t i = first; i < m; i++) g->mark[l * E + cand_expert[i]] = 0;
                return -1;
            }
            int64_t key = l * E + id;
            if (g->assigned[key] >= 0 || g->mark[key]) continue;
            g->mark[key] = 1;
            cand_layer[m] = l;
            cand_expert[m] = id;
            m++;
            taken++;
        }
        for (int64_t i = first; i < m; i++) g->mark[l * E + cand_expert[i]] = 0;
        if (cap && taken > cap[l]) m = first + (cap[l] > 0 ? cap[l] : 0);
    }
    c->n_cand = m;
    return m;
}

/* Keeps c's candidates in admission order, cap[l] per layer: with worth, drops the refused
 * (worth -inf) and orders each layer's by worth, highest first (stable: rank breaks ties).
 * Then lists the rows (layers) that want slots: rows, n_want, and for each of their slots the
 * held key, whether it is free, and whether it is evictable (resident, not in flight, not
 * pinned, and with keep_used not used by the observation). Returns the number of rows. */
int64_t mc_prepare(mc_engine *g, mc_choice *c, int keep_used) {
    const int64_t E = g->n_expert, K = g->n_slots, m = c->n_cand;
    int64_t *cand_layer = c->cand_layer, *cand_expert = c->cand_expert;
    double *worth = c->worth;
    const int64_t *cap = c->cap;
    int64_t kept = 0, n_rows = 0;
    c->short_of_free = 0;
    for (int64_t i = 0; i < m;) {
        const int64_t l = cand_layer[i], first = kept;
        for (; i < m && cand_layer[i] == l; i++) {
            if (worth && !(worth[i] > -INFINITY)) continue;
            /* insertion: after every kept candidate worth at least as much (stable) */
            int64_t at = kept;
            double w = worth ? worth[i] : 0.0;
            int64_t e = cand_expert[i];
            if (worth)
                for (; at > first && worth[at - 1] < w; at--) {
                    worth[at] = worth[at - 1];
                    cand_expert[at] = cand_expert[at - 1];
                    cand_layer[at] = l;
                }
            cand_layer[at] = l;
            cand_expert[at] = e;
            if (worth) worth[at] = w;
            kept++;
        }
        int64_t want = kept - first;
        if (want > cap[l]) want = cap[l] > 0 ? cap[l] : 0;
        kept = first + want;
        if (!want) continue;
        int64_t n_free = 0;
        for (int64_t s = 0; s < K; s++) {
            int64_t r = n_rows * K + s, held = g->slot_expert[l * K + s], key = held + l * E;
            c->keys[r] = key;
            c->free_slot[r] = held < 0;
            n_free += held < 0;
            c->evictable[r] = held >= 0 && !g->in_flight[l * K + s]
                              && !(keep_used && g->used[key]) && !(g->any_pinned && g->pinned[key]);
        }
        if (want > n_free) c->short_of_free = 1;
        c->rows[n_rows] = l;
        c->n_want[n_rows] = want;
        n_rows++;
    }
    c->n_cand = kept;
    c->n_rows = n_rows;
    return n_rows;
}

/* Row r's j-th candidate takes the row's j-th slot in (rank, slot) order, where a free slot
 * ranks -inf and, by `how`: MC_FREE_ONLY: anything else +inf; MC_BY_PRIORITY: an evictable slot
 * its priority rank[r, s], anything else +inf; MC_BY_VICTIM_ORDER: rank[r, s] (the place of
 * the slot's expert in the policy's victim order, +inf elsewhere). Accepted: rank < +inf, or
 * with worth, worth > rank (strictly). Writes the accepted uploads, in candidate order, as
 * (layer, expert, slot) int32 rows and returns how many. */
int64_t mc_choose(mc_engine *g, const mc_choice *c, mc_victims how, const double *rank,
                  int32_t *upload) {
    const int64_t K = g->n_slots;
    double slot_rank[K > 0 ? K : 1];
    int64_t i = 0, out = 0;
    for (int64_t r = 0; r < c->n_rows; r++) {
        for (int64_t s = 0; s < K; s++) {
            int64_t at = r * K + s;
            slot_rank[s] = c->free_slot[at] ? -INFINITY
                           : how == MC_FREE_ONLY ? INFINITY
                           : how == MC_BY_PRIORITY ? (c->evictable[at] ? rank[at] : INFINITY)
                           : rank[at];
        }
        for (int64_t j = 0; j < c->n_want[r]; j++, i++) {
            int64_t best = 0;  /* argmin: the first lowest */
            for (int64_t s = 1; s < K; s++)
                if (slot_rank[s] < slot_rank[best]) best = s;
            double taken = slot_rank[best];
            slot_rank[best] = INFINITY;
            if (!(c->worth ? c->worth[i] > taken : taken < INFINITY)) continue;
            upload[3 * out] = (int32_t)c->rows[r];
            upload[3 * out + 1] = (int32_t)c->cand_expert[i];
            upload[3 * out + 2] = (int32_t)best;
            out++;
        }
    }
    return out;
}

/* Upload expert e of layer l into slot s for each (l, e, s) of the m upload rows, unpublishing
 * the victim a slot held: the tables, the counters, prefetch bookkeeping. Writes the victims as
 * (layer, expert, slot) int32 evict rows and returns how many. */
int64_t mc_commit(mc_engine *g, const int32_t *upload, int64_t m, int prefetch, int32_t *evict) {
    const int64_t E = g->n_expert, K = g->n_slots;
    int64_t gone = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t l = upload[3 * i], e = upload[3 * i + 1], s = upload[3 * i + 2], at = l * K + s;
        int32_t victim = g->slot_expert[at];
        if (victim >= 0) {
            int64_t key = l * E + victim;
            g->expert_slot[key] = -1;
            g->assigned[key] = -1;
            count(g, MC_EVICTIONS, l, 1);
            if (g->track_prefetch && g->prefetched[key]) {
                count(g, MC_PREFETCH_WASTE, l, 1);
                g->prefetched[key] = 0;
            }
            evict[3 * gone] = (int32_t)l;
            evict[3 * gone + 1] = victim;
            evict[3 * gone + 2] = (int32_t)s;
            gone++;
        }
        g->slot_expert[at] = (int32_t)e;
        g->assigned[l * E + e] = (int32_t)s;
        g->in_flight[at] = 1;
        count(g, MC_UPLOADS, l, 1);
        if (prefetch) {
            g->prefetched[l * E + e] = 1;
            count(g, MC_PREFETCH_UPLOADS, l, 1);
        }
    }
    return gone;
}

/* Eager admission's handover (moecache/core/admission.py, build_handover is the reference): per layer the
 * slots in eviction order (free ones first, lowest first; then the evictable residents by
 * ascending priority clipped to finite values, ties to the lowest slot; -1 for the rest) with
 * the worth each keeps (-inf free, its priority, +inf unlisted), and worth set to -inf for
 * experts resident or on their way. priority: (L, K), read where a slot is evictable. */
static int mc_ranked_cmp(const void *a, const void *b) {
    const mc_ranked *x = a, *y = b;
    if (x->category != y->category) return x->category < y->category ? -1 : 1;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return (x->slot > y->slot) - (x->slot < y->slot);
}

#define MC_INSERTION_SORT_MAX 16

int mc_handover(mc_engine *g, const double *priority, double *worth, int32_t *victims,
                double *victim_worth, mc_ranked *scratch) {
    const int64_t K = g->n_slots, E = g->n_expert;
    for (int64_t l = 0; l < g->n_layers; l++) {
        for (int64_t s = 0; s < K; s++) {
            const int32_t held = g->slot_expert[l * K + s];
            mc_ranked *r = &scratch[s];
            r->slot = (int32_t) s;
            r->key = 0.0;
            if (held < 0) {
                r->category = 0;
            } else if (!g->in_flight[l * K + s] && !(g->any_pinned && g->pinned[l * E + held])) {
                const double p = priority[l * K + s];
                r->category = 1;
                r->key = p > DBL_MAX ? DBL_MAX : (p < -DBL_MAX ? -DBL_MAX : p);
            } else {
                r->category = 2;
            }
        }
        if (K <= MC_INSERTION_SORT_MAX) {  /* a few slots: no qsort call (the order is total) */
            for (int64_t j = 1; j < K; j++) {
                const mc_ranked r = scratch[j];
                int64_t at = j;
                for (; at > 0 && mc_ranked_cmp(&scratch[at - 1], &r) > 0; at--) scratch[at] = scratch[at - 1];
                scratch[at] = r;
            }
        } else {
            qsort(scratch, (size_t) K, sizeof *scratch, mc_ranked_cmp);
        }
        for (int64_t j = 0; j < K; j++) {
            const mc_ranked *r = &scratch[j];
            victims[l * K + j] = r->category == 2 ? -1 : r->slot;
            victim_worth[l * K + j] = r->category == 0 ? -INFINITY
                                    : r->category == 1 ? priority[l * K + r->slot] : INFINITY;
        }
        for (int64_t s = 0; s < K; s++) {  /* the experts assigned a slot: resident or on their way */
            const int32_t held = g->slot_expert[l * K + s];
            if (held >= 0) worth[l * E + held] = -INFINITY;
        }
    }
    return 0;
}

/* The key of each slot's expert, layer * E + expert, (L, K); an empty slot gets its layer's
 * expert 0 (a junk key the policy's priority is asked for and the handover ignores). */
void mc_slot_keys(const mc_engine *g, int64_t *keys) {
    const int64_t K = g->n_slots, E = g->n_expert;
    for (int64_t l = 0; l < g->n_layers; l++)
        for (int64_t s = 0; s < K; s++) {
            const int32_t held = g->slot_expert[l * K + s];
            keys[l * K + s] = l * E + (held > 0 ? held : 0);
        }
}

/* Eager admission's rule with the copy-on-miss lane (moecache/core/admission.py states it): the
 * slot writes libllama makes during a graph that selects ids (L, n), per_token of them a token (the
 * candidates: the last token's first, each token's in router rank), under a boundary's handover
 * and the slot contents it was computed from (slot_expert (L, K), -1 empty). Writes (layer,
 * expert, slot) rows to jobs (at most L * min(n, K)) in the order they start: layer by layer,
 * within a layer the lane's copies first (by worth), then the uploads (router rank), each
 * layer's lane rows to lane_rows (L) and its uploads the margin declined to declined (L). mark: E bytes of scratch, all zero before and after; cand:
 * n of scratch. Returns the number of rows, or -1 - i when ids[i] is outside [-1, E). */
int64_t mc_admit(const mc_handover_table *h, const void *ids, int wide, int64_t n, int64_t per_token,
                 const int32_t *slot_expert, uint8_t *mark, int64_t *cand, int32_t *jobs,
                 int32_t *lane_rows, int32_t *declined) {
    enum { SELECTED = 1, HELD = 2, SEEN = 4 };
    const int64_t L = h->n_layers, K = h->n_slots, E = h->n_expert;
    int64_t n_jobs = 0;
    for (int64_t l = 0; l < L; l++) {
        const int32_t *victims = h->victims + l * K, *held = slot_expert + l * K;
        const double *victim_worth = h->victim_worth + l * K, *worth = h->worth + l * E;
        for (int64_t j = 0; j < n; j++) {
            const int64_t e = id_at(ids, wide, l * n + j);
            if (e < -1 || e >= E) {
                for (int64_t i = 0; i < j; i++) {
                    const int64_t seen = id_at(ids, wide, l * n + i);
                    if (seen >= 0) mark[seen] = 0;
                }
                return -1 - (l * n + j);
            }
            if (e >= 0) mark[e] = SELECTED;
        }
        for (int64_t s = 0; s < K; s++)
            if (held[s] >= 0) mark[held[s]] |= HELD;
        /* the candidates: distinct, not held (resident or on their way), worth above -inf; the
         * last token's first */
        int64_t m = 0;
        for (int64_t t0 = (n - 1) / per_token * per_token; n > 0 && t0 >= 0; t0 -= per_token) {
            for (int64_t j = t0; j < t0 + per_token && j < n; j++) {
                const int64_t e = id_at(ids, wide, l * n + j);
                if (e < 0 || (mark[e] & (HELD | SEEN))) continue;
                mark[e] |= SEEN;
                if (worth[e] > -INFINITY) cand[m++] = e;
            }
        }
        int64_t n_lane = h->lane ? h->lane[l * (E + 1) + m] : 0;
        if (n_lane > m) n_lane = m;
        if (n_lane < 0) n_lane = 0;
        /* the lane's: the n_lane most worth, to the front in worth order (stable: rank breaks
         * ties), the others left in rank order */
        for (int64_t i = 0; i < n_lane; i++) {
            int64_t best = i;
            for (int64_t j = i + 1; j < m; j++)
                if (worth[cand[j]] > worth[cand[best]]) best = j;
            const int64_t e = cand[best];
            for (int64_t j = best; j > i; j--) cand[j] = cand[j - 1];
            cand[i] = e;
        }
        int64_t next = 0, started = 0, lane = 0, margin_declined = 0;
        for (int64_t i = 0; i < m && started < h->budget[l]; i++) {
            const int64_t e = cand[i];
            /* the running graph reads the slots of the experts it selects: skip those victims */
            while (next < K && (victims[next] < 0 ||
                                (held[victims[next]] >= 0 && (mark[held[victims[next]]] & SELECTED))))
                next++;
            if (next == K) break;
            if (worth[e] - (i < n_lane ? 0.0 : h->margin) > victim_worth[next]) {
                int32_t *job = jobs + 3 * n_jobs++;
                job[0] = (int32_t) l, job[1] = (int32_t) e, job[2] = victims[next];
                next++, started++, lane += i < n_lane;
            } else if (i >= n_lane && worth[e] > victim_worth[next]) {
                margin_declined++;
            }
        }
        lane_rows[l] = (int32_t) lane, declined[l] = (int32_t) margin_declined;
        for (int64_t j = 0; j < n; j++) {
            const int64_t e = id_at(ids, wide, l * n + j);
            if (e >= 0) mark[e] = 0;
        }
        for (int64_t s = 0; s < K; s++)
            if (held[s] >= 0) mark[held[s]] = 0;
    }
    return n_jobs;
}
