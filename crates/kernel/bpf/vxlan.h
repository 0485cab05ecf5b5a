/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * `vxlan` in the kernel: the transport manager. Each port is a tenant's segment (a VNI and
 * the remote VTEP). A frame entering a segment port gets the segment's tunnel key and is
 * redirected to the data plane's VXLAN device (collect-metadata mode), so the kernel's own
 * VXLAN and routing carry it to the other host. Frames arriving from that device are read by
 * `stitch_tunnel`: the VNI picks the segment port they leave by — only when they come from
 * that segment's remote VTEP — so a tenant's traffic reaches only that tenant's graph.
 */
#ifndef STITCH_VXLAN_H
#define STITCH_VXLAN_H
#include "common.h"

enum vxlan_counter {
	VX_ENCAPSULATED = FC_OWN,
	VX_DECAPSULATED,
};

struct vxlan_segment {
	__u32 vni;
	__be32 remote;
};

struct vni_target {
	__u32 vid;    /* the segment port's VID */
	__be32 remote;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS * MAX_PORTS);
	__type(key, __u32);
	__type(value, struct vxlan_segment);
} vxlan_segments SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); /* VNI */
	__type(value, struct vni_target);
} vxlan_vnis SEC(".maps");

static __always_inline int vxlan(struct __sk_buff *skb)
{
	struct here h;
	if (where(skb, &h) < 0)
		return TC_ACT_SHOT;
	__u32 key = h.slot * MAX_PORTS + h.port;
	struct vxlan_segment *seg = bpf_map_lookup_elem(&vxlan_segments, &key);
	__u32 zero = 0;
	struct globals *g = bpf_map_lookup_elem(&config, &zero);
	if (!seg || !seg->vni || !g || !g->vxlan_ifindex)
		return drop(&h, 0);
	struct bpf_tunnel_key tk = {};
	tk.tunnel_id = seg->vni;
	tk.remote_ipv4 = bpf_ntohl(seg->remote);
	tk.tunnel_ttl = 64;
	if (bpf_skb_set_tunnel_key(skb, &tk, sizeof(tk), BPF_F_ZERO_CSUM_TX) < 0)
		return drop(&h, 0);
	count(&h, VX_ENCAPSULATED);
	count(&h, FC_TX);
	return bpf_redirect(g->vxlan_ifindex, 0);
}

/* Decapsulated frames from the data plane's VXLAN device. */
static __always_inline int tunnel_ingress(struct __sk_buff *skb)
{
	struct bpf_tunnel_key tk = {};
	if (bpf_skb_get_tunnel_key(skb, &tk, sizeof(tk), 0) < 0) {
		dp_count(DP_NO_TUNNEL_KEY);
		return TC_ACT_SHOT;
	}
	__u32 vni = tk.tunnel_id;
	struct vni_target *t = bpf_map_lookup_elem(&vxlan_vnis, &vni);
	if (!t) {
		dp_count(DP_UNKNOWN_VNI);
		return TC_ACT_SHOT;
	}
	if (bpf_htonl(tk.remote_ipv4) != t->remote) {
		dp_count(DP_FOREIGN_VTEP);
		return TC_ACT_SHOT;
	}
	__u32 vid = t->vid;
	struct vi_info *vi = bpf_map_lookup_elem(&vids, &vid);
	if (vi && vi->kind == VI_FUNCTION) {
		struct fn_info *fn = bpf_map_lookup_elem(&slots, &vi->target);
		struct fn_stats *c = fn ? bpf_map_lookup_elem(&fn_counters, &fn->state_id) : 0;
		if (c)
			c->c[VX_DECAPSULATED]++;
	}
	skb->cb[1] = 0;
	return pp_send(skb, vid);
}
#endif
