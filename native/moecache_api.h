/* The moecache C API of the patched libllama (see patches/), as cffi declares it.
   Keep in sync with the "MoE expert cache" section the patches add to include/llama.h (and, for
   the testing-only call at the end, with native/llama/llama-moe-cache.h). LLAMA_MOE_CACHE_VERSION
   is not repeated here: native/build_ffi.py declares it, read from the patches. */

struct llama_context;
struct llama_model;

struct llama_moe_cache_layer_info {
    int32_t      il;
    int32_t      n_expert;
    int32_t      n_expert_used;
    int32_t      n_slots;
    size_t       expert_bytes;
    const char * device;
    bool         from_file;
};

struct llama_moe_cache_params {
    int32_t n_slots;
    int32_t max_batch;
    bool    in_ram;
    bool    read_ahead;
};

/* llama_model_params.lazy_mode: the RAM tier needs the routed experts mapped, not loaded */
enum llama_lazy_mode {
    LLAMA_LAZY_MODE_OFF     = 0,
    LLAMA_LAZY_MODE_AUTO    = 1,
    LLAMA_LAZY_MODE_ON      = 2,
    LLAMA_LAZY_MODE_EXPERTS = 3,
};

struct llama_moe_cache_counters {
    uint64_t hits;
    uint64_t misses;
    uint64_t lane;
    uint64_t uploads;
    uint64_t upload_bytes;
    int64_t  upload_us;
    uint64_t read_ahead;
    uint64_t read_ahead_used;
    uint64_t read_ahead_bytes;
    uint64_t read_ahead_wasted_bytes;
    int64_t  read_wait_us;
};

typedef void (*llama_moe_cache_step_callback)(struct llama_context * ctx, void * user_data);
typedef void (*llama_moe_cache_context_callback)(struct llama_context * ctx, void * user_data);

const char * llama_moe_cache_version(void);
void    llama_moe_cache_set_context_callback(llama_moe_cache_context_callback cb, void * user_data);
struct llama_moe_cache_params llama_moe_cache_default_params(void);
enum llama_moe_cache_tier {
    LLAMA_MOE_CACHE_TIER_DEVICE = 0,
    LLAMA_MOE_CACHE_TIER_RAM    = 1,
};
int32_t llama_moe_cache_init(struct llama_context * ctx, struct llama_moe_cache_params params);
int32_t llama_moe_cache_n_layers(const struct llama_context * ctx, enum llama_moe_cache_tier tier);
bool    llama_moe_cache_layer_info(const struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t i, struct llama_moe_cache_layer_info * info);
size_t  llama_moe_cache_device_bytes(const struct llama_context * ctx, enum llama_moe_cache_tier tier);
void    llama_moe_cache_set_step_callback(struct llama_context * ctx, enum llama_moe_cache_tier tier, llama_moe_cache_step_callback cb, void * user_data);
const int32_t * llama_moe_cache_observed(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_cols, int32_t * stride);
const int32_t * llama_moe_cache_observed_stock(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_cols, int32_t * stride);
enum llama_moe_cache_status {
    LLAMA_MOE_CACHE_OK           =  0,
    LLAMA_MOE_CACHE_BAD_ROW      = -1,
    LLAMA_MOE_CACHE_FILE_CHANGED = -2,
};
int32_t llama_moe_cache_apply(struct llama_context * ctx, enum llama_moe_cache_tier tier, const int32_t * publish, int32_t n_publish,
                              const int32_t * evict, int32_t n_evict, const int32_t * upload, int32_t n_upload);
struct llama_moe_cache_handover {
    const int32_t * victims;
    const double  * victim_worth;
    const double  * worth;
    const int32_t * budget;
    const int32_t * lane;
    double          margin;
};
int32_t llama_moe_cache_hand_over(struct llama_context * ctx, enum llama_moe_cache_tier tier, const struct llama_moe_cache_handover * handover);
const int32_t * llama_moe_cache_admitted(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t * n_rows, int32_t * n_lane);
const int32_t * llama_moe_cache_declined(struct llama_context * ctx, enum llama_moe_cache_tier tier);
int64_t llama_moe_cache_wait_uploads(struct llama_context * ctx, enum llama_moe_cache_tier tier);
int32_t llama_moe_cache_uploads_pending(struct llama_context * ctx, enum llama_moe_cache_tier tier);
bool    llama_moe_cache_get_counters(struct llama_context * ctx, enum llama_moe_cache_tier tier, int32_t i, struct llama_moe_cache_counters * counters);

const struct llama_model * llama_get_model(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);

/* testing only: exported by libllama but declared in its internal llama-moe-cache.h (native/llama/) */
void    llama_moe_cache_set_upload_delay_us(struct llama_context * ctx, int64_t delay_us);
