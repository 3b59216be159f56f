/* The cache engine's per-step bookkeeping (moecache/core/bookkeeping.py calls it for every
 * observation and every upload decision of moecache/core/engine.py's CacheEngine). The tables
 * are the engine's numpy arrays; policies stay in Python and are called between these
 * functions. */

/* The engine's counters, one row of mc_engine.counts each, in this order. This enum is their
 * one list: Python reads the names from it (moecache.core.bookkeeping.COUNTERS). */
typedef enum {
    MC_HITS,
    MC_MISSES,
    MC_UPLOADS,
    MC_EVICTIONS,
    MC_PREFETCH_UPLOADS,
    MC_PREFETCH_HITS,
    MC_PREFETCH_WASTE,
    MC_LATE,              /* uploads not complete at the boundary they were due (each once) */
    MC_PREFILL_UPLOADS,   /* uploads of a prompt's experts (counted by the engine in Python) */
    MC_DECLINED,          /* uploads a miss planner's margin declined (mc_observe) */
    MC_LANE_MISSES,       /* misses a miss planner's lane computed on the device (mc_observe) */
    MC_N_COUNTERS
} mc_counter;

typedef struct {
    int32_t n_layers, n_expert, n_slots;
    int32_t any_pinned;         /* pinned has a set entry */
    int32_t track_prefetch;     /* the policy predicts: keep prefetched and its counters */
    int32_t *slot_expert;       /* (L, K) expert held or being loaded, -1 empty */
    int32_t *expert_slot;       /* (L, E) slot of each published expert, -1 otherwise */
    int32_t *assigned;          /* (L, E) slot of each published or in-flight expert, -1 otherwise */
    uint8_t *in_flight;         /* (L, K) */
    uint8_t *late;              /* (L, K) the slot's upload in flight was counted late already */
    uint8_t *prefetched;        /* (L, E) prefetched, not used yet */
    uint8_t *pinned;            /* (L, E) */
    uint8_t *used;              /* (L, E) the last observation's experts (a new table each step) */
    uint8_t *mark;              /* (L, E) scratch, all zero between calls */
    int64_t *usage;             /* (L, E) observations with lookups each expert was used in */
    int64_t *counts;            /* (MC_N_COUNTERS, L) */
} mc_engine;

/* A miss planner's view of the link: decayed averages of the decode graphs' link time and
 * modelled time, busy their ratio (at most 1; 1 before any graph). */
typedef struct mc_link {
    const double *copy_bytes;   /* (L) one copy's bytes, by layer */
    double bytes_per_ms;        /* the link's rate */
    double decay;               /* an average's weight on its past */
    double link_ms, graph_ms, busy;
} mc_link;

/* One observation: what mc_observe reads (in) and counts (out). */
typedef struct {
    const void *ids;            /* in: (L, n) expert ids, router-rank order, -1 = none */
    int32_t wide;               /* in: ids are int64 (else int32) */
    int64_t n;                  /* in: ids per layer */
    int32_t lookups;            /* in: 0 for a prompt the stock graph ran: it read no slot */
    uint8_t *used;              /* in: (L, E) all zero; becomes mc_engine.used */
    uint8_t *hit;               /* out: (L, n) hit mask */
    int64_t *counts;            /* out: (2, L) hits, then misses, per layer */
    int32_t any_miss;           /* out */
    int64_t bad_id;             /* out: the id outside [-1, E) when mc_observe refuses */
    /* with a miss planner (moecache.core.missplan.MissPlanner), for a decode graph (lookups):
     * the graph's slot writes and the boundary's uploads that ran beside it (job rows of layer,
     * expert, slot), the uploads its margin declined, and its modelled time, the sum over layers
     * of graph_table[graph_group[l]][hits][lane][misses - lane] (one layer's time by its counts,
     * each in [0, graph_n)); the link's averages (mc_link) take the graph when link is set */
    const int32_t *writes;      /* in: (n_writes, 3), the first n_lane lane copies */
    int64_t n_writes, n_lane;   /* in */
    const int32_t *uploads;     /* in: (n_uploads, 3) */
    int64_t n_uploads;          /* in */
    const int32_t *declined;    /* in: (L), NULL: none */
    const double *graph_table;  /* in: NULL: no planner */
    const int64_t *graph_group; /* in: (L) */
    int64_t graph_n;            /* in */
    struct mc_link *link;       /* in: NULL: no planner */
    int64_t *lane;              /* out: (L) lane copies among the misses (from writes) */
    double graph_ms;            /* out: -1 when a count is outside the table (mc_link_update left to the caller) */
    double link_ms;             /* out: the writes' and uploads' time on the link */
} mc_observation;

/* One upload decision: mc_candidates lists the wanted experts, mc_prepare keeps the ones to
 * place and lists the layers (rows) that want slots, mc_choose places them. */
typedef struct {
    int64_t n_cand;             /* candidates listed; mc_prepare keeps those it places */
    int64_t *cand_layer;        /* (n_cand) ascending */
    int64_t *cand_expert;       /* (n_cand) */
    double *worth;              /* (n_cand) admission worth, NULL: the policy admits everything */
    const int64_t *cap;         /* (L) most uploads per layer */
    int64_t n_rows;             /* layers that want slots */
    int64_t *rows;              /* (n_rows) their layer */
    int64_t *n_want;            /* (n_rows) candidates each places */
    int64_t *keys;              /* (n_rows, K) layer * E + held expert (junk where empty) */
    uint8_t *free_slot;         /* (n_rows, K) empty, not being loaded */
    uint8_t *evictable;         /* (n_rows, K) resident, not in flight, pinned or kept by the observation */
    int32_t short_of_free;      /* some row wants more slots than it has free */
} mc_choice;

/* Which slots a candidate may take besides free ones (always first, lowest first). */
typedef enum {
    MC_FREE_ONLY,               /* none */
    MC_BY_PRIORITY,             /* evictable ones, by ascending policy priority */
    MC_BY_VICTIM_ORDER,         /* the ones a queue policy chose, in its order */
} mc_victims;

int mc_observe(mc_engine *g, mc_observation *obs);
void mc_link_update(mc_link *link, double graph_ms, double link_ms);
int64_t mc_publish(mc_engine *g, const int32_t *jobs, int64_t n, int64_t ready);
int64_t mc_candidates(mc_engine *g, const void *ids, int wide, int64_t n, const int64_t *cap,
                      mc_choice *c);
int64_t mc_prepare(mc_engine *g, mc_choice *c, int keep_used);
int64_t mc_choose(mc_engine *g, const mc_choice *c, mc_victims how, const double *rank,
                  int32_t *upload);
int64_t mc_commit(mc_engine *g, const int32_t *upload, int64_t m, int prefetch, int32_t *evict);
typedef struct { int32_t category; double key; int32_t slot; } mc_ranked;
int mc_handover(mc_engine *g, const double *priority, double *worth, int32_t *victims,
                double *victim_worth, mc_ranked *scratch);
void mc_slot_keys(const mc_engine *g, int64_t *keys);

/* A boundary's handover (moecache.core.admission.Handover) as mc_admit reads it. */
typedef struct {
    int64_t n_layers, n_slots, n_expert;
    const int32_t *victims;     /* (L, K) slots in eviction order, -1 padded */
    const double *victim_worth; /* (L, K) */
    const double *worth;        /* (L, E) */
    const int64_t *budget;      /* (L) */
    const int32_t *lane;        /* (L, E + 1): of m candidates, lane[l, m] take the lane; NULL: none */
    double margin;              /* what an upload outside the lane must beat its victim by */
} mc_handover_table;
int64_t mc_admit(const mc_handover_table *h, const void *ids, int wide, int64_t n, int64_t per_token,
                 const int32_t *slot_expert, uint8_t *mark, int64_t *cand, int32_t *jobs,
                 int32_t *lane_rows, int32_t *declined);
