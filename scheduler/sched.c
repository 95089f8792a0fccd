/* sched.c — continuous batching (see kvl_sched.h). */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_error.h"
#include "kvl_sched.h"
#include "kvl_translator.h"

#define MAX_MODELS KVL_SCHED_MAX_MODELS
#define MAX_XLAT 32
#define CONV_BUCKETS 1024

enum phase { P_WAITING, P_RUNNING, P_DONE };

struct req {
  uint64_t id;
  int model;
  int priority;
  uint64_t arrival;
  enum phase phase;
  int32_t *seq;          /* prompt ++ generated */
  int32_t len, cap;      /* len = n_prompt + generated */
  int32_t n_prompt, max_tokens, generated;
  int32_t io_waits;      /* steps spent waiting for its cached blocks to come back from disk */
  int32_t *stop_ids;
  int32_t n_stop_ids;
  enum kvl_reuse reuse;
  kvl_line_t *line;      /* NULL while waiting */
  int32_t computed;      /* positions of seq with KV in the line */
  uint64_t conv;         /* conversation key, 0 = stateless */
  bool no_translate;
  int32_t native_tail;   /* >= 1: positions at the end never translated */
  int32_t native_head;   /* >= 0: positions at the start never translated */
  bool warm_head;        /* at the end, warm the head in the models it translates into */
  int32_t pend_from, pend_n; /* head positions appended this step ahead of a translation:
                                computed by this step's forward with the rest */
  /* translation sources while the line is being extended: other models' lines (forks of
   * kept lines, or attached from their prefix caches), usable up to src_len */
  kvl_line_t *src[MAX_MODELS];
  int32_t src_len[MAX_MODELS];
  bool sources_open;
  kvl_line_t *carry;     /* the line it leaves at a handoff: the next model's source */
  int carry_model;
  /* routing */
  struct {
    bool on;
    int to;
    int32_t window;
    float max_mean_entropy, min_logprob;
  } cascade;
  float *win_h, *win_lp;  /* the cascade window's entropies and log-probs (ring) */
  int32_t win_n;
  int prefill_then;      /* model to hand off to once all but the last token are computed, -1 */
  int last_src;          /* the model it last translated from, -1 */
  float *shadow_ref;     /* a shadow: the translated request's first-token log-probs */
  int shadow_src;        /* ... and the translator's source model */
  kvl_sampler_t *sampler;
  kvl_token_cb cb;
  void *ud;
  struct kvl_usage usage;
  double t_submit, t_sched, t_first;
  /* per-step scratch */
  int32_t step_n;        /* positions scheduled this step */
  bool in_batch;         /* scheduled in the current step */
  int32_t logit_row;     /* row of this step's logits, or -1 */
  struct req *next;      /* in the model's list (all live requests) */
};

struct xlat {
  int src, dst;
  const struct kvl_translator *t;
  kvl_writer_t writer;
  struct kvl_translator_gate gate;
  struct kvl_translator_stats st;
};

struct conv {
  uint64_t key;
  kvl_line_t *line[MAX_MODELS];
  double last_used;
  struct conv *next;     /* bucket chain */
};

struct model {
  struct kvl_sched_model cfg;
  kvl_pool_t *pool;
  struct req *reqs;       /* live requests of this model, unordered */
  int32_t n_reqs;
};

struct kvl_sched {
  struct kvl_sched_config cfg;
  struct model models[MAX_MODELS];
  int n_models;
  uint64_t next_id, arrivals;
  struct xlat xlat[MAX_XLAT];
  int n_xlat;
  kvl_writer_t next_writer;
  struct conv *conv[CONV_BUCKETS];
  int32_t n_conv;
  int32_t io_waiting;    /* requests that waited for disk reads in this step */
  int32_t batched;       /* sequences that ran a forward in this step */
  /* step scratch */
  int32_t *tok, *pos, *seqi;
  int8_t *want;
  const int32_t **tables;
  struct req **batch;
  struct kvl_logit_top *top;    /* [max_seqs]: what each row of logits got */
  float *logits;                /* [step_tokens + max_seqs][widest vocabulary] (logits_ensure) */
  size_t logits_mapped;
  kvl_backend_t *logits_pinned_by; /* the backend that pinned its first max_seqs rows, or NULL */
  size_t cap_tok, cap_logits;
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

int kvl_sched_new(const struct kvl_sched_config *c, kvl_sched_t **out) {
  kvl_sched_t *s = calloc(1, sizeof(*s));
  if (!s) return KVL_ENOMEM;
  s->cfg = *c;
  if (s->cfg.step_tokens <= 0) s->cfg.step_tokens = 512;
  if (s->cfg.max_seqs <= 0) s->cfg.max_seqs = 64;
  s->next_id = 1;
  s->next_writer = 1;
  size_t n = (size_t)s->cfg.step_tokens + (size_t)s->cfg.max_seqs;
  s->cap_tok = n;
  s->tok = malloc(n * sizeof(int32_t));
  s->pos = malloc(n * sizeof(int32_t));
  s->seqi = malloc(n * sizeof(int32_t));
  s->want = malloc(n);
  s->tables = malloc((size_t)s->cfg.max_seqs * sizeof(*s->tables));
  s->batch = malloc((size_t)s->cfg.max_seqs * sizeof(*s->batch));
  s->top = malloc((size_t)s->cfg.max_seqs * sizeof(*s->top));
  if (!s->tok || !s->pos || !s->seqi || !s->want || !s->tables || !s->batch || !s->top) {
    kvl_sched_free(s);
    return KVL_ENOMEM;
  }
  *out = s;
  return 0;
}

static void finish(kvl_sched_t *s, struct model *m, struct req *r, enum kvl_finish_reason why, int32_t token, float lp);
static void conv_keep(kvl_sched_t *s, uint64_t key, int model, kvl_line_t *l);
static void close_sources(struct req *r);

static void conv_free_all(kvl_sched_t *s);

/* A step's logits rows live in a page-aligned mapping whose first max_seqs rows (all a
 * decode step brings back whole) the first device backend to come pins, so that they
 * come back by DMA rather than through the driver's bounce buffer; pinning the rest would
 * lock hundreds of MB for prompt log-prob rows a step rarely has. (The summaries come
 * through the model's own pinned buffer: qwen2.c head_end.) */
static void logits_free(kvl_sched_t *s) {
  if (s->logits_pinned_by) kvl_backend_host_unregister(s->logits_pinned_by, s->logits);
  if (s->logits) kvl_huge_free(s->logits, s->logits_mapped);
  s->logits = NULL, s->logits_pinned_by = NULL, s->cap_logits = 0;
}

/* room for rows of n_vocab logits; pinned by be if a device backend and not pinned yet
 * (the contents do not outlive a step: a wider vocabulary takes a new mapping) */
static int logits_ensure(kvl_sched_t *s, int32_t n_vocab, kvl_backend_t *be) {
  const size_t rows = (size_t)s->cfg.step_tokens + (size_t)s->cfg.max_seqs;
  if (rows > SIZE_MAX / sizeof(float) / (size_t)n_vocab) return KVL_ENOMEM;
  if (rows * (size_t)n_vocab > s->cap_logits) {
    kvl_backend_t *pin = s->logits_pinned_by;
    size_t mapped;
    float *l = kvl_huge_alloc(rows * (size_t)n_vocab * sizeof(float), &mapped);
    if (!l) return KVL_ENOMEM;
    logits_free(s);
    s->logits = l, s->logits_mapped = mapped, s->cap_logits = rows * (size_t)n_vocab;
    if (pin) be = pin;
  }
  const size_t head = (size_t)s->cfg.max_seqs * (s->cap_logits / rows) * sizeof(float);
  if (!s->logits_pinned_by && kvl_backend_host_register(be, s->logits, head)) s->logits_pinned_by = be;
  return 0;
}

void kvl_sched_free(kvl_sched_t *s) {
  if (!s) return;
  for (int i = 0; i < s->n_models; i++) {
    struct model *m = &s->models[i];
    while (m->reqs) finish(s, m, m->reqs, KVL_DONE_CANCELLED, -1, 0);
  }
  conv_free_all(s);
  for (int i = 0; i < s->n_models; i++) kvl_pool_free(s->models[i].pool);
  free(s->tok); free(s->pos); free(s->seqi); free(s->want); free(s->tables); free(s->batch); free(s->top);
  logits_free(s);
  free(s);
}

int kvl_sched_add_model(kvl_sched_t *s, const struct kvl_sched_model *mc, int *model_id, char *err, size_t errlen) {
  int slot = 0; /* a removed model's slot first, so ids stay small */
  while (slot < s->n_models && s->models[slot].pool) slot++;
  if (slot == MAX_MODELS) return kvl_errf(err, errlen, KVL_EFULL, "at most %d models", MAX_MODELS);
  struct kvl_kv_layout want = kvl_model_kv_layout(mc->model, mc->pool.layout.dtype);
  if (memcmp(&want, &mc->pool.layout, sizeof(want)))
    return kvl_errf(err, errlen, KVL_EMISMATCH, "model '%s': pool layout does not match the model", mc->name);
  struct model *m = &s->models[slot];
  memset(m, 0, sizeof(*m));
  m->cfg = *mc;
  const struct kvl_model_hparams *hp = kvl_model_hparams(mc->model);
  if (m->cfg.max_model_len <= 0 || m->cfg.max_model_len > hp->n_ctx_train) m->cfg.max_model_len = hp->n_ctx_train;
  int rc = kvl_pool_new(&mc->pool, &m->pool);
  if (rc < 0) return kvl_errf(err, errlen, rc, "model '%s': cannot create its KV pool (%s)", mc->name, kvl_strerror(rc));
  kvl_pool_pin(m->pool, mc->backend); /* a device backend's block copies from pinned memory */
  if (logits_ensure(s, hp->n_vocab, mc->backend) < 0) {
    kvl_pool_free(m->pool);
    m->pool = NULL;
    return kvl_errf(err, errlen, KVL_ENOMEM, "model '%s': out of memory for its logits", mc->name);
  }
  *model_id = slot;
  if (slot == s->n_models) s->n_models++;
  return 0;
}

int kvl_sched_remove_model(kvl_sched_t *s, int model_id, char *err, size_t errlen) {
  if (model_id < 0 || model_id >= s->n_models || !s->models[model_id].pool)
    return kvl_errf(err, errlen, KVL_ENOENT, "no model %d", model_id);
  struct model *m = &s->models[model_id];
  if (m->reqs)
    return kvl_errf(err, errlen, KVL_EBUSY, "model '%s' still has %d requests", m->cfg.name, (int)m->n_reqs);
  for (int b = 0; b < CONV_BUCKETS; b++)
    for (struct conv *c = s->conv[b]; c; c = c->next) {
      kvl_line_free(c->line[model_id]);
      c->line[model_id] = NULL;
    }
  for (int i = s->n_xlat - 1; i >= 0; i--)
    if (s->xlat[i].src == model_id || s->xlat[i].dst == model_id) s->xlat[i] = s->xlat[--s->n_xlat];
  kvl_pool_free(m->pool);
  memset(m, 0, sizeof(*m));
  return 0;
}

kvl_pool_t *kvl_sched_pool(kvl_sched_t *s, int model_id) { return s->models[model_id].pool; }

bool kvl_sched_idle(const kvl_sched_t *s) {
  for (int i = 0; i < s->n_models; i++)
    if (s->models[i].reqs) return false;
  return true;
}

/* ---- conversations ------------------------------------------------------------------ */

static struct conv *conv_get(kvl_sched_t *s, uint64_t key, bool create) {
  struct conv **head = &s->conv[key % CONV_BUCKETS];
  for (struct conv *c = *head; c; c = c->next)
    if (c->key == key) return c;
  if (!create) return NULL;
  struct conv *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->key = key;
  c->last_used = now_ms();
  c->next = *head;
  *head = c;
  s->n_conv++;
  return c;
}

/* The request's line becomes the conversation's line in `model` (the old one goes). */
static void conv_keep(kvl_sched_t *s, uint64_t key, int model, kvl_line_t *l) {
  struct conv *c = conv_get(s, key, true);
  if (!c) { kvl_line_free(l); return; } /* out of memory: only the reuse is lost */
  kvl_line_commit(l);
  kvl_line_free(c->line[model]);
  c->line[model] = l;
  c->last_used = now_ms();
}

static void conv_release(struct conv *c) {
  for (int i = 0; i < MAX_MODELS; i++) kvl_line_free(c->line[i]);
  free(c);
}

static void conv_free_all(kvl_sched_t *s) {
  for (int b = 0; b < CONV_BUCKETS; b++)
    while (s->conv[b]) {
      struct conv *c = s->conv[b];
      s->conv[b] = c->next;
      conv_release(c);
    }
  s->n_conv = 0;
}

const kvl_line_t *kvl_sched_conversation_line(const kvl_sched_t *s, uint64_t key, int model) {
  if (model < 0 || model >= MAX_MODELS) return NULL;
  for (const struct conv *c = s->conv[key % CONV_BUCKETS]; c; c = c->next)
    if (c->key == key) return c->line[model];
  return NULL;
}

int kvl_sched_conversation_drop(kvl_sched_t *s, uint64_t key) {
  for (struct conv **pp = &s->conv[key % CONV_BUCKETS]; *pp; pp = &(*pp)->next)
    if ((*pp)->key == key) {
      struct conv *c = *pp;
      *pp = c->next;
      conv_release(c);
      s->n_conv--;
      return 0;
    }
  return KVL_ENOENT;
}

int32_t kvl_sched_conversations_expire(kvl_sched_t *s, double idle_ms) {
  double t = now_ms();
  int32_t n = 0;
  for (int b = 0; b < CONV_BUCKETS; b++)
    for (struct conv **pp = &s->conv[b]; *pp;) {
      struct conv *c = *pp;
      if (t - c->last_used > idle_ms) {
        *pp = c->next;
        conv_release(c);
        s->n_conv--;
        n++;
      } else {
        pp = &c->next;
      }
    }
  return n;
}

int32_t kvl_sched_conversations(const kvl_sched_t *s) { return s->n_conv; }

/* Pool pressure: the least recently used kept line of model `mi` that is still hot goes
 * to the cold tier (or, when that frees nothing, is let go: its committed blocks stay in
 * the prefix cache). False when there is none. */
static bool conv_shed(kvl_sched_t *s, int mi) {
  struct conv *lru = NULL;
  for (int b = 0; b < CONV_BUCKETS; b++)
    for (struct conv *c = s->conv[b]; c; c = c->next)
      if (c->line[mi] && kvl_line_is_hot(c->line[mi]) && (!lru || c->last_used < lru->last_used)) lru = c;
  if (!lru) return false;
  kvl_pool_t *p = kvl_line_pool(lru->line[mi]);
  int32_t before = kvl_pool_available(p);
  if (kvl_line_offload(lru->line[mi]) < 0 || kvl_pool_available(p) <= before) {
    kvl_line_free(lru->line[mi]);
    lru->line[mi] = NULL;
  }
  return true;
}

/* ---- translators -------------------------------------------------------------------- */

static bool model_ok(const kvl_sched_t *s, int i) { return i >= 0 && i < s->n_models && s->models[i].pool; }

static struct xlat *xlat_find(kvl_sched_t *s, int src, int dst) {
  for (int i = 0; i < s->n_xlat; i++)
    if (s->xlat[i].src == src && s->xlat[i].dst == dst) return &s->xlat[i];
  return NULL;
}

int kvl_sched_add_translator(kvl_sched_t *s, int src, int dst, const struct kvl_translator *t,
                             const struct kvl_translator_gate *gate, char *err, size_t errlen) {
  struct kvl_translator_gate g = gate ? *gate : (struct kvl_translator_gate){0};
  if (!(g.shadow_fraction >= 0 && g.shadow_fraction <= 1) || !(g.max_kl >= 0) || g.min_shadows < 0)
    return kvl_errf(err, errlen, KVL_EINVAL, "translator gate: shadow_fraction in [0, 1], max_kl >= 0, min_shadows >= 0");
  if (g.min_shadows == 0) g.min_shadows = 8;
  if (!t || !model_ok(s, src) || !model_ok(s, dst) || src == dst)
    return kvl_errf(err, errlen, KVL_EINVAL, "translator: models %d -> %d are not two resident models", src, dst);
  const struct kvl_kv_layout *ls = kvl_pool_layout(s->models[src].pool), *ld = kvl_pool_layout(s->models[dst].pool);
  const struct kvl_model_fingerprint *fs = kvl_translator_source(t), *fd = kvl_translator_target(t);
  if (fs->n_layer != ls->n_layer || fs->n_kv_head != ls->n_kv_head || fs->head_dim != ls->head_dim ||
      fd->n_layer != ld->n_layer || fd->n_kv_head != ld->n_kv_head || fd->head_dim != ld->head_dim)
    return kvl_errf(err, errlen, KVL_EMISMATCH, "translator %s -> %s does not fit models '%s' -> '%s' (layers, KV heads or head size)",
                    fs->name, fd->name, s->models[src].cfg.name, s->models[dst].cfg.name);
  struct xlat *x = xlat_find(s, src, dst);
  if (!x) {
    if (s->n_xlat == MAX_XLAT) return kvl_errf(err, errlen, KVL_EFULL, "at most %d translators", MAX_XLAT);
    x = &s->xlat[s->n_xlat++];
  }
  *x = (struct xlat){src, dst, t, s->next_writer++, g, {.registered = true, .gated = g.off}};
  if (s->next_writer == KVL_WRITER_NATIVE) s->next_writer = 1;
  return 0;
}

void kvl_sched_translator_stats(const kvl_sched_t *s, int src, int dst, struct kvl_translator_stats *out) {
  memset(out, 0, sizeof(*out));
  for (int i = 0; i < s->n_xlat; i++)
    if (s->xlat[i].src == src && s->xlat[i].dst == dst) *out = s->xlat[i].st;
}

int kvl_sched_remove_translator(kvl_sched_t *s, int src, int dst) {
  struct xlat *x = xlat_find(s, src, dst);
  if (!x) return KVL_ENOENT;
  *x = s->xlat[--s->n_xlat];
  return 0;
}

/* ---- requests ----------------------------------------------------------------------- */

static void close_sources(struct req *r) {
  for (int i = 0; i < MAX_MODELS; i++) {
    kvl_line_free(r->src[i]);
    r->src[i] = NULL;
  }
  r->sources_open = false;
}

static void req_free(struct req *r) {
  close_sources(r);
  free(r->shadow_ref);
  kvl_line_free(r->carry);
  free(r->win_h);
  free(r->win_lp);
  kvl_line_free(r->line);
  kvl_sampler_free(r->sampler);
  free(r->seq);
  free(r->stop_ids);
  free(r);
}

static void warm_heads(kvl_sched_t *s, const struct req *r);

/* Final callback, then forget the request (after warming its head elsewhere, if asked). */
static void finish(kvl_sched_t *s, struct model *m, struct req *r, enum kvl_finish_reason why, int32_t token, float lp) {
  if (r->warm_head && (why == KVL_DONE_STOP || why == KVL_DONE_LENGTH)) warm_heads(s, r);
  for (struct req **pp = &m->reqs; *pp; pp = &(*pp)->next)
    if (*pp == r) { *pp = r->next; break; }
  m->n_reqs--;
  close_sources(r);
  if (r->line && r->conv && why != KVL_DONE_ERROR) conv_keep(s, r->conv, r->model, r->line);
  else kvl_line_free(r->line); /* blocks released now; committed ones stay cached */
  r->line = NULL;
  struct kvl_token_event ev = {token, r->generated - (token >= 0 ? 1 : 0), lp, true, why, r->usage,
                               r->t_sched > 0 ? r->t_sched - r->t_submit : 0, r->t_first > 0 ? r->t_first - r->t_submit : 0,
                               r->model, 0};
  if (r->cb) r->cb(r->ud, r->id, &ev);
  req_free(r);
}

int kvl_sched_submit(kvl_sched_t *s, const struct kvl_request *q, kvl_token_cb cb, void *ud, uint64_t *id,
                     char *err, size_t errlen) {
  if (q->model < 0 || q->model >= s->n_models || !s->models[q->model].pool)
    return kvl_errf(err, errlen, KVL_EINVAL, "unknown model %d", q->model);
  struct model *m = &s->models[q->model];
  const struct kvl_model_hparams *hp = kvl_model_hparams(m->cfg.model);
  if (q->n_prompt <= 0) return kvl_errf(err, errlen, KVL_EINVAL, "the prompt is empty");
  if (q->max_tokens < 1) return kvl_errf(err, errlen, KVL_EINVAL, "max_tokens must be at least 1 (got %d)", q->max_tokens);
  for (int32_t i = 0; i < q->n_prompt; i++)
    if (q->prompt[i] < 0 || q->prompt[i] >= hp->n_vocab)
      return kvl_errf(err, errlen, KVL_EINVAL, "prompt token %d at position %d is outside the vocabulary of %d", q->prompt[i], i, hp->n_vocab);
  int64_t total = (int64_t)q->n_prompt + q->max_tokens;
  if (total > m->cfg.max_model_len)
    return kvl_errf(err, errlen, KVL_EINVAL, "prompt (%d tokens) + max_tokens (%d) = %lld exceeds max_model_len %d of model '%s'",
                q->n_prompt, q->max_tokens, (long long)total, m->cfg.max_model_len, m->cfg.name);
  struct kvl_pool_stats st;
  kvl_pool_stats(m->pool, &st);
  int64_t blocks = (total + KVL_KV_BLOCK - 1) / KVL_KV_BLOCK + 1; /* + a copy-on-write spare */
  if (blocks > st.hot_blocks)
    return kvl_errf(err, errlen, KVL_EINVAL, "the request needs %lld KV blocks (%lld tokens) but model '%s' has %d in all",
                (long long)blocks, (long long)total, m->cfg.name, st.hot_blocks);
  /* routing: the models it may move to must hold it too and speak the same vocabulary */
  int start = q->model, then = -1;
  const int others[2] = {q->cascade.on ? q->cascade.to : -1, q->prefill_on.on ? q->prefill_on.model : -1};
  for (int k = 0; k < 2; k++) {
    int o = others[k];
    if (o < 0 && !(k == 0 ? q->cascade.on : q->prefill_on.on)) continue;
    const char *what = k == 0 ? "cascade" : "prefill_on";
    if (!model_ok(s, o)) return kvl_errf(err, errlen, KVL_EINVAL, "%s: unknown model %d", what, o);
    const struct model *mo = &s->models[o];
    if (kvl_model_hparams(mo->cfg.model)->n_vocab != hp->n_vocab)
      return kvl_errf(err, errlen, KVL_EINVAL, "%s: models '%s' and '%s' have different vocabularies", what,
                      m->cfg.name, mo->cfg.name);
    if (total > mo->cfg.max_model_len)
      return kvl_errf(err, errlen, KVL_EINVAL, "%s: %lld tokens exceed max_model_len %d of model '%s'", what,
                      (long long)total, mo->cfg.max_model_len, mo->cfg.name);
  }
  if (q->cascade.on && q->cascade.window < 1)
    return kvl_errf(err, errlen, KVL_EINVAL, "cascade: the window must be at least 1 token (got %d)", q->cascade.window);
  if (q->prefill_on.on && q->prefill_on.model != q->model && q->n_prompt > 1) {
    start = q->prefill_on.model; /* the prompt runs there first, then moves */
    then = q->model;
  }
  struct req *r = calloc(1, sizeof(*r));
  if (!r) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  r->prefill_then = then;
  r->last_src = -1;
  r->conv = q->conversation;
  r->no_translate = q->no_translate;
  r->native_tail = q->native_tail > 1 ? q->native_tail : 1;
  r->native_head = q->native_head > 0 ? q->native_head : 0;
  r->warm_head = q->warm_head;
  if (q->cascade.on && q->cascade.to != q->model) {
    r->cascade.on = true;
    r->cascade.to = q->cascade.to;
    r->cascade.window = q->cascade.window;
    r->cascade.max_mean_entropy = q->cascade.max_mean_entropy;
    r->cascade.min_logprob = q->cascade.min_logprob;
    r->win_h = malloc((size_t)q->cascade.window * sizeof(float));
    r->win_lp = malloc((size_t)q->cascade.window * sizeof(float));
    if (!r->win_h || !r->win_lp) { req_free(r); return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory"); }
  }
  int rc = kvl_sampler_new(&q->sampling, hp->n_vocab, 0, &r->sampler, err, errlen);
  if (rc < 0) { req_free(r); return rc; }
  r->cap = (int32_t)total;
  r->seq = malloc((size_t)r->cap * sizeof(int32_t));
  r->stop_ids = malloc(((size_t)q->n_stop_ids + 1) * sizeof(int32_t));
  if (!r->seq || !r->stop_ids) { req_free(r); return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory"); }
  memcpy(r->seq, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
  if (q->n_stop_ids) memcpy(r->stop_ids, q->stop_ids, (size_t)q->n_stop_ids * sizeof(int32_t));
  r->n_stop_ids = q->n_stop_ids;
  r->len = r->n_prompt = q->n_prompt;
  r->max_tokens = q->max_tokens;
  r->model = start;
  r->priority = q->priority;
  r->reuse = q->reuse;
  r->arrival = s->arrivals++;
  r->cb = cb;
  r->ud = ud;
  r->id = s->next_id++;
  r->phase = P_WAITING;
  r->usage.prompt_tokens = q->n_prompt;
  r->t_submit = now_ms();
  kvl_sampler_accept_prompt(r->sampler, q->prompt, (size_t)q->n_prompt);
  m = &s->models[start];
  r->next = m->reqs;
  m->reqs = r;
  m->n_reqs++;
  *id = r->id;
  return 0;
}

int kvl_sched_cancel(kvl_sched_t *s, uint64_t id) {
  for (int i = 0; i < s->n_models; i++)
    for (struct req *r = s->models[i].reqs; r; r = r->next)
      if (r->id == id) { finish(s, &s->models[i], r, KVL_DONE_CANCELLED, -1, 0); return 0; }
  return KVL_ENOENT;
}

/* Scheduling order: running before waiting; then priority (high first), arrival. */
static int cmp_req(const void *a, const void *b) {
  const struct req *x = *(struct req *const *)a, *y = *(struct req *const *)b;
  if ((x->phase == P_RUNNING) != (y->phase == P_RUNNING)) return x->phase == P_RUNNING ? -1 : 1;
  if (x->priority != y->priority) return x->priority > y->priority ? -1 : 1;
  return x->arrival < y->arrival ? -1 : x->arrival > y->arrival;
}

/* Give the line back (recompute later); the committed prefix stays in the cache. */
static void preempt(struct req *r) {
  close_sources(r);
  kvl_line_commit(r->line);
  kvl_line_free(r->line);
  r->line = NULL;
  r->computed = 0;
  r->phase = P_WAITING;
  r->usage.preemptions++;
}

static int model_index(const kvl_sched_t *s, const struct model *m) { return (int)(m - s->models); }

/* Length of the common prefix of a line's tokens and seq[0..limit). */
static int32_t common_prefix(const kvl_line_t *l, const int32_t *seq, int32_t limit) {
  const int32_t *t = kvl_line_tokens(l);
  int32_t n = kvl_line_len(l) < limit ? kvl_line_len(l) : limit, i = 0;
  while (i < n && t[i] == seq[i]) i++;
  return i;
}

static bool native_at(const kvl_line_t *l, int32_t pos) { return kvl_line_writer(l, pos) == KVL_WRITER_NATIVE; }

/* The first position r may translate: its next one, past the native head. */
static int32_t translatable_from(const struct req *r) {
  return r->computed > r->native_head ? r->computed : r->native_head;
}

/* The lines other models hold of r's sequence beyond what r's line has: those with a
 * translator to r's model become its translation sources; positions only they hold
 * natively without one are counted (untranslatable, or declined when the request asked
 * for no translation) and prefilled. */
static void open_sources(kvl_sched_t *s, struct req *r) {
  int mi = r->model;
  int32_t limit = r->len - r->native_tail; /* the last position (or tail) always runs natively */
  int32_t from = translatable_from(r);
  if (from >= limit) { kvl_line_free(r->carry); r->carry = NULL; return; }
  struct conv *c = r->conv ? conv_get(s, r->conv, false) : NULL;
  uint8_t *held = NULL; /* positions held natively by a model without a usable translator */
  for (int k = 0; k < s->n_models; k++) {
    if (k == mi || !s->models[k].pool) continue;
    struct xlat *x = xlat_find(s, k, mi);
    bool usable = x && !r->no_translate && !x->st.gated;
    kvl_line_t *l = NULL;           /* a source line of our own */
    const kvl_line_t *seen = NULL;  /* or one only looked at (writers and tokens need no restore) */
    if (r->carry && r->carry_model == k) {
      l = r->carry;
      r->carry = NULL;
    } else if (c && c->line[k]) {
      if (usable && (kvl_line_is_hot(c->line[k]) || kvl_line_restore(c->line[k]) == 0)) l = kvl_line_fork(c->line[k]);
      else seen = c->line[k];
    } else if (x) { /* without a translator for the pair its prefix index is not worth a lookup */
      l = kvl_line_new(s->models[k].pool);
      struct kvl_prefix_hit hit;
      if (l && (kvl_line_attach_prefix(l, r->seq, limit, KVL_REUSE_ANY, &hit) < 0 || hit.n_tokens <= r->computed)) {
        kvl_line_free(l);
        l = NULL;
      }
    }
    const kvl_line_t *any = l ? l : seen;
    if (!any) continue;
    int32_t n = common_prefix(any, r->seq, limit);
    if (l && n > from && usable) {
      r->src[k] = l;
      r->src_len[k] = n;
      r->sources_open = true;
      continue;
    }
    if (n > from && (held || (held = calloc((size_t)limit, 1))))
      for (int32_t p = from; p < n; p++)
        if (native_at(any, p)) held[p] |= x ? 2 : 1; /* 2: declined (asked, or gated); 1: no translator */
    kvl_line_free(l);
  }
  kvl_line_free(r->carry); /* a carry from a model that is gone */
  r->carry = NULL;
  if (!held) return;
  for (int32_t p = from; p < limit; p++) {
    if (!held[p]) continue;
    bool covered = false;
    for (int k = 0; k < s->n_models && !covered; k++)
      covered = r->src[k] && p < r->src_len[k] && native_at(r->src[k], p);
    if (!covered) {
      if (held[p] & 2) r->usage.declined++;
      else r->usage.untranslatable++;
    }
  }
  free(held);
}

/* Sources are done with: let them go, and move the conversation's outgoing lines (the
 * ones translated from) to the cold tier first (DESIGN.md, the multi-turn protocol). */
static void finish_sources(kvl_sched_t *s, struct req *r) {
  bool used[MAX_MODELS] = {0};
  for (int k = 0; k < MAX_MODELS; k++) used[k] = r->src[k] != NULL;
  close_sources(r);
  struct conv *c = r->conv ? conv_get(s, r->conv, false) : NULL;
  if (!c) return;
  for (int k = 0; k < MAX_MODELS; k++)
    if (used[k] && c->line[k] && kvl_line_is_hot(c->line[k])) (void)kvl_line_offload(c->line[k]);
}

/* Cached blocks this request would attach (its own prefix, its translation sources' prefixes)
 * that went to the disk tier are read back by the pool's I/O thread; the request waits for
 * them, a bounded number of steps (after that it computes what is still on disk). */
enum { MAX_IO_WAITS = 256 };
static bool wait_for_disk(kvl_sched_t *s, struct model *m, struct req *r, struct conv *c) {
  if (r->io_waits >= MAX_IO_WAITS) return false;
  int mi = model_index(s, m);
  int32_t pending = 0;
  if (!(c && c->line[mi])) pending += kvl_pool_prefetch(m->pool, r->seq, r->len - 1, r->reuse);
  for (int k = 0; k < s->n_models; k++) {
    if (k == mi || !s->models[k].pool || (c && c->line[k]) || (r->carry && r->carry_model == k)) continue;
    struct xlat *x = xlat_find(s, k, mi);
    if (x && !r->no_translate && !x->st.gated)
      pending += kvl_pool_prefetch(s->models[k].pool, r->seq, r->len - r->native_tail, KVL_REUSE_ANY);
  }
  if (!pending) return false;
  r->io_waits++;
  s->io_waiting++;
  return true;
}

/* Admit a waiting request: the conversation's kept line (forked at the first token that
 * differs), or a line sharing the longest cached prefix of its sequence (never the last
 * position: its logits must be computed); then its translation sources. KVL_EAGAIN while
 * some of that is being read back from disk. */
static int admit(kvl_sched_t *s, struct model *m, struct req *r) {
  int mi = model_index(s, m);
  struct conv *c = r->conv ? conv_get(s, r->conv, false) : NULL;
  if (wait_for_disk(s, m, r, c)) return KVL_EAGAIN;
  int32_t cached_native = 0, cached_translated = 0;
  if (c && c->line[mi]) {
    kvl_line_t *l = c->line[mi];
    if (!kvl_line_is_hot(l)) {
      int rc = kvl_line_restore(l);
      if (rc < 0) return rc;
    }
    c->line[mi] = NULL;
    c->last_used = now_ms();
    int32_t keep = common_prefix(l, r->seq, r->len - 1);
    if (r->reuse == KVL_REUSE_NATIVE_ONLY) /* the request wants native positions only */
      for (int32_t p = 0; p < keep; p++)
        if (!native_at(l, p)) { keep = p; break; }
    kvl_line_truncate(l, keep);
    for (int32_t p = 0; p < kvl_line_len(l); p++) {
      if (native_at(l, p)) cached_native++;
      else cached_translated++;
    }
    r->line = l;
  } else {
    r->line = kvl_line_new(m->pool);
    if (!r->line) return KVL_ENOMEM;
    struct kvl_prefix_hit hit;
    int rc = kvl_line_attach_prefix(r->line, r->seq, r->len - 1, r->reuse, &hit);
    if (rc < 0) { kvl_line_free(r->line); r->line = NULL; return rc; }
    cached_native = hit.n_native;
    cached_translated = hit.n_translated;
  }
  r->computed = kvl_line_len(r->line);
  if (r->usage.preemptions == 0 && r->usage.handoffs == 0) {
    r->usage.cached_native = cached_native;
    r->usage.cached_translated = cached_translated;
  }
  r->phase = P_RUNNING;
  open_sources(s, r);
  return 0;
}

/* The last request in scheduling order after position i that holds a line and is not in
 * this step's batch: the one to preempt when room runs out. */
static struct req *victim_after(struct req **order, int32_t n, int32_t i) {
  for (int32_t j = n - 1; j > i; j--)
    if (order[j]->line && !order[j]->in_batch) return order[j];
  return NULL;
}

/* Make room for model mi: preempt a later request, else shed a kept conversation line. */
static bool make_room(kvl_sched_t *s, int mi, struct req **order, int32_t n, int32_t i) {
  struct req *v = victim_after(order, n, i);
  if (v) { preempt(v); return true; }
  return conv_shed(s, mi);
}

/* Extend r's line by translation while its next position is native in a source. 0, or
 * KVL_EFULL when there is no room now (it waits for the next step). A translator that
 * fails is dropped for this request: those positions are prefilled instead. */
static int translate_ready(kvl_sched_t *s, struct model *m, struct req *r, struct req **order, int32_t n, int32_t i) {
  int mi = model_index(s, m);
  int32_t limit = r->len - r->native_tail;
  while (r->sources_open && r->computed < limit) {
    if (r->computed < r->native_head) return 0; /* the head is prefilled first */
    int k = 0;
    while (k < MAX_MODELS && !(r->src[k] && r->computed < r->src_len[k] && native_at(r->src[k], r->computed))) k++;
    if (k == MAX_MODELS) return 0; /* no model holds the next position: prefill it */
    int32_t e = r->computed + 1;
    while (e < limit && e < r->src_len[k] && native_at(r->src[k], e)) e++;
    struct xlat *x = xlat_find(s, k, mi);
    char err[256];
    int rc = KVL_ENOENT;
    while (x) { /* timed without make_room: its evictions are not translation */
      double t0 = now_ms();
      rc = kvl_line_translate(r->line, r->src[k], x->t, m->cfg.backend, x->writer, r->computed, e,
                              kvl_model_rope(s->models[k].cfg.model),
                              kvl_model_rope(m->cfg.model), err, sizeof(err));
      r->usage.translate_ms += now_ms() - t0;
      if (rc != KVL_EFULL || !make_room(s, mi, order, n, i)) break;
    }
    if (rc == KVL_EFULL) return KVL_EFULL;
    if (rc < 0) { /* removed or failing translator: prefill what it would have written */
      r->usage.untranslatable += e - r->computed;
      kvl_line_free(r->src[k]);
      r->src[k] = NULL;
      continue;
    }
    if (r->last_src != k) x->st.requests++;
    x->st.positions += (uint64_t)(e - r->computed);
    r->last_src = k;
    r->usage.translated += e - r->computed;
    r->computed = e;
    if (!r->pend_n) kvl_line_commit(r->line); /* a pending head is indexed once computed */
  }
  if (r->sources_open && r->computed >= limit) finish_sources(s, r);
  return 0;
}

/* How many of r's next `want` positions to prefill before a source can supply one. */
static int32_t prefill_run(const struct req *r, int32_t want) {
  if (!r->sources_open) return want;
  int32_t best = want;
  for (int k = 0; k < MAX_MODELS; k++) {
    if (!r->src[k]) continue;
    int32_t end = r->src_len[k] < r->computed + best ? r->src_len[k] : r->computed + best;
    for (int32_t p = translatable_from(r); p < end; p++)
      if (native_at(r->src[k], p)) { best = p - r->computed; break; }
  }
  return best > 0 ? best : want;
}

/* Move r from model m to model `to`: its line stays behind as the conversation's line
 * there (or as the translation source it carries), and it rejoins `to` as waiting — the
 * oldest arrival, so it is admitted first — where what m wrote natively is translated and
 * the last position computed natively. */
static void handoff(kvl_sched_t *s, struct model *m, struct req *r, int to) {
  int mi = model_index(s, m);
  close_sources(r);
  kvl_line_commit(r->line);
  if (r->conv) {
    conv_keep(s, r->conv, mi, r->line);
  } else {
    kvl_line_free(r->carry);
    r->carry = r->line;
    r->carry_model = mi;
  }
  r->line = NULL;
  r->computed = 0;
  r->phase = P_WAITING;
  for (struct req **pp = &m->reqs; *pp; pp = &(*pp)->next)
    if (*pp == r) { *pp = r->next; break; }
  m->n_reqs--;
  struct model *t = &s->models[to];
  r->next = t->reqs;
  t->reqs = r;
  t->n_reqs++;
  r->model = to;
  r->usage.handoffs++;
}

/* Entropy (nats) of softmax(l) and the log-prob of token `tok`. */
static void uncertainty(const float *l, int32_t n, int32_t tok, float *h, float *lp) {
  float mx = -INFINITY;
  for (int32_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
  double z = 0, ez = 0;
  for (int32_t i = 0; i < n; i++) {
    double d = (double)l[i] - mx, e = exp(d);
    z += e;
    ez += e * d;
  }
  double lz = log(z);
  *h = (float)(lz - ez / z);
  *lp = (float)((double)l[tok] - mx - lz);
}

/* the same from a row's summary: tok was drawn there (its logit came with it), or chosen
 * from its largest entries */
static void uncertainty_top(const struct kvl_logit_top *t, int32_t tok, float *h, float *lp) {
  *h = t->entropy;
  if (t->temperature > 0 && t->drawn == tok) {
    *lp = (float)((double)t->drawn_val - t->lse);
    return;
  }
  int j = 0;
  while (j < t->n - 1 && t->id[j] != tok) j++;
  KVL_ASSERT(t->id[j] == tok);
  *lp = (float)((double)t->val[j] - t->lse);
}

/* KL(native || translated) of a shadow's next-token distribution (logits l) against the
 * translated request's (log-probs ref), folded into its translator's online estimate;
 * the gate closes when the estimate passes the bar. */
/* log Σ exp(l): the log-partition, so that l[i] - it is log_softmax(l)[i]. */
static double log_partition(const float *l, int32_t n) {
  float mx = -INFINITY;
  for (int32_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
  double z = 0;
  for (int32_t i = 0; i < n; i++) z += exp((double)l[i] - mx);
  return mx + log(z);
}

static void shadow_measure(kvl_sched_t *s, int mi, struct req *r, const float *l, int32_t n) {
  double lz = log_partition(l, n), kl = 0;
  for (int32_t i = 0; i < n; i++) {
    double ln = (double)l[i] - lz;
    kl += exp(ln) * (ln - r->shadow_ref[i]);
  }
  free(r->shadow_ref);
  r->shadow_ref = NULL;
  struct xlat *x = xlat_find(s, r->shadow_src, mi);
  if (!x) return; /* removed meanwhile */
  struct kvl_translator_stats *st = &x->st;
  st->shadows++;
  st->kl_last = kl;
  double a = 1.0 / (double)st->shadows;
  if (a < 1.0 / 32) a = 1.0 / 32;
  st->kl_mean += a * (kl - st->kl_mean);
  if (x->gate.max_kl > 0 && st->shadows >= (uint64_t)x->gate.min_shadows && st->kl_mean > x->gate.max_kl) st->gated = true;
}

/* After a translated request's first token: every 1/f-th one gets a shadow — the same
 * prompt re-prefilled natively at the lowest priority, for one token, carrying the
 * request's log-probs to compare with. */
/* A background request: seq[0..n) computed natively in `model` at the lowest priority,
 * one greedy token, nobody waiting (the shadows, the warm heads). Returns it, or NULL
 * when it cannot be queued. */
static struct req *submit_background(kvl_sched_t *s, int model, const int32_t *seq, int32_t n) {
  struct kvl_request q = {.model = model, .prompt = seq, .n_prompt = n, .max_tokens = 1,
                          .priority = INT_MIN, .no_translate = true, .reuse = KVL_REUSE_NATIVE_ONLY};
  kvl_sampler_params_init(&q.sampling);
  q.sampling.temperature = 0;
  uint64_t id;
  char err[160];
  if (kvl_sched_submit(s, &q, NULL, NULL, &id, err, sizeof(err)) < 0) return NULL;
  struct req *b = s->models[model].reqs; /* submit puts it first */
  KVL_ASSERT(b && b->id == id);
  return b;
}

static void shadow_maybe(kvl_sched_t *s, int mi, struct req *r, const float *l, int32_t n) {
  struct xlat *x = xlat_find(s, r->last_src, mi);
  if (!x || x->gate.shadow_fraction <= 0) return;
  uint64_t k = x->st.requests;
  if (k == 0 || floor((double)k * x->gate.shadow_fraction) == floor((double)(k - 1) * x->gate.shadow_fraction)) return;
  float *ref = malloc((size_t)n * sizeof(float));
  if (!ref) return;
  double lz = log_partition(l, n);
  for (int32_t i = 0; i < n; i++) ref[i] = (float)((double)l[i] - lz);
  struct req *sh = submit_background(s, mi, r->seq, r->n_prompt);
  if (!sh) { free(ref); return; }
  sh->shadow_ref = ref;
  sh->shadow_src = r->last_src;
}

/* After r ends in model S: for every model M with a translator S -> M, unless M holds the
 * first native_head positions of r's sequence natively (the conversation's kept line in M,
 * or M's prefix cache), a request computes them in M at the lowest priority, for one token,
 * nobody waiting; its blocks stay in M's prefix cache. Whole blocks only. */
static void warm_heads(kvl_sched_t *s, const struct req *r) {
  const int32_t h = r->native_head / KVL_KV_BLOCK * KVL_KV_BLOCK;
  if (h <= 0 || r->len <= h) return;
  struct conv *c = r->conv ? conv_get(s, r->conv, false) : NULL;
  for (int i = 0; i < s->n_xlat; i++) {
    struct xlat *x = &s->xlat[i];
    if (x->src != r->model || !x->t || x->gate.off || x->st.gated || !model_ok(s, x->dst)) continue;
    if (c && c->line[x->dst] && kvl_line_len(c->line[x->dst]) >= h && common_prefix(c->line[x->dst], r->seq, h) == h &&
        kvl_line_native_span(c->line[x->dst], 0, h) == 0)
      continue;
    kvl_line_t *probe = kvl_line_new(s->models[x->dst].pool);
    if (!probe) continue;
    struct kvl_prefix_hit hit = {0};
    int rc = kvl_line_attach_prefix(probe, r->seq, h, KVL_REUSE_NATIVE_ONLY, &hit);
    kvl_line_free(probe);
    if (rc < 0 || hit.n_native >= h) continue;
    if (submit_background(s, x->dst, r->seq, h)) x->st.head_warmups++;
  }
}

/* The cascade's decision after a generated token: true when the window is full and its
 * mean entropy or lowest log-prob passes a bar. */
static bool cascade_due(struct req *r, float h, float lp) {
  int32_t w = r->cascade.window;
  r->win_h[r->win_n % w] = h;
  r->win_lp[r->win_n % w] = lp;
  r->win_n++;
  if (r->win_n < w) return false;
  float sum = 0, lo = 0;
  for (int32_t i = 0; i < w; i++) {
    sum += r->win_h[i];
    lo = i == 0 || r->win_lp[i] < lo ? r->win_lp[i] : lo;
  }
  return (r->cascade.max_mean_entropy > 0 && sum / (float)w > r->cascade.max_mean_entropy) ||
         (r->cascade.min_logprob < 0 && lo < r->cascade.min_logprob);
}

/* whether r's next logits must come to the host whole: its sampler needs more than a
 * summary or a draw made with it (kvl_sampler_top_enough, kvl_sampler_draw_enough), or a
 * shadow compares the whole distribution */
static bool full_row(const struct req *r) {
  return !(kvl_sampler_top_enough(r->sampler) || kvl_sampler_draw_enough(r->sampler)) || r->shadow_ref ||
         (r->generated == 0 && r->usage.translated > 0 && r->cb);
}

static int step_model(kvl_sched_t *s, struct model *m) {
  if (!m->reqs) return 0;
  /* order the live requests */
  int32_t n = m->n_reqs;
  struct req **order = malloc((size_t)n * sizeof(*order));
  if (!order) return KVL_ENOMEM;
  int32_t k = 0;
  for (struct req *r = m->reqs; r; r = r->next) { order[k++] = r; r->in_batch = false; }
  qsort(order, (size_t)n, sizeof(*order), cmp_req);

  int32_t budget = s->cfg.step_tokens, n_batch = 0, n_tok = 0, n_rows = 0;
  double t = now_ms();
  for (int pass = 0; pass < 2; pass++) {   /* pass 0: decoding requests; pass 1: prefill */
    for (int32_t i = 0; i < n && n_batch < s->cfg.max_seqs && budget > 0; i++) {
      struct req *r = order[i];
      if (r->phase == P_DONE) continue;
      bool decoding = r->phase == P_RUNNING && r->len - r->computed == 1;
      if ((pass == 0) != decoding) continue;
      if (r->phase == P_WAITING) {
        int rc;
        while ((rc = admit(s, m, r)) == KVL_EFULL && make_room(s, model_index(s, m), order, n, i)) {}
        if (rc == KVL_EFULL) break; /* no room for its cached prefix now: keep FCFS order */
        if (rc == KVL_EAGAIN) continue; /* its cached blocks are coming back from disk */
        if (rc < 0) { free(order); return rc; }
        if (r->t_sched == 0) r->t_sched = t;
      }
      /* A native head ahead of a translation: its tokens are appended now and computed in
       * this step's forward together with the prefill after the translated span (the
       * forward stores every token's K/V before any attends), so the head costs no step
       * of its own. */
      r->pend_n = 0;
      int32_t h = r->native_head < r->len - 1 ? r->native_head : r->len - 1;
      if (r->sources_open && r->computed < h && r->prefill_then < 0 && budget > h - r->computed) {
        int rc;
        while ((rc = kvl_line_append(r->line, r->seq + r->computed, h - r->computed, KVL_WRITER_NATIVE)) == KVL_EFULL &&
               make_room(s, model_index(s, m), order, n, i)) {}
        if (rc == KVL_EFULL) break;
        if (rc < 0) { free(order); return rc; }
        r->pend_from = r->computed;
        r->pend_n = h - r->computed;
        r->computed = h;
      }
      int32_t translated0 = r->usage.translated;
      if (r->sources_open && translate_ready(s, m, r, order, n, i) == KVL_EFULL) {
        if (r->pend_n) { /* no room to translate: the head waits too, and what was translated */
          kvl_line_truncate(r->line, r->pend_from);
          r->computed = r->pend_from;
          r->usage.translated = translated0;
          r->pend_n = 0;
        }
        break;
      }
      if (r->prefill_then >= 0 && r->computed >= r->len - 1) { /* prompt already here (cached) */
        int to = r->prefill_then;
        r->prefill_then = -1;
        handoff(s, m, r, to);
        continue;
      }
      budget -= r->pend_n;
      int32_t want = r->len - r->computed;
      if (r->prefill_then >= 0) want--; /* the last position runs on the model it moves to */
      want = prefill_run(r, want);
      int32_t take = want < budget ? want : budget;
      int rc;
      /* no room: preempt the last request in scheduling order that holds a line and is
       * not in this step's batch (recompute later), or shed a kept conversation line */
      while ((rc = kvl_line_append(r->line, r->seq + r->computed, take, KVL_WRITER_NATIVE)) == KVL_EFULL &&
             make_room(s, model_index(s, m), order, n, i)) {}
      bool full = rc == KVL_EFULL;
      if (full && !r->pend_n) break; /* it keeps its line and continues next step */
      if (full) take = 0;              /* ... after its pending head is computed */
      else if (rc < 0) { free(order); return rc; }
      r->step_n = take;
      r->in_batch = true;
      r->logit_row = take > 0 && r->computed + take == r->len ? 0 : -1;
      s->batch[n_batch] = r;
      s->tables[n_batch] = NULL; /* filled after all appends (they may move blocks) */
      for (int32_t j = 0; j < r->pend_n; j++) {
        s->tok[n_tok] = r->seq[r->pend_from + j];
        s->pos[n_tok] = r->pend_from + j;
        s->seqi[n_tok] = n_batch;
        s->want[n_tok] = false;
        n_tok++;
      }
      for (int32_t j = 0; j < take; j++) {
        s->tok[n_tok] = r->seq[r->computed + j];
        s->pos[n_tok] = r->computed + j;
        s->seqi[n_tok] = n_batch;
        const bool last = r->computed + j == r->len - 1;
        s->want[n_tok] = last ? (full_row(r) ? 1 : KVL_LOGITS_TOP) : 0;
        if (last) { /* its row of the summaries: a draw there for a sampler without truncation */
          struct kvl_logit_top *t = &s->top[n_rows++];
          t->temperature = 0, t->u = 0;
          if (s->want[n_tok] == KVL_LOGITS_TOP && kvl_sampler_draw_enough(r->sampler))
            kvl_sampler_predraw(r->sampler, t);
        }
        n_tok++;
      }
      n_batch++;
      budget -= take;
      if (full) break;
    }
  }
  free(order);
  s->batched += n_batch;
  if (n_batch == 0) return 0;
  for (int32_t b = 0; b < n_batch; b++) {
    KVL_ASSERT(kvl_line_is_hot(s->batch[b]->line));
    s->tables[b] = kvl_line_block_table(s->batch[b]->line);
  }
  struct kvl_kv_view kv = {kvl_pool_layout(m->pool), kvl_pool_base(m->pool), s->tables, kvl_pool_stamps(m->pool),
                           kvl_pool_hot_blocks(m->pool)};
  struct kvl_batch bt = {n_tok, s->tok, s->pos, s->seqi, s->want};
  int rc = kvl_model_forward_top(m->cfg.model, m->cfg.backend, &bt, &kv, s->logits, s->top);
  if (rc < 0) return rc;
  const int32_t NV = kvl_model_hparams(m->cfg.model)->n_vocab;
  int32_t row = 0;
  for (int32_t b = 0; b < n_batch; b++) {
    struct req *r = s->batch[b];
    bool was_prompt = r->computed < r->n_prompt;
    if (was_prompt) {
      int32_t end = r->computed + r->step_n < r->n_prompt ? r->computed + r->step_n : r->n_prompt;
      if (r->usage.preemptions == 0) r->usage.prefilled += end - r->computed;
    }
    if (r->pend_n && r->usage.preemptions == 0) r->usage.prefilled += r->pend_n;
    r->pend_n = 0;
    r->computed += r->step_n;
    kvl_line_commit(r->line);
    if (r->prefill_then >= 0 && r->computed == r->len - 1) { /* prefill_on: the prompt is in */
      int to = r->prefill_then;
      r->prefill_then = -1;
      handoff(s, m, r, to);
      continue;
    }
    if (r->logit_row < 0) continue;
    /* the row, or only its summary where the backend kept the row on its device */
    const struct kvl_logit_top *top = &s->top[row];
    const float *lrow = top->full ? s->logits + (size_t)row * NV : NULL;
    if (r->shadow_ref) shadow_measure(s, model_index(s, m), r, lrow, NV);
    struct kvl_sample_info info;
    int32_t tok = lrow ? kvl_sampler_sample(r->sampler, lrow, &info) : kvl_sampler_sample_top(r->sampler, top, &info);
    row++;
    if (tok < 0) { finish(s, m, r, KVL_DONE_ERROR, -1, 0); continue; }
    kvl_sampler_accept(r->sampler, tok);
    r->seq[r->len++] = tok;
    r->generated++;
    if (r->generated == 1 && r->usage.translated > 0 && r->cb) shadow_maybe(s, model_index(s, m), r, lrow, NV);
    r->usage.generated = r->generated;
    if (r->t_first == 0) r->t_first = now_ms();
    bool stop = false;
    for (int32_t j = 0; j < r->n_stop_ids; j++) stop |= tok == r->stop_ids[j];
    if (stop) { finish(s, m, r, KVL_DONE_STOP, tok, info.logprob); continue; }
    if (r->generated >= r->max_tokens || r->len >= m->cfg.max_model_len) {
      finish(s, m, r, KVL_DONE_LENGTH, tok, info.logprob);
      continue;
    }
    float h = 0, lp = 0;
    bool move = false;
    if (r->cascade.on) {
      if (lrow) uncertainty(lrow, NV, tok, &h, &lp);
      else uncertainty_top(top, tok, &h, &lp);
      move = cascade_due(r, h, lp);
    }
    struct kvl_token_event ev = {tok, r->generated - 1, info.logprob, false, KVL_DONE_NONE, r->usage,
                                 r->t_sched - r->t_submit, r->t_first - r->t_submit, r->model, h};
    if (r->cb) r->cb(r->ud, r->id, &ev);
    if (move) {
      r->cascade.on = false; /* one handoff: the strong model finishes the answer */
      handoff(s, m, r, r->cascade.to);
    }
  }
  return 0;
}

int kvl_sched_step(kvl_sched_t *s) {
  int live = 0;
  s->io_waiting = s->batched = 0;
  for (int i = 0; i < s->n_models; i++)
    if (s->models[i].pool) kvl_pool_io_poll(s->models[i].pool); /* disk reads that finished */
  for (int i = 0; i < s->n_models; i++) {
    if (!s->models[i].pool) continue; /* removed */
    int rc = step_model(s, &s->models[i]);
    if (rc < 0) return rc;
    live += s->models[i].n_reqs;
  }
  /* Nothing could run but requests wait for disk reads: sleep until one finishes (briefly:
   * the loop thread's submissions wake the engine only between steps) instead of spinning. */
  if (s->batched == 0 && s->io_waiting)
    for (int i = 0; i < s->n_models; i++)
      if (s->models[i].pool && kvl_pool_io_wait(s->models[i].pool, 5)) break;
  return live;
}

int kvl_sched_model_stats(const kvl_sched_t *s, int model_id, struct kvl_sched_model_stats *out) {
  memset(out, 0, sizeof(*out));
  if (model_id < 0 || model_id >= s->n_models) return KVL_ERANGE;
  const struct model *m = &s->models[model_id];
  if (!m->pool) return KVL_ENOENT; /* removed */
  for (const struct req *r = m->reqs; r; r = r->next) {
    if (r->line) out->running++;
    else out->waiting++;
  }
  struct kvl_pool_stats ps;
  kvl_pool_stats(m->pool, &ps);
  out->kv_usage = ps.hot_blocks > 0 ? (double)ps.hot_used / ps.hot_blocks : 0;
  out->pool = ps;
  for (int b = 0; b < CONV_BUCKETS; b++)
    for (const struct conv *c = s->conv[b]; c; c = c->next) out->conversations += c->line[model_id] != NULL;
  for (int i = 0; i < s->n_xlat; i++)
    if (s->xlat[i].dst == model_id) out->from[s->xlat[i].src] = s->xlat[i].st;
  return 0;
}
