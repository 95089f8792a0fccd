/* http.c — HTTP on the daemon's libuv loop with libmicrohttpd (no HTTP parser of ours):
 * MHD runs without threads of its own in epoll mode; its epoll descriptor is watched by a
 * uv_poll_t and its timeout by a uv_timer_t, so every request is handled on the loop
 * thread like the gRPC calls. Routes: /health, /metrics (Prometheus text), /v1/models. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
};

static void reschedule(struct kvld_http *h);

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type, char *body, size_t len,
                             bool free_body) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, body, free_body ? MHD_RESPMEM_MUST_FREE
                                                                               : MHD_RESPMEM_PERSISTENT);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, "Content-Type", type);
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
  return reply_json(conn, status, json_pack("{s:{s:s,s:s,s:i}}", "error", "message", msg, "type", type, "code", status));
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
  if (*con_cls == NULL) { /* first call: headers only */
    *con_cls = h;
    return MHD_YES;
  }
  if (*upload_size) { /* bodies are not read by these routes */
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
  if (!strcmp(url, "/v1/models")) {
    if (!get) return error_json(conn, 405, "invalid_request_error", "use GET /v1/models");
    json_t *data = json_array();
    for (int i = 0; i < d->n_models; i++)
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
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof(sa));
  if (uv_ip4_addr(d->cfg.listen, d->cfg.http_port, &sa) != 0) {
    free(h);
    return kvl_errf(err, errlen, KVL_EINVAL, "http: listen address '%s' is not IPv4", d->cfg.listen);
  }
  h->mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_SUSPEND_RESUME | MHD_USE_ERROR_LOG, (uint16_t)d->cfg.http_port,
                            NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120, MHD_OPTION_END);
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
