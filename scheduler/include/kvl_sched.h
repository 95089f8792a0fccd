/* kvl_sched.h — continuous batching over resident models: requests join and leave the
 * running batch at every step, long prompts are prefilled in chunks under a per-step
 * token budget so decoding streams keep flowing, shared prefixes come from the prefix
 * cache, and a full pool preempts (recompute) instead of failing.
 *
 *   kvl_sched_t *s;
 *   kvl_sched_new(&(struct kvl_sched_config){.step_tokens = 512, .max_seqs = 64}, &s);
 *   int mid;
 *   kvl_sched_add_model(s, &(struct kvl_sched_model){.name = "qwen2.5-coder-0.5b", .model = m,
 *                        .backend = kvl_backend_cpu(), .pool = pool_cfg}, &mid, err, sizeof(err));
 *   struct kvl_request r = {.model = mid, .prompt = ids, .n_prompt = n, .max_tokens = 128,
 *                           .stop_ids = eog, .n_stop_ids = 2};
 *   kvl_sampler_params_init(&r.sampling);
 *   uint64_t id;
 *   if (kvl_sched_submit(s, &r, on_token, ctx, &id, err, sizeof(err)) < 0) reply_400(err);
 *   while (!kvl_sched_idle(s)) kvl_sched_step(s);   // the compute thread's loop
 *
 * Each step runs, per model with work, one batched forward: first one token for every
 * request that is decoding, then prefill chunks (running requests first, then new ones
 * in priority-then-arrival order) until the step's token budget is used. A request's
 * sequence is prompt ++ generated; positions are computed in order, and logits are taken
 * at the sequence's last position, so decoding and prefill are the same operation — and
 * a preempted request (its line freed when the pool is full) resumes by recomputing,
 * mostly from the prefix cache.
 *
 * Callbacks run on the thread calling kvl_sched_step, once per generated token; the last
 * call has `final` set and carries usage and the finish reason. After the final callback
 * the scheduler forgets the request.
 *
 * Switching models (DESIGN.md "Translation", the multi-turn protocol). With translators
 * registered (kvl_sched_add_translator), a request for model M extends M's line by
 * *translating* every span another resident model S holds natively, instead of
 * prefilling it: M's line comes from the conversation's kept line or M's prefix cache;
 * S's lines likewise (the conversation's kept line, or S's prefix index for stateless
 * requests); positions no model holds natively are prefilled by M; the last position
 * always runs natively in M. Only native positions are translation sources, so nothing
 * is translated twice. Sources are translated from while hot; a conversation's outgoing
 * line is offloaded to the cold tier right after.
 *
 * Conversations. A request with a nonzero `conversation` key leaves its line (prompt +
 * generated, the last sampled token without KV) as that conversation's line in its
 * model, replacing the previous one; the next request of the conversation continues it
 * (truncated at the first token that differs: an edited or regenerated turn forks there).
 * Kept lines are offloaded under pool pressure, and dropped by
 * kvl_sched_conversation_drop / kvl_sched_conversations_expire.
 *
 * Handoff (routing). A request may move to another model mid-way: `cascade` moves it
 * after a generated token when the small model's uncertainty over a window passes a
 * bar; `prefill_on` runs the prompt (all but its last token) on another model first. The
 * receiving model translates what the first one wrote natively and continues the same
 * request: same sampler state, same token stream; events say which model produced each
 * token.
 */
#ifndef KVL_SCHED_H
#define KVL_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_kvpool.h"
#include "kvl_model.h"
#include "kvl_sampler.h"

struct kvl_translator;

typedef struct kvl_sched kvl_sched_t;

struct kvl_sched_config {
  int32_t step_tokens;  /* tokens per forward per model (prefill chunking budget); default 512 */
  int32_t max_seqs;     /* requests per step per model; default 64 */
};

struct kvl_sched_model {
  const char *name;
  kvl_model_t *model;             /* borrowed: outlives the scheduler */
  kvl_backend_t *backend;
  struct kvl_pool_config pool;    /* its layout must be the model's (dtype chosen here) */
  int32_t max_model_len;          /* 0: the model's training context */
};

enum kvl_finish_reason {
  KVL_DONE_NONE = 0,
  KVL_DONE_STOP,       /* a stop id was generated */
  KVL_DONE_LENGTH,     /* max_tokens or max_model_len reached */
  KVL_DONE_CANCELLED,  /* kvl_sched_cancel */
  KVL_DONE_ERROR,      /* sampling failed (every token banned) */
};

struct kvl_usage {
  int32_t prompt_tokens;
  int32_t cached_native;      /* prompt positions reused from the prefix cache, by writer */
  int32_t cached_translated;
  int32_t prefilled;          /* prompt positions computed */
  int32_t generated;
  int32_t preemptions;        /* times the request lost its line and recomputed */
  int32_t translated;         /* positions translated into its line from another model */
  int32_t untranslatable;     /* positions another model held natively, prefilled instead:
                                 no translator for the pair */
  int32_t declined;           /* ... prefilled instead because the request said so (no_translate) */
  int32_t handoffs;           /* times it moved to another model */
  double translate_ms;        /* wall time spent translating into its lines (on a device backend the
                                 calls': the device may still run the work after they return,
                                 and its time then falls in the next step's) */
};

struct kvl_token_event {
  int32_t token;              /* -1 on a final event without a token (cancel, error) */
  int32_t index;              /* 0-based index of the generated token */
  float logprob;
  bool final;
  enum kvl_finish_reason finish;
  struct kvl_usage usage;
  double queue_ms;            /* submit -> first scheduled */
  double ttft_ms;             /* submit -> first token */
  int model;                  /* the model that produced this token (changes at a handoff) */
  float entropy;              /* of the distribution the token was sampled from (nats; cascade only, else 0) */
};

typedef void (*kvl_token_cb)(void *ud, uint64_t id, const struct kvl_token_event *ev);

struct kvl_request {
  int model;                        /* from kvl_sched_add_model */
  const int32_t *prompt;            /* copied at submit */
  int32_t n_prompt;
  int32_t max_tokens;
  struct kvl_sampler_params sampling;
  const int32_t *stop_ids;          /* copied; end-of-generation ids */
  int32_t n_stop_ids;
  int priority;                     /* larger first; FCFS within a priority */
  enum kvl_reuse reuse;             /* prefix-cache policy */
  uint64_t conversation;            /* 0: stateless; else the key its kept lines live under */
  bool no_translate;                /* prefill what other models hold (the quality gate's fallback) */
  int32_t native_tail;              /* the sequence's last N positions are always computed natively,
                                       never translated (0 or 1: only the last; a larger tail buys
                                       quality right after a switch for N - 1 tokens of prefill) */
  int32_t native_head;              /* the sequence's first N positions are always computed natively,
                                       never translated (0: none). The first block holds the
                                       attention sink: computing it natively costs N positions of
                                       prefill on a model's first turn and keeps most of the quality
                                       a translated short prompt loses (docs/switching.md) */
  bool warm_head;                   /* when it ends (stop or length), every model it has a
                                       translator into that does not hold the sequence's first
                                       native_head positions natively gets them computed in the
                                       background, at the lowest priority, into its prefix cache:
                                       a later switch there translates the rest and prefills only
                                       the new turn. Only whole 16-position blocks are kept, so
                                       native_head below 16 warms nothing */
  struct {                          /* move to `to` when the window's uncertainty passes a bar */
    bool on;
    int to;                         /* model id (same vocabulary) */
    int32_t window;                 /* generated tokens per decision (>= 1) */
    float max_mean_entropy;         /* hand off when the window's mean entropy (nats) exceeds this (0: unused) */
    float min_logprob;              /* ... or its lowest sampled log-prob is below this (0: unused) */
  } cascade;
  struct {                          /* prefill all but the last prompt token on `model` first */
    bool on;
    int model;
  } prefill_on;
};

int kvl_sched_new(const struct kvl_sched_config *c, kvl_sched_t **out);
/* Frees the scheduler; pending requests get a final CANCELLED callback first. */
void kvl_sched_free(kvl_sched_t *s);
int kvl_sched_add_model(kvl_sched_t *s, const struct kvl_sched_model *m, int *model_id, char *err, size_t errlen);
kvl_pool_t *kvl_sched_pool(kvl_sched_t *s, int model_id);
/* Remove a model with no live requests (KVL_EBUSY otherwise): its pool is freed, its id
 * refused by submit and reused by a later add_model. The model itself is the caller's. */
int kvl_sched_remove_model(kvl_sched_t *s, int model_id, char *err, size_t errlen);

/* Queue a request. KVL_EINVAL with a message for anything that can never run: unknown
 * model, empty prompt, prompt + max_tokens over max_model_len, more KV than the whole
 * hot pool, invalid sampling values. */
int kvl_sched_submit(kvl_sched_t *s, const struct kvl_request *r, kvl_token_cb cb, void *ud, uint64_t *id,
                     char *err, size_t errlen);
/* Cancel: its blocks are released at once and the final callback (CANCELLED) runs
 * before this returns. KVL_ENOENT for an unknown or finished id. */
int kvl_sched_cancel(kvl_sched_t *s, uint64_t id);
/* One engine step over every model with work. Returns the number of requests still
 * queued or running, or a negative error (a forward failure). */
int kvl_sched_step(kvl_sched_t *s);
bool kvl_sched_idle(const kvl_sched_t *s);

/* The quality gate of one translator. Offline: `off` (its held-out score is over the
 * operator's bar) — requests prefill what it would translate and say so (usage.declined).
 * Online: a fraction of the requests it served are re-prefilled natively in the
 * background (a shadow at the lowest priority, one token, nobody waiting for it) and
 * the KL(native || translated) of the two next-token distributions at the end of the
 * prompt is tracked; once the estimate passes max_kl (after min_shadows shadows) the gate
 * closes: the translator stays registered, requests decline it, until it is registered
 * again. */
struct kvl_translator_gate {
  bool off;
  double shadow_fraction;  /* [0, 1]; 0: no shadows (deterministic: every 1/f-th request) */
  double max_kl;           /* nats; 0: never close */
  int32_t min_shadows;     /* default 8 */
};
struct kvl_translator_stats {
  bool registered;
  bool gated;              /* off, or closed by the online estimate */
  uint64_t requests;       /* requests it translated for */
  uint64_t positions;      /* positions it translated */
  uint64_t shadows;        /* shadow re-prefills measured */
  uint64_t head_warmups;   /* background prefills of a sequence's head in dst after src served it
                              (kvl_request.warm_head) */
  double kl_mean;          /* online KL estimate: the mean, then a moving average over ~32 */
  double kl_last;
};

/* Register translator t (borrowed: it must outlive its registration) for model src -> dst,
 * replacing the pair's previous one (positions it wrote keep their writer: a new
 * translator never aliases an old one's blocks; its statistics start afresh). `gate` may
 * be NULL (always used, no shadows). KVL_EINVAL for unknown models, src == dst, bad gate
 * values; KVL_EMISMATCH for a translator whose layout does not fit the two pools. */
int kvl_sched_add_translator(kvl_sched_t *s, int src, int dst, const struct kvl_translator *t,
                             const struct kvl_translator_gate *gate, char *err, size_t errlen);
/* Forget the pair's translator (0, or KVL_ENOENT). */
int kvl_sched_remove_translator(kvl_sched_t *s, int src, int dst);
/* The pair's statistics (registered false when there is none). */
void kvl_sched_translator_stats(const kvl_sched_t *s, int src, int dst, struct kvl_translator_stats *out);

/* Conversations: the kept line of `conversation` in `model` (NULL when none; owned by the
 * scheduler, valid until the next step); drop one conversation's lines (0 or KVL_ENOENT);
 * drop those unused for more than `idle_ms` (returns how many). */
const kvl_line_t *kvl_sched_conversation_line(const kvl_sched_t *s, uint64_t conversation, int model);
int kvl_sched_conversation_drop(kvl_sched_t *s, uint64_t conversation);
int32_t kvl_sched_conversations_expire(kvl_sched_t *s, double idle_ms);
int32_t kvl_sched_conversations(const kvl_sched_t *s);

/* What a model's queue and pool hold now (for metrics). */
#define KVL_SCHED_MAX_MODELS 8
struct kvl_sched_model_stats {
  int32_t running;        /* requests holding a line (shadows included) */
  int32_t waiting;        /* requests queued without one */
  double kv_usage;        /* referenced hot blocks / hot capacity, 0..1 */
  int32_t conversations;  /* kept conversation lines in this model */
  struct kvl_pool_stats pool; /* its KV pool: blocks per tier, moves between them */
  struct kvl_translator_stats from[KVL_SCHED_MAX_MODELS]; /* translators into this model, by source */
};
/* KVL_ERANGE past the last model, KVL_ENOENT for a removed one. */
int kvl_sched_model_stats(const kvl_sched_t *s, int model_id, struct kvl_sched_model_stats *out);

#endif /* KVL_SCHED_H */
