/* service.c — one generation request from validated input to streamed text, shared by
 * the gRPC and HTTP front ends: tokenise or template the input, check every field with a
 * message a client can act on, submit to the engine, turn token events into text deltas
 * (streaming detokenizer, stop strings) and account usage, timings and metrics. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "daemon.h"
#include "kvl_chat.h"
#include "kvl_error.h"

const char *kvld_finish_name(enum kvld_finish f) {
  switch (f) {
  case KVLD_FIN_STOP: return "stop";
  case KVLD_FIN_LENGTH: return "length";
  case KVLD_FIN_CANCELLED: return "abort";
  case KVLD_FIN_ERROR: return "error";
  default: return "none";
  }
}

void kvld_gen_params_free(struct kvld_gen_params *p) {
  free(p->prompt);
  free(p->bias);
  free(p->stop_ids);
  if (p->stops)
    for (char **s = p->stops; *s; s++) free(*s);
  free(p->stops);
  memset(p, 0, sizeof(*p));
}

int kvld_model_find(const struct kvld *d, const char *name) {
  if (!name || !*name || !strcmp(name, "auto")) return kvld_auto_model(d);
  for (int i = 0; i < d->n_models; i++)
    if (kvld_model_live(d, i) && !strcmp(d->models[i].name, name)) return i;
  return -1;
}

static enum kvld_status fail(char *msg, size_t msglen, enum kvld_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum kvld_status fail(char *msg, size_t msglen, enum kvld_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, msglen, fmt, ap);
  va_end(ap);
  return st;
}

void kvld_escape(const char *s, char *out, size_t outlen) {
  size_t o = 0;
  for (; *s && o + 5 < outlen; s++) {
    unsigned char c = (unsigned char)*s;
    if (c >= 0x20 && c < 0x7f) out[o++] = (char)c;
    else o += (size_t)snprintf(out + o, outlen - o, "\\x%02x", c);
  }
  if (*s && o + 3 < outlen) o += (size_t)snprintf(out + o, outlen - o, "...");
  if (outlen) out[o < outlen ? o : outlen - 1] = 0;
}

enum kvld_status kvld_prepare(struct kvld *d, const char *model, const char *text, size_t text_len,
                              const int32_t *ids, size_t n_ids, const void *chat_json, bool continue_final,
                              struct kvld_gen_params *p, char *msg, size_t msglen) {
  int mi = kvld_model_find(d, model);
  if (mi < 0) {
    char names[512] = "";
    for (int i = 0; i < d->n_models; i++)
      if (kvld_model_live(d, i))
        snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s, ", d->models[i].name);
    char shown[96];
    kvld_escape(model, shown, sizeof(shown));
    return fail(msg, msglen, KVLD_NOT_FOUND, "unknown model '%s' (resident: %sor auto)", shown, names);
  }
  struct kvld_model *m = &d->models[mi];
  p->model = mi;
  p->is_auto = !model || !*model || !strcmp(model, "auto");
  int n_vocab = kvl_model_hparams(m->m)->n_vocab;
  size_t n = 0;
  int32_t *toks = NULL;
  char err[512];
  if (text) {
    if (text_len == 0) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt is empty");
    int rc = kvl_tokenizer_encode(m->tk, text, text_len, false, &toks, &n);
    if (rc == KVL_EINVAL) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt is not valid UTF-8");
    if (rc < 0) return fail(msg, msglen, KVLD_INTERNAL, "tokenizer: %s", kvl_strerror(rc));
  } else if (ids) {
    if (n_ids == 0) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt is empty (no token ids)");
    for (size_t i = 0; i < n_ids; i++)
      if (ids[i] < 0 || ids[i] >= n_vocab)
        return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "token id %d at position %zu is outside the vocabulary [0, %d)",
                    (int)ids[i], i, n_vocab);
    toks = malloc(n_ids * sizeof(int32_t));
    if (!toks) return fail(msg, msglen, KVLD_RESOURCE_EXHAUSTED, "out of memory");
    memcpy(toks, ids, n_ids * sizeof(int32_t));
    n = n_ids;
  } else if (chat_json) {
    const json_t *msgs = chat_json;
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
      return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "chat input has no messages");
    if (!m->tmpl) return fail(msg, msglen, KVLD_FAILED_PRECONDITION, "model '%s' has no chat template", m->name);
    json_t *ctx = json_pack("{s:O,s:b}", "messages", msgs, "add_generation_prompt", !continue_final);
    int rc = kvl_chat_encode(m->tmpl, m->tk, ctx, &toks, &n, NULL, NULL, err, sizeof(err));
    json_decref(ctx);
    if (rc < 0) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "chat messages: %s", err);
  } else
    return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "no input: give text, token ids or chat messages");
  if (n == 0) {
    free(toks);
    return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt is empty after tokenization");
  }
  p->prompt = toks;
  p->n_prompt = (int32_t)n;
  if ((int)n > d->cfg.max_prompt_tokens)
    return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt has %zu tokens, over the limit of %d", n,
                d->cfg.max_prompt_tokens);
  if ((int32_t)n >= m->max_model_len)
    return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "the prompt has %zu tokens; model '%s' holds %d", n, m->name,
                (int)m->max_model_len);
  return KVLD_OK;
}

enum kvld_status kvld_check_sampling(struct kvld *d, struct kvld_gen_params *p, char *msg, size_t msglen) {
  struct kvld_model *m = &d->models[p->model];
  if (p->max_tokens < 0) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "max_tokens must be positive");
  if (p->max_tokens == 0) p->max_tokens = d->cfg.default_max_tokens;
  if (p->max_tokens > d->cfg.max_new_tokens)
    return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "max_tokens %d is over the limit of %d", (int)p->max_tokens,
                d->cfg.max_new_tokens);
  if (p->n_prompt + p->max_tokens > m->max_model_len) /* as vLLM: shorten to what fits */
    p->max_tokens = m->max_model_len - p->n_prompt;
  char err[256];
  kvl_sampler_t *s;
  int rc = kvl_sampler_new(&p->sampling, kvl_model_hparams(m->m)->n_vocab, 0, &s, err, sizeof(err));
  if (rc < 0) return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "%s", err);
  kvl_sampler_free(s);
  return KVLD_OK;
}

enum kvld_status kvld_set_stops(struct kvld *d, struct kvld_gen_params *p, const int32_t *ids, size_t n_ids,
                                const char *const *strings, size_t n_strings, char *msg, size_t msglen) {
  const struct kvld_model *m = &d->models[p->model];
  int nv = kvl_model_hparams(m->m)->n_vocab;
  p->stop_ids = malloc((n_ids + (size_t)m->n_eog + 1) * sizeof(int32_t));
  p->stops = calloc(n_strings + 1, sizeof(char *));
  if (!p->stop_ids || !p->stops) return fail(msg, msglen, KVLD_RESOURCE_EXHAUSTED, "out of memory");
  p->n_stop_ids = 0;
  if (!p->ignore_eos)
    for (int i = 0; i < m->n_eog; i++) p->stop_ids[p->n_stop_ids++] = m->eog[i];
  for (size_t i = 0; i < n_ids; i++) {
    if (ids[i] < 0 || ids[i] >= nv)
      return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "stop token id %d is outside the vocabulary [0, %d)", (int)ids[i],
                  nv);
    p->stop_ids[p->n_stop_ids++] = ids[i];
  }
  for (size_t i = 0; i < n_strings; i++) {
    if (!strings[i] || !strings[i][0])
      return fail(msg, msglen, KVLD_INVALID_ARGUMENT, "stop string %zu is empty", i);
    if (!(p->stops[i] = strdup(strings[i]))) return fail(msg, msglen, KVLD_RESOURCE_EXHAUSTED, "out of memory");
  }
  return KVLD_OK;
}

/* ---- the request's life --------------------------------------------------------------- */

static void append_text(struct kvld_req *r, const char *s, size_t n) {
  if (!n) return;
  if (r->text_len + n + 1 > r->text_cap) {
    size_t cap = (r->text_len + n + 1) * 2;
    char *t = realloc(r->text, cap);
    if (!t) return;
    r->text = t;
    r->text_cap = cap;
  }
  memcpy(r->text + r->text_len, s, n);
  r->text_len += n;
  r->text[r->text_len] = 0;
}

static void append_id(struct kvld_req *r, int32_t id, float lp) {
  if (r->n_ids == r->cap_ids) {
    int cap = r->cap_ids ? 2 * r->cap_ids : 16;
    int32_t *i = realloc(r->ids, (size_t)cap * sizeof(int32_t));
    float *l = i ? realloc(r->lps, (size_t)cap * sizeof(float)) : NULL;
    if (i) r->ids = i;
    if (!l) return;
    r->lps = l;
    r->cap_ids = cap;
  }
  r->ids[r->n_ids] = id;
  r->lps[r->n_ids] = lp;
  r->n_ids++;
}

static void finish_metrics(struct kvld_req *r) {
  struct kvld_model *m = &r->d->models[r->p.model];
  double now = kvld_now();
  m->mx.prompt_tokens += (uint64_t)r->usage.prompt_tokens;
  m->mx.generation_tokens += (uint64_t)r->generated;
  m->mx.prefix_queries += (uint64_t)r->usage.prompt_tokens;
  m->mx.prefix_hits += (uint64_t)(r->usage.cached_native + r->usage.cached_translated);
  m->mx.translated_tokens += (uint64_t)r->usage.translated;
  r->d->outcomes[kvld_outcome_of(&r->usage)]++;
  int fi = r->finish == KVLD_FIN_STOP ? 0 : r->finish == KVLD_FIN_LENGTH ? 1 : r->finish == KVLD_FIN_CANCELLED ? 2 : 3;
  m->mx.success[fi]++;
  kvld_hist_observe(&m->mx.e2e, now - r->t_arrival);
  kvld_hist_observe(&m->mx.queue, r->queue_s);
  if (m->mx.running > 0) m->mx.running--;
  kvld_log(KVLD_INFO, "request_done",
           "\"request\":%llu,\"request_id\":\"%s\",\"model\":\"%s\",\"finish\":\"%s\",\"prompt_tokens\":%d,"
           "\"cached_tokens\":%d,\"translated_tokens\":%d,\"prefilled_tokens\":%d,\"generated_tokens\":%d,"
           "\"translation\":\"%s\",\"route\":\"%s/%s\",\"ttft_s\":%.4f,\"e2e_s\":%.4f",
           (unsigned long long)r->id, r->p.request_id, m->name, kvld_finish_name(r->finish), r->usage.prompt_tokens,
           r->usage.cached_native + r->usage.cached_translated, r->usage.translated, r->usage.prefilled, r->generated,
           kvld_outcome_name(kvld_outcome_of(&r->usage)), r->p.route.policy, r->p.route.decision,
           r->t_first > 0 ? r->t_first - r->t_arrival : -1.0, now - r->t_arrival);
}

/* Which model produced this token: a change is the cascade's handoff, reported with the
 * window that caused it. */
static void note_model(struct kvld_req *r, const struct kvl_token_event *tok) {
  struct kvld *d = r->d;
  if (r->ent && r->w_ent > 0) r->ent[r->n_ent++ % r->w_ent] = tok->entropy;
  if (tok->model == d->models[r->cur_model].sched_id) return;
  int to = -1;
  for (int i = 0; i < d->n_models && to < 0; i++)
    if (d->models[i].m && d->models[i].active && d->models[i].sched_id == tok->model) to = i;
  if (to < 0) return;
  struct kvld_route *rt = &r->p.route;
  rt->from_model = r->cur_model;
  rt->handoff_token = r->generated;
  double mean = 0;
  int n = r->n_ent - 1 < r->w_ent ? r->n_ent - 1 : r->w_ent; /* the window before this token */
  for (int i = 0; i < n; i++) mean += r->ent[(r->n_ent - 2 - i + r->w_ent * 2) % r->w_ent];
  if (n > 0) mean /= n;
  snprintf(rt->decision, sizeof(rt->decision), "escalated");
  snprintf(rt->reason, sizeof(rt->reason), "%s handed over to %s at token %d: mean entropy %.3g nats over the last %d tokens",
           d->models[r->cur_model].name, d->models[to].name, r->generated, mean, n);
  d->handoffs[r->cur_model][to]++;
  kvld_route_count(d, rt->policy, "escalated");
  kvld_log(KVLD_INFO, "handoff", "\"request\":%llu,\"from\":\"%s\",\"to\":\"%s\",\"token\":%d,\"mean_entropy\":%.4f",
           (unsigned long long)r->id, d->models[r->cur_model].name, d->models[to].name, r->generated, mean);
  r->cur_model = to;
}

static void on_event(void *ud, const struct kvl_engine_event *ev) {
  struct kvld_req *r = ud;
  struct kvld_model *m = &r->d->models[r->p.model];
  double now = kvld_now();
  if (ev->tok.token >= 0) note_model(r, &ev->tok);
  if (ev->tok.token >= 0 && r->p.conversation[0]) { /* what the kept line holds */
    if (r->n_sampled == r->cap_sampled) {
      int cap = r->cap_sampled ? r->cap_sampled * 2 : 64;
      int32_t *g = realloc(r->sampled, (size_t)cap * sizeof(int32_t));
      if (g) { r->sampled = g; r->cap_sampled = cap; }
    }
    if (r->n_sampled < r->cap_sampled) r->sampled[r->n_sampled++] = ev->tok.token;
  }
  if (ev->tok.token >= 0 && !r->stop_hit) {
    if (r->generated == 0) {
      r->t_first = now;
      kvld_hist_observe(&m->mx.ttft, now - r->t_arrival);
      r->queue_s = ev->tok.queue_ms / 1e3;
    } else
      kvld_hist_observe(&m->mx.itl, now - r->t_last);
    r->t_last = now;
    r->generated++;
    char *out = NULL;
    size_t len = 0;
    /* with ignore_eos an end token is generated like any other (its text is a special,
     * never emitted): keep it away from the detokenizer, which would end the text */
    enum kvl_finish f = r->p.ignore_eos && kvl_tokenizer_is_eog(m->tk, ev->tok.token)
                            ? KVL_FINISH_NONE
                            : kvl_detok_push(r->detok, ev->tok.token, &out, &len);
    append_text(r, out, len);
    free(out);
    bool eog = f == KVL_FINISH_STOP;
    /* an end token or stop id is not part of the output; a stop string's token is */
    bool stop_id = false;
    for (int i = 0; i < r->p.n_stop_ids; i++) stop_id |= r->p.stop_ids[i] == ev->tok.token;
    if (!stop_id) append_id(r, ev->tok.token, ev->tok.logprob);
    if (eog && !ev->tok.final) {
      r->stop_hit = true; /* a stop string: end the request now */
      r->finish = KVLD_FIN_STOP;
      kvl_engine_cancel(r->d->engine, r->engine_id);
    }
  }
  if (ev->tok.final) {
    r->engine_final = true;
    r->usage = ev->tok.usage;
    if (!r->stop_hit) {
      switch (ev->tok.finish) {
      case KVL_DONE_STOP: r->finish = KVLD_FIN_STOP; break;
      case KVL_DONE_LENGTH: r->finish = KVLD_FIN_LENGTH; break;
      case KVL_DONE_CANCELLED: r->finish = KVLD_FIN_CANCELLED; break;
      default: r->finish = KVLD_FIN_ERROR; break;
      }
      if (r->finish == KVLD_FIN_LENGTH) {
        char *out = NULL;
        size_t len = 0;
        kvl_detok_flush(r->detok, &out, &len);
        append_text(r, out, len);
        free(out);
      }
      if (ev->status != 0 && ev->status != KVL_ECANCELED) {
        r->status = ev->status == KVL_EINVAL ? KVLD_INVALID_ARGUMENT : KVLD_INTERNAL;
        snprintf(r->message, sizeof(r->message), "%s", ev->message ? ev->message : kvl_strerror(ev->status));
      }
    }
    r->usage.generated = r->generated;
    r->done = true;
    if (r->p.conversation[0] && r->finish != KVLD_FIN_ERROR)
      kvld_conv_remember(r->d, r->p.conversation, m, r->p.prompt, r->p.n_prompt, r->sampled, r->n_sampled);
    finish_metrics(r);
  }
  r->sink(r, r->sink_ud);
}

enum kvld_status kvld_req_start(struct kvld *d, struct kvld_gen_params *p, kvld_sink_fn sink, void *ud,
                                struct kvld_req **out, char *msg, size_t msglen) {
  *out = NULL;
  if (d->draining) {
    kvld_gen_params_free(p);
    return fail(msg, msglen, KVLD_UNAVAILABLE, "the server is shutting down");
  }
  if (d->in_flight >= d->cfg.max_concurrent) {
    kvld_gen_params_free(p);
    return fail(msg, msglen, KVLD_RESOURCE_EXHAUSTED, "%d requests in flight, the limit", d->in_flight);
  }
  struct kvld_req *r = calloc(1, sizeof(*r));
  if (!r) {
    kvld_gen_params_free(p);
    return fail(msg, msglen, KVLD_RESOURCE_EXHAUSTED, "out of memory");
  }
  r->d = d;
  r->p = *p;
  memset(p, 0, sizeof(*p));
  r->id = ++d->next_request;
  r->sink = sink;
  r->sink_ud = ud;
  r->t_arrival = kvld_now();
  /* a model's own translated blocks are its line too: reuse them (usage says which) */
  struct kvl_request q = {.model = d->models[r->p.model].sched_id, .prompt = r->p.prompt, .n_prompt = r->p.n_prompt,
                          .max_tokens = r->p.max_tokens, .sampling = r->p.sampling,
                          .stop_ids = r->p.stop_ids, .n_stop_ids = r->p.n_stop_ids, .reuse = KVL_REUSE_ANY};
  q.sampling.bias = r->p.bias;
  q.native_tail = d->cfg.translate_native_tail;
  q.native_head = d->cfg.translate_native_head;
  q.warm_head = d->cfg.translate_warm_head;
  kvld_route(d, &r->p, &q);
  if (r->p.reprefill) {
    q.no_translate = true;
    q.reuse = KVL_REUSE_NATIVE_ONLY;
  }
  struct kvld_model *m = &d->models[r->p.model];
  r->cur_model = r->p.model; /* prefill_on: the first token already comes from it */
  if (q.cascade.on && (r->ent = calloc((size_t)q.cascade.window, sizeof(float)))) r->w_ent = q.cascade.window;
  r->detok = kvl_detok_new(m->tk, (const char *const *)r->p.stops);
  char err[512];
  int rc = r->detok ? kvl_engine_submit(d->engine, &q, on_event, r, &r->engine_id, err, sizeof(err)) : KVL_ENOMEM;
  if (rc < 0) {
    kvl_detok_free(r->detok);
    kvld_gen_params_free(&r->p);
    free(r->ent);
    free(r);
    return fail(msg, msglen, rc == KVL_EINVAL ? KVLD_INVALID_ARGUMENT : KVLD_UNAVAILABLE, "%s",
                rc == KVL_ENOMEM ? "out of memory" : err);
  }
  r->submitted = true;
  d->in_flight++;
  m->mx.running++;
  kvld_log(KVLD_DEBUG, "request_start", "\"request\":%llu,\"request_id\":\"%s\",\"model\":\"%s\",\"prompt_tokens\":%d",
           (unsigned long long)r->id, r->p.request_id, m->name, (int)r->p.n_prompt);
  *out = r;
  return KVLD_OK;
}

void kvld_req_cancel(struct kvld_req *r) {
  if (r->done || r->stop_hit) return;
  kvl_engine_cancel(r->d->engine, r->engine_id);
}

void kvld_req_take(struct kvld_req *r, struct kvld_out *o) {
  *o = (struct kvld_out){r->text, r->text_len, r->ids, r->lps, r->n_ids};
  r->text = NULL;
  r->text_len = r->text_cap = 0;
  r->ids = NULL;
  r->lps = NULL;
  r->n_ids = r->cap_ids = 0;
}

void kvld_out_free(struct kvld_out *o) {
  free(o->text);
  free(o->ids);
  free(o->lps);
  memset(o, 0, sizeof(*o));
}

void kvld_req_release(struct kvld_req *r) {
  if (!r) return;
  r->d->in_flight--; /* counted from start to here: the drain waits for the answer to go out */
  kvl_detok_free(r->detok);
  kvld_gen_params_free(&r->p);
  free(r->ent);
  free(r->sampled);
  free(r->text);
  free(r->ids);
  free(r->lps);
  free(r);
}
