/* admin.c — loading and unloading models and translators while requests stream.
 *
 * Load: the file is opened (mmap, tokenizer, template) on a libuv worker thread, then
 * the engine adds the model to the scheduler between two steps (kvl_engine_run); only
 * then does its name resolve. Unload: the name stops resolving at once (new requests get
 * NOT_FOUND), the requests already running finish, then the engine removes the model
 * between two steps and its memory is released here. No request fails either way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "kvl_error.h"
#include "kvl_sched.h"

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
  kvld_log(KVLD_INFO, "model_loaded", "\"model\":\"%s\",\"file\":\"%s\",\"at_runtime\":true", m->name, m->path);
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
  kvld_model_sched_cfg(&op->d->models[op->slot], &op->cfg, &op->sm);
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
    if (d->translators[i].src == mi || d->translators[i].dst == mi) {
      kvl_translator_free(d->translators[i].t);
      d->translators[i] = d->translators[--d->n_translators];
    } else
      i++;
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

/* ---- translators -------------------------------------------------------------------- */

int kvld_translator_add(struct kvld *d, const char *path, char *err, size_t errlen) {
  if (d->n_translators == KVLD_MAX_TRANSLATORS)
    return kvl_errf(err, errlen, KVL_EFULL, "at most %d translators", KVLD_MAX_TRANSLATORS);
  struct kvld_translator *t = &d->translators[d->n_translators];
  snprintf(t->path, sizeof(t->path), "%s", path);
  int rc = kvl_translator_load(t->path, &t->t, err, errlen);
  if (rc < 0) return rc;
  t->src = t->dst = -1;
  struct kvl_model_fingerprint fp[KVLD_MAX_MODELS];
  for (int k = 0; k < d->n_models; k++)
    if (kvld_model_live(d, k)) kvl_fingerprint_from_gguf(kvl_model_gguf(d->models[k].m), &fp[k], err, errlen);
  char why[300] = "no two models loaded";
  for (int a = 0; a < d->n_models && t->src < 0; a++)
    for (int b = 0; b < d->n_models && t->src < 0; b++)
      if (a != b && kvld_model_live(d, a) && kvld_model_live(d, b)) {
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
      kvl_translator_free(d->translators[i].t);
      d->translators[i] = *t;
      kvld_log(KVLD_INFO, "translator_replaced", "\"file\":\"%s\"", path);
      return i;
    }
  d->n_translators++;
  kvld_log(KVLD_INFO, "translator_loaded", "\"file\":\"%s\",\"source\":\"%s\",\"target\":\"%s\"", t->path,
           d->models[t->src].name, d->models[t->dst].name);
  return d->n_translators - 1;
}

int kvld_translator_remove(struct kvld *d, const char *source, const char *target, char *err, size_t errlen) {
  for (int i = 0; i < d->n_translators; i++) {
    struct kvld_translator *t = &d->translators[i];
    if (!strcmp(d->models[t->src].name, source) && !strcmp(d->models[t->dst].name, target)) {
      kvl_translator_free(t->t);
      d->translators[i] = d->translators[--d->n_translators];
      return 0;
    }
  }
  return kvl_errf(err, errlen, KVL_ENOENT, "no translator from '%s' to '%s' is loaded", source, target);
}
