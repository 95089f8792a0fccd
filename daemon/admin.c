/* admin.c — loading and unloading models and translators while requests stream.
 *
 * Load: the file is opened (mmap, tokenizer, template) on a libuv worker thread, then
 * the engine adds the model to the scheduler between two steps (kvl_engine_run); only
 * then does its name resolve. Unload: the name stops resolving at once (new requests get
 * NOT_FOUND), the requests already running finish, then the engine removes the model
 * between two steps and its memory is released here. No request fails either way. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "daemon.h"
#include "kvl_error.h"
#include "kvl_sched.h"

static void translator_drop(struct kvld *d, int i);

bool kvld_model_live(const struct kvld *d, int i) {
  return i >= 0 && i < d->n_models && d->models[i].m && d->models[i].active && !d->models[i].unloading;
}

struct load_op {
  uv_work_t work;
  struct kvld *d;
  int slot;
  struct kvld_model_cfg cfg;
  char err[512];
  int rc;
  struct kvl_sched_model sm;
  kvld_admin_reply reply;
  void *ctx;
};

/* Worker thread: everything that touches only the new model. */
static void load_work(uv_work_t *w) {
  struct load_op *op = w->data;
  struct kvld_model *m = &op->d->models[op->slot];
  op->rc = kvld_model_open(m, &op->cfg, op->err, sizeof(op->err));
}

static int add_in_engine(kvl_sched_t *s, void *arg) {
  struct load_op *op = arg;
  return kvl_sched_add_model(s, &op->sm, &op->d->models[op->slot].sched_id, op->err, sizeof(op->err));
}

static void load_failed(struct load_op *op, enum kvld_status st) {
  struct kvld_model *m = &op->d->models[op->slot];
  kvld_model_close(m);
  m->reserved = false;
  kvld_log(KVLD_WARN, "model_load_failed", "\"model\":\"%s\",\"error\":\"%s\"", op->cfg.name, op->err);
  op->reply(op->ctx, st, op->err, NULL);
  free(op);
}

static void added(void *arg, int rc) {
  struct load_op *op = arg;
  struct kvld_model *m = &op->d->models[op->slot];
  if (rc < 0) {
    load_failed(op, KVLD_RESOURCE_EXHAUSTED);
    return;
  }
  m->active = true;
  m->reserved = false;
  kvld_log(KVLD_INFO, "model_loaded", "\"model\":\"%s\",\"file\":\"%s\",\"at_runtime\":true,\"repacked_mib\":%.1f", m->name,
           m->path, (double)m->repacked_bytes / (1 << 20));
  op->reply(op->ctx, KVLD_OK, NULL, m);
  free(op);
}

static void load_after(uv_work_t *w, int status) {
  struct load_op *op = w->data;
  if (status < 0 || op->rc < 0) {
    if (status < 0) snprintf(op->err, sizeof(op->err), "load cancelled");
    load_failed(op, op->rc == KVL_ENOENT ? KVLD_NOT_FOUND : KVLD_INVALID_ARGUMENT);
    return;
  }
  /* no prefault: the pool is made on the compute thread, and faulting a GiB in there would
   * stall every running request for a second or more; its pages fault in as used */
  kvld_model_sched_cfg(&op->d->models[op->slot], &op->cfg, false, &op->sm);
  if (op->d->draining || kvl_engine_run(op->d->engine, add_in_engine, added, op) < 0) {
    snprintf(op->err, sizeof(op->err), "the server is shutting down");
    load_failed(op, KVLD_UNAVAILABLE);
  }
}

void kvld_admin_load_model(struct kvld *d, const char *name, const char *path, kvld_admin_reply reply, void *ctx) {
  char msg[300];
  if (!name || !*name || strlen(name) >= sizeof(d->models[0].name) || !strcmp(name, "auto")) {
    reply(ctx, KVLD_INVALID_ARGUMENT, "a model needs a name (not 'auto', under 64 bytes)", NULL);
    return;
  }
  if (!path || !*path) {
    reply(ctx, KVLD_INVALID_ARGUMENT, "a model needs a path", NULL);
    return;
  }
  int slot = -1;
  for (int i = 0; i < d->n_models; i++) {
    struct kvld_model *m = &d->models[i];
    if ((m->active || m->reserved) && !strcmp(m->name, name)) {
      snprintf(msg, sizeof(msg), "a model named '%s' is %s", name, m->unloading ? "still unloading" : "loaded");
      reply(ctx, KVLD_FAILED_PRECONDITION, msg, NULL);
      return;
    }
    if (slot < 0 && !m->active && !m->reserved && !m->m) slot = i;
  }
  if (slot < 0) {
    if (d->n_models == KVLD_MAX_MODELS) {
      reply(ctx, KVLD_RESOURCE_EXHAUSTED, "no room for another model (at most 8)", NULL);
      return;
    }
    slot = d->n_models++;
  }
  struct load_op *op = calloc(1, sizeof(*op));
  if (!op) {
    reply(ctx, KVLD_RESOURCE_EXHAUSTED, "out of memory", NULL);
    return;
  }
  op->d = d;
  op->slot = slot;
  op->reply = reply;
  op->ctx = ctx;
  op->work.data = op;
  kvld_model_cfg_default(&op->cfg);
  snprintf(op->cfg.name, sizeof(op->cfg.name), "%s", name);
  snprintf(op->cfg.path, sizeof(op->cfg.path), "%s", path);
  struct kvld_model *m = &d->models[slot];
  memset(m, 0, sizeof(*m));
  snprintf(m->name, sizeof(m->name), "%s", name);
  m->reserved = true;
  uv_queue_work(d->loop, &op->work, load_work, load_after);
}

/* ---- unload ------------------------------------------------------------------------- */

struct unload_op {
  struct kvld *d;
  int slot;
  uv_timer_t timer;
  char err[256];
  kvld_admin_reply reply;
  void *ctx;
};

static void unload_timer_closed(uv_handle_t *h) { free(h->data); }

static int remove_in_engine(kvl_sched_t *s, void *arg) {
  struct unload_op *op = arg;
  return kvl_sched_remove_model(s, op->d->models[op->slot].sched_id, op->err, sizeof(op->err));
}

static void wait_idle(uv_timer_t *t);

static void removed(void *arg, int rc) {
  struct unload_op *op = arg;
  struct kvld_model *m = &op->d->models[op->slot];
  if (rc == KVL_EBUSY) { /* a request got in between: wait again */
    uv_timer_start(&op->timer, wait_idle, 50, 0);
    return;
  }
  kvld_log(KVLD_INFO, "model_unloaded", "\"model\":\"%s\"", m->name);
  kvld_model_close(m);
  memset(m, 0, sizeof(*m));
  op->reply(op->ctx, rc < 0 ? KVLD_INTERNAL : KVLD_OK, rc < 0 ? op->err : NULL, NULL);
  uv_close((uv_handle_t *)&op->timer, unload_timer_closed);
}

static void wait_idle(uv_timer_t *t) {
  struct unload_op *op = t->data;
  if (op->d->models[op->slot].mx.running > 0) {
    uv_timer_start(t, wait_idle, 50, 0);
    return;
  }
  if (kvl_engine_run(op->d->engine, remove_in_engine, removed, op) < 0) {
    op->reply(op->ctx, KVLD_UNAVAILABLE, "the server is shutting down", NULL);
    uv_close((uv_handle_t *)&op->timer, unload_timer_closed);
  }
}

void kvld_admin_unload_model(struct kvld *d, const char *name, kvld_admin_reply reply, void *ctx) {
  char msg[300];
  int mi = -1;
  for (int i = 0; i < d->n_models; i++)
    if (kvld_model_live(d, i) && !strcmp(d->models[i].name, name ? name : "")) mi = i;
  if (mi < 0) {
    snprintf(msg, sizeof(msg), "no model named '%s' is loaded", name ? name : "");
    reply(ctx, KVLD_NOT_FOUND, msg, NULL);
    return;
  }
  if (!strcmp(d->cfg.default_model, name)) {
    int other = -1;
    for (int i = 0; i < d->n_models && other < 0; i++)
      if (i != mi && kvld_model_live(d, i)) other = i;
    if (other < 0) {
      reply(ctx, KVLD_FAILED_PRECONDITION, "it is the only model: load another one first", NULL);
      return;
    }
    snprintf(d->cfg.default_model, sizeof(d->cfg.default_model), "%s", d->models[other].name);
  }
  d->models[mi].unloading = true; /* the name stops resolving now */
  /* translators to or from it go with it */
  for (int i = 0; i < d->n_translators;) {
    if (d->translators[i].src == mi || d->translators[i].dst == mi) translator_drop(d, i);
    else i++;
  }
  struct unload_op *op = calloc(1, sizeof(*op));
  if (!op) {
    reply(ctx, KVLD_RESOURCE_EXHAUSTED, "out of memory", NULL);
    return;
  }
  op->d = d;
  op->slot = mi;
  op->reply = reply;
  op->ctx = ctx;
  uv_timer_init(d->loop, &op->timer);
  op->timer.data = op;
  uv_timer_start(&op->timer, wait_idle, 0, 0);
}

/* ---- translators --------------------------------------------------------------------
 * The daemon owns the translator objects, the scheduler borrows them: registration and
 * removal happen on the compute thread between two steps (kvl_engine_run) and a
 * translator the scheduler let go of is freed only afterwards, on the loop thread. */

/* The worst held-out KL the file records (kvlingo.scores: {"<domain>": {"kl": {"mean": x}}}),
 * or -1 when it records none. */
static double heldout_kl(const kvl_translator_t *t) {
  const char *js = kvl_translator_scores_json(t);
  if (!js) return -1;
  json_t *j = json_loads(js, 0, NULL);
  double worst = -1;
  const char *k;
  json_t *v;
  json_object_foreach(j, k, v) {
    json_t *kl = json_object_get(json_object_get(v, "kl"), "mean");
    if (json_is_number(kl) && json_number_value(kl) > worst) worst = json_number_value(kl);
  }
  json_decref(j);
  return worst;
}

struct xlat_op {
  struct kvld *d;
  int src, dst;                 /* scheduler model ids */
  kvl_translator_t *t;          /* to register (NULL: remove the pair's) */
  struct kvl_translator_gate gate;
  kvl_translator_t *old;        /* freed once the scheduler no longer holds it */
  char err[256];
};

static int xlat_in_engine(kvl_sched_t *s, void *arg) {
  struct xlat_op *op = arg;
  if (!op->t) return kvl_sched_remove_translator(s, op->src, op->dst);
  return kvl_sched_add_translator(s, op->src, op->dst, op->t, &op->gate, op->err, sizeof(op->err));
}

static void xlat_done(void *arg, int rc) {
  struct xlat_op *op = arg;
  if (rc < 0 && op->t) kvld_log(KVLD_WARN, "translator_not_registered", "\"error\":\"%s\"", op->err);
  kvl_translator_free(op->old);
  free(op);
}

/* Hand the pair (daemon model indices) to the scheduler: t registered (NULL: removed);
 * `old` freed when the scheduler is done with it. Before the engine starts, directly. */
static void xlat_sync(struct kvld *d, int src, int dst, kvl_translator_t *t, kvl_translator_t *old) {
  struct xlat_op *op = calloc(1, sizeof(*op));
  if (!op) { /* cannot tell the scheduler: leak `old` rather than free what it may use */
    kvld_log(KVLD_ERROR, "translator_sync_failed", "\"error\":\"out of memory\"");
    return;
  }
  *op = (struct xlat_op){.d = d, .src = d->models[src].sched_id, .dst = d->models[dst].sched_id, .t = t, .old = old};
  op->gate.shadow_fraction = d->cfg.gate.shadow_fraction;
  op->gate.max_kl = d->cfg.gate.max_online_kl;
  op->gate.min_shadows = d->cfg.gate.min_shadows;
  if (t) {
    double kl = heldout_kl(t);
    op->gate.off = d->cfg.gate.max_heldout_kl > 0 && kl > d->cfg.gate.max_heldout_kl;
    if (op->gate.off)
      kvld_log(KVLD_WARN, "translator_gated", "\"source\":\"%s\",\"target\":\"%s\",\"heldout_kl\":%.4g,\"bar\":%.4g",
               d->models[src].name, d->models[dst].name, kl, d->cfg.gate.max_heldout_kl);
  }
  if (d->boot_sched) { /* the engine is not running yet */
    xlat_done(op, xlat_in_engine(d->boot_sched, op));
    return;
  }
  if (!d->engine || kvl_engine_run(d->engine, xlat_in_engine, xlat_done, op) < 0) {
    kvl_translator_free(old); /* the engine is gone: nothing uses it any more */
    free(op);
  }
}

/* The precision probe (kvl_translator_pick_precision) runs OpenMP regions, and oneDNN's.
 * Run on the loop thread, it left a second OpenMP team beside the compute thread's for the
 * daemon's life: libgomp then counted 4 threads on 2 cores, spun only briefly before
 * sleeping, and every parallel region of every forward paid futex wake-ups — a 32-token
 * prefill of the 0.5B took 93-147 ms in the daemon against 72-79 with the probe off
 * (translation_precision: fp32). On a thread of its own, the team goes with the thread. */
struct probe {
  kvl_translator_t *t;
  double ms_fp32, ms_bf16;
  int rc;
  char why[256];
};

static void *probe_main(void *arg) {
  struct probe *p = arg;
  p->rc = kvl_translator_pick_precision(p->t, &p->ms_fp32, &p->ms_bf16, p->why, sizeof(p->why));
  return NULL;
}

static int pick_precision(kvl_translator_t *t, double *ms_fp32, double *ms_bf16, char *why, size_t whylen) {
  struct probe p = {.t = t};
  pthread_t th;
  if (pthread_create(&th, NULL, probe_main, &p) == 0) pthread_join(th, NULL);
  else probe_main(&p); /* no thread to spare: here, at the cost above */
  *ms_fp32 = p.ms_fp32;
  *ms_bf16 = p.ms_bf16;
  snprintf(why, whylen, "%s", p.why);
  return p.rc;
}

int kvld_translator_add(struct kvld *d, const char *path, char *err, size_t errlen) {
  if (d->n_translators == KVLD_MAX_TRANSLATORS)
    return kvl_errf(err, errlen, KVL_EFULL, "at most %d translators", KVLD_MAX_TRANSLATORS);
  struct kvld_translator *t = &d->translators[d->n_translators];
  snprintf(t->path, sizeof(t->path), "%s", path);
  int rc = kvl_translator_load(t->path, &t->t, err, errlen);
  if (rc < 0) return rc;
  double ms_fp32 = 0, ms_bf16 = 0; /* the auto probe's times */
  if (strcmp(d->cfg.translation_precision, "fp32") != 0) {
    char why[256];
    int pr = !strcmp(d->cfg.translation_precision, "auto")
                 ? pick_precision(t->t, &ms_fp32, &ms_bf16, why, sizeof(why))
                 : kvl_translator_use_bf16(t->t, true, why, sizeof(why));
    if (pr == KVL_ENOMEM || (pr < 0 && !strcmp(d->cfg.translation_precision, "bf16"))) {
      kvl_translator_free(t->t);
      return kvl_errf(err, errlen, pr, "translator %s: translation_precision %s: %s", path,
                      d->cfg.translation_precision, why);
    }
  }
  t->src = t->dst = -1;
  struct kvl_model_fingerprint fp[KVLD_MAX_MODELS];
  for (int k = 0; k < d->n_models; k++)
    if (kvld_model_live(d, k)) kvl_fingerprint_from_gguf(kvl_model_gguf(d->models[k].m), &fp[k], err, errlen);
  char why[300] = "no two models loaded";
  /* the first pair it fits that has no translator yet, else the first pair it fits (the
   * newer one replaces): models of one layout (copies, fine-tunes) get both directions
   * from one file listed twice */
  for (int pass = 0; pass < 2 && t->src < 0; pass++)
    for (int a = 0; a < d->n_models && t->src < 0; a++)
      for (int b = 0; b < d->n_models && t->src < 0; b++) {
        if (a == b || !kvld_model_live(d, a) || !kvld_model_live(d, b)) continue;
        bool taken = false;
        for (int i = 0; i < d->n_translators; i++) taken |= d->translators[i].src == a && d->translators[i].dst == b;
        if (pass == 0 && taken) continue;
        if (kvl_translator_check_models(t->t, &fp[a], &fp[b], why, sizeof(why)) == 0) {
          t->src = a;
          t->dst = b;
        }
      }
  if (t->src < 0) {
    kvl_translator_free(t->t);
    return kvl_errf(err, errlen, KVL_EMISMATCH, "translator %s fits no pair of the resident models (%s)", path, why);
  }
  for (int i = 0; i < d->n_translators; i++)
    if (d->translators[i].src == t->src && d->translators[i].dst == t->dst) { /* the newer serves the pair */
      kvl_translator_t *old = d->translators[i].t;
      d->translators[i] = *t;
      xlat_sync(d, t->src, t->dst, t->t, old);
      kvld_log(KVLD_INFO, "translator_replaced", "\"file\":\"%s\"", path);
      return i;
    }
  d->n_translators++;
  xlat_sync(d, t->src, t->dst, t->t, NULL);
  /* translations run on the target's backend: a device one (cuda) multiplies in bf16 */
  const bool on_device = kvl_backend_can_translate(d->models[t->dst].be);
  kvld_log(KVLD_INFO, "translator_loaded",
           "\"file\":\"%s\",\"source\":\"%s\",\"target\":\"%s\",\"precision\":\"%s\",\"probe_ms_fp32\":%.3f,"
           "\"probe_ms_bf16\":%.3f,\"backend\":\"%s\"",
           t->path, d->models[t->src].name, d->models[t->dst].name,
           on_device || kvl_translator_is_bf16(t->t) ? "bf16" : "fp32", ms_fp32, ms_bf16,
           on_device ? "cuda" : "cpu");
  return d->n_translators - 1;
}

/* Forget translator i: the scheduler lets go of it first, then it is freed. */
static void translator_drop(struct kvld *d, int i) {
  struct kvld_translator t = d->translators[i];
  d->translators[i] = d->translators[--d->n_translators];
  xlat_sync(d, t.src, t.dst, NULL, t.t);
}

int kvld_translator_remove(struct kvld *d, const char *source, const char *target, char *err, size_t errlen) {
  for (int i = 0; i < d->n_translators; i++) {
    struct kvld_translator *t = &d->translators[i];
    if (!strcmp(d->models[t->src].name, source) && !strcmp(d->models[t->dst].name, target)) {
      translator_drop(d, i);
      return 0;
    }
  }
  return kvl_errf(err, errlen, KVL_ENOENT, "no translator from '%s' to '%s' is loaded", source, target);
}
