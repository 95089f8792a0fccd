/* grpc.c — the gRPC front end on gRPC C core (../shared/GRPC-NOTES.md): one completion
 * queue polled by a dedicated thread that hands {tag, ok} to the libuv loop; every call
 * is then driven on the loop thread. One SEND_MESSAGE in flight per stream (tokens that
 * arrive meanwhile are coalesced into the next message); RECV_CLOSE_ON_SERVER tells a
 * cancelled call or a passed deadline, which cancels the request at once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <jansson.h>

#include "daemon.h"
#include "health.pb-c.h"
#include "kvl_error.h"
#include "kvlingo.pb-c.h"

enum method {
  M_GENERATE, M_COMPLETE, M_TOKENIZE, M_DETOKENIZE, M_LIST_MODELS, M_SERVER_INFO,
  M_LOAD_MODEL, M_UNLOAD_MODEL, M_LOAD_TRANSLATOR, M_UNLOAD_TRANSLATOR, M_HEALTH_CHECK, M_HEALTH_WATCH,
  M_COUNT, M_GENERIC = M_COUNT
};

static const char *const method_path[M_COUNT] = {
  "/kvlingo.v1.Inference/Generate", "/kvlingo.v1.Inference/Complete", "/kvlingo.v1.Inference/Tokenize",
  "/kvlingo.v1.Inference/Detokenize", "/kvlingo.v1.Inference/ListModels", "/kvlingo.v1.Inference/ServerInfo",
  "/kvlingo.v1.Admin/LoadModel", "/kvlingo.v1.Admin/UnloadModel", "/kvlingo.v1.Admin/LoadTranslator",
  "/kvlingo.v1.Admin/UnloadTranslator", "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
};

struct call;
struct tag {
  void (*fn)(struct call *c, int ok);
  struct call *c;
};

struct kvld_grpc {
  struct kvld *d;
  grpc_server *server;
  grpc_completion_queue *cq;
  void *handle[M_COUNT];
  uv_thread_t thread;
  uv_async_t async;
  uv_mutex_t mu;
  struct { void *tag; int ok; } *q;
  int qn, qcap;
  bool shutdown;            /* no new calls requested */
  struct tag t_shutdown;
  void (*shutdown_cb)(struct kvld *d);
  int live_calls;
  int active;               /* calls started and not yet freed */
  uv_timer_t grace;         /* after shutdown_and_notify: then cancel what is left */
  bool grace_on;
};

struct call {
  struct kvld_grpc *g;
  enum method m;
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array md;
  grpc_byte_buffer *payload;
  grpc_call_details details;
  struct tag t_new, t_close, t_send, t_status;
  int cancelled;             /* RECV_CLOSE_ON_SERVER result */
  int pending;               /* batches in flight */
  bool started, md_sent, send_busy, final_sent, status_sent, closed;
  bool admin_busy;           /* an admin operation will answer later */
  grpc_byte_buffer *out;
  struct kvld_req *req;
  uv_timer_t deadline_timer;
  bool timer_on;
  /* Complete: the whole text */
  char *acc_text;
  size_t acc_len;
  int32_t *acc_ids;
  float *acc_lps;
  int acc_n;
  grpc_slice status_details;
};

static void request_call(struct kvld_grpc *g, enum method m);
static void call_maybe_free(struct call *c);

/* ---- the completion-queue thread ----------------------------------------------------- */

static void cq_thread(void *arg) {
  struct kvld_grpc *g = arg;
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type != GRPC_OP_COMPLETE) continue;
    uv_mutex_lock(&g->mu);
    if (g->qn == g->qcap) {
      int cap = g->qcap ? 2 * g->qcap : 64;
      void *nq = realloc(g->q, (size_t)cap * sizeof(*g->q));
      if (nq) {
        g->q = nq;
        g->qcap = cap;
      }
    }
    if (g->qn < g->qcap) {
      g->q[g->qn].tag = ev.tag;
      g->q[g->qn].ok = ev.success;
      g->qn++;
    }
    uv_mutex_unlock(&g->mu);
    uv_async_send(&g->async);
  }
}

static void on_async(uv_async_t *a) {
  struct kvld_grpc *g = a->data;
  for (;;) {
    uv_mutex_lock(&g->mu);
    int n = g->qn;
    void *batch = NULL;
    if (n) {
      batch = malloc((size_t)n * sizeof(*g->q));
      if (batch) memcpy(batch, g->q, (size_t)n * sizeof(*g->q));
      g->qn = 0;
    }
    uv_mutex_unlock(&g->mu);
    if (!n || !batch) return;
    struct { void *tag; int ok; } *ev = batch;
    for (int i = 0; i < n; i++) {
      struct tag *t = ev[i].tag;
      t->fn(t->c, ev[i].ok);
    }
    free(batch);
  }
}

/* ---- sending ------------------------------------------------------------------------- */

static grpc_byte_buffer *pack(const ProtobufCMessage *msg) {
  size_t n = protobuf_c_message_get_packed_size(msg);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *b = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return b;
}

static void start_batch(struct call *c, grpc_op *ops, size_t n, struct tag *t) {
  c->pending++;
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, t, NULL);
  if (e != GRPC_CALL_OK) {
    c->pending--;
    kvld_log(KVLD_ERROR, "grpc_batch_failed", "\"error\":%d,\"method\":\"%s\"", (int)e,
             c->m < M_COUNT ? method_path[c->m] : "generic");
  }
}

static void on_status_sent(struct call *c, int ok) {
  (void)ok;
  c->pending--;
  call_maybe_free(c);
}

/* Finish the call: optional last message, then the status. */
static void send_status(struct call *c, enum kvld_status st, const char *msg, const ProtobufCMessage *reply) {
  if (c->status_sent) return;
  c->status_sent = true;
  grpc_op ops[3];
  memset(ops, 0, sizeof(ops));
  size_t n = 0;
  if (!c->md_sent) {
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    c->md_sent = true;
  }
  if (reply) {
    c->out = pack(reply);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->out;
    n++;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = (grpc_status_code)st;
  c->status_details = grpc_slice_from_copied_string(msg ? msg : "");
  ops[n].data.send_status_from_server.status_details = &c->status_details;
  n++;
  start_batch(c, ops, n, &c->t_status);
  if (st != KVLD_OK)
    kvld_log(KVLD_INFO, "grpc_error", "\"method\":\"%s\",\"code\":%d,\"message\":\"%s\"",
             c->m < M_COUNT ? method_path[c->m] : "unknown", (int)st, msg ? msg : "");
}

/* ---- Generate: the stream pump ------------------------------------------------------- */

static Kvlingo__V1__FinishReason finish_pb(enum kvld_finish f) {
  switch (f) {
  case KVLD_FIN_STOP: return KVLINGO__V1__FINISH_REASON__FINISH_REASON_STOP;
  case KVLD_FIN_LENGTH: return KVLINGO__V1__FINISH_REASON__FINISH_REASON_LENGTH;
  case KVLD_FIN_CANCELLED: return KVLINGO__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
  case KVLD_FIN_ERROR: return KVLINGO__V1__FINISH_REASON__FINISH_REASON_ERROR;
  default: return KVLINGO__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
  }
}

/* The final message's usage, timings and routing (rt's strings point into r). */
static void fill_usage(const struct kvld_req *r, Kvlingo__V1__Usage *u, Kvlingo__V1__Timings *t,
                       Kvlingo__V1__Routing *rt) {
  u->prompt_tokens = (uint32_t)r->usage.prompt_tokens;
  u->cached_native_tokens = (uint32_t)r->usage.cached_native;
  u->cached_translated_tokens = (uint32_t)r->usage.cached_translated;
  u->translated_tokens = (uint32_t)r->usage.translated;
  u->prefilled_tokens = (uint32_t)r->usage.prefilled;
  u->generated_tokens = (uint32_t)r->generated;
  u->untranslatable_tokens = (uint32_t)r->usage.untranslatable;
  u->declined_tokens = (uint32_t)r->usage.declined;
  u->handoffs = (uint32_t)r->usage.handoffs;
  rt->policy = (char *)r->p.route.policy;
  rt->decision = (char *)r->p.route.decision;
  rt->reason = (char *)r->p.route.reason;
  rt->from_model = r->p.route.from_model >= 0 ? (char *)r->d->models[r->p.route.from_model].name : "";
  rt->handoff_token = r->p.route.handoff_token;
  t->queue_seconds = r->queue_s;
  t->time_to_first_token_seconds = r->t_first > 0 ? r->t_first - r->t_arrival : 0;
  t->total_seconds = kvld_now() - r->t_arrival;
  t->translation_seconds = r->usage.translate_ms / 1e3;
}

static void pump(struct call *c);

static void on_sent(struct call *c, int ok) {
  c->pending--;
  c->send_busy = false;
  if (c->out) grpc_byte_buffer_destroy(c->out);
  c->out = NULL;
  if (!ok && c->req && !c->req->done) kvld_req_cancel(c->req); /* the stream broke */
  pump(c);
  call_maybe_free(c);
}

/* Send what the request has produced. Never frees the call: its callers run call_maybe_free
 * afterwards (a cancelled call whose request ended is freed there). */
static void pump(struct call *c) {
  struct kvld_req *r = c->req;
  if (!r || c->send_busy || c->status_sent) return;
  if (c->cancelled) { /* nobody listens: wait for the request to end, then drop it */
    if (r->done) { /* the caller frees the call (call_maybe_free) once pump returns */
      kvld_req_release(r);
      c->req = NULL;
    }
    return;
  }
  if (c->final_sent) { /* the last message went out: the status follows */
    send_status(c, r->status, r->status ? r->message : NULL, NULL);
    kvld_req_release(r);
    c->req = NULL;
    return;
  }
  if (r->done && r->status != KVLD_OK && !c->md_sent) { /* refused before any output */
    send_status(c, r->status, r->message, NULL);
    kvld_req_release(r);
    c->req = NULL;
    return;
  }
  struct kvld_out o;
  kvld_req_take(r, &o);
  if (!o.len && !o.n && !r->done) return;
  Kvlingo__V1__GenerateResponse m = KVLINGO__V1__GENERATE_RESPONSE__INIT;
  Kvlingo__V1__Usage u = KVLINGO__V1__USAGE__INIT;
  Kvlingo__V1__Timings t = KVLINGO__V1__TIMINGS__INIT;
  Kvlingo__V1__Routing rt = KVLINGO__V1__ROUTING__INIT;
  m.model = r->d->models[r->cur_model].name;
  m.text = o.text ? o.text : "";
  m.n_token_ids = (size_t)o.n;
  m.token_ids = o.ids;
  if (r->p.logprobs) {
    m.n_logprobs = (size_t)o.n;
    m.logprobs = o.lps;
  }
  m.request_id = r->p.request_id;
  if (r->done) {
    m.finish_reason = finish_pb(r->finish);
    fill_usage(r, &u, &t, &rt);
    m.usage = &u;
    m.timings = &t;
    m.routing = &rt;
    m.replica = r->d->cfg.replica_id;
    m.translation = (Kvlingo__V1__TranslationOutcome)kvld_outcome_of(&r->usage);
    c->final_sent = true;
  }
  grpc_op ops[2];
  memset(ops, 0, sizeof(ops));
  size_t k = 0;
  if (!c->md_sent) {
    ops[k++].op = GRPC_OP_SEND_INITIAL_METADATA;
    c->md_sent = true;
  }
  c->out = pack(&m.base);
  ops[k].op = GRPC_OP_SEND_MESSAGE;
  ops[k].data.send_message.send_message = c->out;
  k++;
  kvld_out_free(&o);
  c->send_busy = true;
  start_batch(c, ops, k, &c->t_send);
}

static void generate_sink(struct kvld_req *r, void *ud) {
  (void)r;
  pump(ud);
  call_maybe_free(ud);
}

/* Complete: collect everything, answer once. */
static void complete_sink(struct kvld_req *r, void *ud) {
  struct call *c = ud;
  struct kvld_out o;
  kvld_req_take(r, &o);
  if (o.len) {
    c->acc_text = realloc(c->acc_text, c->acc_len + o.len + 1);
    memcpy(c->acc_text + c->acc_len, o.text, o.len);
    c->acc_len += o.len;
    c->acc_text[c->acc_len] = 0;
  }
  if (o.n) {
    c->acc_ids = realloc(c->acc_ids, (size_t)(c->acc_n + o.n) * sizeof(int32_t));
    c->acc_lps = realloc(c->acc_lps, (size_t)(c->acc_n + o.n) * sizeof(float));
    memcpy(c->acc_ids + c->acc_n, o.ids, (size_t)o.n * sizeof(int32_t));
    memcpy(c->acc_lps + c->acc_n, o.lps, (size_t)o.n * sizeof(float));
    c->acc_n += o.n;
  }
  kvld_out_free(&o);
  if (!r->done) return;
  if (!c->cancelled) {
    if (r->status != KVLD_OK)
      send_status(c, r->status, r->message, NULL);
    else {
      Kvlingo__V1__CompleteResponse m = KVLINGO__V1__COMPLETE_RESPONSE__INIT;
      Kvlingo__V1__Choice ch = KVLINGO__V1__CHOICE__INIT, *chs[1] = {&ch};
      Kvlingo__V1__Usage u = KVLINGO__V1__USAGE__INIT;
      Kvlingo__V1__Timings t = KVLINGO__V1__TIMINGS__INIT;
      Kvlingo__V1__Routing rt = KVLINGO__V1__ROUTING__INIT;
      m.model = r->d->models[r->cur_model].name;
      ch.text = c->acc_text ? c->acc_text : "";
      ch.n_token_ids = (size_t)c->acc_n;
      ch.token_ids = c->acc_ids;
      if (r->p.logprobs) {
        ch.n_logprobs = (size_t)c->acc_n;
        ch.logprobs = c->acc_lps;
      }
      ch.finish_reason = finish_pb(r->finish);
      m.n_choices = 1;
      m.choices = chs;
      fill_usage(r, &u, &t, &rt);
      m.usage = &u;
      m.timings = &t;
      m.routing = &rt;
      m.replica = r->d->cfg.replica_id;
      m.translation = (Kvlingo__V1__TranslationOutcome)kvld_outcome_of(&r->usage);
      m.request_id = r->p.request_id;
      send_status(c, KVLD_OK, NULL, &m.base);
    }
  }
  kvld_req_release(r);
  c->req = NULL;
  call_maybe_free(c);
}

/* ---- decoding requests ---------------------------------------------------------------- */

static bool read_payload(struct call *c, uint8_t **data, size_t *len) {
  *data = NULL;
  *len = 0;
  if (!c->payload) return true; /* no message at all: an empty request */
  grpc_byte_buffer_reader rd;
  if (!grpc_byte_buffer_reader_init(&rd, c->payload)) return false;
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  *len = GRPC_SLICE_LENGTH(s);
  *data = malloc(*len + 1);
  if (*data) memcpy(*data, GRPC_SLICE_START_PTR(s), *len);
  grpc_slice_unref(s);
  return *data != NULL;
}

static bool md_value(const grpc_metadata_array *md, const char *key, char *out, size_t outlen) {
  for (size_t i = 0; i < md->count; i++) {
    const grpc_metadata *m = &md->metadata[i];
    if (GRPC_SLICE_LENGTH(m->key) == strlen(key) && !memcmp(GRPC_SLICE_START_PTR(m->key), key, strlen(key))) {
      size_t n = GRPC_SLICE_LENGTH(m->value);
      if (n >= outlen) n = outlen - 1;
      memcpy(out, GRPC_SLICE_START_PTR(m->value), n);
      out[n] = 0;
      return true;
    }
  }
  return false;
}

/* Bearer token from `authorization`, compared in constant time. */
static bool token_ok(const grpc_metadata_array *md, const char *header, const char *want) {
  char v[512];
  if (!md_value(md, header, v, sizeof(v))) return false;
  const char *tok = !strncmp(v, "Bearer ", 7) ? v + 7 : v;
  size_t a = strlen(tok), b = strlen(want);
  unsigned diff = (unsigned)(a ^ b);
  for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned)(tok[i] ^ want[i]);
  return diff == 0;
}

/* Decode the request as `desc`; on failure answer INVALID_ARGUMENT naming the message and
 * return NULL. Free with protobuf_c_message_free_unpacked. */
static void *unpack(struct call *c, const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len) {
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, buf);
  if (!m) {
    char msg[160];
    snprintf(msg, sizeof(msg), "malformed %s (protobuf decoding failed)", desc->short_name);
    send_status(c, KVLD_INVALID_ARGUMENT, msg, NULL);
  }
  return m;
}

/* ---- method handlers -------------------------------------------------------------------- */

static void model_info(const struct kvld_model *m, Kvlingo__V1__ModelInfo *mi) {
  const struct kvl_model_hparams *hp = kvl_model_hparams(m->m);
  kvlingo__v1__model_info__init(mi);
  mi->name = (char *)m->name;
  mi->architecture = (char *)hp->arch;
  mi->n_layer = (uint32_t)hp->n_layer;
  mi->n_vocab = (uint32_t)hp->n_vocab;
  mi->max_model_len = (uint32_t)m->max_model_len;
  mi->file = (char *)m->path;
  mi->kv_dtype = (char *)m->kv_dtype;
}

static void translator_info(const struct kvld *d, const struct kvld_translator *t, Kvlingo__V1__TranslatorInfo *ti) {
  struct kvl_translator_map km;
  kvl_translator_get_map(t->t, 0, KVL_TRANSLATOR_K, &km);
  kvlingo__v1__translator_info__init(ti);
  ti->source = (char *)d->models[t->src].name;
  ti->target = (char *)d->models[t->dst].name;
  ti->file = (char *)t->path;
  ti->nu = (uint32_t)km.nu;
  ti->affine = kvl_translator_affine(t->t);
  ti->fit_json = (char *)(kvl_translator_fit_json(t->t) ? kvl_translator_fit_json(t->t) : "");
  ti->scores_json = (char *)(kvl_translator_scores_json(t->t) ? kvl_translator_scores_json(t->t) : "");
}

/* An admin operation finished (loop thread): answer unless the client left. */
static void admin_reply(void *ctx, int status, const char *msg, struct kvld_model *m) {
  struct call *c = ctx;
  c->admin_busy = false;
  if (!c->cancelled) {
    if (status == KVLD_OK && c->m == M_LOAD_MODEL && m) {
      Kvlingo__V1__LoadModelResponse r = KVLINGO__V1__LOAD_MODEL_RESPONSE__INIT;
      Kvlingo__V1__ModelInfo mi;
      model_info(m, &mi);
      r.model = &mi;
      send_status(c, KVLD_OK, NULL, &r.base);
    } else if (status == KVLD_OK) {
      Kvlingo__V1__UnloadModelResponse r = KVLINGO__V1__UNLOAD_MODEL_RESPONSE__INIT;
      send_status(c, KVLD_OK, NULL, &r.base);
    } else
      send_status(c, (enum kvld_status)status, msg, NULL);
  }
  call_maybe_free(c);
}

static void handle_admin(struct call *c, const uint8_t *buf, size_t len) {
  struct kvld *d = c->g->d;
  char msg[600];
  switch (c->m) {
  case M_LOAD_MODEL: {
    Kvlingo__V1__LoadModelRequest *q = unpack(c, &kvlingo__v1__load_model_request__descriptor, buf, len);
    if (!q) return;
    c->admin_busy = true;
    kvld_admin_load_model(d, q->name, q->path, admin_reply, c);
    kvlingo__v1__load_model_request__free_unpacked(q, NULL);
    return;
  }
  case M_UNLOAD_MODEL: {
    Kvlingo__V1__UnloadModelRequest *q = unpack(c, &kvlingo__v1__unload_model_request__descriptor, buf, len);
    if (!q) return;
    c->admin_busy = true;
    kvld_admin_unload_model(d, q->name, admin_reply, c);
    kvlingo__v1__unload_model_request__free_unpacked(q, NULL);
    return;
  }
  case M_LOAD_TRANSLATOR: {
    Kvlingo__V1__LoadTranslatorRequest *q = unpack(c, &kvlingo__v1__load_translator_request__descriptor, buf, len);
    if (!q) return;
    int i = kvld_translator_add(d, q->path, msg, sizeof(msg));
    if (i < 0)
      send_status(c, i == KVL_EMISMATCH ? KVLD_FAILED_PRECONDITION : KVLD_INVALID_ARGUMENT, msg, NULL);
    else {
      Kvlingo__V1__LoadTranslatorResponse r = KVLINGO__V1__LOAD_TRANSLATOR_RESPONSE__INIT;
      Kvlingo__V1__TranslatorInfo ti;
      translator_info(d, &d->translators[i], &ti);
      r.translator = &ti;
      send_status(c, KVLD_OK, NULL, &r.base);
    }
    kvlingo__v1__load_translator_request__free_unpacked(q, NULL);
    return;
  }
  case M_UNLOAD_TRANSLATOR: {
    Kvlingo__V1__UnloadTranslatorRequest *q = unpack(c, &kvlingo__v1__unload_translator_request__descriptor, buf, len);
    if (!q) return;
    if (kvld_translator_remove(d, q->source, q->target, msg, sizeof(msg)) < 0)
      send_status(c, KVLD_NOT_FOUND, msg, NULL);
    else {
      Kvlingo__V1__UnloadTranslatorResponse r = KVLINGO__V1__UNLOAD_TRANSLATOR_RESPONSE__INIT;
      send_status(c, KVLD_OK, NULL, &r.base);
    }
    kvlingo__v1__unload_translator_request__free_unpacked(q, NULL);
    return;
  }
  default:
    send_status(c, KVLD_UNIMPLEMENTED, "not an admin method", NULL);
  }
}

static void handle(struct call *c) {
  struct kvld *d = c->g->d;
  char msg[512] = "";
  if (c->m == M_GENERIC) {
    char path[256];
    size_t n = GRPC_SLICE_LENGTH(c->details.method);
    if (n >= sizeof(path)) n = sizeof(path) - 1;
    memcpy(path, GRPC_SLICE_START_PTR(c->details.method), n);
    path[n] = 0;
    snprintf(msg, sizeof(msg), "unknown method %s", path);
    send_status(c, KVLD_UNIMPLEMENTED, msg, NULL);
    return;
  }
  bool admin = c->m >= M_LOAD_MODEL && c->m <= M_UNLOAD_TRANSLATOR, health = c->m >= M_HEALTH_CHECK;
  if (!health && !admin && d->cfg.auth_token[0] && !token_ok(&c->md, "authorization", d->cfg.auth_token)) {
    send_status(c, KVLD_UNAUTHENTICATED, "missing or wrong bearer token (metadata 'authorization: Bearer ...')", NULL);
    return;
  }
  if (admin) {
    if (!d->cfg.admin_token[0])
      send_status(c, KVLD_PERMISSION_DENIED, "the admin service is disabled (no admin_token configured)", NULL);
    else if (!token_ok(&c->md, "authorization", d->cfg.admin_token))
      send_status(c, KVLD_PERMISSION_DENIED, "admin calls need the admin token (metadata 'authorization: Bearer ...')",
                  NULL);
    else {
      uint8_t *adata;
      size_t alen;
      if (!read_payload(c, &adata, &alen)) {
        send_status(c, KVLD_INTERNAL, "could not read the request", NULL);
        return;
      }
      handle_admin(c, adata ? adata : (const uint8_t *)"", alen);
      free(adata);
    }
    return;
  }
  uint8_t *data;
  size_t len;
  if (!read_payload(c, &data, &len)) {
    send_status(c, KVLD_INTERNAL, "could not read the request", NULL);
    return;
  }
  const uint8_t *buf = data ? data : (const uint8_t *)"";
  switch (c->m) {
  case M_HEALTH_CHECK: {
    Grpc__Health__V1__HealthCheckRequest *q = unpack(c, &grpc__health__v1__health_check_request__descriptor, buf, len);
    if (!q) break;
    if (q->service[0] && strcmp(q->service, "kvlingo.v1.Inference") != 0) {
      char shown[96];
      kvld_escape(q->service, shown, sizeof(shown));
      snprintf(msg, sizeof(msg), "unknown service '%s'", shown);
      send_status(c, KVLD_NOT_FOUND, msg, NULL);
    } else {
      Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
      r.status = d->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                            : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
      send_status(c, KVLD_OK, NULL, &r.base);
    }
    grpc__health__v1__health_check_request__free_unpacked(q, NULL);
    break;
  }
  case M_HEALTH_WATCH:
    send_status(c, KVLD_UNIMPLEMENTED, "Health.Watch is not implemented: poll Health.Check", NULL);
    break;
  case M_GENERATE:
  case M_COMPLETE: {
    Kvlingo__V1__GenerateRequest *q = unpack(c, &kvlingo__v1__generate_request__descriptor, buf, len);
    if (!q) break;
    struct kvld_gen_params p;
    char conv_md[256] = "";
    md_value(&c->md, "x-kvlingo-conversation", conv_md, sizeof(conv_md));
    enum kvld_status st = kvld_pb_request(d, q, conv_md, &p, msg, sizeof(msg));
    kvlingo__v1__generate_request__free_unpacked(q, NULL);
    if (st == KVLD_OK)
      st = kvld_req_start(d, &p, c->m == M_GENERATE ? generate_sink : complete_sink, c, &c->req, msg, sizeof(msg));
    if (st != KVLD_OK) send_status(c, st, msg, NULL);
    break;
  }
  case M_TOKENIZE: {
    Kvlingo__V1__TokenizeRequest *q = unpack(c, &kvlingo__v1__tokenize_request__descriptor, buf, len);
    if (!q) break;
    struct kvld_gen_params p;
    memset(&p, 0, sizeof(p));
    json_t *chat = NULL;
    if (q->input_case == KVLINGO__V1__TOKENIZE_REQUEST__INPUT_CHAT) {
      chat = json_array();
      for (size_t i = 0; i < q->chat->n_messages; i++)
        json_array_append_new(chat, json_pack("{s:s,s:s}", "role", q->chat->messages[i]->role, "content",
                                              q->chat->messages[i]->content));
    }
    const char *text = q->input_case == KVLINGO__V1__TOKENIZE_REQUEST__INPUT_TEXT ? q->text : NULL;
    enum kvld_status st = kvld_prepare(d, q->model, text, text ? strlen(text) : 0, NULL, 0, chat,
                                       chat ? q->chat->continue_final_message : false, &p, msg, sizeof(msg));
    json_decref(chat);
    if (st == KVLD_OK || (st == KVLD_INVALID_ARGUMENT && p.prompt)) { /* over-long is fine here */
      Kvlingo__V1__TokenizeResponse r = KVLINGO__V1__TOKENIZE_RESPONSE__INIT;
      r.model = d->models[p.model].name;
      r.n_ids = (size_t)p.n_prompt;
      r.ids = p.prompt;
      send_status(c, KVLD_OK, NULL, &r.base);
    } else
      send_status(c, st, msg, NULL);
    kvld_gen_params_free(&p);
    kvlingo__v1__tokenize_request__free_unpacked(q, NULL);
    break;
  }
  case M_DETOKENIZE: {
    Kvlingo__V1__DetokenizeRequest *q = unpack(c, &kvlingo__v1__detokenize_request__descriptor, buf, len);
    if (!q) break;
    int mi = kvld_model_find(d, q->model);
    if (mi < 0) {
      char shown[96];
      kvld_escape(q->model, shown, sizeof(shown));
      snprintf(msg, sizeof(msg), "unknown model '%s'", shown);
      send_status(c, KVLD_NOT_FOUND, msg, NULL);
    } else {
      int nv = kvl_model_hparams(d->models[mi].m)->n_vocab;
      size_t bad = q->n_ids;
      for (size_t i = 0; i < q->n_ids && bad == q->n_ids; i++)
        if (q->ids[i] < 0 || q->ids[i] >= nv) bad = i;
      char *out = NULL;
      size_t olen = 0;
      if (bad != q->n_ids) {
        snprintf(msg, sizeof(msg), "token id %d at position %zu is outside the vocabulary [0, %d)", q->ids[bad], bad,
                 nv);
        send_status(c, KVLD_INVALID_ARGUMENT, msg, NULL);
      } else if (kvl_tokenizer_decode(d->models[mi].tk, q->ids, q->n_ids, q->skip_special, &out, &olen) < 0) {
        send_status(c, KVLD_INTERNAL, "detokenization failed", NULL);
      } else {
        /* protobuf strings must be UTF-8: repair a cut character */
        Kvlingo__V1__DetokenizeResponse r = KVLINGO__V1__DETOKENIZE_RESPONSE__INIT;
        r.model = d->models[mi].name;
        r.text = out;
        json_t *probe = json_stringn(out, olen);
        if (!probe) {
          for (size_t i = 0; i < olen; i++)
            if ((unsigned char)out[i] >= 0x80) out[i] = '?';
        }
        json_decref(probe);
        send_status(c, KVLD_OK, NULL, &r.base);
      }
      free(out);
    }
    kvlingo__v1__detokenize_request__free_unpacked(q, NULL);
    break;
  }
  case M_LIST_MODELS: {
    Kvlingo__V1__ListModelsResponse r = KVLINGO__V1__LIST_MODELS_RESPONSE__INIT;
    Kvlingo__V1__ModelInfo mi[KVLD_MAX_MODELS], *mp[KVLD_MAX_MODELS];
    Kvlingo__V1__TranslatorInfo ti[KVLD_MAX_TRANSLATORS], *tp[KVLD_MAX_TRANSLATORS];
    size_t nm = 0;
    for (int i = 0; i < d->n_models; i++) {
      if (!kvld_model_live(d, i)) continue;
      model_info(&d->models[i], &mi[nm]);
      mp[nm] = &mi[nm];
      nm++;
    }
    for (int i = 0; i < d->n_translators; i++) {
      translator_info(d, &d->translators[i], &ti[i]);
      tp[i] = &ti[i];
    }
    r.n_models = nm;
    r.models = mp;
    r.n_translators = (size_t)d->n_translators;
    r.translators = tp;
    send_status(c, KVLD_OK, NULL, &r.base);
    break;
  }
  case M_SERVER_INFO: {
    Kvlingo__V1__ServerInfoResponse r = KVLINGO__V1__SERVER_INFO_RESPONSE__INIT;
    Kvlingo__V1__ModelStats ms[KVLD_MAX_MODELS], *mp[KVLD_MAX_MODELS];
    size_t nm = 0;
    for (int i = 0; i < d->n_models; i++) {
      if (!kvld_model_live(d, i)) continue;
      struct kvl_sched_model_stats st = {0};
      kvl_engine_model_stats(d->engine, d->models[i].sched_id, &st);
      kvlingo__v1__model_stats__init(&ms[nm]);
      ms[nm].name = d->models[i].name;
      ms[nm].running = (uint32_t)st.running;
      ms[nm].waiting = (uint32_t)st.waiting;
      ms[nm].kv_cache_usage = st.kv_usage;
      mp[nm] = &ms[nm];
      nm++;
    }
    r.version = KVLD_VERSION;
    char backends[1024] = ""; /* the live models' backends, each named once */
    for (int i = 0; i < d->n_models; i++) {
      if (!kvld_model_live(d, i)) continue;
      const char *bn = kvl_backend_name(d->models[i].be ? d->models[i].be : kvl_backend_cpu());
      bool seen = false; /* by name, not as a substring of the list: one name may contain another */
      for (int j = 0; j < i && !seen; j++)
        seen = kvld_model_live(d, j) &&
               !strcmp(bn, kvl_backend_name(d->models[j].be ? d->models[j].be : kvl_backend_cpu()));
      if (seen) continue;
      size_t used = strlen(backends);
      snprintf(backends + used, sizeof(backends) - used, "%s%s", used ? "; " : "", bn);
    }
    r.backend = backends[0] ? backends : (char *)kvl_backend_name(kvl_backend_cpu());
    r.uptime_seconds = kvld_now() - d->t_start;
    r.n_models = nm;
    r.models = mp;
    send_status(c, KVLD_OK, NULL, &r.base);
    break;
  }
  default:
    send_status(c, KVLD_UNIMPLEMENTED, "not implemented", NULL);
  }
  free(data);
}

/* ---- call life ------------------------------------------------------------------------- */

static void deadline_closed(uv_handle_t *h) {
  struct call *c = h->data;
  c->timer_on = false;
  call_maybe_free(c);
}

static void call_maybe_free(struct call *c) {
  if (!c->started || c->pending > 0 || !c->closed || c->req || c->admin_busy) return;
  if (c->timer_on) {
    if (!uv_is_closing((uv_handle_t *)&c->deadline_timer)) uv_close((uv_handle_t *)&c->deadline_timer, deadline_closed);
    return;
  }
  struct kvld_grpc *g = c->g;
  if (c->out) grpc_byte_buffer_destroy(c->out);
  if (c->payload) grpc_byte_buffer_destroy(c->payload);
  grpc_metadata_array_destroy(&c->md);
  if (c->m == M_GENERIC) grpc_call_details_destroy(&c->details);
  grpc_slice_unref(c->status_details);
  grpc_call_unref(c->call);
  free(c->acc_text);
  free(c->acc_ids);
  free(c->acc_lps);
  free(c);
  g->live_calls--;
  g->active--;
}

static void on_close(struct call *c, int ok) {
  (void)ok;
  c->pending--;
  c->closed = true;
  if (c->cancelled && c->req) {
    kvld_log(KVLD_INFO, "grpc_cancelled", "\"request\":%llu", (unsigned long long)c->req->id);
    kvld_req_cancel(c->req);
    if (c->req->done) {
      kvld_req_release(c->req);
      c->req = NULL;
    }
  }
  call_maybe_free(c);
}

static void on_deadline(uv_timer_t *t) {
  struct call *c = t->data;
  if (c->req && !c->req->done) {
    kvld_req_cancel(c->req);
    c->cancelled = 1; /* the status below replaces whatever would have followed */
    send_status(c, KVLD_DEADLINE_EXCEEDED, "the server's default deadline passed", NULL);
  }
}

static void on_new(struct call *c, int ok) {
  struct kvld_grpc *g = c->g;
  if (!ok) { /* shutting down: the request tag came back empty */
    if (c->m == M_GENERIC) grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    free(c);
    g->live_calls--;
    return;
  }
  if (!g->shutdown) request_call(g, c->m);
  c->started = true;
  g->active++;
  grpc_op op;
  memset(&op, 0, sizeof(op));
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &c->cancelled;
  start_batch(c, &op, 1, &c->t_close);
  handle(c);
  if (c->req && g->d->cfg.default_deadline_s > 0 &&
      gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) == 0) {
    uv_timer_init(g->d->loop, &c->deadline_timer);
    c->deadline_timer.data = c;
    c->timer_on = true;
    uv_timer_start(&c->deadline_timer, on_deadline, (uint64_t)(g->d->cfg.default_deadline_s * 1e3), 0);
  }
  call_maybe_free(c);
}

static void request_call(struct kvld_grpc *g, enum method m) {
  struct call *c = calloc(1, sizeof(*c));
  if (!c) return;
  c->g = g;
  c->m = m;
  c->status_details = grpc_empty_slice();
  struct tag *tags[] = {&c->t_new, &c->t_close, &c->t_send, &c->t_status};
  void (*fns[])(struct call *, int) = {on_new, on_close, on_sent, on_status_sent};
  for (int i = 0; i < 4; i++) {
    tags[i]->fn = fns[i];
    tags[i]->c = c;
  }
  grpc_metadata_array_init(&c->md);
  grpc_call_error e;
  if (m == M_GENERIC) {
    grpc_call_details_init(&c->details);
    e = grpc_server_request_call(g->server, &c->call, &c->details, &c->md, g->cq, g->cq, &c->t_new);
  } else
    e = grpc_server_request_registered_call(g->server, g->handle[m], &c->call, &c->deadline, &c->md, &c->payload,
                                            g->cq, g->cq, &c->t_new);
  if (e != GRPC_CALL_OK) {
    kvld_log(KVLD_ERROR, "grpc_request_call_failed", "\"error\":%d", (int)e);
    grpc_metadata_array_destroy(&c->md);
    free(c);
    return;
  }
  g->live_calls++;
}

int kvld_grpc_start(struct kvld *d, char *err, size_t errlen) {
  struct kvld_grpc *g = calloc(1, sizeof(*g));
  if (!g) return kvl_errf(err, errlen, KVL_ENOMEM, "grpc: out of memory");
  g->d = d;
  d->grpc = g;
  grpc_init();
  g->server = grpc_server_create(NULL, NULL);
  g->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_server_register_completion_queue(g->server, g->cq, NULL);
  for (int m = 0; m < M_COUNT; m++)
    g->handle[m] = grpc_server_register_method(g->server, method_path[m], NULL,
                                               GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
  grpc_server_credentials *creds;
  if (d->cfg.tls_cert[0]) {
    char *cert = NULL, *key = NULL;
    FILE *f;
    long n;
    for (int i = 0; i < 2; i++) {
      const char *path = i ? d->cfg.tls_key : d->cfg.tls_cert;
      if (!(f = fopen(path, "rb"))) return kvl_errf(err, errlen, KVL_ENOENT, "tls: cannot read %s", path);
      fseek(f, 0, SEEK_END);
      n = ftell(f);
      fseek(f, 0, SEEK_SET);
      char *buf = calloc((size_t)n + 1, 1);
      if (fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
      fclose(f);
      *(i ? &key : &cert) = buf;
    }
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    creds = grpc_ssl_server_credentials_create(NULL, &pair, 1, 0, NULL);
    free(cert);
    free(key);
  } else
    creds = grpc_insecure_server_credentials_create();
  char addr[256];
  snprintf(addr, sizeof(addr), "%s:%d", d->cfg.listen, d->cfg.grpc_port);
  d->grpc_port = grpc_server_add_http2_port(g->server, addr, creds);
  grpc_server_credentials_release(creds);
  if (d->grpc_port == 0) return kvl_errf(err, errlen, KVL_EBUSY, "grpc: cannot listen on %s", addr);
  grpc_server_start(g->server);
  uv_mutex_init(&g->mu);
  uv_async_init(d->loop, &g->async, on_async);
  g->async.data = g;
  for (int m = 0; m <= M_GENERIC; m++) request_call(g, m);
  if (uv_thread_create(&g->thread, cq_thread, g) != 0)
    return kvl_errf(err, errlen, KVL_ENOMEM, "grpc: cannot start the completion-queue thread");
  return 0;
}

static void on_async_closed(uv_handle_t *h) {
  struct kvld_grpc *g = h->data;
  struct kvld *d = g->d;
  uv_mutex_destroy(&g->mu);
  free(g->q);
  void (*cb)(struct kvld *) = g->shutdown_cb;
  free(g);
  d->grpc = NULL;
  grpc_shutdown();
  if (cb) cb(d);
}

static void on_grace_closed(uv_handle_t *h) { (void)h; }

static void on_server_shutdown(struct call *c, int ok) {
  (void)ok;
  struct kvld_grpc *g = (struct kvld_grpc *)c;
  if (g->grace_on) {
    uv_timer_stop(&g->grace);
    uv_close((uv_handle_t *)&g->grace, on_grace_closed);
    g->grace_on = false;
  }
  /* every call is over (cancel_all_calls ran): stop the poller */
  grpc_server_destroy(g->server);
  grpc_completion_queue_shutdown(g->cq);
  uv_thread_join(&g->thread);
  /* tags delivered after the last drain are request tags of the server: handled below */
  on_async(&g->async);
  grpc_completion_queue_destroy(g->cq);
  uv_close((uv_handle_t *)&g->async, on_async_closed);
}

static void on_grace(uv_timer_t *t) {
  struct kvld_grpc *g = t->data;
  kvld_log(KVLD_WARN, "grpc_cancel_remaining", "\"calls\":%d", g->active);
  grpc_server_cancel_all_calls(g->server);
}

/* Stop listening; calls in flight are cancelled (the caller waited the drain period). */
void kvld_grpc_shutdown(struct kvld *d, void (*done)(struct kvld *d)) {
  struct kvld_grpc *g = d->grpc;
  if (!g || g->shutdown) return;
  g->shutdown = true;
  g->shutdown_cb = done;
  g->t_shutdown.fn = on_server_shutdown;
  g->t_shutdown.c = (struct call *)g;
  grpc_server_shutdown_and_notify(g->server, g->cq, &g->t_shutdown);
  /* calls still open get a moment to finish (the drain waited for our side of them; the
   * transport may still be flushing), then whatever is left is cancelled */
  uv_timer_init(d->loop, &g->grace);
  g->grace.data = g;
  g->grace_on = true;
  uv_timer_start(&g->grace, on_grace, 2000, 0);
}

int kvld_grpc_active(const struct kvld *d) { return d->grpc ? d->grpc->active : 0; }
