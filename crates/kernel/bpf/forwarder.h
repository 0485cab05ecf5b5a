/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* `forwarder`: what enters `input` leaves by `output` (port 0 in, port 1 out). */
#ifndef STITCH_FORWARDER_H
#define STITCH_FORWARDER_H
#include "common.h"

static __always_inline int forwarder(struct __sk_buff *skb)
{
	struct here h;
	if (where(skb, &h) < 0)
		return TC_ACT_SHOT;
	if (h.port != 0)
		return drop(&h, 0);
	return send(skb, &h, 1);
}
#endif
