/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * `router` in the kernel (IPv4): longest-prefix match in an LPM trie keyed by (router slot,
 * destination), connected routes from the interface addresses, static routes with a next hop.
 * ARP: requests for the router's own addresses are answered in place; replies (and requests
 * to us) fill the neighbour table; a packet whose next hop is unknown becomes the ARP request
 * for it (the packet itself is lost, as in a router without a queue; the sender retransmits).
 * TTL decrement with an incremental checksum update; ICMP echo replies for its own addresses;
 * ICMP time exceeded, net unreachable and fragmentation needed, at most `icmp_rate` a second.
 */
#ifndef STITCH_ROUTER_H
#define STITCH_ROUTER_H
#include "common.h"
#define ARPHRD_ETHER 1
#define ARPOP_REQUEST 1
#define ARPOP_REPLY 2

enum router_counter {
	RT_FORWARDED = FC_OWN,
	RT_ARP_REPLIES,   /* answers sent for our addresses */
	RT_ARP_REQUESTS,  /* next hops asked for (the packet that needed it is dropped) */
	RT_ARP_LEARNED,
	RT_ECHO_REPLIES,
	RT_TTL_EXCEEDED,
	RT_NO_ROUTE,
	RT_TOO_BIG,
	RT_ICMP_LIMITED,  /* ICMP errors suppressed by the rate limit or not buildable */
	RT_NOT_FOR_US,    /* unicast frame to another MAC address */
	RT_LOCAL,         /* to one of our addresses but not an echo request */
	RT_NOT_IPV4,
};

struct router_port {
	__u8 mac[ETH_ALEN];
	__u16 mtu;
	__be32 addr;
	__u32 prefix_len;
};

struct route_key {
	__u32 prefix_len; /* 32 (slot) + the route's prefix length */
	__be32 slot;
	__be32 addr;
};

struct route {
	__be32 gateway; /* 0: connected, the destination itself is the next hop */
	__u32 port;
};

struct neigh_key {
	__u32 state_id;
	__be32 addr;
};

struct neigh {
	__u8 mac[ETH_ALEN];
	__u16 pad;
	__u64 updated_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS * MAX_PORTS);
	__type(key, __u32);
	__type(value, struct router_port);
} router_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1 << 20);
	__type(key, struct route_key);
	__type(value, struct route);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} routes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct neigh_key);
	__type(value, struct neigh);
} neighbours SEC(".maps");

struct arp_eth {
	__be16 htype, ptype;
	__u8 hlen, plen;
	__be16 op;
	__u8 sha[ETH_ALEN];
	__u8 spa[4];
	__u8 tha[ETH_ALEN];
	__u8 tpa[4];
} __attribute__((packed));

static __always_inline struct router_port *router_port(__u32 slot, __u32 port)
{
	__u32 key = slot * MAX_PORTS + port;
	return bpf_map_lookup_elem(&router_ports, &key);
}

static __always_inline void learn(__u32 state_id, __be32 addr, const __u8 *mac)
{
	struct neigh_key k = { .state_id = state_id, .addr = addr };
	struct neigh n = { .updated_ns = bpf_ktime_get_ns() };
	__builtin_memcpy(n.mac, mac, ETH_ALEN);
	bpf_map_update_elem(&neighbours, &k, &n, BPF_ANY);
}

static __always_inline int router_arp(struct __sk_buff *skb, struct here *h, struct router_port *rp)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct arp_eth *arp = (void *)(eth + 1);
	if ((void *)(arp + 1) > end)
		return drop(h, FC_MALFORMED);
	if (arp->htype != bpf_htons(ARPHRD_ETHER) || arp->ptype != bpf_htons(ETH_P_IP) ||
	    arp->hlen != ETH_ALEN || arp->plen != 4)
		return drop(h, FC_MALFORMED);
	__be32 spa, tpa;
	__builtin_memcpy(&spa, arp->spa, 4);
	__builtin_memcpy(&tpa, arp->tpa, 4);
	if (tpa != rp->addr)
		return drop(h, 0);
	learn(h->state, spa, arp->sha);
	count(h, RT_ARP_LEARNED);
	if (arp->op != bpf_htons(ARPOP_REQUEST))
		return drop(h, 0); /* a reply: consumed */
	__builtin_memcpy(eth->h_dest, arp->sha, ETH_ALEN);
	__builtin_memcpy(eth->h_source, rp->mac, ETH_ALEN);
	arp->op = bpf_htons(ARPOP_REPLY);
	__builtin_memcpy(arp->tha, arp->sha, ETH_ALEN);
	__builtin_memcpy(arp->tpa, arp->spa, 4);
	__builtin_memcpy(arp->sha, rp->mac, ETH_ALEN);
	__builtin_memcpy(arp->spa, &rp->addr, 4);
	count(h, RT_ARP_REPLIES);
	return send(skb, h, h->port);
}

/* The packet becomes the ARP request for `target` out of `port`. */
static __always_inline int router_ask(struct __sk_buff *skb, struct here *h, __u32 port, __be32 target)
{
	struct router_port *rp = router_port(h->slot, port);
	if (!rp)
		return drop(h, 0);
	/* Padded to Ethernet's 60 bytes; also, the kernel will not shorten a packet whose
	 * checksum is left to offload below the end of that checksum (TCP: 52 bytes). */
	struct {
		struct ethhdr eth;
		struct arp_eth arp;
		__u8 padding[18];
	} __attribute__((packed)) f = {};
	__builtin_memset(f.eth.h_dest, 0xff, ETH_ALEN);
	__builtin_memcpy(f.eth.h_source, rp->mac, ETH_ALEN);
	f.eth.h_proto = bpf_htons(ETH_P_ARP);
	f.arp.htype = bpf_htons(ARPHRD_ETHER);
	f.arp.ptype = bpf_htons(ETH_P_IP);
	f.arp.hlen = ETH_ALEN;
	f.arp.plen = 4;
	f.arp.op = bpf_htons(ARPOP_REQUEST);
	__builtin_memcpy(f.arp.sha, rp->mac, ETH_ALEN);
	__builtin_memcpy(f.arp.spa, &rp->addr, 4);
	__builtin_memcpy(f.arp.tpa, &target, 4);
	if (bpf_skb_change_tail(skb, sizeof(f), 0) < 0 ||
	    bpf_skb_store_bytes(skb, 0, &f, sizeof(f), 0) < 0)
		return drop(h, 0);
	count(h, RT_ARP_REQUESTS);
	return send(skb, h, port);
}

/* Answer the packet's sender with an ICMP error from the port it came in by. */
static __always_inline int router_error(struct __sk_buff *skb, struct here *h, struct router_port *rp,
					__u8 type, __u8 code, __u16 mtu, __u32 reason)
{
	count(h, reason);
	if (!icmp_allowed(h->slot, h->fn->icmp_rate) ||
	    make_icmp_error(skb, type, code, mtu, rp->addr, rp->mac) < 0)
		return drop(h, RT_ICMP_LIMITED);
	return send(skb, h, h->port);
}

/* To one of our addresses: echo requests are answered, anything else is not our business. */
static __always_inline int router_local(struct __sk_buff *skb, struct here *h, struct router_port *rp,
					struct ethhdr *eth, struct iphdr *ip, void *end)
{
	__be32 daddr = ip->daddr;
	struct icmphdr *icmp = (void *)(ip + 1);
	if (ip->ihl != 5 || ip->protocol != IPPROTO_ICMP || (void *)(icmp + 1) > end ||
	    icmp->type != ICMP_ECHO)
		return drop(h, RT_LOCAL);
	__u8 mac[ETH_ALEN];
	__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, rp->mac, ETH_ALEN);
	ip->daddr = ip->saddr;
	ip->saddr = daddr;
	ip->ttl = 64;
	ip->check = 0;
	ip->check = csum_fold(bpf_csum_diff(0, 0, (__be32 *)ip, sizeof(*ip), 0));
	/* Echo request (8) to reply (0): RFC 1624 update of the ICMP checksum. */
	icmp->type = ICMP_ECHOREPLY;
	__u32 sum = (__u16)~icmp->checksum + (__u16)~bpf_htons(ICMP_ECHO << 8) + bpf_htons(ICMP_ECHOREPLY << 8);
	icmp->checksum = csum_fold(sum);
	count(h, RT_ECHO_REPLIES);
	return send(skb, h, h->port);
}

static __always_inline int router(struct __sk_buff *skb)
{
	struct here h;
	if (where(skb, &h) < 0)
		return TC_ACT_SHOT;
	struct router_port *rp = router_port(h.slot, h.port);
	if (!rp)
		return drop(&h, 0);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return drop(&h, FC_MALFORMED);
	if (eth->h_proto == bpf_htons(ETH_P_ARP))
		return router_arp(skb, &h, rp);
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return drop(&h, RT_NOT_IPV4);
	if (!(eth->h_dest[0] & 1) && !mac_equal(eth->h_dest, rp->mac))
		return drop(&h, RT_NOT_FOR_US);
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return drop(&h, FC_MALFORMED);
	if (ip->version != 4 || ip->ihl < 5 || bpf_ntohs(ip->tot_len) < ip->ihl * 4 ||
	    bpf_ntohs(ip->tot_len) > skb->len - sizeof(struct ethhdr))
		return drop(&h, FC_MALFORMED);
	__be32 daddr = ip->daddr;

	struct route_key rk = { .prefix_len = 64, .slot = bpf_htonl(h.slot), .addr = daddr };
	struct route *r = bpf_map_lookup_elem(&routes, &rk);
	struct router_port *op = r ? router_port(h.slot, r->port) : 0;
	/* Our own addresses are inside our connected routes, so one lookup finds both. */
	if (op && !r->gateway && op->addr == daddr)
		return router_local(skb, &h, rp, eth, ip, end);
	if (ip->ttl <= 1)
		return router_error(skb, &h, rp, ICMP_TIME_EXCEEDED, ICMP_EXC_TTL, 0, RT_TTL_EXCEEDED);
	if (!r)
		return router_error(skb, &h, rp, ICMP_DEST_UNREACH, ICMP_NET_UNREACH, 0, RT_NO_ROUTE);
	if (!op)
		return drop(&h, 0);
	__u32 out = r->port;
	__be32 next_hop = r->gateway ? r->gateway : daddr;
	/* Fragmentation needed: DF set and over the egress MTU (GSO frames are cut later, to size). */
	if ((ip->frag_off & bpf_htons(0x4000 /* DF */)) && !skb->gso_size &&
	    bpf_ntohs(ip->tot_len) > op->mtu)
		return router_error(skb, &h, rp, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, op->mtu, RT_TOO_BIG);
	struct neigh_key nk = { .state_id = h.state, .addr = next_hop };
	struct neigh *n = bpf_map_lookup_elem(&neighbours, &nk);
	if (!n)
		return router_ask(skb, &h, out, next_hop);
	/* TTL - 1 with the checksum updated as Linux's ip_decrease_ttl does. */
	__u32 check = ip->check;
	check += bpf_htons(0x0100);
	ip->check = (__u16)(check + (check >= 0xFFFF));
	ip->ttl--;
	__builtin_memcpy(eth->h_dest, n->mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, op->mac, ETH_ALEN);
	count(&h, RT_FORWARDED);
	return send(skb, &h, out);
}
#endif
