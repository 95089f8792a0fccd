/* route.c — conversations and the router.
 *
 * Conversations: a client's conversation id names the scheduler's kept lines (one per
 * model, DESIGN.md "Translation"); here the daemon keeps what it needs on the loop
 * thread — the id's key, its pinned model, when it was last used — counts them for
 * /metrics (a replica sees a conversation "start" the first time the id reaches it: what
 * the affinity tests count) and expires idle ones, dropping their lines in the engine.
 *
 * Routing: a request for "auto" gets a model by the configured policy:
 *   fixed            the default model;
 *   cascade          the small model answers; when its mean entropy (or lowest sampled
 *                    log-prob) over a window passes the bar, the large model takes over
 *                    mid-answer from the translated cache, keeping the text so far;
 *   prefill-offload  prompts of at least N tokens are prefilled by the small model and
 *                    decoded by the large one from the translated cache;
 *   pinned           a conversation stays on the model its first turn used.
 * The decision and its reason go into the response and the counters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "kvl_error.h"

enum kvld_outcome kvld_outcome_of(const struct kvl_usage *u) {
  if (u->translated > 0) return KVLD_TR_APPLIED;
  if (u->declined > 0) return KVLD_TR_FALLBACK;
  if (u->untranslatable > 0) return KVLD_TR_UNSUPPORTED;
  return KVLD_TR_NOT_NEEDED;
}

const char *kvld_outcome_name(enum kvld_outcome o) {
  switch (o) {
  case KVLD_TR_APPLIED: return "applied";
  case KVLD_TR_FALLBACK: return "fallback_reprefill";
  case KVLD_TR_UNSUPPORTED: return "unsupported";
  default: return "not_needed";
  }
}

void kvld_route_count(struct kvld *d, const char *policy, const char *decision) {
  for (int i = 0; i < d->n_routes; i++)
    if (!strcmp(d->routes[i].policy, policy) && !strcmp(d->routes[i].decision, decision)) {
      d->routes[i].n++;
      return;
    }
  if (d->n_routes == KVLD_MAX_ROUTES) return;
  struct kvld_route_count *c = &d->routes[d->n_routes++];
  snprintf(c->policy, sizeof(c->policy), "%s", policy);
  snprintf(c->decision, sizeof(c->decision), "%s", decision);
  c->n = 1;
}

/* ---- conversations ------------------------------------------------------------------ */

/* FNV-1a, never 0 (0 means "no conversation" to the scheduler). */
static uint64_t conv_key(const char *id) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)id; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
  return h ? h : 1;
}

enum kvld_status kvld_conv_check_id(const char *id, char *msg, size_t msglen) {
  size_t n = strlen(id);
  if (n == 0 || n >= sizeof(((struct kvld_conv *)0)->id)) {
    snprintf(msg, msglen, "conversation id: expected 1 to %zu characters, got %zu",
             sizeof(((struct kvld_conv *)0)->id) - 1, n);
    return KVLD_INVALID_ARGUMENT;
  }
  for (size_t i = 0; i < n; i++)
    if (id[i] < 0x21 || id[i] > 0x7e) {
      snprintf(msg, msglen, "conversation id: character %zu is not printable ASCII", i);
      return KVLD_INVALID_ARGUMENT;
    }
  return KVLD_OK;
}

struct kvld_conv *kvld_conv_touch(struct kvld *d, const char *id) {
  uint64_t key = conv_key(id);
  struct kvld_conv **head = &d->convs[key % KVLD_CONV_BUCKETS];
  d->conv_turns++;
  for (struct kvld_conv *c = *head; c; c = c->next)
    if (c->key == key && !strcmp(c->id, id)) {
      c->last_used = kvld_now();
      c->turns++;
      return c;
    }
  struct kvld_conv *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  snprintf(c->id, sizeof(c->id), "%s", id);
  c->key = key;
  c->last_used = kvld_now();
  c->pinned = -1;
  c->turns = 1;
  c->next = *head;
  *head = c;
  d->conv_active++;
  d->conv_started++;
  return c;
}

static struct kvld_conv *conv_find(struct kvld *d, const char *id) {
  uint64_t key = conv_key(id);
  for (struct kvld_conv *c = d->convs[key % KVLD_CONV_BUCKETS]; c; c = c->next)
    if (c->key == key && !strcmp(c->id, id)) return c;
  return NULL;
}

static void conv_free(struct kvld_conv *c) {
  free(c->last);
  free(c);
}

void kvld_conv_remember(struct kvld *d, const char *id, const struct kvld_model *tokenized_by, const int32_t *prompt,
                        int32_t n_prompt, const int32_t *gen, int32_t n_gen) {
  struct kvld_conv *c = conv_find(d, id);
  if (!c) return;
  int32_t *s = realloc(c->last, ((size_t)n_prompt + (size_t)n_gen) * sizeof(int32_t));
  if (!s) return;
  memcpy(s, prompt, (size_t)n_prompt * sizeof(int32_t));
  if (n_gen) memcpy(s + n_prompt, gen, (size_t)n_gen * sizeof(int32_t));
  c->last = s;
  c->n_last = n_prompt + n_gen;
  c->n_last_prompt = n_prompt;
  snprintf(c->last_tok, sizeof(c->last_tok), "%s", tokenized_by->tok_hash);
}

/* The client resent the conversation with the last answer as text, which the tokenizer
 * may split differently from the ids the model generated. When the new prompt starts
 * with the previous prompt and continues with exactly the bytes of the previous answer,
 * put the generated ids back in place of the re-tokenised ones: the kept line then
 * matches to its end. Returns true when the prompt was changed. */
static bool canonicalize(const struct kvld_conv *c, const struct kvld_model *m, int32_t **ids, int32_t *n) {
  const kvl_tokenizer_t *tk = m->tk;
  int32_t a = c->n_last_prompt, b = c->n_last, *P = *ids;
  if (!c->last || !m->tok_hash[0] || strcmp(c->last_tok, m->tok_hash) || b <= a || *n < a || memcmp(P, c->last, (size_t)a * sizeof(int32_t))) return false;
  size_t want = 0;
  for (int32_t i = a; i < b; i++) {
    size_t len;
    kvl_tokenizer_token_bytes(tk, c->last[i], &len);
    want += len;
  }
  size_t got = 0;
  int32_t j = a, k = a; /* k walks the answer's ids beside P's bytes */
  size_t koff = 0;
  while (got < want && j < *n) {
    size_t len;
    const char *pb = kvl_tokenizer_token_bytes(tk, P[j], &len);
    if (!pb || got + len > want) return false;
    for (size_t x = 0; x < len; x++) { /* compare byte by byte against the answer's bytes */
      size_t ql;
      const char *qb = kvl_tokenizer_token_bytes(tk, c->last[k], &ql);
      if (!qb || qb[koff] != pb[x]) return false;
      if (++koff == ql) { k++; koff = 0; }
    }
    got += len;
    j++;
  }
  if (got != want) return false;
  if (j - a == b - a && !memcmp(P + a, c->last + a, (size_t)(b - a) * sizeof(int32_t))) return false; /* same ids */
  int32_t total = b + (*n - j);
  int32_t *q = malloc((size_t)total * sizeof(int32_t));
  if (!q) return false;
  memcpy(q, c->last, (size_t)b * sizeof(int32_t));
  memcpy(q + b, P + j, (size_t)(*n - j) * sizeof(int32_t));
  free(P);
  *ids = q;
  *n = total;
  return true;
}

static int drop_in_engine(kvl_sched_t *s, void *arg) {
  (void)kvl_sched_conversations_expire(s, *(double *)arg);
  return 0;
}

static void drop_done(void *arg, int rc) {
  (void)rc;
  free(arg);
}

static void on_conv_tick(uv_timer_t *t) {
  struct kvld *d = t->data;
  double now = kvld_now(), ttl = d->cfg.conversation_ttl_s;
  for (int b = 0; b < KVLD_CONV_BUCKETS; b++)
    for (struct kvld_conv **pp = &d->convs[b]; *pp;) {
      struct kvld_conv *c = *pp;
      if (now - c->last_used > ttl) {
        *pp = c->next;
        conv_free(c);
        d->conv_active--;
        d->conv_expired++;
      } else {
        pp = &c->next;
      }
    }
  /* the scheduler keeps its own last-use times: the same rule drops the same lines */
  double *ms = malloc(sizeof(double));
  if (!ms) return;
  *ms = ttl * 1e3;
  if (!d->engine || kvl_engine_run(d->engine, drop_in_engine, drop_done, ms) < 0) free(ms);
}

void kvld_conv_start(struct kvld *d) {
  uv_timer_init(d->loop, &d->conv_timer);
  d->conv_timer.data = d;
  uint64_t every = (uint64_t)(d->cfg.conversation_ttl_s * 1e3 / 4);
  if (every < 1000) every = 1000;
  if (every > 60000) every = 60000;
  uv_timer_start(&d->conv_timer, on_conv_tick, every, every);
  uv_unref((uv_handle_t *)&d->conv_timer); /* never keeps the loop alive */
}

static void conv_closed(uv_handle_t *h) {
  struct kvld *d = h->data;
  for (int b = 0; b < KVLD_CONV_BUCKETS; b++)
    while (d->convs[b]) {
      struct kvld_conv *c = d->convs[b];
      d->convs[b] = c->next;
      conv_free(c);
    }
  d->conv_active = 0;
}

void kvld_conv_stop(struct kvld *d) {
  if (!uv_is_closing((uv_handle_t *)&d->conv_timer)) uv_close((uv_handle_t *)&d->conv_timer, conv_closed);
}

/* ---- routing ------------------------------------------------------------------------- */

static int find_live(const struct kvld *d, const char *name) {
  for (int i = 0; i < d->n_models; i++)
    if (kvld_model_live(d, i) && !strcmp(d->models[i].name, name)) return i;
  return -1;
}

int kvld_auto_model(const struct kvld *d) {
  if (strcmp(d->cfg.router.policy, "fixed")) {
    int s = find_live(d, d->cfg.router.small);
    if (s >= 0) return s;
  }
  return find_live(d, d->cfg.default_model);
}

static void set(struct kvld_route *r, const char *policy, const char *decision) {
  snprintf(r->policy, sizeof(r->policy), "%s", policy);
  snprintf(r->decision, sizeof(r->decision), "%s", decision);
  r->from_model = r->handoff_token = -1;
}

void kvld_route(struct kvld *d, struct kvld_gen_params *p, struct kvl_request *q) {
  struct kvld_route *r = &p->route;
  struct kvld_conv *c = p->conversation[0] ? kvld_conv_touch(d, p->conversation) : NULL;
  if (c) {
    q->conversation = c->key;
    if (canonicalize(c, &d->models[p->model], &p->prompt, &p->n_prompt)) {
      q->prompt = p->prompt;
      q->n_prompt = p->n_prompt;
      kvld_log(KVLD_DEBUG, "conversation_ids_restored", "\"conversation\":\"%s\",\"prompt_tokens\":%d", c->id,
               (int)p->n_prompt);
    }
  }
  int model = p->model;
  const char *policy = d->cfg.router.policy;
  int small = find_live(d, d->cfg.router.small), large = find_live(d, d->cfg.router.large);
  bool pair = small >= 0 && large >= 0 && small != large &&
              kvl_model_hparams(d->models[small].m)->n_vocab == kvl_model_hparams(d->models[large].m)->n_vocab;
  if (!p->is_auto) {
    set(r, "requested", "requested");
    snprintf(r->reason, sizeof(r->reason), "the client named the model");
  } else if (!strcmp(policy, "cascade") && pair) {
    set(r, policy, "small");
    model = small;
    q->cascade.on = true;
    q->cascade.to = d->models[large].sched_id;
    q->cascade.window = d->cfg.router.cascade_window;
    q->cascade.max_mean_entropy = (float)d->cfg.router.cascade_max_mean_entropy;
    q->cascade.min_logprob = (float)d->cfg.router.cascade_min_logprob;
    if (d->cfg.router.handoff_native_tail > q->native_tail) q->native_tail = d->cfg.router.handoff_native_tail;
    snprintf(r->reason, sizeof(r->reason),
             "cascade: %s answers; %s takes over if the mean entropy over %d tokens exceeds %.3g nats%s", d->models[small].name,
             d->models[large].name, q->cascade.window, d->cfg.router.cascade_max_mean_entropy,
             d->cfg.router.cascade_min_logprob < 0 ? " or a sampled log-prob falls below the bar" : "");
  } else if (!strcmp(policy, "prefill-offload") && pair) {
    model = large;
    if (p->n_prompt >= d->cfg.router.prefill_offload_min_tokens) {
      set(r, policy, "prefill-offload");
      q->prefill_on.on = true;
      q->prefill_on.model = d->models[small].sched_id;
      if (d->cfg.router.handoff_native_tail > q->native_tail) q->native_tail = d->cfg.router.handoff_native_tail;
      snprintf(r->reason, sizeof(r->reason), "prompt of %d tokens >= %d: %s prefills, %s decodes from the translated cache",
               (int)p->n_prompt, d->cfg.router.prefill_offload_min_tokens, d->models[small].name, d->models[large].name);
    } else {
      set(r, policy, "large");
      snprintf(r->reason, sizeof(r->reason), "prompt of %d tokens < %d: %s does it all", (int)p->n_prompt,
               d->cfg.router.prefill_offload_min_tokens, d->models[large].name);
    }
  } else if (!strcmp(policy, "pinned") && c) {
    if (c->pinned >= 0 && kvld_model_live(d, c->pinned)) {
      model = c->pinned;
      set(r, policy, "pinned");
      snprintf(r->reason, sizeof(r->reason), "conversation pinned to %s at its first turn", d->models[model].name);
    } else {
      c->pinned = model;
      set(r, policy, "pinned");
      snprintf(r->reason, sizeof(r->reason), "first turn of the conversation: pinned to %s", d->models[model].name);
    }
  } else {
    set(r, strcmp(policy, "fixed") ? policy : "fixed", "default");
    snprintf(r->reason, sizeof(r->reason), "%s", !strcmp(policy, "fixed") ? "the default model"
                                                 : !pair ? "the router's two models are not both resident (default model)"
                                                         : "no conversation id to pin (default model)");
  }
  if (c && c->pinned < 0) c->pinned = model;
  p->model = model;
  q->model = d->models[model].sched_id;
  kvld_route_count(d, r->policy, r->decision);
}
