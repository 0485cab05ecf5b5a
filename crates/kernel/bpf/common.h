/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The shared part of Stitch's in-kernel data plane: the maps every function reads, the
 * per-packet metadata, and the patch panel.
 *
 * Every port of every function and interface is a virtual interface (VI) with a small number,
 * its VID. A packet carries the VID it is entering in skb->cb[0] and the number of tail calls
 * so far in skb->cb[1]. A function decides on an output VID and calls pp_send(), the patch
 * panel: `graph` gives the VID at the other end of the link, `vids` says what is behind it —
 * an interface (redirect to its ifindex), an engine port (a copy into its ring buffer, see
 * engine_send) or a function (tail call into `functions` at the function's slot). The patch panel is inlined into every program instead of being a program
 * of its own so that one hop costs one tail call.
 *
 * The kernel stops a chain after 33 tail calls. Before that, pp_send re-enters the graph
 * through the loop device: the packet is redirected to the loop device's ingress with the
 * VID in skb->mark and starts a fresh chain there. Flooding uses the same device for copies
 * that go to functions (a copy cannot be tail-called).
 *
 * Layouts of the structs below are mirrored in crates/kernel/src/maps.rs; the loader checks
 * the sizes against the maps' key and value sizes.
 */
#ifndef STITCH_COMMON_H
#define STITCH_COMMON_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

/* From linux/icmp.h, which pulls in glibc's socket headers. */
#define ICMP_ECHOREPLY 0
#define ICMP_DEST_UNREACH 3
#define ICMP_ECHO 8
#define ICMP_TIME_EXCEEDED 11
#define ICMP_NET_UNREACH 0
#define ICMP_FRAG_NEEDED 4
#define ICMP_PKT_FILTERED 13
#define ICMP_EXC_TTL 0

struct icmphdr {
	__u8 type;
	__u8 code;
	__sum16 checksum;
	__be16 id;
	__be16 sequence;
};

#define MAX_SLOTS 256
#define MAX_VIDS 4096
#define MAX_PORTS 16
#define MAX_RULES 64
#define FN_COUNTERS 16
/* Tail calls a packet may take before it re-enters through the loop device (limit 33). */
#define MAX_HOPS 30
#define LOOP_MAGIC 0x5e000000u
#define LOOP_MASK 0xff000000u
#ifndef TCX_NEXT
#define TCX_NEXT -1 /* linux/bpf.h of kernels before 6.6 does not have it */
#endif

enum vi_kind { VI_NONE = 0, VI_FUNCTION = 1, VI_INTERFACE = 2, VI_ENGINE = 3 };
enum fn_kind { FN_NONE = 0, FN_FORWARDER = 1, FN_BRIDGE = 2, FN_ROUTER = 3, FN_FIREWALL = 4, FN_VXLAN = 5 };

/* Counters every function has (fn_stats), then each kind's own from FC_OWN on. */
enum fn_counter { FC_RX = 0, FC_TX = 1, FC_DROP = 2, FC_MALFORMED = 3, FC_OWN = 4 };

struct vi_info {
	__u32 kind;   /* enum vi_kind */
	__u32 target; /* function slot, interface ifindex, or engine ring (the VID) */
	__u32 port;   /* port number within the function */
	__u32 pad;
};

/*
 * One function instance's settings, at its slot. A changed app gets a new slot with the new
 * settings, and its VIs are pointed at that slot one by one, so that no packet sees half an
 * update. `state_id` stays with the app across changes: learned addresses, neighbours,
 * connections and counters are keyed by it, not by the slot.
 */
struct fn_info {
	__u32 kind; /* enum fn_kind */
	__u32 base_vid;
	__u32 nports;
	__u32 nrules;
	__u32 state_id;
	__u32 icmp_rate;   /* router/firewall: ICMP errors per second */
	__u32 flags;       /* firewall: bit 0 stateful, bits 8-15 default action */
	__u32 pad;
	__u64 aging_ns;    /* bridge: MAC aging */
	__u64 timeout_ns[4]; /* firewall: tcp established, tcp transitory, udp, icmp */
};

struct vi_stats {
	__u64 rx_packets, rx_bytes, tx_packets, tx_bytes, drops;
};

struct globals {
	__u32 loop_ifindex;
	__u32 vxlan_ifindex;
};

/* Counters of the data plane as a whole (dp_counters). */
enum dp_counter {
	DP_UNKNOWN_VNI = 0,  /* tunnel frames with a VNI no segment has */
	DP_FOREIGN_VTEP = 1, /* tunnel frames from another VTEP than the segment's remote */
	DP_NO_TUNNEL_KEY = 2,
	DP_COUNTERS = 8,
};

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} functions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_VIDS);
	__type(key, __u32);
	__type(value, __u32);
} graph SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_VIDS);
	__type(key, __u32);
	__type(value, struct vi_info);
} vids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);   /* ifindex */
	__type(value, __u32); /* VID of the interface's receive side */
} ifaces SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct fn_info);
} slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct globals);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_VIDS);
	__type(key, __u32);
	__type(value, struct vi_stats);
} vi_counters SEC(".maps");

/* One function's counters, per CPU: looked up once per packet (struct here). */
struct fn_stats {
	__u64 c[FN_COUNTERS];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32); /* state id */
	__type(value, struct fn_stats);
} fn_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DP_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} dp_counters SEC(".maps");

static __always_inline void dp_count(__u32 counter)
{
	__u64 *c = bpf_map_lookup_elem(&dp_counters, &counter);
	if (c)
		*c += 1;
}


static __always_inline void vi_count_tx(__u32 vid, __u32 len)
{
	struct vi_stats *s = bpf_map_lookup_elem(&vi_counters, &vid);
	if (s) {
		s->tx_packets++;
		s->tx_bytes += len;
	}
}

static __always_inline void vi_count_drop(__u32 vid)
{
	struct vi_stats *s = bpf_map_lookup_elem(&vi_counters, &vid);
	if (s)
		s->drops++;
}

/*
 * Link taps (`stitch capture --link` on a kernel graph). `taps` says, per VID, which capture
 * sessions copy the packets leaving it (a bit per session) and how many bytes of each they
 * keep at most. Each session has its own BPF ring buffer in `tap_rings`, made and put there by
 * its reader, so captures of the same link at once each see every packet. A packet is copied
 * into a per-CPU record first (bpf_ringbuf_output takes the record's real size), then into the
 * ring of each session; a full ring drops the record and counts it in `tap_drops`. Untapped,
 * a hop pays one array lookup.
 */
#define TAP_SESSIONS 8
#define TAP_SNAP_MAX 9216
#define TAP_RING_BYTES (8u << 20)

struct tap_point {
	__u32 sessions; /* bit i: session i copies what leaves this VID */
	__u32 snaplen;  /* the largest of the sessions' snap lengths */
};

struct tap_record {
	__u64 time_ns; /* CLOCK_MONOTONIC */
	__u32 vid;     /* the VID the packet left */
	__u32 len;     /* its length on the link */
	__u32 caplen;  /* bytes of it that follow */
	__u32 pad;
	__u8 data[TAP_SNAP_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_VIDS);
	__type(key, __u32);
	__type(value, struct tap_point);
} taps SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct tap_record);
} tap_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, TAP_SESSIONS * MAX_VIDS);
	__type(key, __u32);   /* session * MAX_VIDS + VID */
	__type(value, __u64); /* records of that VID the session's ring had no room for */
} tap_drops SEC(".maps");

struct tap_ring {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, TAP_RING_BYTES);
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, TAP_SESSIONS);
	__type(key, __u32); /* session */
	__array(values, struct tap_ring);
} tap_rings SEC(".maps");

/* Copies the packet leaving `vid` into the ring of every session in `sessions`. */
static __noinline int tap_copy(struct __sk_buff *skb, __u32 vid, __u32 sessions, __u32 snaplen)
{
	__u32 zero = 0;
	struct tap_record *r = bpf_map_lookup_elem(&tap_scratch, &zero);
	if (!r)
		return 0;
	__u64 cap = skb->len;
	if (cap > snaplen)
		cap = snaplen;
	/* The verifier must see the bound on the register passed to the helper. */
	barrier_var(cap);
	if (cap == 0 || cap > TAP_SNAP_MAX)
		return 0;
	r->time_ns = bpf_ktime_get_ns();
	r->vid = vid;
	r->len = skb->len;
	r->caplen = cap;
	if (bpf_skb_load_bytes(skb, 0, r->data, cap) < 0)
		return 0;
	for (__u32 i = 0; i < TAP_SESSIONS; i++) {
		if (!(sessions & (1u << i)))
			continue;
		void *ring = bpf_map_lookup_elem(&tap_rings, &i);
		if (!ring)
			continue;
		__u64 size = r->caplen;
		barrier_var(size);
		if (size > TAP_SNAP_MAX)
			size = TAP_SNAP_MAX;
		/* The reader is woken only when its ring is a quarter full; it also looks every few
		 * milliseconds. A wake-up per packet would cost the tapped link more than the copy. */
		__u64 wake = bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA) > TAP_RING_BYTES / 4 ?
				     BPF_RB_FORCE_WAKEUP :
				     BPF_RB_NO_WAKEUP;
		if (bpf_ringbuf_output(ring, r, __builtin_offsetof(struct tap_record, data) + size,
				       wake) < 0) {
			__u32 key = i * MAX_VIDS + vid;
			__u64 *d = bpf_map_lookup_elem(&tap_drops, &key);
			if (d)
				*d += 1;
		}
	}
	return 0;
}

static __always_inline void tap(struct __sk_buff *skb, __u32 vid)
{
	struct tap_point *t = bpf_map_lookup_elem(&taps, &vid);
	if (t && t->sessions)
		tap_copy(skb, vid, t->sessions, t->snaplen);
}

/*
 * Engine ports: the kernel end of a kernel ↔ engine boundary in a mixed graph (`stitch-place`).
 * Packets from the engine still arrive through the boundary's veth (tc ingress, as from any
 * workload), but packets for the engine are not redirected back through it: each is copied
 * into a BPF ring buffer that the engine's end reads (its `af_packet` app, `kernel_ring`), one
 * ring per such VI, in `engine_rings` at the VID. That skips the second pass through the
 * host's stack a redirect costs (veth transmit, backlog, receive, packet socket copy). A record
 * carries what the skb knew beyond the bytes — a partial checksum's place, a super-frame's
 * segment size, a VLAN tag the kernel lifted out — as a virtio-net header would. The skb's
 * checksum state is read from the kernel's `struct sk_buff` (a CO-RE read through
 * bpf_cast_to_kern_ctx), which `struct __sk_buff` does not show. A full ring drops the packet
 * and counts it as the VI's drop.
 */
#define ENGINE_RING_BYTES (8u << 20)

struct engine_record {
	__u32 len;         /* bytes of frame that follow */
	__u16 csum_start;  /* ENGINE_CSUM_PARTIAL: where the sum starts, from the frame's start */
	__u16 csum_offset; /* and where it goes, from csum_start */
	__u16 gso_size;    /* a super-frame's segment size, else 0 */
	__u16 vlan_tci;    /* ENGINE_VLAN: the tag the kernel lifted out of the frame */
	__u16 vlan_proto;  /* its TPID, network byte order */
	__u8 flags;
	__u8 pad;
	__u8 data[];
};

#define ENGINE_CSUM_PARTIAL 1
#define ENGINE_CSUM_VALID 2
#define ENGINE_VLAN 4

struct engine_ring {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, ENGINE_RING_BYTES);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_VIDS);
	__type(key, __u32); /* VID */
	__array(values, struct engine_ring);
} engine_rings SEC(".maps");

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/* The fields of the kernel's struct sk_buff a record needs, relocated by libbpf (CO-RE). */
struct sk_buff___stitch {
	__u8 ip_summed : 2;
	__u16 csum_start;  /* from skb->head */
	__u16 csum_offset; /* from csum_start */
	__u16 mac_header;  /* from skb->head; the frame's first byte at tc ingress */
} __attribute__((preserve_access_index));

#define CHECKSUM_UNNECESSARY 1
#define CHECKSUM_PARTIAL 3

/* One record of at most `room` bytes of frame; `len` is the frame's length. */
#define ENGINE_OUTPUT(room)                                                              \
	static __noinline int engine_output_##room(struct __sk_buff *skb, void *ring,        \
						    __u32 len, __u32 meta_lo, __u32 meta_hi)   \
	{                                                                                    \
		struct engine_record *r =                                                    \
			bpf_ringbuf_reserve(ring, sizeof(struct engine_record) + room, 0);  \
		if (!r)                                                                      \
			return -1;                                                           \
		/* Two checks with a barrier between: merged into one range test, the      \
		 * verifier would not see the lower bound on the register passed on. */    \
		__u64 n = len;                                                               \
		if (n > room)                                                                \
			goto discard;                                                        \
		barrier_var(n);                                                              \
		if (n == 0 || bpf_skb_load_bytes(skb, 0, r->data, n) < 0)                    \
			goto discard;                                                        \
		r->len = n;                                                                  \
		r->csum_start = meta_lo & 0xffff;                                            \
		r->csum_offset = meta_lo >> 16;                                              \
		r->gso_size = skb->gso_size;                                                 \
		r->vlan_tci = skb->vlan_tci;                                                 \
		r->vlan_proto = skb->vlan_proto;                                             \
		r->flags = meta_hi;                                                          \
		r->pad = 0;                                                                  \
		bpf_ringbuf_submit(r, BPF_RB_NO_WAKEUP);                                     \
		return 0;                                                                    \
	discard:                                                                             \
		bpf_ringbuf_discard(r, BPF_RB_NO_WAKEUP);                                    \
		return -1;                                                                   \
	}
ENGINE_OUTPUT(240)
ENGINE_OUTPUT(2032)
ENGINE_OUTPUT(9216)
/* A whole super-frame: 64 KiB of IP packet, its Ethernet header and a tag (MAX_GSO_FRAME). */
ENGINE_OUTPUT(65560)

/* Hands the packet entering `vid` (an engine port) to the engine, then ends the skb: TC_ACT_SHOT
 * whether it went into the ring or not (not found, counted as the VI's drop). tcx knows only
 * pass, drop and redirect: any other code — TC_ACT_STOLEN included — means "next", and the
 * packet the engine already has would go on up the host's stack (measured: ip_rcv took 12 % of
 * the crossing's CPU dropping them, and one for the host's own address would be answered). */
static __always_inline int engine_send(struct __sk_buff *skb, __u32 vid)
{
	void *ring = bpf_map_lookup_elem(&engine_rings, &vid);
	if (!ring) {
		vi_count_drop(vid);
		return TC_ACT_SHOT;
	}
	struct sk_buff___stitch *k = bpf_cast_to_kern_ctx(skb);
	__u32 summed = BPF_CORE_READ_BITFIELD(k, ip_summed);
	__u32 meta_lo = 0, flags = 0;
	if (summed == CHECKSUM_PARTIAL) {
		__u32 start = (__u32)k->csum_start - (__u32)k->mac_header;
		meta_lo = (start & 0xffff) | ((__u32)k->csum_offset << 16);
		flags = ENGINE_CSUM_PARTIAL;
	} else if (summed == CHECKSUM_UNNECESSARY) {
		flags = ENGINE_CSUM_VALID;
	}
	if (skb->vlan_present)
		flags |= ENGINE_VLAN;
	__u32 len = skb->len;
	int err;
	if (len <= 240)
		err = engine_output_240(skb, ring, len, meta_lo, flags);
	else if (len <= 2032)
		err = engine_output_2032(skb, ring, len, meta_lo, flags);
	else if (len <= 9216)
		err = engine_output_9216(skb, ring, len, meta_lo, flags);
	else
		err = engine_output_65560(skb, ring, len, meta_lo, flags);
	if (err)
		vi_count_drop(vid);
	return TC_ACT_SHOT;
}

static __always_inline __u32 loop_ifindex(void)
{
	__u32 zero = 0;
	struct globals *g = bpf_map_lookup_elem(&config, &zero);
	return g ? g->loop_ifindex : 0;
}

/* The patch panel: sends the packet out of `out_vid` to whatever the graph links it to. */
static __always_inline int pp_send(struct __sk_buff *skb, __u32 out_vid)
{
	__u32 *dst = bpf_map_lookup_elem(&graph, &out_vid);
	if (!dst || !*dst) {
		vi_count_drop(out_vid);
		return TC_ACT_SHOT;
	}
	__u32 to = *dst;
	struct vi_info *vi = bpf_map_lookup_elem(&vids, &to);
	if (!vi || vi->kind == VI_NONE) {
		vi_count_drop(out_vid);
		return TC_ACT_SHOT;
	}
	/* Links are one-to-one: what enters `to` is what left `out_vid` (counted once). */
	vi_count_tx(out_vid, skb->len);
	tap(skb, out_vid);
	if (vi->kind == VI_INTERFACE)
		return bpf_redirect(vi->target, 0);
	if (vi->kind == VI_ENGINE)
		return engine_send(skb, to);
	__u32 hops = skb->cb[1] + 1;
	if (hops >= MAX_HOPS) {
		/* Start a new chain: re-enter at the loop device with the link's source VID. */
		__u32 loop = loop_ifindex();
		if (!loop) {
			vi_count_drop(to);
			return TC_ACT_SHOT;
		}
		skb->mark = LOOP_MAGIC | out_vid;
		return bpf_redirect(loop, BPF_F_INGRESS);
	}
	skb->cb[0] = to;
	skb->cb[1] = hops;
	bpf_tail_call(skb, &functions, vi->target);
	/* No program in the slot: the graph is being changed, or the slot is stale. */
	vi_count_drop(to);
	return TC_ACT_SHOT;
}

/* A copy of the packet out of `out_vid` (flooding); the original is left as it was. */
static __always_inline void pp_send_copy(struct __sk_buff *skb, __u32 out_vid)
{
	__u32 *dst = bpf_map_lookup_elem(&graph, &out_vid);
	if (!dst || !*dst)
		return;
	__u32 to = *dst;
	struct vi_info *vi = bpf_map_lookup_elem(&vids, &to);
	if (!vi || vi->kind == VI_NONE)
		return;
	/* Links are one-to-one: what enters `to` is what left `out_vid` (counted once). */
	vi_count_tx(out_vid, skb->len);
	tap(skb, out_vid);
	if (vi->kind == VI_INTERFACE) {
		bpf_clone_redirect(skb, vi->target, 0);
		return;
	}
	if (vi->kind == VI_ENGINE) {
		engine_send(skb, to);
		return;
	}
	__u32 loop = loop_ifindex();
	if (!loop)
		return;
	__u32 mark = skb->mark;
	skb->mark = LOOP_MAGIC | out_vid;
	bpf_clone_redirect(skb, loop, BPF_F_INGRESS);
	skb->mark = mark;
}

static __always_inline int mac_equal(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] &&
	       a[5] == b[5];
}

/* The function instance a packet is entering: its slot, info and port number. */
struct here {
	__u32 vid;
	__u32 slot;
	__u32 state;
	__u32 port;
	struct fn_info *fn;
	struct fn_stats *ctr;
};

static __always_inline void count(struct here *h, __u32 counter)
{
	h->ctr->c[counter & (FN_COUNTERS - 1)]++;
}

static __always_inline int where(struct __sk_buff *skb, struct here *h)
{
	h->vid = skb->cb[0];
	struct vi_info *vi = bpf_map_lookup_elem(&vids, &h->vid);
	if (!vi || vi->kind != VI_FUNCTION)
		return -1;
	h->slot = vi->target;
	h->port = vi->port;
	h->fn = bpf_map_lookup_elem(&slots, &h->slot);
	if (!h->fn)
		return -1;
	h->state = h->fn->state_id;
	h->ctr = bpf_map_lookup_elem(&fn_counters, &h->state);
	if (!h->ctr)
		return -1;
	count(h, FC_RX);
	return 0;
}

static __always_inline int drop(struct here *h, __u32 reason)
{
	count(h, FC_DROP);
	if (reason)
		count(h, reason);
	return TC_ACT_SHOT;
}

static __always_inline int send(struct __sk_buff *skb, struct here *h, __u32 port)
{
	count(h, FC_TX);
	return pp_send(skb, h->fn->base_vid + port);
}

static __always_inline __u16 csum_fold(__u64 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

struct icmp_error_body {
	__u8 type, code;
	__u16 checksum;
	__u16 unused;
	__u16 mtu;
	__u8 quote[28]; /* the offending IPv4 header (no options) and 8 bytes after it */
};

/*
 * Turns the packet into an ICMPv4 error about itself, from `src_ip`/`src_mac`, addressed back
 * to its sender. Only for IPv4 headers without options (the quote has a fixed size). Returns
 * 0 when the packet now is the error, -1 when it could not be built (drop it).
 */
static __always_inline int make_icmp_error(struct __sk_buff *skb, __u8 type, __u8 code,
					   __u16 mtu, __be32 src_ip, const __u8 *src_mac)
{
	struct ethhdr eth = {};
	struct iphdr ip = {};
	struct icmp_error_body icmp = {};
	if (bpf_skb_load_bytes(skb, ETH_ALEN, eth.h_dest, ETH_ALEN) < 0)
		return -1;
	if (bpf_skb_load_bytes(skb, sizeof(struct ethhdr), icmp.quote, sizeof(icmp.quote)) < 0)
		return -1;
	struct iphdr *orig = (struct iphdr *)icmp.quote;
	if (orig->ihl != 5)
		return -1;
	/* Never an error about an ICMP error (RFC 1812 4.3.2.7). */
	if (orig->protocol == IPPROTO_ICMP) {
		__u8 t = icmp.quote[20];
		if (t != ICMP_ECHO && t != ICMP_ECHOREPLY)
			return -1;
	}
	__builtin_memcpy(eth.h_source, src_mac, ETH_ALEN);
	eth.h_proto = bpf_htons(ETH_P_IP);
	ip.version = 4;
	ip.ihl = 5;
	ip.tot_len = bpf_htons(sizeof(ip) + sizeof(icmp));
	ip.ttl = 64;
	ip.protocol = IPPROTO_ICMP;
	ip.saddr = src_ip;
	ip.daddr = orig->saddr;
	ip.check = csum_fold(bpf_csum_diff(0, 0, (__be32 *)&ip, sizeof(ip), 0));
	icmp.type = type;
	icmp.code = code;
	icmp.mtu = bpf_htons(mtu);
	icmp.checksum = csum_fold(bpf_csum_diff(0, 0, (__be32 *)&icmp, sizeof(icmp), 0));
	__u32 len = sizeof(eth) + sizeof(ip) + sizeof(icmp);
	if (bpf_skb_change_tail(skb, len, 0) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth), &ip, sizeof(ip), 0) < 0 ||
	    bpf_skb_store_bytes(skb, sizeof(eth) + sizeof(ip), &icmp, sizeof(icmp), 0) < 0)
		return -1;
	return 0;
}

/* Per-instance ICMP error budget, per CPU: `rate` tokens a second, burst of `rate`. */
struct icmp_bucket {
	__u64 last_ns;
	__u64 tokens_ns; /* tokens, in units of 1e9 ns per token * rate */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct icmp_bucket);
} icmp_budget SEC(".maps");

static __always_inline int icmp_allowed(__u32 slot, __u32 rate)
{
	if (!rate)
		return 0;
	struct icmp_bucket *b = bpf_map_lookup_elem(&icmp_budget, &slot);
	if (!b)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	__u64 cap = 1000000000ull; /* one second's worth */
	__u64 t = b->tokens_ns + (now - b->last_ns);
	if (t > cap || b->last_ns == 0)
		t = cap;
	b->last_ns = now;
	__u64 cost = 1000000000ull / rate;
	if (t < cost) {
		b->tokens_ns = t;
		return 0;
	}
	b->tokens_ns = t - cost;
	return 1;
}

#endif
