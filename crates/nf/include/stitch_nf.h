/* Stitch function library: attach a network function in any language to an `nf_port` of a
 * running Stitch graph, over shared memory. Link with -lstitch_nf (target/release/libstitch_nf.so).
 *
 *   stitch_nf *f = stitch_nf_attach("/run/stitch-fn/nf.sock", "tenant1");
 *   if (!f) { fprintf(stderr, "%s\n", stitch_nf_last_error()); return 1; }
 *   stitch_nf_run(f, my_callback, my_state);   // until Stitch closes the port
 *   stitch_nf_detach(f);
 *
 * The callback sees each frame in place (zero-copy ports: Stitch's own buffer; isolated ports:
 * the function's slot) and returns 0 to forward it, anything else to drop it.
 */
#ifndef STITCH_NF_H
#define STITCH_NF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct stitch_nf stitch_nf;

/* 0: forward the frame; otherwise drop it. */
typedef int (*stitch_nf_callback)(uint8_t *frame, uint32_t len, void *user);

/* NULL on failure; stitch_nf_last_error() says why. */
stitch_nf *stitch_nf_attach(const char *socket, const char *port);
/* Handles up to `max` waiting frames; returns how many, -1 on error. */
int stitch_nf_poll(stitch_nf *f, unsigned max, stitch_nf_callback cb, void *user);
/* Blocking ports: sleeps until frames wait. 0, or -1 when Stitch closed the port. */
int stitch_nf_wait(stitch_nf *f);
/* Serves frames until Stitch closes the port (sleeping or yielding as the port says). */
int stitch_nf_run(stitch_nf *f, stitch_nf_callback cb, void *user);
/* 1 for blocking ports, 0 for polling ones. */
int stitch_nf_is_blocking(const stitch_nf *f);
/* Detaches and frees. */
void stitch_nf_detach(stitch_nf *f);
/* The calling thread's last error. */
const char *stitch_nf_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
