#!/bin/sh
# Three "hosts" made of network namespaces on one machine, for trying Stitch's cluster mode
# (docs/cluster.md). `up` makes:
#   - namespaces h1, h2, h3, each with two links to a fabric namespace `fabric`:
#       mgmt 198.51.100.N/24 (etcd's traffic) and ul0 192.0.2.N/24 (the underlay the
#       tunnels use), both at the ordinary MTU of 1500;
#   - one etcd member per host (a 3-member cluster at https://198.51.100.N:2379, etcd's
#     default timing), its data and log under $STITCH_CLUSTER_DIR (/tmp/stitch-cluster);
#   - etcd secured as docs/cluster.md says ("Who may write what"): TLS between members and
#     to clients, a client certificate required (its common name is the etcd user), and
#     roles — each host's agent may write only its own host, alive and status keys and read
#     its graph; h1 may also run the placement controller (placements, graphs of every host);
#     the operator writes cluster graphs. The CA, the members' certificates and one per
#     client (h1, h2, h3, operator, root) are made in $STITCH_CLUSTER_DIR/pki (keys 0600).
#   - empty workload namespaces wa and wb, for containers that stitch-cni attaches.
# `down` stops every process in those namespaces (agents, etcd, iperf3) and removes them.
set -eu
dir=${STITCH_CLUSTER_DIR:-/tmp/stitch-cluster}
pki=$dir/pki
hosts="h1 h2 h3"
endpoints=https://198.51.100.1:2379,https://198.51.100.2:2379,https://198.51.100.3:2379

down() {
    for ns in $hosts wa wb fabric; do
        if ip netns list | grep -qw "^$ns"; then
            ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
            ip netns del "$ns"
        fi
    done
    # host-local's leases of the example's networks: left behind, the next run's containers
    # would get other addresses than the walkthrough's (10.20.1.2 and 10.20.2.2).
    rm -rf /var/lib/cni/networks/chain-a /var/lib/cni/networks/chain-b
}

# A certificate signed by the example's CA: NAME, its common name, SAN and key usages.
certificate() {
    name=$1 san=$2 usage=$3
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$name" -keyout "$pki/$name.key" \
        -out "$pki/$name.csr" 2>/dev/null
    printf 'extendedKeyUsage=%s\n%s' "$usage" "${san:+subjectAltName=$san}" >"$pki/$name.ext"
    openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
        -CAcreateserial -days 30 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
    chmod 600 "$pki/$name.key"
    rm -f "$pki/$name.csr" "$pki/$name.ext"
}

pki_up() {
    rm -rf "$pki"
    mkdir -m 700 "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=stitch-example-etcd-ca \
        -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
    chmod 600 "$pki/ca.key"
    for i in 1 2 3; do
        certificate e$i IP:198.51.100.$i serverAuth,clientAuth
    done
    for who in h1 h2 h3 operator root; do
        certificate $who "" clientAuth
    done
}

# Users and roles, then authentication on: etcd's own access control on key prefixes.
roles_up() {
    e="etcdctl --endpoints=$endpoints --cacert=$pki/ca.crt --cert=$pki/root.crt --key=$pki/root.key"
    ip netns exec h1 $e user add root --no-password >/dev/null
    ip netns exec h1 $e role add controller >/dev/null
    ip netns exec h1 $e role grant-permission controller --prefix=true read /stitch/ >/dev/null
    for p in /stitch/placements/ /stitch/assign/ /stitch/election; do
        ip netns exec h1 $e role grant-permission controller --prefix=true readwrite $p >/dev/null
    done
    ip netns exec h1 $e role add operator >/dev/null
    ip netns exec h1 $e role grant-permission operator --prefix=true read /stitch/ >/dev/null
    ip netns exec h1 $e role grant-permission operator --prefix=true readwrite /stitch/graphs/ >/dev/null
    ip netns exec h1 $e user add operator --no-password >/dev/null
    ip netns exec h1 $e user grant-role operator operator >/dev/null
    for h in $hosts; do
        ip netns exec h1 $e role add host-$h >/dev/null
        for k in /stitch/hosts/$h /stitch/alive/$h /stitch/status/$h; do
            ip netns exec h1 $e role grant-permission host-$h readwrite $k >/dev/null
        done
        ip netns exec h1 $e role grant-permission host-$h read /stitch/assign/$h >/dev/null
        # Host records (addresses, labels) are no secret; the agents' connection check reads them.
        ip netns exec h1 $e role grant-permission host-$h --prefix=true read /stitch/hosts/ >/dev/null
        ip netns exec h1 $e user add $h --no-password >/dev/null
        ip netns exec h1 $e user grant-role $h host-$h >/dev/null
    done
    ip netns exec h1 $e user grant-role h1 controller >/dev/null
    ip netns exec h1 $e auth enable >/dev/null
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
        cluster="$cluster${cluster:+,}e$i=https://198.51.100.$i:2380"
    done
    pki_up
    i=0
    for h in $hosts; do
        i=$((i + 1))
        rm -rf "$dir/e$i"
        ip netns exec $h etcd --name e$i --data-dir "$dir/e$i" \
            --listen-client-urls https://198.51.100.$i:2379 \
            --advertise-client-urls https://198.51.100.$i:2379 \
            --listen-peer-urls https://198.51.100.$i:2380 \
            --initial-advertise-peer-urls https://198.51.100.$i:2380 \
            --initial-cluster "$cluster" --initial-cluster-token stitch-example \
            --cert-file "$pki/e$i.crt" --key-file "$pki/e$i.key" \
            --trusted-ca-file "$pki/ca.crt" --client-cert-auth \
            --peer-cert-file "$pki/e$i.crt" --peer-key-file "$pki/e$i.key" \
            --peer-trusted-ca-file "$pki/ca.crt" --peer-client-cert-auth \
            >"$dir/etcd-e$i.log" 2>&1 &
    done
    for ns in wa wb; do
        ip netns add $ns
        ip -n $ns link set lo up
    done
    tries=0
    until ip netns exec h1 env ETCDCTL_API=3 etcdctl --endpoints=$endpoints \
        --cacert="$pki/ca.crt" --cert="$pki/root.crt" --key="$pki/root.key" \
        --command-timeout=2s endpoint health >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [ $tries -gt 60 ]; then
            echo "fabric.sh: etcd did not become healthy in 30 s; see $dir/etcd-e*.log" >&2
            exit 1
        fi
        sleep 0.5
    done
    roles_up
    echo "three hosts up; etcd at $endpoints (TLS, client certificates and roles: $pki)"
}

case "${1:-}" in
up) up ;;
down) down ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
