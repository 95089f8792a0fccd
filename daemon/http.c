/* http.c — HTTP on the daemon's libuv loop with libmicrohttpd (no HTTP parser of ours):
 * MHD runs without threads of its own in epoll mode; its epoll descriptor is watched by a
 * uv_poll_t and its timeout by a uv_timer_t, so every request is handled on the loop
 * thread like the gRPC calls. Routes: /health, /metrics (Prometheus text), and the
 * OpenAI-compatible /v1/models, /v1/completions, /v1/chat/completions (JSON, or SSE with
 * `stream`, `stream_options.include_usage`). A streaming response is a content-reader
 * callback that suspends its connection while no text is pending; the request's sink
 * resumes it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>
#include <microhttpd.h>

#include "daemon.h"
#include "kvl_error.h"

struct kvld_http {
  struct kvld *d;
  struct MHD_Daemon *mhd;
  uv_poll_t poll;
  uv_timer_t timer;
  int closing;
  uint64_t next_id;
  int active;          /* OpenAI requests being answered */
};

#define MAX_BODY (4 << 20)

enum route { R_OTHER, R_COMPLETIONS, R_CHAT };

/* One OpenAI request on one connection. */
struct hconn {
  struct kvld_http *h;
  struct MHD_Connection *conn;
  enum route route;
  char *body;
  size_t len;
  bool too_big, started, stream, include_usage, suspended, conn_done, final_queued;
  struct kvld_req *req;
  char id[64], model[64];
  long created;
  char *out;          /* bytes ready for the client (SSE events, or the whole JSON body) */
  size_t out_len, out_pos, out_cap;
  char *acc;          /* non-streaming: the whole text */
  size_t acc_len;
  bool role_sent;
  unsigned code;      /* non-streaming: the status of the answer */
};

static void reschedule(struct kvld_http *h);
static enum MHD_Result openai(struct hconn *c, struct MHD_Connection *conn, const char *upload, size_t *upload_size);

static char g_replica[128]; /* every response says which replica answered (affinity checks, debugging) */

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type, char *body, size_t len,
                             bool free_body) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, free_body ? MHD_RESPMEM_MUST_FREE
                                                                               : MHD_RESPMEM_PERSISTENT);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, "Content-Type", type);
  MHD_add_response_header(r, "x-kvlingo-replica", g_replica);
  enum MHD_Result ret = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return ret;
}

static enum MHD_Result reply_json(struct MHD_Connection *conn, unsigned status, json_t *j) {
  char *s = json_dumps(j, JSON_COMPACT);
  json_decref(j);
  if (!s) return MHD_NO;
  return reply(conn, status, "application/json", s, strlen(s), true);
}

static enum MHD_Result error_json(struct MHD_Connection *conn, unsigned status, const char *type, const char *msg) {
  json_t *j = json_pack("{s:{s:s,s:s,s:i}}", "error", "message", msg, "type", type, "code", status);
  if (!j) { /* not UTF-8 (the decoders escape what they echo, so a bug): escaped, still answered */
    char shown[512];
    kvld_escape(msg, shown, sizeof(shown));
    j = json_pack("{s:{s:s,s:s,s:i}}", "error", "message", shown, "type", type, "code", status);
  }
  return reply_json(conn, status, j);
}

static bool authorized(struct kvld *d, struct MHD_Connection *conn) {
  if (!d->cfg.auth_token[0]) return true;
  const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
  if (!v || strncmp(v, "Bearer ", 7) != 0) return false;
  const char *tok = v + 7;
  size_t a = strlen(tok), b = strlen(d->cfg.auth_token);
  unsigned diff = (unsigned)(a ^ b);
  for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned)(tok[i] ^ d->cfg.auth_token[i]);
  return diff == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
  (void)version;
  (void)upload;
  struct kvld_http *h = cls;
  struct kvld *d = h->d;
  enum route rt = !strcmp(url, "/v1/completions") ? R_COMPLETIONS : !strcmp(url, "/v1/chat/completions") ? R_CHAT : R_OTHER;
  if (*con_cls == NULL) { /* first call: headers only */
    if (rt != R_OTHER && !strcmp(method, "POST")) {
      struct hconn *c = calloc(1, sizeof(*c));
      if (!c) return MHD_NO;
      c->h = h;
      c->route = rt;
      *con_cls = c;
      h->active++;
    } else
      *con_cls = (void *)-1;
    return MHD_YES;
  }
  if (*con_cls != (void *)-1) {
    struct hconn *c = *con_cls;
    if (!c->started && !*upload_size && !authorized(d, conn)) {
      c->started = true;
      return error_json(conn, 401, "authentication_error", "missing or wrong bearer token");
    }
    return openai(c, conn, upload, upload_size);
  }
  if (*upload_size) { /* bodies are not read by the other routes */
    *upload_size = 0;
    return MHD_YES;
  }
  bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
  if (!strcmp(url, "/health")) {
    if (!get) return error_json(conn, 405, "invalid_request_error", "use GET /health");
    static char ok[] = "ok\n", no[] = "not serving\n";
    return d->serving ? reply(conn, 200, "text/plain", ok, 3, false) : reply(conn, 503, "text/plain", no, 12, false);
  }
  if (!strcmp(url, "/metrics")) {
    if (!get) return error_json(conn, 405, "invalid_request_error", "use GET /metrics");
    char *s = kvld_metrics_render(d);
    if (!s) return MHD_NO;
    return reply(conn, 200, "text/plain; version=0.0.4; charset=utf-8", s, strlen(s), true);
  }
  if (!authorized(d, conn)) return error_json(conn, 401, "authentication_error", "missing or wrong bearer token");
  if (rt != R_OTHER) return error_json(conn, 405, "invalid_request_error", "use POST");
  if (!strcmp(url, "/v1/models")) {
    if (!get) return error_json(conn, 405, "invalid_request_error", "use GET /v1/models");
    json_t *data = json_array();
    for (int i = 0; i < d->n_models; i++)
      if (kvld_model_live(d, i))
      json_array_append_new(data, json_pack("{s:s,s:s,s:i,s:s,s:i}", "id", d->models[i].name, "object", "model",
                                            "created", 0, "owned_by", "kvlingo", "max_model_len",
                                            d->models[i].max_model_len));
    json_array_append_new(data, json_pack("{s:s,s:s,s:i,s:s}", "id", "auto", "object", "model", "created", 0,
                                          "owned_by", "kvlingo"));
    return reply_json(conn, 200, json_pack("{s:s,s:o}", "object", "list", "data", data));
  }
  char msg[300];
  snprintf(msg, sizeof(msg), "no route %s %s", method, url);
  return error_json(conn, 404, "invalid_request_error", msg);
}


/* ---- OpenAI-compatible generation ---------------------------------------------------- */

static void on_timer(uv_timer_t *t);
/* Run MHD soon: a resumed connection has something to send. */
static void kick(struct kvld_http *h) { uv_timer_start(&h->timer, on_timer, 0, 0); }

static void out_put(struct hconn *c, const char *s, size_t n) {
  if (c->out_len + n + 1 > c->out_cap) {
    size_t cap = (c->out_len + n + 1) * 2;
    char *o = realloc(c->out, cap);
    if (!o) return;
    c->out = o;
    c->out_cap = cap;
  }
  memcpy(c->out + c->out_len, s, n);
  c->out_len += n;
  c->out[c->out_len] = 0;
}

static void out_event(struct hconn *c, json_t *j) {
  char *s = json_dumps(j, JSON_COMPACT);
  json_decref(j);
  if (!s) return;
  out_put(c, "data: ", 6);
  out_put(c, s, strlen(s));
  out_put(c, "\n\n", 2);
  free(s);
}

static json_t *usage_json(const struct kvld_req *r) {
  return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", r->usage.prompt_tokens, "completion_tokens", r->generated,
                   "total_tokens", r->usage.prompt_tokens + r->generated, "prompt_tokens_details", "cached_tokens",
                   r->usage.cached_native + r->usage.cached_translated);
}

/* What only kvlingo reports, beside OpenAI's fields: the replica, the translation
 * outcome, the routing decision and the full usage. */
static json_t *kvlingo_json(const struct kvld_req *r) {
  const struct kvld_route *rt = &r->p.route;
  const struct kvl_usage *u = &r->usage;
  return json_pack("{s:s,s:s,s:{s:s,s:s,s:s,s:s,s:i},s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f}}", "replica", g_replica,
                   "translation", kvld_outcome_name(kvld_outcome_of(u)), "route", "policy", rt->policy, "decision",
                   rt->decision, "reason", rt->reason, "from_model",
                   rt->from_model >= 0 ? r->d->models[rt->from_model].name : "", "handoff_token", rt->handoff_token,
                   "usage", "cached_native_tokens", u->cached_native, "cached_translated_tokens", u->cached_translated,
                   "translated_tokens", u->translated, "prefilled_tokens", u->prefilled, "untranslatable_tokens",
                   u->untranslatable, "declined_tokens", u->declined, "handoffs", u->handoffs,
                   "translation_seconds", u->translate_ms / 1e3);
}

static json_t *finish_json(const struct kvld_req *r) {
  if (!r->done) return json_null();
  return json_string(r->finish == KVLD_FIN_LENGTH ? "length" : r->finish == KVLD_FIN_STOP ? "stop" : "abort");
}

static json_t *chunk_json(struct hconn *c, const char *text, size_t len, json_t *finish) {
  json_t *choice;
  if (c->route == R_CHAT) {
    json_t *delta = json_object();
    if (!c->role_sent) json_object_set_new(delta, "role", json_string("assistant"));
    c->role_sent = true;
    if (len) json_object_set_new(delta, "content", json_stringn(text, len));
    choice = json_pack("{s:i,s:o,s:o}", "index", 0, "delta", delta, "finish_reason", finish);
  } else
    choice = json_pack("{s:i,s:s%,s:n,s:o}", "index", 0, "text", text ? text : "", len, "logprobs", "finish_reason",
                       finish);
  return json_pack("{s:s,s:s,s:i,s:s,s:[o]}", "id", c->id, "object",
                   c->route == R_CHAT ? "chat.completion.chunk" : "text_completion", "created", (int)c->created, "model",
                   c->model, "choices", choice);
}

static unsigned http_code(enum kvld_status st) {
  switch (st) {
  case KVLD_INVALID_ARGUMENT: return 400;
  case KVLD_NOT_FOUND: return 404;
  case KVLD_UNAUTHENTICATED: return 401;
  case KVLD_PERMISSION_DENIED: return 403;
  case KVLD_RESOURCE_EXHAUSTED: return 429;
  case KVLD_UNAVAILABLE: return 503;
  case KVLD_FAILED_PRECONDITION: return 400;
  default: return 500;
  }
}

static void hconn_free(struct hconn *c) {
  free(c->body);
  free(c->out);
  free(c->acc);
  free(c);
}

static void http_sink(struct kvld_req *r, void *ud) {
  struct hconn *c = ud;
  struct kvld_out o;
  kvld_req_take(r, &o);
  char *text = o.text;
  size_t len = o.len;
  free(o.ids);
  free(o.lps);
  snprintf(c->model, sizeof(c->model), "%s", r->d->models[r->cur_model].name); /* changes at a handoff */
  if (c->conn_done) { /* the client is gone */
    free(text);
    if (r->done) {
      kvld_req_release(r);
      c->req = NULL;
      hconn_free(c);
    }
    return;
  }
  if (c->stream) {
    if (len || (!c->role_sent && c->route == R_CHAT)) out_event(c, chunk_json(c, text, len, json_null()));
    if (r->done) {
      if (r->status != KVLD_OK) {
        out_event(c, json_pack("{s:{s:s,s:s}}", "error", "message", r->message, "type", "server_error"));
      } else {
        json_t *last = chunk_json(c, NULL, 0, finish_json(r));
        json_object_set_new(last, "kvlingo", kvlingo_json(r));
        out_event(c, last);
        if (c->include_usage)
          out_event(c, json_pack("{s:s,s:s,s:i,s:s,s:[],s:o}", "id", c->id, "object",
                                 c->route == R_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                                 (int)c->created, "model", c->model, "choices", "usage", usage_json(r)));
      }
      out_put(c, "data: [DONE]\n\n", 14);
      c->final_queued = true;
    }
  } else {
    if (len) {
      char *a = realloc(c->acc, c->acc_len + len + 1);
      if (a) {
        memcpy(a + c->acc_len, text, len);
        c->acc = a;
        c->acc_len += len;
        a[c->acc_len] = 0;
      }
    }
    if (r->done) {
      json_t *j;
      if (r->status != KVLD_OK) {
        c->code = http_code(r->status);
        j = json_pack("{s:{s:s,s:s,s:i}}", "error", "message", r->message, "type", "server_error", "code", (int)c->code);
      }
      else {
        json_t *choice = c->route == R_CHAT
                             ? json_pack("{s:i,s:{s:s,s:s%},s:o}", "index", 0, "message", "role", "assistant",
                                         "content", c->acc ? c->acc : "", c->acc_len, "finish_reason", finish_json(r))
                             : json_pack("{s:i,s:s%,s:n,s:o}", "index", 0, "text", c->acc ? c->acc : "", c->acc_len,
                                         "logprobs", "finish_reason", finish_json(r));
        j = json_pack("{s:s,s:s,s:i,s:s,s:[o],s:o}", "id", c->id, "object",
                      c->route == R_CHAT ? "chat.completion" : "text_completion", "created", (int)c->created, "model",
                      c->model, "choices", choice, "usage", usage_json(r));
        json_object_set_new(j, "kvlingo", kvlingo_json(r));
      }
      char *s = json_dumps(j, JSON_COMPACT);
      json_decref(j);
      if (s) out_put(c, s, strlen(s));
      free(s);
      c->final_queued = true;
    }
  }
  free(text);
  if (r->done) {
    kvld_req_release(r);
    c->req = NULL;
  }
  if (c->suspended && (c->stream || c->final_queued)) {
    c->suspended = false;
    MHD_resume_connection(c->conn);
    kick(c->h);
  }
}

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  struct hconn *c = cls;
  if (c->out_pos < c->out_len) {
    size_t n = c->out_len - c->out_pos < max ? c->out_len - c->out_pos : max;
    memcpy(buf, c->out + c->out_pos, n);
    c->out_pos += n;
    if (c->out_pos == c->out_len) c->out_pos = c->out_len = 0;
    return (ssize_t)n;
  }
  if (c->final_queued) return MHD_CONTENT_READER_END_OF_STREAM;
  c->suspended = true;
  MHD_suspend_connection(c->conn);
  return 0;
}

/* Decode the body (request.c) and start the request; on failure a status and message. */
static enum kvld_status openai_start(struct hconn *c, char *msg, size_t msglen) {
  struct kvld *d = c->h->d;
  struct kvld_gen_params p;
  struct kvld_openai_flags f;
  const char *cid = MHD_lookup_connection_value(c->conn, MHD_HEADER_KIND, "x-kvlingo-conversation");
  enum kvld_status st = kvld_openai_request(d, c->route == R_CHAT, c->body, c->len, cid, &p, &f, msg, msglen);
  if (st != KVLD_OK) return st;
  c->stream = f.stream;
  c->include_usage = f.include_usage;
  snprintf(c->model, sizeof(c->model), "%s", d->models[p.model].name);
  snprintf(c->id, sizeof(c->id), "%s-%llu", c->route == R_CHAT ? "chatcmpl" : "cmpl",
           (unsigned long long)++c->h->next_id);
  c->created = (long)time(NULL);
  return kvld_req_start(d, &p, http_sink, c, &c->req, msg, msglen);
}

static enum MHD_Result openai(struct hconn *c, struct MHD_Connection *conn, const char *upload, size_t *upload_size) {
  if (*upload_size) {
    if (c->len + *upload_size > MAX_BODY) c->too_big = true;
    else {
      char *b = realloc(c->body, c->len + *upload_size + 1);
      if (!b) return MHD_NO;
      memcpy(b + c->len, upload, *upload_size);
      c->body = b;
      c->len += *upload_size;
    }
    *upload_size = 0;
    return MHD_YES;
  }
  if (!c->started) {
    c->started = true;
    c->conn = conn;
    if (c->too_big) return error_json(conn, 413, "invalid_request_error", "the body is over 4 MiB");
    char msg[512];
    enum kvld_status st = openai_start(c, msg, sizeof(msg));
    if (st != KVLD_OK) return error_json(conn, http_code(st), "invalid_request_error", msg);
    if (c->stream) {
      struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, sse_reader, c, NULL);
      MHD_add_response_header(r, "Content-Type", "text/event-stream");
      MHD_add_response_header(r, "Cache-Control", "no-cache");
      MHD_add_response_header(r, "x-kvlingo-replica", g_replica);
      enum MHD_Result ret = MHD_queue_response(conn, 200, r);
      MHD_destroy_response(r);
      return ret;
    }
    c->suspended = true;
    MHD_suspend_connection(conn);
    return MHD_YES;
  }
  /* resumed: the non-streaming answer is ready */
  char *body = c->out;
  size_t len = c->out_len;
  c->out = NULL;
  c->out_len = c->out_cap = 0;
  return reply(conn, c->code ? c->code : 200, "application/json", body ? body : strdup("{}"), body ? len : 2, true);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)conn;
  (void)toe;
  struct hconn *c = *con_cls;
  *con_cls = NULL;
  if (!c || c == (void *)-1) return;
  c->h->active--;
  if (c->req) { /* still generating: stop it; the sink frees c when the request ends */
    c->conn_done = true;
    kvld_req_cancel(c->req);
    return;
  }
  hconn_free(c);
}

/* ---- MHD on the libuv loop ------------------------------------------------------------ */

static void run_mhd(struct kvld_http *h) {
  if (h->closing) return;
  MHD_run(h->mhd);
  reschedule(h);
}

static void on_poll(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  run_mhd(p->data);
}

static void on_timer(uv_timer_t *t) { run_mhd(t->data); }

static void reschedule(struct kvld_http *h) {
  MHD_UNSIGNED_LONG_LONG to;
  if (MHD_get_timeout(h->mhd, &to) == MHD_YES)
    uv_timer_start(&h->timer, on_timer, to, 0);
  else
    uv_timer_stop(&h->timer);
}

int kvld_http_start(struct kvld *d, char *err, size_t errlen) {
  struct kvld_http *h = calloc(1, sizeof(*h));
  if (!h) return KVL_ENOMEM;
  h->d = d;
  snprintf(g_replica, sizeof(g_replica), "%s", d->cfg.replica_id);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  if (uv_ip4_addr(d->cfg.listen, d->cfg.http_port, &sa) != 0) {
    free(h);
    return kvl_errf(err, errlen, KVL_EINVAL, "http: listen address '%s' is not IPv4", d->cfg.listen);
  }
  h->mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_SUSPEND_RESUME | MHD_USE_ERROR_LOG, (uint16_t)d->cfg.http_port,
                            NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
                            h, MHD_OPTION_END);
  if (!h->mhd) {
    free(h);
    return kvl_errf(err, errlen, KVL_EBUSY, "http: cannot listen on %s:%d", d->cfg.listen, d->cfg.http_port);
  }
  const union MHD_DaemonInfo *pi = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
  d->http_port = pi ? pi->port : d->cfg.http_port;
  const union MHD_DaemonInfo *ei = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_EPOLL_FD);
  uv_poll_init(d->loop, &h->poll, ei->epoll_fd);
  h->poll.data = h;
  uv_poll_start(&h->poll, UV_READABLE, on_poll);
  uv_timer_init(d->loop, &h->timer);
  h->timer.data = h;
  d->http = h;
  reschedule(h);
  return 0;
}

static void on_closed(uv_handle_t *hd) {
  struct kvld_http *h = hd->data;
  if (++h->closing == 3) {
    MHD_stop_daemon(h->mhd);
    free(h);
  }
}

void kvld_http_stop(struct kvld *d) {
  struct kvld_http *h = d->http;
  if (!h) return;
  d->http = NULL;
  h->closing = 1;
  uv_close((uv_handle_t *)&h->poll, on_closed);
  uv_close((uv_handle_t *)&h->timer, on_closed);
}

int kvld_http_active(const struct kvld *d) { return d->http ? d->http->active : 0; }
