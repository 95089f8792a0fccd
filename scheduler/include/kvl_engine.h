/* kvl_engine.h — the scheduler on its own compute thread, driven from a libuv loop.
 *
 * The daemon's loop thread never computes and the compute thread never does I/O
 * (DESIGN.md, "Data flow of one request"). An engine owns one kvl_sched_t and one
 * compute thread that runs kvl_sched_step while there is work and sleeps on a condition
 * variable when there is none. Every function below is called on the loop thread; every
 * callback runs on the loop thread.
 *
 *   kvl_sched_t *s;                       // created, models added, then handed over
 *   kvl_sched_new(&cfg, &s);
 *   kvl_sched_add_model(s, &model, &mid, err, sizeof(err));
 *   kvl_engine_t *e;
 *   if (kvl_engine_start(loop, s, &e) < 0) { kvl_sched_free(s); ... }   // s is e's now
 *
 *   static void on_event(void *ud, const struct kvl_engine_event *ev) {  // loop thread
 *     struct call *c = ud;
 *     if (ev->tok.token >= 0) stream_token(c, ev->tok.token, ev->tok.logprob);
 *     if (ev->tok.final) finish_call(c, ev->tok.finish, ev->status, ev->message, &ev->tok.usage);
 *   }
 *   uint64_t id;
 *   if (kvl_engine_submit(e, &req, on_event, call, &id, err, sizeof(err)) < 0) reply_400(err);
 *   ...
 *   kvl_engine_cancel(e, id);            // client went away; the final event comes later
 *   ...
 *   kvl_engine_stop(e, on_engine_closed); // in-flight requests end CANCELLED, then on_engine_closed
 *
 * Events. A submitted request (kvl_engine_submit returned 0) gets zero or more token
 * events and then exactly one final event (tok.final set); nothing arrives for it after
 * the final event. A submit that fails synchronously never fires the callback. Event
 * payloads are copies owned by the engine and valid only during the callback.
 *
 * Validation. kvl_engine_submit checks synchronously what needs neither the scheduler
 * nor the model: a non-negative model index, a non-empty prompt of non-negative ids,
 * max_tokens >= 1, consistent array lengths. Everything that needs the scheduler's state
 * (model index in range, ids inside the vocabulary, prompt + max_tokens against
 * max_model_len, KV capacity, sampling ranges) is checked by kvl_sched_submit on the
 * compute thread; a refusal there arrives as the request's only event: final, finish
 * KVL_DONE_ERROR, status KVL_EINVAL, message = the scheduler's reason. It arrives after
 * at most the step the compute thread is running when the request is queued.
 */
#ifndef KVL_ENGINE_H
#define KVL_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "kvl_sched.h"

typedef struct kvl_engine kvl_engine_t;

/* One event of one request, as delivered on the loop thread. */
struct kvl_engine_event {
  uint64_t id;                /* the engine's id, from kvl_engine_submit */
  struct kvl_token_event tok; /* the scheduler's event, copied; queue_ms and ttft_ms count
                                 from kvl_engine_submit (time in the hand-off included) */
  int status;                 /* final events: 0 (STOP, LENGTH), KVL_ECANCELED (CANCELLED),
                                 KVL_EINVAL (refused by the scheduler), the step's error
                                 (forward failure), KVL_ENOMEM (token events were lost);
                                 0 on token events */
  const char *message;        /* final events with a status other than 0 and KVL_ECANCELED:
                                 a sentence a person can act on; otherwise NULL */
};

typedef void (*kvl_engine_cb)(void *ud, const struct kvl_engine_event *ev);
/* Runs on the loop thread when the engine is gone: the compute thread has been joined,
 * the scheduler freed (so its models may be freed now), every request has had its final
 * event. `e` is only an identity here: it is freed right after this returns. */
typedef void (*kvl_engine_close_cb)(kvl_engine_t *e);

/* Start the compute thread and attach to `loop` (one uv_async_t, referenced: the loop
 * keeps running until the engine is stopped). On success the engine owns `sched` (it is
 * freed by the engine, on the compute thread) and its models must outlive the close
 * callback. On failure (KVL_ENOMEM, or a libuv / pthreads error as a negative errno) the
 * caller keeps `sched`; run the loop once more to release what was partly set up. */
int kvl_engine_start(uv_loop_t *loop, kvl_sched_t *sched, kvl_engine_t **out);

/* Queue a request; `*id` is its id at once. The request's arrays (prompt, stop ids,
 * logit bias) are copied. KVL_EINVAL with a message for the checks listed above,
 * KVL_ENOMEM; KVL_ECANCELED after kvl_engine_stop. `cb(ud, ...)` receives its events. */
int kvl_engine_submit(kvl_engine_t *e, const struct kvl_request *r, kvl_engine_cb cb, void *ud, uint64_t *id,
                      char *err, size_t errlen);

/* Ask for a request to end: its final event (CANCELLED, or whatever it finished with
 * if it got there first) arrives through its callback later. An id that is unknown or
 * already finished is a no-op, and so is any cancel after kvl_engine_stop (which cancels
 * everything). 0, or KVL_ENOMEM when the cancel could not be queued. */
int kvl_engine_cancel(kvl_engine_t *e, uint64_t id);

/* Stop: queued and running requests end with a final CANCELLED event (delivered
 * before close_cb), the scheduler is freed, the compute thread joined, the async handle
 * closed; memory is freed in its close callback, after close_cb (which may be NULL).
 * Never blocks for a step: the join happens on the loop thread once the compute thread
 * has pushed its last event and is returning. Callbacks of the requests still running may
 * fire before close_cb; they may call submit (refused) and cancel (a no-op). Once only. */
void kvl_engine_stop(kvl_engine_t *e, kvl_engine_close_cb close_cb);
/* Run fn(sched, arg) on the compute thread between steps (e.g. kvl_sched_add_model /
 * kvl_sched_remove_model while requests stream), then done(arg, fn's return) on the loop
 * thread. 0, KVL_ENOMEM, or KVL_ECANCELED after kvl_engine_stop (done is not called). */
typedef int (*kvl_engine_fn)(kvl_sched_t *s, void *arg);
typedef void (*kvl_engine_done_cb)(void *arg, int rc);
int kvl_engine_run(kvl_engine_t *e, kvl_engine_fn fn, kvl_engine_done_cb done, void *arg);

/* The scheduler's per-model stats as of the end of the last step (the compute thread
 * publishes a snapshot after every step and when it goes idle). KVL_ERANGE for an
 * unknown model. */
int kvl_engine_model_stats(kvl_engine_t *e, int model_id, struct kvl_sched_model_stats *out);

#endif /* KVL_ENGINE_H */
