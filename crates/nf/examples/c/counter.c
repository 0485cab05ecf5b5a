/* A function in C: counts frames, drops those shorter than 100 bytes, forwards the rest.
 * cc -O2 counter.c -I../../include -L<target>/release -lstitch_nf -o counter
 * ./counter /run/stitch-fn/nf.sock PORT */
#include <stdio.h>
#include <stdint.h>
#include "stitch_nf.h"

struct state { unsigned long seen, dropped; };

static int on_frame(uint8_t *frame, uint32_t len, void *user) {
    struct state *s = user;
    (void)frame;
    s->seen++;
    if (len < 100) {
        s->dropped++;
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOCKET PORT\n", argv[0]);
        return 2;
    }
    stitch_nf *f = stitch_nf_attach(argv[1], argv[2]);
    if (!f) {
        fprintf(stderr, "attach: %s\n", stitch_nf_last_error());
        return 1;
    }
    struct state s = {0, 0};
    int r = stitch_nf_run(f, on_frame, &s);
    stitch_nf_detach(f);
    printf("seen %lu dropped %lu\n", s.seen, s.dropped);
    return r == 0 ? 0 : 1;
}
