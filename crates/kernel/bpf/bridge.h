/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * `bridge` in the kernel: MAC learning per (bridge, VLAN) in an LRU hash with aging, known
 * destinations to their port, broadcast/multicast/unknown flooded to every other port of the
 * VLAN (copies through the patch panel, the original to the last port). Access ports only:
 * every port carries untagged frames of its `vlan`.
 */
#ifndef STITCH_BRIDGE_H
#define STITCH_BRIDGE_H
#include "common.h"

enum bridge_counter {
	BR_FLOODED = FC_OWN,
	BR_FILTERED, /* destination learned on the port the frame came from */
	BR_LEARNED,
	BR_TAGGED,   /* tagged frame on an access port */
};

struct bridge_port {
	__u16 vlan;
	__u16 pad;
};

struct fdb_key {
	__u32 state_id;
	__u16 vlan;
	__u8 mac[ETH_ALEN];
};

struct fdb_entry {
	__u32 port;
	__u32 pad;
	__u64 seen_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS * MAX_PORTS);
	__type(key, __u32);
	__type(value, struct bridge_port);
} bridge_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fdb_key);
	__type(value, struct fdb_entry);
} fdb SEC(".maps");

static __always_inline __u16 bridge_port_vlan(__u32 slot, __u32 port)
{
	__u32 key = slot * MAX_PORTS + port;
	struct bridge_port *p = bpf_map_lookup_elem(&bridge_ports, &key);
	return p ? p->vlan : 0;
}

/* Flooding, one port per bpf_loop step: a copy to the previous eligible port, so that the
 * original packet is left for the last one. */
struct flood {
	struct __sk_buff *skb;
	__u32 slot, state, in_port, base_vid;
	__u16 vlan;
	int last;
	__u32 copies;
};

static long flood_port(__u32 p, void *ctx)
{
	struct flood *f = ctx;
	if (p == f->in_port || bridge_port_vlan(f->slot, p) != f->vlan)
		return 0;
	if (f->last >= 0) {
		f->copies++;
		pp_send_copy(f->skb, f->base_vid + f->last);
	}
	f->last = p;
	return 0;
}

static __always_inline int bridge(struct __sk_buff *skb)
{
	struct here h;
	if (where(skb, &h) < 0)
		return TC_ACT_SHOT;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return drop(&h, FC_MALFORMED);
	if (skb->vlan_present)
		return drop(&h, BR_TAGGED);
	__u16 vlan = bridge_port_vlan(h.slot, h.port);
	__u64 now = bpf_ktime_get_ns();

	struct fdb_key key = { .state_id = h.state, .vlan = vlan };
	if (!(eth->h_source[0] & 1)) {
		__builtin_memcpy(key.mac, eth->h_source, ETH_ALEN);
		struct fdb_entry *e = bpf_map_lookup_elem(&fdb, &key);
		/* Refresh at most once a second per address: a map update per packet costs. */
		if (!e || e->port != h.port || (__s64)(now - e->seen_ns) > 1000000000ll) {
			struct fdb_entry ne = { .port = h.port, .seen_ns = now };
			bpf_map_update_elem(&fdb, &key, &ne, BPF_ANY);
			if (!e || e->port != h.port)
				count(&h, BR_LEARNED);
		}
	}
	if (!(eth->h_dest[0] & 1)) {
		__builtin_memcpy(key.mac, eth->h_dest, ETH_ALEN);
		struct fdb_entry *e = bpf_map_lookup_elem(&fdb, &key);
		if (e && (__s64)(now - e->seen_ns) <= (__s64)h.fn->aging_ns) {
			if (e->port == h.port)
				return drop(&h, BR_FILTERED);
			return send(skb, &h, e->port);
		}
	}
	count(&h, BR_FLOODED);
	struct flood f = { .skb = skb, .slot = h.slot, .state = h.state, .in_port = h.port, .base_vid = h.fn->base_vid,
			   .vlan = vlan, .last = -1 };
	bpf_loop(h.fn->nports < MAX_PORTS ? h.fn->nports : MAX_PORTS, flood_port, &f, 0);
	int last = f.last;
	h.ctr->c[FC_TX] += f.copies;
	if (last < 0)
		return drop(&h, 0);
	return send(skb, &h, last);
}
#endif
