/* sched.c — continuous batching (see kvl_sched.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_error.h"
#include "kvl_sched.h"

#define MAX_MODELS 8

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
  int32_t *stop_ids;
  int32_t n_stop_ids;
  enum kvl_reuse reuse;
  kvl_line_t *line;      /* NULL while waiting */
  int32_t computed;      /* positions of seq with KV in the line */
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
  /* step scratch */
  int32_t *tok, *pos, *seqi;
  int8_t *want;
  const int32_t **tables;
  struct req **batch;
  float *logits;
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
  size_t n = (size_t)s->cfg.step_tokens + (size_t)s->cfg.max_seqs;
  s->cap_tok = n;
  s->tok = malloc(n * sizeof(int32_t));
  s->pos = malloc(n * sizeof(int32_t));
  s->seqi = malloc(n * sizeof(int32_t));
  s->want = malloc(n);
  s->tables = malloc((size_t)s->cfg.max_seqs * sizeof(*s->tables));
  s->batch = malloc((size_t)s->cfg.max_seqs * sizeof(*s->batch));
  if (!s->tok || !s->pos || !s->seqi || !s->want || !s->tables || !s->batch) { kvl_sched_free(s); return KVL_ENOMEM; }
  *out = s;
  return 0;
}

static void finish(kvl_sched_t *s, struct model *m, struct req *r, enum kvl_finish_reason why, int32_t token, float lp);

void kvl_sched_free(kvl_sched_t *s) {
  if (!s) return;
  for (int i = 0; i < s->n_models; i++) {
    struct model *m = &s->models[i];
    while (m->reqs) finish(s, m, m->reqs, KVL_DONE_CANCELLED, -1, 0);
    kvl_pool_free(m->pool);
  }
  free(s->tok); free(s->pos); free(s->seqi); free(s->want); free(s->tables); free(s->batch); free(s->logits);
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
  size_t need = (size_t)(s->cfg.step_tokens + s->cfg.max_seqs) * (size_t)hp->n_vocab;
  if (need > s->cap_logits) {
    float *l = realloc(s->logits, need * sizeof(float));
    if (!l) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory for logits");
    s->logits = l;
    s->cap_logits = need;
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

static void req_free(struct req *r) {
  kvl_line_free(r->line);
  kvl_sampler_free(r->sampler);
  free(r->seq);
  free(r->stop_ids);
  free(r);
}

/* Final callback, then forget the request. */
static void finish(kvl_sched_t *s, struct model *m, struct req *r, enum kvl_finish_reason why, int32_t token, float lp) {
  (void)s;
  for (struct req **pp = &m->reqs; *pp; pp = &(*pp)->next)
    if (*pp == r) { *pp = r->next; break; }
  m->n_reqs--;
  kvl_line_free(r->line); /* blocks released now; committed ones stay cached */
  r->line = NULL;
  struct kvl_token_event ev = {token, r->generated - (token >= 0 ? 1 : 0), lp, true, why, r->usage,
                               r->t_sched > 0 ? r->t_sched - r->t_submit : 0, r->t_first > 0 ? r->t_first - r->t_submit : 0};
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
  struct req *r = calloc(1, sizeof(*r));
  if (!r) return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  int rc = kvl_sampler_new(&q->sampling, hp->n_vocab, 0, &r->sampler, err, errlen);
  if (rc < 0) { free(r); return rc; }
  r->cap = (int32_t)total;
  r->seq = malloc((size_t)r->cap * sizeof(int32_t));
  r->stop_ids = malloc(((size_t)q->n_stop_ids + 1) * sizeof(int32_t));
  if (!r->seq || !r->stop_ids) { req_free(r); return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory"); }
  memcpy(r->seq, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
  if (q->n_stop_ids) memcpy(r->stop_ids, q->stop_ids, (size_t)q->n_stop_ids * sizeof(int32_t));
  r->n_stop_ids = q->n_stop_ids;
  r->len = r->n_prompt = q->n_prompt;
  r->max_tokens = q->max_tokens;
  r->model = q->model;
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
  kvl_line_commit(r->line);
  kvl_line_free(r->line);
  r->line = NULL;
  r->computed = 0;
  r->phase = P_WAITING;
  r->usage.preemptions++;
}

/* Admit a waiting request: a line sharing the longest cached prefix of its sequence
 * (never the last position: its logits must be computed). */
static int admit(struct model *m, struct req *r) {
  r->line = kvl_line_new(m->pool);
  if (!r->line) return KVL_ENOMEM;
  struct kvl_prefix_hit hit;
  int rc = kvl_line_attach_prefix(r->line, r->seq, r->len - 1, r->reuse, &hit);
  if (rc < 0) { kvl_line_free(r->line); r->line = NULL; return rc; }
  r->computed = hit.n_tokens;
  if (r->usage.preemptions == 0) {
    r->usage.cached_native = hit.n_native;
    r->usage.cached_translated = hit.n_translated;
  }
  r->phase = P_RUNNING;
  return 0;
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

  int32_t budget = s->cfg.step_tokens, n_batch = 0, n_tok = 0;
  double t = now_ms();
  for (int pass = 0; pass < 2; pass++) {   /* pass 0: decoding requests; pass 1: prefill */
    for (int32_t i = 0; i < n && n_batch < s->cfg.max_seqs && budget > 0; i++) {
      struct req *r = order[i];
      if (r->phase == P_DONE) continue;
      bool decoding = r->phase == P_RUNNING && r->len - r->computed == 1;
      if ((pass == 0) != decoding) continue;
      if (r->phase == P_WAITING) {
        int rc = admit(m, r);
        if (rc == KVL_EFULL) break; /* no room for its cached prefix now: keep FCFS order */
        if (rc < 0) { free(order); return rc; }
        if (r->t_sched == 0) r->t_sched = t;
      }
      int32_t want = r->len - r->computed;
      int32_t take = want < budget ? want : budget;
      int rc;
      while ((rc = kvl_line_append(r->line, r->seq + r->computed, take, KVL_WRITER_NATIVE)) == KVL_EFULL) {
        /* preempt the last request in scheduling order that holds a line and is not in
         * this step's batch (recompute later); stop when there is none */
        struct req *victim = NULL;
        for (int32_t j = n - 1; j > i; j--)
          if (order[j]->line && !order[j]->in_batch) { victim = order[j]; break; }
        if (!victim) break;
        preempt(victim);
      }
      if (rc == KVL_EFULL) break; /* it keeps its line and continues next step */
      if (rc < 0) { free(order); return rc; }
      r->step_n = take;
      r->in_batch = true;
      r->logit_row = r->computed + take == r->len ? 0 : -1;
      s->batch[n_batch] = r;
      s->tables[n_batch] = NULL; /* filled after all appends (they may move blocks) */
      for (int32_t j = 0; j < take; j++) {
        s->tok[n_tok] = r->seq[r->computed + j];
        s->pos[n_tok] = r->computed + j;
        s->seqi[n_tok] = n_batch;
        s->want[n_tok] = r->computed + j == r->len - 1;
        n_tok++;
      }
      n_batch++;
      budget -= take;
    }
  }
  free(order);
  if (n_batch == 0) return 0;
  for (int32_t b = 0; b < n_batch; b++) {
    KVL_ASSERT(kvl_line_is_hot(s->batch[b]->line));
    s->tables[b] = kvl_line_block_table(s->batch[b]->line);
  }
  struct kvl_kv_view kv = {kvl_pool_layout(m->pool), kvl_pool_base(m->pool), s->tables};
  struct kvl_batch bt = {n_tok, s->tok, s->pos, s->seqi, s->want};
  int rc = kvl_model_forward(m->cfg.model, m->cfg.backend, &bt, &kv, s->logits, NULL);
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
    r->computed += r->step_n;
    kvl_line_commit(r->line);
    if (r->logit_row < 0) continue;
    struct kvl_sample_info info;
    int32_t tok = kvl_sampler_sample(r->sampler, s->logits + (size_t)row * NV, &info);
    row++;
    if (tok < 0) { finish(s, m, r, KVL_DONE_ERROR, -1, 0); continue; }
    kvl_sampler_accept(r->sampler, tok);
    r->seq[r->len++] = tok;
    r->generated++;
    r->usage.generated = r->generated;
    if (r->t_first == 0) r->t_first = now_ms();
    bool stop = false;
    for (int32_t j = 0; j < r->n_stop_ids; j++) stop |= tok == r->stop_ids[j];
    if (stop) { finish(s, m, r, KVL_DONE_STOP, tok, info.logprob); continue; }
    if (r->generated >= r->max_tokens || r->len >= m->cfg.max_model_len) {
      finish(s, m, r, KVL_DONE_LENGTH, tok, info.logprob);
      continue;
    }
    struct kvl_token_event ev = {tok, r->generated - 1, info.logprob, false, KVL_DONE_NONE, r->usage,
                                 r->t_sched - r->t_submit, r->t_first - r->t_submit};
    if (r->cb) r->cb(r->ud, r->id, &ev);
  }
  return 0;
}

int kvl_sched_step(kvl_sched_t *s) {
  int live = 0;
  for (int i = 0; i < s->n_models; i++) {
    if (!s->models[i].pool) continue; /* removed */
    int rc = step_model(s, &s->models[i]);
    if (rc < 0) return rc;
    live += s->models[i].n_reqs;
  }
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
  return 0;
}
