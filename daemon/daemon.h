/* daemon.h — kvlingod's parts (private to daemon/): configuration, the resident models,
 * requests in flight and their sinks, metrics, logging, the gRPC and HTTP front ends.
 *
 * Threads: everything here runs on the libuv loop thread, except the gRPC completion
 * queue poller (grpc.c), which only pushes {tag, ok} pairs to the loop, and the engine's
 * compute thread (scheduler/engine.c), which only talks through kvl_engine callbacks.
 */
#ifndef KVLD_DAEMON_H
#define KVLD_DAEMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "kvl_engine.h"
#include "kvl_sched.h"
#include "kvl_model.h"
#include "kvl_template.h"
#include "kvl_tokenizer.h"
#include "kvl_translator.h"

struct kvld;

#ifndef KVLD_VERSION /* meson passes the project's version */
#define KVLD_VERSION "0.2.0"
#endif
#define KVLD_MAX_MODELS 8
#define KVLD_MAX_TRANSLATORS 16

/* ---- configuration (config.c) -------------------------------------------------------- */

struct kvld_model_cfg {
  char name[64];
  char path[1024];     /* .gguf path, or a name looked up in the models directory */
  char kv_dtype[8];    /* "bf16" | "f32" */
  int64_t hot_bytes;   /* KV pool budgets */
  int64_t cold_bytes;
  int64_t disk_bytes;  /* spill-file tier behind the cold one (0 = none) */
  int32_t max_model_len;
  char backend[16];    /* "cpu" | "cuda" | "cuda-sim": where its forward passes (and translations into it) run */
};

struct kvld_config {
  char listen[128];          /* host the ports bind on; default 127.0.0.1 */
  int grpc_port;             /* 0 = any free port (printed and logged) */
  int http_port;             /* -1 = no HTTP */
  char auth_token[256];      /* bearer token for every call ("" = none) */
  char admin_token[256];     /* needed by the Admin service ("" = admin disabled) */
  char tls_cert[1024], tls_key[1024];
  int max_prompt_tokens;
  int max_new_tokens;        /* cap on max_tokens */
  int default_max_tokens;
  int max_concurrent;        /* requests in flight; more get RESOURCE_EXHAUSTED */
  double default_deadline_s; /* applied when the client sets none (0 = none) */
  double drain_s;            /* SIGTERM: streams may finish for this long */
  int step_tokens;
  char log_level[16];        /* debug | info | warn | error */
  char default_model[64];    /* what "auto" / "" means until the router lands */
  char spill_dir[1024];      /* where the models' disk tiers and cache snapshots live */
  bool cache_snapshot;       /* save the prefix caches at shutdown, load them at start */
  bool kv_prefault;          /* fault each model's hot KV arena in at start (kvl_pool_config.prefault) */
  int translate_native_tail; /* every request: its last N positions computed natively, never
                                translated (1: only the last; the router's handoffs take the
                                larger of this and router.handoff_native_tail) */
  int translate_native_head; /* every request: its first N positions computed natively, never
                                translated (the attention sink's block; 0: none) */
  bool translate_warm_head;  /* after a request, compute its head (translate_native_head
                                positions) in the background in every model it translates
                                into, so a switch there prefills only the new turn */
  char translation_precision[8]; /* the translators' products: auto (whichever is faster
                                    here: kvl_translator_pick_precision) | bf16 | fp32 */
  char replica_id[128];      /* this replica's name in responses (default: the hostname) */
  double conversation_ttl_s; /* a conversation's kept lines expire after this idle time */
  struct {                   /* what model "auto" means */
    char policy[24];         /* fixed | cascade | prefill-offload | pinned */
    char small[64], large[64];
    int cascade_window;      /* generated tokens per decision */
    double cascade_max_mean_entropy; /* nats (0: unused) */
    double cascade_min_logprob;      /* (0: unused) */
    int prefill_offload_min_tokens;  /* prompts at least this long go small -> large */
    int handoff_native_tail;         /* on a cascade or prefill-offload handoff the large model
                                        computes the last N positions itself (1: only the last) */
  } router;
  struct {                   /* per translator (DESIGN.md "Translation") */
    double max_heldout_kl;   /* the file's held-out KL over this: never used (0: no bar) */
    double shadow_fraction;  /* of translated requests also re-prefilled in the background */
    double max_online_kl;    /* the shadows' KL estimate over this: re-prefill instead (0: no bar) */
    int min_shadows;
  } gate;
  struct kvld_model_cfg models[KVLD_MAX_MODELS];
  int n_models;
  char translators[KVLD_MAX_TRANSLATORS][1024];
  int n_translators;
};

/* Defaults: the Qwen2.5-Coder pair from the models directory with the committed
 * translators, CPU, gRPC 50051, HTTP 8000, localhost. */
void kvld_config_defaults(struct kvld_config *c, const char *source_root);
/* Read a YAML file (at most 1 MiB) over the defaults. An unknown key, a wrong type or a
 * value out of range is refused with the key's path ("models[1].kv_dtype: expected bf16
 * or f32"). */
int kvld_config_load(struct kvld_config *c, const char *path, char *err, size_t errlen);
/* The same from memory (`name` for messages: "config NAME:LINE:COL: ..."); the fuzz
 * target tests/fuzz/fuzz-config.c drives it. */
int kvld_config_load_mem(struct kvld_config *c, const void *data, size_t len, const char *name, char *err,
                         size_t errlen);
/* KVLINGO_GRPC_PORT, KVLINGO_HTTP_PORT, KVLINGO_AUTH_TOKEN, KVLINGO_ADMIN_TOKEN,
 * KVLINGO_LOG_LEVEL, KVLINGO_LISTEN override the file; flags override both. */
int kvld_config_env(struct kvld_config *c, char *err, size_t errlen);
int kvld_config_check(const struct kvld_config *c, char *err, size_t errlen);
/* Models of one's own: a router model name that is not among them becomes the first
 * (small) or the last (large) model. */
void kvld_config_settle_router(struct kvld_config *c);

/* ---- logging (log.c): JSON lines on stderr --------------------------------------------- */

enum kvld_level { KVLD_DEBUG, KVLD_INFO, KVLD_WARN, KVLD_ERROR };
void kvld_log_set_level(const char *level);
/* kvld_log(KVLD_INFO, "request_done", "\"request_id\":\"%s\",\"tokens\":%d", id, n):
 * the last argument is a printf format of extra JSON members (may be NULL). */
void kvld_log(enum kvld_level lv, const char *event, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* JSON-escape s into buf (quotes not added). */
void kvld_json_escape(const char *s, char *buf, size_t len);

/* ---- metrics (metrics.c): vLLM's names + kvlingo's own, Prometheus text ---------------- */

#define KVLD_HIST_MAX_BUCKETS 24
struct kvld_hist {
  int n;
  const double *bounds;        /* upper bounds, ascending; +Inf implied */
  uint64_t counts[KVLD_HIST_MAX_BUCKETS + 1];
  double sum;
  uint64_t count;
};

struct kvld_model_metrics {
  uint64_t prompt_tokens, generation_tokens;
  uint64_t prefix_queries, prefix_hits;  /* in tokens, as vLLM counts them */
  uint64_t success[4];                   /* finished_reason: stop, length, abort, error */
  int running, waiting;
  struct kvld_hist ttft, itl, e2e, queue;
  uint64_t translated_tokens;
};

/* Render every series (HELP/TYPE lines, labels) into a malloc'd string. */
char *kvld_metrics_render(const struct kvld *d);
void kvld_hist_init(struct kvld_hist *h, const double *bounds, int n);
void kvld_hist_observe(struct kvld_hist *h, double v);
extern const double kvld_ttft_buckets[], kvld_itl_buckets[], kvld_e2e_buckets[];
extern const int kvld_n_ttft_buckets, kvld_n_itl_buckets, kvld_n_e2e_buckets;

/* ---- the daemon ------------------------------------------------------------------------- */

struct kvld_model {
  char name[64], path[1024];
  kvl_model_t *m;
  kvl_tokenizer_t *tk;
  char tok_hash[132];         /* its tokenizer's identity (the translator fingerprint's) */
  kvl_template_t *tmpl;       /* NULL when the model has no chat template */
  kvl_backend_t *be;          /* its backend (the configuration's `backend`) */
  size_t repacked_bytes;      /* the backend's copies of its weights, made at load (kvl_model_prepare) */
  int sched_id;               /* the scheduler's model index */
  int32_t max_model_len;
  int32_t eog[8];             /* its end-of-generation ids, found once at load */
  int n_eog;
  char kv_dtype[8];
  char disk_path[1300];       /* its disk tier's file */
  struct kvld_model_metrics mx;
  bool active;                /* in the scheduler and resolvable by name */
  bool unloading;             /* name no longer resolves; waiting for its requests */
  bool reserved;              /* a load in progress owns this slot */
};

struct kvld_translator {
  char path[1024];
  kvl_translator_t *t;
  int src, dst;               /* model indices */
};

struct kvld_grpc;
struct kvld_http;

/* ---- conversations and routing (route.c) -------------------------------------------- */

/* What the router decided for a request, and why (reported in responses and counted). */
struct kvld_route {
  char policy[24];     /* requested | fixed | cascade | prefill-offload | pinned */
  char decision[24];   /* the model's role: requested, default, small, large, prefill-offload, pinned, escalated */
  char reason[320];
  int from_model;      /* escalated: the model it left (daemon index), else -1 */
  int handoff_token;   /* escalated: index of the first token from the new model, else -1 */
};

/* The proto's TranslationOutcome values. */
enum kvld_outcome { KVLD_TR_NOT_NEEDED = 1, KVLD_TR_APPLIED = 2, KVLD_TR_FALLBACK = 3, KVLD_TR_UNSUPPORTED = 4 };
enum kvld_outcome kvld_outcome_of(const struct kvl_usage *u);
const char *kvld_outcome_name(enum kvld_outcome o); /* not_needed, applied, fallback_reprefill, unsupported */

struct kvld_conv {
  char id[128];
  uint64_t key;        /* the scheduler's conversation key */
  double last_used;
  int pinned;          /* daemon model index the pinned policy keeps it on, -1 */
  uint32_t turns;
  int32_t *last;       /* the previous request's sequence as the model saw it: prompt ++
                          every sampled id (what its kept line holds) */
  int32_t n_last, n_last_prompt;
  char last_tok[132];  /* ... in the ids of the tokenizer with this hash */
  struct kvld_conv *next;
};

#define KVLD_CONV_BUCKETS 512
#define KVLD_MAX_ROUTES 32
struct kvld_route_count {
  char policy[24], decision[24];
  uint64_t n;
};

struct kvld {
  uv_loop_t *loop;
  struct kvld_config cfg;
  struct kvld_model models[KVLD_MAX_MODELS];
  int n_models;
  struct kvld_translator translators[KVLD_MAX_TRANSLATORS];
  int n_translators;
  kvl_engine_t *engine;
  kvl_sched_t *boot_sched;    /* the scheduler before the engine owns it (start-up only) */
  struct kvld_grpc *grpc;
  struct kvld_http *http;
  int grpc_port, http_port;   /* bound */
  bool serving;               /* models loaded and not draining: health SERVING */
  bool draining;
  int in_flight;              /* generation requests from start until their answer is out */
  uint64_t next_request;
  double t_start;
  uv_signal_t sig_term, sig_int;
  uv_timer_t drain_timer;
  /* conversations (route.c) */
  struct kvld_conv *convs[KVLD_CONV_BUCKETS];
  int conv_active;
  uint64_t conv_started, conv_turns, conv_expired;
  uv_timer_t conv_timer;
  /* routing and translation counters */
  struct kvld_route_count routes[KVLD_MAX_ROUTES];
  int n_routes;
  uint64_t outcomes[5];       /* by enum kvld_outcome */
  uint64_t handoffs[KVLD_MAX_MODELS][KVLD_MAX_MODELS];
};

/* Conversation ids: length 1..127, printable ASCII. KVLD_OK or a message. */
enum kvld_status kvld_conv_check_id(const char *id, char *msg, size_t msglen);
/* A request of conversation `id` arrives: counters, last use; its record (NULL: out of memory). */
struct kvld_conv *kvld_conv_touch(struct kvld *d, const char *id);
/* The expiry sweep (a timer on the loop; kept lines dropped in the engine too). */
void kvld_conv_start(struct kvld *d);
void kvld_conv_stop(struct kvld *d);
/* Route a request whose prompt is in p (tokenized by p->model): choose its model and
 * fill p->route and the scheduler request's routing fields (model, cascade, prefill_on,
 * conversation). */
struct kvld_gen_params;
void kvld_route(struct kvld *d, struct kvld_gen_params *p, struct kvl_request *q);
/* A request of conversation `id` finished: remember its prompt and sampled ids, so that
 * the next turn's re-tokenised copy of this answer is replaced by the ids actually
 * generated (kvld_route does it) and the kept line is reused whole. */
void kvld_conv_remember(struct kvld *d, const char *id, const struct kvld_model *tokenized_by, const int32_t *prompt,
                        int32_t n_prompt, const int32_t *gen, int32_t n_gen);
/* The model that "auto" tokenizes with. */
int kvld_auto_model(const struct kvld *d);
void kvld_route_count(struct kvld *d, const char *policy, const char *decision);

double kvld_now(void);
/* Model index by name; "auto" and "" give the default model. -1 when unknown (or
 * loading, or unloading). */
int kvld_model_find(const struct kvld *d, const char *name);
/* Slot i holds a model that serves requests. */
bool kvld_model_live(const struct kvld *d, int i);

/* ---- models (model.c) and their administration (admin.c) ------------------------------- */

/* A model entry's defaults (config.c: the file's entries start from them too): bf16 KV,
 * 1 GiB hot, 2 GiB cold, no disk tier, max_model_len 8192, the CPU backend. */
void kvld_model_cfg_default(struct kvld_model_cfg *c);
/* Open the file, tokenizer and template into m (no loop or engine state: runs on a worker
 * thread). On failure m holds nothing. */
int kvld_model_open(struct kvld_model *m, const struct kvld_model_cfg *c, char *err, size_t errlen);
void kvld_model_sched_cfg(const struct kvld_model *m, const struct kvld_model_cfg *c, bool prefault,
                          struct kvl_sched_model *sm);
void kvld_model_close(struct kvld_model *m);

/* The answer of an admin operation (loop thread); m is the model loaded, or NULL. */
typedef void (*kvld_admin_reply)(void *ctx, int status, const char *msg, struct kvld_model *m);
void kvld_admin_load_model(struct kvld *d, const char *name, const char *path, kvld_admin_reply reply, void *ctx);
void kvld_admin_unload_model(struct kvld *d, const char *name, kvld_admin_reply reply, void *ctx);
/* Load a translator and attach it to the two live models it fits (the newer of two for the
 * same pair serves). Its index, or a negative code with a message. */
int kvld_translator_add(struct kvld *d, const char *path, char *err, size_t errlen);
int kvld_translator_remove(struct kvld *d, const char *source, const char *target, char *err, size_t errlen);

/* ---- requests (service.c), shared by the gRPC and HTTP front ends -------------------- */

enum kvld_status { /* gRPC codes; the HTTP side maps them */
  KVLD_OK = 0,
  KVLD_CANCELLED = 1,
  KVLD_UNKNOWN = 2,
  KVLD_INVALID_ARGUMENT = 3,
  KVLD_DEADLINE_EXCEEDED = 4,
  KVLD_NOT_FOUND = 5,
  KVLD_PERMISSION_DENIED = 7,
  KVLD_RESOURCE_EXHAUSTED = 8,
  KVLD_FAILED_PRECONDITION = 9,
  KVLD_UNIMPLEMENTED = 12,
  KVLD_INTERNAL = 13,
  KVLD_UNAVAILABLE = 14,
  KVLD_UNAUTHENTICATED = 16,
};

enum kvld_finish { KVLD_FIN_NONE = 0, KVLD_FIN_STOP, KVLD_FIN_LENGTH, KVLD_FIN_CANCELLED, KVLD_FIN_ERROR };

/* What a request is, front-end independent. */
struct kvld_gen_params {
  int model;                       /* index into d->models */
  int32_t *prompt;                 /* owned */
  int32_t n_prompt;
  int32_t max_tokens;
  struct kvl_sampler_params sampling;
  struct kvl_logit_bias *bias;     /* owned */
  char **stops;                    /* NULL-terminated, owned */
  int32_t *stop_ids;               /* owned: the model's end tokens + the request's */
  int32_t n_stop_ids;
  bool ignore_eos;
  bool logprobs;
  char request_id[128];
  char conversation[128];          /* "" = none */
  bool is_auto;                    /* the client asked for "auto" (or no model) */
  bool reprefill;                  /* no translation, native cache only */
  struct kvld_route route;         /* filled by kvld_route */
};

void kvld_gen_params_free(struct kvld_gen_params *p);

struct kvld_req;
/* A front end's side of a request: called when new output is pending or the request is
 * done (kvld_req_done). The sink takes what it can send (kvld_req_take) and, once done
 * and everything is taken, finishes its call and calls kvld_req_release. */
typedef void (*kvld_sink_fn)(struct kvld_req *r, void *ud);

struct kvld_req {
  struct kvld *d;
  uint64_t id, engine_id;
  struct kvld_gen_params p;
  kvl_detok_t *detok;
  kvld_sink_fn sink;
  void *sink_ud;
  /* pending output, not yet taken by the sink */
  char *text;
  size_t text_len, text_cap;
  int32_t *ids;
  float *lps;
  int n_ids, cap_ids;
  /* state */
  bool submitted, engine_final, done, released, stop_hit;
  enum kvld_finish finish;
  enum kvld_status status;
  char message[512];
  struct kvl_usage usage;
  double t_arrival, t_first, t_last, queue_s;
  int generated;
  int cur_model;              /* the model producing tokens now (daemon index) */
  int32_t *sampled;           /* every sampled id, stop tokens included (conversations only) */
  int n_sampled, cap_sampled;
  float *ent;                 /* cascade: the last window's entropies (ring), for the reason */
  int n_ent, w_ent;
};

/* A client's string for a message: printable ASCII as is, every other byte as \xNN, cut
 * with "..." to fit outlen (so that messages stay valid UTF-8 in JSON and gRPC status). */
void kvld_escape(const char *s, char *out, size_t outlen);
/* Validate and resolve: fills p from already-decoded fields. Returns KVLD_OK or a status
 * with a message naming the problem. `text`, `ids`, `chat` (jansson array of {role,
 * content}): exactly one non-NULL. */
enum kvld_status kvld_prepare(struct kvld *d, const char *model, const char *text, size_t text_len,
                              const int32_t *ids, size_t n_ids, const void *chat_json, bool continue_final,
                              struct kvld_gen_params *p, char *msg, size_t msglen);
/* Stop conditions, shared by the front ends: the model's end-of-generation ids (unless
 * p->ignore_eos) + `ids` (each checked against the vocabulary) into p->stop_ids, and the
 * non-empty `strings` into p->stops. A status with a message naming the bad one. */
enum kvld_status kvld_set_stops(struct kvld *d, struct kvld_gen_params *p, const int32_t *ids, size_t n_ids,
                                const char *const *strings, size_t n_strings, char *msg, size_t msglen);
/* Sampling fields into p->sampling, validated (the sampler's own checks). */
enum kvld_status kvld_check_sampling(struct kvld *d, struct kvld_gen_params *p, char *msg, size_t msglen);
/* The front ends' request decoders (request.c), fuzzed by tests/fuzz/fuzz-request.c: an
 * OpenAI completions (chat = false) or chat completions body, or a decoded gRPC
 * GenerateRequest, into p ready for kvld_req_start. The conversation id comes from the
 * body's field or else the affinity header (HTTP: the header wins; gRPC: the field wins).
 * On failure a status and message, and p is left freed. */
struct kvld_openai_flags {
  bool stream, include_usage; /* `stream`, `stream_options.include_usage` */
};
enum kvld_status kvld_openai_request(struct kvld *d, bool chat, const char *body, size_t len, const char *conv_header,
                                     struct kvld_gen_params *p, struct kvld_openai_flags *f, char *msg,
                                     size_t msglen);
struct Kvlingo__V1__GenerateRequest;
enum kvld_status kvld_pb_request(struct kvld *d, const struct Kvlingo__V1__GenerateRequest *q, const char *conv_md,
                                 struct kvld_gen_params *p, char *msg, size_t msglen);
/* Start: takes ownership of p. On failure (status != OK) nothing is left to free and no
 * sink call happens. */
enum kvld_status kvld_req_start(struct kvld *d, struct kvld_gen_params *p, kvld_sink_fn sink, void *ud,
                                struct kvld_req **out, char *msg, size_t msglen);
/* The client went away or its deadline passed: end the request now (its blocks are freed
 * within one engine step); the sink is still called once more with done set. */
void kvld_req_cancel(struct kvld_req *r);
/* Pending output moved to a sink (malloc'd, NULL/0 when nothing); kvld_out_free frees. */
struct kvld_out {
  char *text;
  size_t len;
  int32_t *ids;
  float *lps; /* one per id */
  int n;
};
void kvld_req_take(struct kvld_req *r, struct kvld_out *o);
void kvld_out_free(struct kvld_out *o);
/* The sink is finished with the request: free it (after done). */
void kvld_req_release(struct kvld_req *r);
const char *kvld_finish_name(enum kvld_finish f); /* "stop", "length", "abort", "error" */

/* ---- front ends ------------------------------------------------------------------------ */

int kvld_grpc_start(struct kvld *d, char *err, size_t errlen);
/* Stop accepting calls; in-flight calls continue (drain). */
void kvld_grpc_shutdown(struct kvld *d, void (*done)(struct kvld *d));
/* Calls being answered now (the drain waits for them). */
int kvld_grpc_active(const struct kvld *d);
/* HTTP requests being answered now. */
int kvld_http_active(const struct kvld *d);
int kvld_http_start(struct kvld *d, char *err, size_t errlen);
void kvld_http_stop(struct kvld *d);


/* ---- cache snapshots across restarts (snapshot.c) ----------------------------------- */

/* What a model's snapshot is valid for (model file, KV dtype, translators in order). */
void kvld_snapshot_fingerprint(const struct kvld *d, int model, char *fp, size_t n);
/* <spill_dir>/<model>.snapshot */
void kvld_snapshot_path(const struct kvld *d, int model, char *out, size_t n);
/* Before the engine starts: load each model's snapshot into its cold tier; one that does
 * not match or is damaged is removed with a warning. */
void kvld_snapshot_load_all(struct kvld *d, kvl_sched_t *s);
/* A kvl_engine_fn (arg: the daemon): save every model's snapshot; KVL_EIO if one failed
 * (each failure logged). */
int kvld_snapshot_save_all(kvl_sched_t *s, void *arg);

#endif /* KVLD_DAEMON_H */
