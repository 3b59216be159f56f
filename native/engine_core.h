/* The cache engine's per-step bookkeeping (moecache/engine.py's CacheEngine calls it for every
 * observation and every upload decision). The tables are the engine's numpy arrays; policies
 * stay in Python and are called between these functions. */

typedef struct {
    int32_t n_layers, n_expert, n_slots;
    int32_t any_pinned;         /* pinned has a set entry */
    int32_t track_prefetch;     /* the policy predicts: keep prefetched and its counters */
    int32_t *slot_expert;       /* (L, K) expert held or being loaded, -1 empty */
    int32_t *expert_slot;       /* (L, E) slot of each published expert, -1 otherwise */
    int32_t *assigned;          /* (L, E) slot of each published or in-flight expert, -1 otherwise */
    uint8_t *in_flight;         /* (L, K) */
    uint8_t *prefetched;        /* (L, E) prefetched, not used yet */
    uint8_t *pinned;            /* (L, E) */
    uint8_t *used;              /* (L, E) the last observation's experts (a new table each step) */
    uint8_t *mark;              /* (L, E) scratch, all zero between calls */
    int64_t *usage;             /* (L, E) observations with lookups each expert was used in */
    int64_t *counts;            /* (n_counters, L) the engine's COUNTERS, in that order (C updates the first 8) */
} mc_engine;

int mc_observe(mc_engine *g, const void *ids, int wide, int64_t n, int lookups, uint8_t *used, uint8_t *hit,
               int64_t *counts, int64_t *bad, int32_t *flags);
int64_t mc_publish(mc_engine *g, const int32_t *jobs, int64_t n, int64_t ready);
int64_t mc_candidates(mc_engine *g, const void *ids, int wide, int64_t n, const int64_t *cap,
                      int64_t *cand_layer, int64_t *cand_expert);
int64_t mc_prepare(mc_engine *g, int64_t *m, int64_t *cand_layer, int64_t *cand_expert, double *worth,
                   const int64_t *cap, int use_used, int64_t *rows, int64_t *n_want, int64_t *keys,
                   uint8_t *evictable, uint8_t *free_slot, int32_t *short_any);
int64_t mc_choose(mc_engine *g, int mode, const double *rank_in, int64_t n_rows, const int64_t *rows,
                  const int64_t *n_want, const uint8_t *evictable, const uint8_t *free_slot,
                  const int64_t *cand_layer, const int64_t *cand_expert, const double *worth,
                  int64_t *out_layer, int64_t *out_expert, int64_t *out_slot);
int64_t mc_commit(mc_engine *g, int64_t m, const int64_t *layers, const int64_t *experts,
                  const int64_t *slots, int prefetch, int32_t *upload, int32_t *evict, int64_t *n_evict);
typedef struct { int32_t category; double key; int32_t slot; } mc_ranked;
int mc_handover(mc_engine *g, const double *priority, double *worth, int32_t *victims,
                double *victim_worth, mc_ranked *scratch);
