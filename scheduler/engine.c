/* engine.c — one compute thread running the scheduler, fed and drained from a libuv
 * loop through two queues (see kvl_engine.h).
 *
 *   loop thread                                   compute thread
 *   kvl_engine_submit / cancel / stop
 *     ── push cmd on `in` (in_mu), signal in_cv ──▶ swap out `in`, run the commands
 *                                                   (kvl_sched_submit / kvl_sched_cancel)
 *                                                   kvl_sched_step when not idle
 *                                                   scheduler callback: push a copy of the
 *   on_async: swap out `out` (out_mu), call  ◀───── event on `out` (out_mu); one
 *   the callbacks with no lock held                 uv_async_send per batch of pushes
 *
 * Ownership. A request is one `struct job`, allocated on the loop thread by submit and
 * carrying its own final event (`fin`), so its final event can always be sent without
 * allocating. It belongs to the compute thread from the moment it is on `in` until its
 * final event is pushed on `out`, then to the loop thread, which frees it after the
 * callback. Token events are separate allocations made on the compute thread and freed
 * on the loop thread after their callback. The scheduler is touched only by the compute
 * thread (it frees it on the way out).
 *
 * Lock order. There are two mutexes, in_mu (the `in` queue, in_stop, in_cv) and out_mu
 * (the `out` queue, out_exited), and they are never held together: each is taken for a
 * list splice or a flag and released. No callback, scheduler call, allocation or libuv
 * call runs under either, except pthread_cond_wait/signal on in_cv under in_mu. So the
 * loop thread waits at most for one such splice; it never waits for a step.
 */
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvl_engine.h"
#include "kvl_error.h"

#define container_of(p, type, member) ((type *)((char *)(p) - offsetof(type, member)))

enum cmd_kind { CMD_SUBMIT, CMD_CANCEL, CMD_RUN };

/* One order from the loop thread to the compute thread. */
struct cmd {
  struct cmd *next;
  enum cmd_kind kind;
  uint64_t id;               /* the engine id it is about */
};

/* One event on its way from the compute thread to the loop thread. */
struct node {
  struct node *next;
  kvl_engine_cb cb;
  void *ud;
  struct kvl_engine_event ev; /* a copy: nothing in it points into compute-thread memory
                                 (message points into the owning job, which travels along) */
};

/* A function to run on the compute thread (kvl_engine_run), and its answer. */
struct run {
  struct cmd cmd;
  struct node done;          /* delivered to the loop: done.cb = run_done, done.ud = this */
  kvl_engine_fn fn;
  kvl_engine_done_cb done_cb;
  void *arg;
};

/* One request, from kvl_engine_submit until its final event has been delivered. */
struct job {
  struct cmd cmd;            /* its CMD_SUBMIT; cmd.id is the engine id */
  struct node fin;           /* its final event, preallocated; fin.cb / fin.ud are the caller's */
  kvl_engine_t *e;
  struct kvl_request req;    /* arrays point into `data` until kvl_sched_submit copied them */
  void *data;                /* prompt ++ stop ids ++ logit bias; freed on the compute thread */
  uint64_t sched_id;         /* the scheduler's id, once submitted there */
  double t_submit;           /* kvl_engine_submit, ms (CLOCK_MONOTONIC, as the scheduler's) */
  double t_handoff;          /* kvl_sched_submit, ms */
  bool lost;                 /* a token event could not be allocated */
  char msg[256];             /* the final event's message */
};

struct kvl_engine {
  /* set by kvl_engine_start, read-only after */
  uv_loop_t *loop;
  uv_async_t async;          /* compute -> loop wake-up; async.data = the engine */
  pthread_t thread;

  /* loop -> compute, guarded by in_mu */
  pthread_mutex_t in_mu;
  pthread_cond_t in_cv;      /* the compute thread sleeps here when idle */
  struct cmd *in_head, **in_tail;
  bool in_stop;              /* kvl_engine_stop was called */

  /* compute -> loop, guarded by out_mu */
  pthread_mutex_t out_mu;
  struct node *out_head, **out_tail;
  bool out_exited;           /* the compute thread pushed its last event and is leaving */
  struct kvl_sched_model_stats stats[16]; /* snapshot after each step (out_mu) */
  int n_stats;

  /* loop thread only */
  uint64_t next_id;          /* engine ids: 1, 2, ... */
  bool stopping;             /* kvl_engine_stop was called */
  bool closing;              /* thread joined, uv_close called */
  kvl_engine_close_cb close_cb;

  /* compute thread only */
  kvl_sched_t *sched;
  struct job **map;          /* live jobs by engine id: open addressing, linear probing */
  size_t map_cap, map_n;     /* map_cap a power of two (or 0), map_n <= map_cap / 2 */
  bool c_pushed;             /* events pushed since the last uv_async_send */
  int c_fail;                /* while ending every request after a failed step: its error */
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* ---- the id map (compute thread) ---------------------------------------------------- */

static size_t map_home(const kvl_engine_t *e, uint64_t id) {
  return (size_t)((id * 0x9E3779B97F4A7C15ull) >> 32) & (e->map_cap - 1);
}

/* Slot of `id`, or of the empty slot where it would go. Needs map_cap > 0. */
static size_t map_slot(const kvl_engine_t *e, uint64_t id) {
  size_t i = map_home(e, id);
  while (e->map[i] && e->map[i]->cmd.id != id) i = (i + 1) & (e->map_cap - 1);
  return i;
}

static struct job *map_get(const kvl_engine_t *e, uint64_t id) {
  return e->map_cap ? e->map[map_slot(e, id)] : NULL;
}

/* Insert a job whose id is not in the map. 0 or KVL_ENOMEM. */
static int map_put(kvl_engine_t *e, struct job *j) {
  if ((e->map_n + 1) * 2 > e->map_cap) {
    size_t cap = e->map_cap ? e->map_cap * 2 : 64;
    struct job **old = e->map, **tab = calloc(cap, sizeof(*tab));
    if (!tab) return KVL_ENOMEM;
    size_t old_cap = e->map_cap;
    e->map = tab;
    e->map_cap = cap;
    for (size_t i = 0; i < old_cap; i++)
      if (old[i]) e->map[map_slot(e, old[i]->cmd.id)] = old[i];
    free(old);
  }
  size_t i = map_slot(e, j->cmd.id);
  KVL_ASSERT(!e->map[i]);
  e->map[i] = j;
  e->map_n++;
  return 0;
}

/* Remove `id` if present (backward-shift deletion: no tombstones). */
static void map_del(kvl_engine_t *e, uint64_t id) {
  if (!e->map_cap) return;
  size_t mask = e->map_cap - 1, i = map_slot(e, id), j = i;
  if (!e->map[i]) return;
  for (;;) {
    j = (j + 1) & mask;
    if (!e->map[j]) break;
    size_t k = map_home(e, e->map[j]->cmd.id);
    /* the entry at j may stay when its home lies cyclically in (i, j] */
    if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
    e->map[i] = e->map[j];
    i = j;
  }
  e->map[i] = NULL;
  e->map_n--;
}

/* ---- compute -> loop ---------------------------------------------------------------- */

static void push_event(kvl_engine_t *e, struct node *n) {
  n->next = NULL;
  pthread_mutex_lock(&e->out_mu);
  *e->out_tail = n;
  e->out_tail = &n->next;
  pthread_mutex_unlock(&e->out_mu);
  e->c_pushed = true;
}

/* One wake-up for everything pushed since the last one (uv_async_send coalesces anyway;
 * this saves the syscalls). */
static void flush_events(kvl_engine_t *e) {
  if (!e->c_pushed) return;
  e->c_pushed = false;
  uv_async_send(&e->async);
}

/* Push the job's final event; the job now belongs to the loop thread. */
static void push_final(kvl_engine_t *e, struct job *j, const struct kvl_token_event *tok, int status, const char *msg) {
  j->fin.ev.id = j->cmd.id;
  j->fin.ev.tok = *tok;
  j->fin.ev.status = status;
  j->fin.ev.message = msg;
  push_event(e, &j->fin);
}

/* The scheduler's callback (compute thread, inside kvl_sched_step / cancel / free). */
static void on_sched_event(void *ud, uint64_t sched_id, const struct kvl_token_event *ev) {
  struct job *j = ud;
  kvl_engine_t *e = j->e;
  (void)sched_id;
  struct kvl_token_event tok = *ev;
  /* timings count from kvl_engine_submit: add the time spent in the hand-off */
  double handoff = j->t_handoff - j->t_submit;
  if (tok.queue_ms > 0) tok.queue_ms += handoff;
  if (tok.ttft_ms > 0) tok.ttft_ms += handoff;
  if (!ev->final) {
    struct node *n = malloc(sizeof(*n));
    if (!n) { j->lost = true; return; } /* reported on the final event */
    n->cb = j->fin.cb;
    n->ud = j->fin.ud;
    n->ev = (struct kvl_engine_event){j->cmd.id, tok, 0, NULL};
    push_event(e, n);
    return;
  }
  map_del(e, j->cmd.id);
  int status = 0;
  const char *msg = NULL;
  switch (tok.finish) {
  case KVL_DONE_CANCELLED:
    status = KVL_ECANCELED;
    if (e->c_fail) {
      tok.finish = KVL_DONE_ERROR;
      status = e->c_fail;
      snprintf(j->msg, sizeof(j->msg), "the engine step failed (%s); the request was ended after %d tokens",
               kvl_strerror(e->c_fail), tok.usage.generated);
      msg = j->msg;
    }
    break;
  case KVL_DONE_ERROR:
    status = KVL_ERANGE;
    msg = "sampling failed: every token was banned (check logit_bias)";
    break;
  default:
    break;
  }
  if (j->lost && status == 0) {
    status = KVL_ENOMEM;
    msg = "out of memory: some token events of this request were lost";
  }
  push_final(e, j, &tok, status, msg);
}

/* ---- the compute thread -------------------------------------------------------------- */

/* Hand a job to the scheduler; a refusal becomes its final event. */
static void run_submit(kvl_engine_t *e, struct job *j) {
  j->t_handoff = now_ms();
  int rc = map_put(e, j);
  if (rc == 0) {
    rc = kvl_sched_submit(e->sched, &j->req, on_sched_event, j, &j->sched_id, j->msg, sizeof(j->msg));
    if (rc < 0) map_del(e, j->cmd.id);
  } else {
    snprintf(j->msg, sizeof(j->msg), "out of memory");
  }
  free(j->data); /* the scheduler copied what it keeps */
  j->data = NULL;
  j->req.prompt = j->req.stop_ids = NULL;
  j->req.sampling.bias = NULL;
  if (rc < 0) {
    struct kvl_token_event tok = {.token = -1, .final = true, .finish = KVL_DONE_ERROR};
    tok.usage.prompt_tokens = j->req.n_prompt;
    push_final(e, j, &tok, rc, j->msg);
  }
}

static void run_commands(kvl_engine_t *e, struct cmd *c) {
  while (c) {
    struct cmd *next = c->next;
    if (c->kind == CMD_SUBMIT) {
      run_submit(e, container_of(c, struct job, cmd));
    } else if (c->kind == CMD_RUN) {
      struct run *r = container_of(c, struct run, cmd);
      r->done.ev.status = r->fn(e->sched, r->arg);
      pthread_mutex_lock(&e->out_mu);
      *e->out_tail = &r->done;
      e->out_tail = &r->done.next;
      pthread_mutex_unlock(&e->out_mu);
      e->c_pushed = true;
    } else {
      struct job *j = map_get(e, c->id); /* absent: unknown, refused or finished: no-op */
      if (j) {
        int rc = kvl_sched_cancel(e->sched, j->sched_id); /* pushes its final, unmaps it */
        KVL_ASSERT(rc == 0); /* mapped <=> live in the scheduler */
      }
      free(c);
    }
    c = next;
  }
}

/* A step failed: end every live request with an error (the scheduler's state for them
 * is not trusted any more); the engine keeps serving new ones. */
static void fail_all(kvl_engine_t *e, int rc) {
  e->c_fail = rc;
  while (e->map_n) {
    struct job *j = NULL;
    for (size_t i = 0; !j; i++) j = e->map[i];
    int crc = kvl_sched_cancel(e->sched, j->sched_id); /* pushes its final, unmaps it */
    KVL_ASSERT(crc == 0);
  }
  e->c_fail = 0;
}

/* Per-model stats for the loop thread's metrics (compute thread). */
static void publish_stats(kvl_engine_t *e) {
  struct kvl_sched_model_stats st[16];
  int n = 0;
  for (int rc; n < 16 && (rc = kvl_sched_model_stats(e->sched, n, &st[n])) != KVL_ERANGE; n++)
    if (rc < 0) memset(&st[n], 0, sizeof(st[n])); /* a removed model */
  pthread_mutex_lock(&e->out_mu);
  memcpy(e->stats, st, sizeof(st[0]) * (size_t)n);
  e->n_stats = n;
  pthread_mutex_unlock(&e->out_mu);
}

static void *compute_main(void *arg) {
  kvl_engine_t *e = arg;
  bool stop = false;
  while (!stop) {
    bool idle = kvl_sched_idle(e->sched); /* only this thread changes the scheduler */
    pthread_mutex_lock(&e->in_mu);
    while (idle && !e->in_head && !e->in_stop) pthread_cond_wait(&e->in_cv, &e->in_mu);
    struct cmd *cmds = e->in_head;
    e->in_head = NULL;
    e->in_tail = &e->in_head;
    stop = e->in_stop;
    pthread_mutex_unlock(&e->in_mu);

    bool had_cmds = cmds != NULL;
    run_commands(e, cmds);
    if (had_cmds) publish_stats(e);
    flush_events(e); /* refusals and cancels need not wait for the step */
    if (!stop && !kvl_sched_idle(e->sched)) {
      int rc = kvl_sched_step(e->sched);
      if (rc < 0) fail_all(e, rc);
      publish_stats(e);
      flush_events(e);
    }
  }
  /* Stop: every request still live gets its final CANCELLED from kvl_sched_free. The
   * loop thread queues no command after in_stop (submit and cancel check `stopping`), and
   * the commands queued before it came in the same splice as the flag: `in` is empty. */
  kvl_sched_free(e->sched);
  e->sched = NULL;
  pthread_mutex_lock(&e->out_mu);
  e->n_stats = 0;
  pthread_mutex_unlock(&e->out_mu);
  KVL_ASSERT(e->map_n == 0);
  free(e->map);
  e->map = NULL;
  pthread_mutex_lock(&e->out_mu);
  e->out_exited = true;
  pthread_mutex_unlock(&e->out_mu);
  uv_async_send(&e->async); /* the last touch of `e` by this thread */
  return NULL;
}

/* ---- the loop thread ------------------------------------------------------------------ */

static void push_cmd(kvl_engine_t *e, struct cmd *c) {
  c->next = NULL;
  pthread_mutex_lock(&e->in_mu);
  *e->in_tail = c;
  e->in_tail = &c->next;
  pthread_cond_signal(&e->in_cv);
  pthread_mutex_unlock(&e->in_mu);
}

static void on_closed(uv_handle_t *h) {
  kvl_engine_t *e = h->data;
  if (e->close_cb) e->close_cb(e);
  pthread_cond_destroy(&e->in_cv);
  pthread_mutex_destroy(&e->in_mu);
  pthread_mutex_destroy(&e->out_mu);
  free(e);
}

/* The loop side of a CMD_RUN: hand the result over (on_async frees the command). */
static void run_done(void *ud, const struct kvl_engine_event *ev) {
  struct run *r = ud;
  if (r->done_cb) r->done_cb(r->arg, ev->status);
}

/* Drain the whole `out` queue: one wake-up may stand for many pushes. */
static void on_async(uv_async_t *a) {
  kvl_engine_t *e = a->data;
  if (e->closing) return;
  pthread_mutex_lock(&e->out_mu);
  struct node *n = e->out_head;
  e->out_head = NULL;
  e->out_tail = &e->out_head;
  bool exited = e->out_exited;
  pthread_mutex_unlock(&e->out_mu);
  while (n) {
    struct node *next = n->next;
    n->cb(n->ud, &n->ev); /* may submit, cancel or stop */
    if (n->ev.tok.final)
      free(container_of(n, struct job, fin));
    else if (n->cb == run_done)
      free(container_of(n, struct run, done));
    else
      free(n);
    n = next;
  }
  if (exited) { /* everything it pushed was in this batch; it is returning now */
    int rc = pthread_join(e->thread, NULL);
    KVL_ASSERT(rc == 0);
    e->closing = true;
    uv_close((uv_handle_t *)&e->async, on_closed);
  }
}

static void on_start_failed(uv_handle_t *h) {
  kvl_engine_t *e = h->data;
  pthread_cond_destroy(&e->in_cv);
  pthread_mutex_destroy(&e->in_mu);
  pthread_mutex_destroy(&e->out_mu);
  free(e);
}

int kvl_engine_start(uv_loop_t *loop, kvl_sched_t *sched, kvl_engine_t **out) {
  KVL_ASSERT(loop && sched && out);
  kvl_engine_t *e = calloc(1, sizeof(*e));
  if (!e) return KVL_ENOMEM;
  e->loop = loop;
  e->sched = sched;
  e->next_id = 1;
  e->in_tail = &e->in_head;
  e->out_tail = &e->out_head;
  int rc = pthread_mutex_init(&e->in_mu, NULL);
  if (rc) goto err_free;
  rc = pthread_mutex_init(&e->out_mu, NULL);
  if (rc) goto err_in_mu;
  rc = pthread_cond_init(&e->in_cv, NULL);
  if (rc) goto err_out_mu;
  int uvrc = uv_async_init(loop, &e->async, on_async);
  if (uvrc < 0) { rc = -uvrc; goto err_cv; } /* libuv errors are -errno on Unix */
  e->async.data = e;
  /* The compute thread takes no signals: they are the loop thread's (uv_signal_t). */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&e->thread, NULL, compute_main, e);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc) {
    e->sched = NULL; /* the caller keeps it */
    uv_close((uv_handle_t *)&e->async, on_start_failed);
    return -rc;
  }
  *out = e;
  return 0;

err_cv:
  pthread_cond_destroy(&e->in_cv);
err_out_mu:
  pthread_mutex_destroy(&e->out_mu);
err_in_mu:
  pthread_mutex_destroy(&e->in_mu);
err_free:
  free(e);
  return -rc; /* KVL_ENOMEM is -ENOMEM */
}

int kvl_engine_submit(kvl_engine_t *e, const struct kvl_request *r, kvl_engine_cb cb, void *ud, uint64_t *id,
                      char *err, size_t errlen) {
  KVL_ASSERT(e && r && cb && id);
  if (e->stopping) return kvl_errf(err, errlen, KVL_ECANCELED, "the engine is stopping");
  /* what can be refused without the scheduler; the rest is kvl_sched_submit's */
  if (r->model < 0) return kvl_errf(err, errlen, KVL_EINVAL, "unknown model %d", r->model);
  if (r->n_prompt <= 0 || !r->prompt) return kvl_errf(err, errlen, KVL_EINVAL, "the prompt is empty");
  if (r->max_tokens < 1) return kvl_errf(err, errlen, KVL_EINVAL, "max_tokens must be at least 1 (got %d)", r->max_tokens);
  if (r->n_stop_ids < 0 || (r->n_stop_ids > 0 && !r->stop_ids))
    return kvl_errf(err, errlen, KVL_EINVAL, "%d stop ids given without an array", r->n_stop_ids);
  if (r->sampling.n_bias < 0 || (r->sampling.n_bias > 0 && !r->sampling.bias))
    return kvl_errf(err, errlen, KVL_EINVAL, "%d logit-bias entries given without an array", r->sampling.n_bias);
  for (int32_t i = 0; i < r->n_prompt; i++)
    if (r->prompt[i] < 0)
      return kvl_errf(err, errlen, KVL_EINVAL, "prompt token %d at position %d is negative", r->prompt[i], i);

  /* one block for the arrays: prompt ++ stop ids ++ bias (int32 sizes: no overflow in size_t) */
  size_t n_prompt = (size_t)r->n_prompt * sizeof(int32_t), n_stop = (size_t)r->n_stop_ids * sizeof(int32_t);
  size_t n_bias = (size_t)r->sampling.n_bias * sizeof(struct kvl_logit_bias);
  _Static_assert(_Alignof(struct kvl_logit_bias) <= _Alignof(int32_t), "bias after int32 arrays");
  struct job *j = calloc(1, sizeof(*j));
  void *data = malloc(n_prompt + n_stop + n_bias);
  if (!j || !data) {
    free(j);
    free(data);
    return kvl_errf(err, errlen, KVL_ENOMEM, "out of memory");
  }
  j->e = e;
  j->data = data;
  j->req = *r;
  int32_t *p = data;
  memcpy(p, r->prompt, n_prompt);
  j->req.prompt = p;
  if (n_stop) memcpy(p + r->n_prompt, r->stop_ids, n_stop);
  j->req.stop_ids = r->n_stop_ids ? p + r->n_prompt : NULL;
  struct kvl_logit_bias *b = (struct kvl_logit_bias *)(p + r->n_prompt + r->n_stop_ids);
  if (n_bias) memcpy(b, r->sampling.bias, n_bias);
  j->req.sampling.bias = r->sampling.n_bias ? b : NULL;
  j->fin.cb = cb;
  j->fin.ud = ud;
  j->cmd.kind = CMD_SUBMIT;
  j->cmd.id = e->next_id++;
  j->t_submit = now_ms();
  *id = j->cmd.id;
  push_cmd(e, &j->cmd);
  return 0;
}

int kvl_engine_cancel(kvl_engine_t *e, uint64_t id) {
  KVL_ASSERT(e);
  if (e->stopping) return 0;                 /* everything is being cancelled anyway */
  if (id == 0 || id >= e->next_id) return 0; /* never issued */
  struct cmd *c = malloc(sizeof(*c));
  if (!c) return KVL_ENOMEM;
  c->kind = CMD_CANCEL;
  c->id = id;
  push_cmd(e, c);
  return 0;
}

void kvl_engine_stop(kvl_engine_t *e, kvl_engine_close_cb close_cb) {
  KVL_ASSERT(e && !e->stopping);
  e->stopping = true;
  e->close_cb = close_cb;
  pthread_mutex_lock(&e->in_mu);
  e->in_stop = true;
  pthread_cond_signal(&e->in_cv);
  pthread_mutex_unlock(&e->in_mu);
}

int kvl_engine_model_stats(kvl_engine_t *e, int model_id, struct kvl_sched_model_stats *out) {
  pthread_mutex_lock(&e->out_mu);
  int rc = model_id >= 0 && model_id < e->n_stats ? 0 : KVL_ERANGE;
  if (rc == 0) *out = e->stats[model_id];
  pthread_mutex_unlock(&e->out_mu);
  return rc;
}


int kvl_engine_run(kvl_engine_t *e, kvl_engine_fn fn, kvl_engine_done_cb done, void *arg) {
  if (e->stopping) return KVL_ECANCELED;
  struct run *r = calloc(1, sizeof(*r));
  if (!r) return KVL_ENOMEM;
  r->cmd.kind = CMD_RUN;
  r->fn = fn;
  r->done_cb = done;
  r->arg = arg;
  r->done.cb = run_done;
  r->done.ud = r;
  r->done.ev.tok.token = -1;
  push_cmd(e, &r->cmd);
  return 0;
}
