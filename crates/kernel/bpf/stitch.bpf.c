/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Stitch's in-kernel data plane: one object with every program and map. `stitch_port` sits on
 * the tc ingress hook of each workload interface (the physical-to-virtual manager),
 * `stitch_loop` on the loop device, and one program per function kind fills the slots of
 * `functions` — one slot per function instance, several slots may hold the same program;
 * instance settings live in maps keyed by slot.
 */
#include "common.h"
#include "forwarder.h"
#include "bridge.h"
#include "router.h"
#include "firewall.h"
#include "vxlan.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* A packet from a workload: it leaves the interface's VI into the graph. Not ours: pass on. */
SEC("tcx/ingress")
int stitch_port(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	__u32 *vid = bpf_map_lookup_elem(&ifaces, &ifindex);
	if (!vid)
		return TCX_NEXT;
	/* Frames written by a packet socket (Stitch's engine on a boundary veth) or a virtio
	 * device can arrive with their headers in page fragments, past data_end: functions read
	 * headers there, so make the first bytes linear. */
	__u32 len = skb->len;
	if ((long)skb->data_end - (long)skb->data < (len < 256 ? len : 256))
		bpf_skb_pull_data(skb, len < 256 ? len : 256);
	skb->cb[1] = 0;
	return pp_send(skb, *vid);
}

/* Re-entry: the VID to send out of is in the mark (see pp_send). */
SEC("tcx/ingress")
int stitch_loop(struct __sk_buff *skb)
{
	if ((skb->mark & LOOP_MASK) != LOOP_MAGIC)
		return TC_ACT_SHOT;
	__u32 vid = skb->mark & ~LOOP_MASK;
	skb->mark = 0;
	skb->cb[1] = 0;
	__u32 *dst = bpf_map_lookup_elem(&graph, &vid);
	if (!dst || !*dst)
		return TC_ACT_SHOT;
	/* The link was counted when the packet left; deliver without counting again. */
	__u32 to = *dst;
	struct vi_info *vi = bpf_map_lookup_elem(&vids, &to);
	if (!vi)
		return TC_ACT_SHOT;
	if (vi->kind == VI_INTERFACE)
		return bpf_redirect(vi->target, 0);
	if (vi->kind == VI_ENGINE)
		return engine_send(skb, to);
	skb->cb[0] = to;
	bpf_tail_call(skb, &functions, vi->target);
	return TC_ACT_SHOT;
}

SEC("tcx/ingress")
int fn_forwarder(struct __sk_buff *skb)
{
	return forwarder(skb);
}

SEC("tcx/ingress")
int fn_bridge(struct __sk_buff *skb)
{
	return bridge(skb);
}

SEC("tcx/ingress")
int fn_router(struct __sk_buff *skb)
{
	return router(skb);
}

SEC("tcx/ingress")
int fn_firewall(struct __sk_buff *skb)
{
	return firewall(skb);
}

SEC("tcx/ingress")
int fn_vxlan(struct __sk_buff *skb)
{
	return vxlan(skb);
}

/* On the data plane's VXLAN device: frames from other hosts, by VNI to their segment. */
SEC("tcx/ingress")
int stitch_tunnel(struct __sk_buff *skb)
{
	return tunnel_ingress(skb);
}
