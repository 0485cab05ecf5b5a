#!/bin/sh
# Three "hosts" made of network namespaces on one machine, for trying Stitch's cluster mode
# (docs/cluster.md). `up` makes:
#   - namespaces h1, h2, h3, each with two links to a fabric namespace `fabric`:
#       mgmt 198.51.100.N/24 (etcd's traffic) and ul0 192.0.2.N/24 (the underlay the
#       tunnels use), both at the ordinary MTU of 1500;
#   - one etcd member per host (a 3-member cluster at http://198.51.100.N:2379, etcd's
#     default timing), its data and log under $STITCH_CLUSTER_DIR (/tmp/stitch-cluster);
#   - empty workload namespaces wa and wb, for containers that stitch-cni attaches.
# `down` stops every process in those namespaces (agents, etcd, iperf3) and removes them.
set -eu
dir=${STITCH_CLUSTER_DIR:-/tmp/stitch-cluster}
hosts="h1 h2 h3"

down() {
    for ns in $hosts wa wb fabric; do
        if ip netns list | grep -qw "^$ns"; then
            ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
            ip netns del "$ns"
        fi
    done
}

up() {
    for ns in $hosts wa wb fabric; do
        if ip netns list | grep -qw "^$ns"; then
            echo "fabric.sh: namespace $ns exists already: run \`$0 down\` first" >&2
            exit 1
        fi
    done
    mkdir -p "$dir"
    ip netns add fabric
    for br in mg ul; do
        ip -n fabric link add $br type bridge
        ip -n fabric link set $br up
    done
    i=0
    cluster=""
    for h in $hosts; do
        i=$((i + 1))
        ip netns add $h
        ip -n $h link set lo up
        ip -n $h link add mgmt type veth peer name mg$i netns fabric
        ip -n $h link add ul0 type veth peer name ul$i netns fabric
        ip -n fabric link set mg$i master mg up
        ip -n fabric link set ul$i master ul up
        ip -n $h addr add 198.51.100.$i/24 dev mgmt
        ip -n $h addr add 192.0.2.$i/24 dev ul0
        ip -n $h link set mgmt up
        ip -n $h link set ul0 up
        cluster="$cluster${cluster:+,}e$i=http://198.51.100.$i:2380"
    done
    i=0
    for h in $hosts; do
        i=$((i + 1))
        rm -rf "$dir/e$i"
        ip netns exec $h etcd --name e$i --data-dir "$dir/e$i" \
            --listen-client-urls http://198.51.100.$i:2379 \
            --advertise-client-urls http://198.51.100.$i:2379 \
            --listen-peer-urls http://198.51.100.$i:2380 \
            --initial-advertise-peer-urls http://198.51.100.$i:2380 \
            --initial-cluster "$cluster" --initial-cluster-token stitch-example \
            >"$dir/etcd-e$i.log" 2>&1 &
    done
    for ns in wa wb; do
        ip netns add $ns
        ip -n $ns link set lo up
    done
    endpoints=http://198.51.100.1:2379,http://198.51.100.2:2379,http://198.51.100.3:2379
    tries=0
    until ip netns exec h1 env ETCDCTL_API=3 etcdctl --endpoints=$endpoints \
        --command-timeout=2s endpoint health >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [ $tries -gt 60 ]; then
            echo "fabric.sh: etcd did not become healthy in 30 s; see $dir/etcd-e*.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "three hosts up; etcd at $endpoints"
}

case "${1:-}" in
up) up ;;
down) down ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
