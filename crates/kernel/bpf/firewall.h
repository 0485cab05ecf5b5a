/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * `firewall` in the kernel (IPv4): ordered rules (side, protocol, CIDRs, port ranges, VLAN),
 * first match decides accept/drop/reject; `default` otherwise. Stateful: accepted TCP SYNs,
 * UDP datagrams and ICMP echo requests open a connection in an LRU hash; later packets of a
 * connection pass in either direction without the rules; TCP packets that belong to no
 * connection are dropped as invalid. Reject answers with ICMP "administratively prohibited"
 * from the packet's destination address. Port 0 is `lan`, port 1 is `wan`.
 * Non-IPv4 frames: ARP passes, anything else gets `default`.
 */
#ifndef STITCH_FIREWALL_H
#define STITCH_FIREWALL_H
#include "common.h"

enum action { ACT_ACCEPT = 0, ACT_DROP = 1, ACT_REJECT = 2 };
enum side { SIDE_LAN = 0, SIDE_WAN = 1, SIDE_ANY = 2 };
enum fw_counter {
	FW_ACCEPTED = FC_OWN,
	FW_DROPPED,
	FW_REJECTED,
	FW_ESTABLISHED, /* passed as part of a tracked connection */
	FW_INVALID,     /* TCP without a connection, not a SYN */
	FW_NEW,         /* connections opened */
	FW_DEFAULT,     /* decided by `default` */
};
enum ct_state { CT_SYN_SENT = 1, CT_ESTABLISHED = 2, CT_CLOSING = 3, CT_OTHER = 4 };
#define FW_STATEFUL 1u

struct fw_rule {
	__u8 action;
	__u8 from;      /* enum side */
	__u8 proto;     /* 0: any */
	__u8 has_vlan;
	__be32 src, src_mask, dst, dst_mask;
	__u16 sport_lo, sport_hi, dport_lo, dport_hi;
	__u16 vlan;
	__u16 pad;
};

/* A connection, keyed by its first packet's direction; looked up both ways. */
struct ct_key {
	__u32 state_id;
	__be32 saddr, daddr;
	__u16 sport, dport;
	__u8 proto;
	__u8 pad[3];
};

struct ct_entry {
	__u64 seen_ns;
	__u32 state;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS * MAX_RULES);
	__type(key, __u32);
	__type(value, struct fw_rule);
} fw_rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SLOTS * MAX_RULES);
	__type(key, __u32);
	__type(value, __u64);
} fw_rule_hits SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct ct_key);
	__type(value, struct ct_entry);
} conntrack SEC(".maps");

struct five_tuple {
	__be32 saddr, daddr;
	__u16 sport, dport; /* host order; ICMP echo: the identifier in both */
	__u8 proto;
	__u8 tcp_flags;
	__u8 has_ports;
	__u8 icmp_type;
};

struct fw_search {
	struct five_tuple *t;
	__u32 slot, side;
	__u16 vlan;
	__u16 has_vlan;
	int action; /* -1 until a rule matches */
};

static long fw_try_rule(__u32 i, void *ctx)
{
	struct fw_search *s = ctx;
	struct five_tuple *t = s->t;
	__u32 key = s->slot * MAX_RULES + i;
	struct fw_rule *r = bpf_map_lookup_elem(&fw_rules, &key);
	if (!r)
		return 1;
	if (r->from != SIDE_ANY && r->from != s->side)
		return 0;
	if (r->proto && r->proto != t->proto)
		return 0;
	if ((t->saddr & r->src_mask) != r->src || (t->daddr & r->dst_mask) != r->dst)
		return 0;
	if (r->has_vlan && (!s->has_vlan || r->vlan != s->vlan))
		return 0;
	if (r->sport_lo != 0 || r->sport_hi != 0xffff) {
		if (!t->has_ports || t->sport < r->sport_lo || t->sport > r->sport_hi)
			return 0;
	}
	if (r->dport_lo != 0 || r->dport_hi != 0xffff) {
		if (!t->has_ports || t->dport < r->dport_lo || t->dport > r->dport_hi)
			return 0;
	}
	__u64 *hits = bpf_map_lookup_elem(&fw_rule_hits, &key);
	if (hits)
		*hits += 1;
	s->action = r->action;
	return 1;
}

static __always_inline int fw_decide(struct here *h, struct five_tuple *t, __u16 vlan, int has_vlan)
{
	struct fw_search s = { .t = t, .slot = h->slot, .side = h->port, .vlan = vlan,
			       .has_vlan = has_vlan, .action = -1 };
	bpf_loop(h->fn->nrules < MAX_RULES ? h->fn->nrules : MAX_RULES, fw_try_rule, &s, 0);
	if (s.action >= 0)
		return s.action;
	count(h, FW_DEFAULT);
	return (h->fn->flags >> 8) & 0xff;
}

static __always_inline __u64 ct_timeout(struct fn_info *fn, __u8 proto, __u32 state)
{
	if (proto == IPPROTO_TCP)
		return state == CT_ESTABLISHED ? fn->timeout_ns[0] : fn->timeout_ns[1];
	if (proto == IPPROTO_UDP)
		return fn->timeout_ns[2];
	return fn->timeout_ns[3];
}

static __always_inline int fw_verdict(struct __sk_buff *skb, struct here *h, int action, __be32 daddr)
{
	if (action == ACT_ACCEPT) {
		count(h, FW_ACCEPTED);
		return send(skb, h, h->port ^ 1);
	}
	if (action == ACT_REJECT) {
		count(h, FW_REJECTED);
		__u8 mac[ETH_ALEN];
		if (bpf_skb_load_bytes(skb, 0, mac, ETH_ALEN) < 0 ||
		    !icmp_allowed(h->slot, h->fn->icmp_rate) ||
		    make_icmp_error(skb, ICMP_DEST_UNREACH, ICMP_PKT_FILTERED, 0, daddr, mac) < 0)
			return drop(h, 0);
		return send(skb, h, h->port);
	}
	return drop(h, FW_DROPPED);
}

static __always_inline int firewall(struct __sk_buff *skb)
{
	struct here h;
	if (where(skb, &h) < 0)
		return TC_ACT_SHOT;
	if (h.port > 1)
		return drop(&h, 0);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return drop(&h, FC_MALFORMED);
	__u16 vlan = skb->vlan_tci & 0x0fff;
	int has_vlan = skb->vlan_present;
	if (eth->h_proto == bpf_htons(ETH_P_ARP))
		return send(skb, &h, h.port ^ 1);
	struct five_tuple t = {};
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return fw_verdict(skb, &h, fw_decide(&h, &t, vlan, has_vlan), 0);
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5)
		return drop(&h, FC_MALFORMED);
	t.saddr = ip->saddr;
	t.daddr = ip->daddr;
	t.proto = ip->protocol;
	int first_fragment = (ip->frag_off & bpf_htons(0x1fff)) == 0;
	void *l4 = (void *)ip + ip->ihl * 4;
	if (first_fragment && t.proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;
		if ((void *)(tcp + 1) > end)
			return drop(&h, FC_MALFORMED);
		t.sport = bpf_ntohs(tcp->source);
		t.dport = bpf_ntohs(tcp->dest);
		t.tcp_flags = ((__u8 *)tcp)[13];
		t.has_ports = 1;
	} else if (first_fragment && t.proto == IPPROTO_UDP) {
		struct udphdr *udp = l4;
		if ((void *)(udp + 1) > end)
			return drop(&h, FC_MALFORMED);
		t.sport = bpf_ntohs(udp->source);
		t.dport = bpf_ntohs(udp->dest);
		t.has_ports = 1;
	} else if (first_fragment && t.proto == IPPROTO_ICMP) {
		struct icmphdr *icmp = l4;
		if ((void *)(icmp + 1) > end)
			return drop(&h, FC_MALFORMED);
		t.icmp_type = icmp->type;
		if (icmp->type == ICMP_ECHO || icmp->type == ICMP_ECHOREPLY)
			t.sport = t.dport = bpf_ntohs(icmp->id);
	}

	if (!(h.fn->flags & FW_STATEFUL) || (!t.has_ports && t.proto != IPPROTO_ICMP))
		return fw_verdict(skb, &h, fw_decide(&h, &t, vlan, has_vlan), t.daddr);

	__u64 now = bpf_ktime_get_ns();
	struct ct_key fwd = { .state_id = h.state, .saddr = t.saddr, .daddr = t.daddr,
			      .sport = t.sport, .dport = t.dport, .proto = t.proto };
	struct ct_key rev = { .state_id = h.state, .saddr = t.daddr, .daddr = t.saddr,
			      .sport = t.dport, .dport = t.sport, .proto = t.proto };
	int reply = 0;
	struct ct_entry *ct = bpf_map_lookup_elem(&conntrack, &fwd);
	if (!ct) {
		ct = bpf_map_lookup_elem(&conntrack, &rev);
		reply = 1;
	}
	/* Signed: another CPU may have stamped the entry a little after `now` was read. */
	if (ct && (__s64)(now - ct->seen_ns) > (__s64)ct_timeout(h.fn, t.proto, ct->state)) {
		bpf_map_delete_elem(&conntrack, reply ? &rev : &fwd);
		ct = 0;
	}
	if (ct) {
		if (t.proto == IPPROTO_TCP) {
			__u8 f = t.tcp_flags;
			if (f & 0x04) /* RST */
				ct->state = CT_CLOSING;
			else if (f & 0x01) /* FIN */
				ct->state = CT_CLOSING;
			else if (ct->state == CT_SYN_SENT && reply && (f & 0x12) == 0x12)
				ct->state = CT_SYN_SENT; /* SYN-ACK: wait for the ACK */
			else if (ct->state == CT_SYN_SENT && !reply && (f & 0x10))
				ct->state = CT_ESTABLISHED;
		}
		ct->seen_ns = now;
		count(&h, FW_ESTABLISHED);
		return send(skb, &h, h.port ^ 1);
	}
	/* ICMP other than echo requests never opens a connection; echo replies need one. */
	if (t.proto == IPPROTO_ICMP && t.icmp_type != ICMP_ECHO)
		return fw_verdict(skb, &h, fw_decide(&h, &t, vlan, has_vlan), t.daddr);
	if (t.proto == IPPROTO_TCP && (t.tcp_flags & 0x12) != 0x02) {
		count(&h, FW_INVALID);
		return drop(&h, FW_DROPPED);
	}
	int action = fw_decide(&h, &t, vlan, has_vlan);
	if (action == ACT_ACCEPT) {
		struct ct_entry ne = { .seen_ns = now,
				       .state = t.proto == IPPROTO_TCP ? CT_SYN_SENT : CT_OTHER };
		bpf_map_update_elem(&conntrack, &fwd, &ne, BPF_ANY);
		count(&h, FW_NEW);
	}
	return fw_verdict(skb, &h, action, t.daddr);
}
#endif
